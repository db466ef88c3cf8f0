"""The planner (`python -m trainers.plan`) against measurements, this machine's
(bench/plan_measurement.py) and the papers' (bench/papers.py): the comparison, the fits
of the V100's decompositions to the papers, the tables and the figure.

(1) This machine: 1 process vs 2 ranks (Horovod, and tf.distribute's
    MultiWorkerMirroredStrategy), predicted by the planner's "local" device and
    "loopback" network against bench/distributed_benchmark.py (K-FAC factors every 5
    steps, decompositions every 10, global batch 128): per step, the stale step's phases
    (the median step), the factor phases (their clock) and the decompositions (the median
    inverse step's clock), each with its error, and the notes that say which term misses
    and why (COLUMNS below). `--measure` first times this machine's rates and the 2-rank
    collectives (loopback.json, the network profile), then runs that benchmark into
    bench/results/plan_validation/; without it the stored results are used.
(2) Ueno et al. (KDD'20) Table 1, ResNet-50 on 128 V100s: the predicted effect of
    symmetric packing, 21-bit factors and stale factors beside the paper's.
(3) Pauloski et al. (SC'20) Tables IV-VI (K-FAC/SGD per step vs GPUs, factor and
    eigendecomposition phases, slowest/fastest worker), with their system's rules
    (kfac_pytorch: full factors and eigenbases allreduced in float32, its layer-wise
    round-robin); Osawa et al. (CVPR'19) §5: the factors' size (Figure 4) and 1 vs 64 GPUs.
(4) The LPT saturation on keras.applications.ResNet50 (224x224, 108 factors): the
    slowest rank's decomposition work against an outside estimate (4.63x from 16 ranks
    on) and kfac_pytorch's round-robin.
The papers' figures are quoted with their table or section; the models' inputs are the
library's (trainers/planning). Writes bench/results/plan_validation.json and .png and
prints the tables docs/benchmarks.md quotes.

Run (idle machine; `--measure` takes ~3 min, the rest ~1 min):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/plan_validation.py --measure
"""

import dataclasses
import json
import os
import statistics

from absl import flags

import harness
import papers
from plan_measurement import (LOCAL_MODELS, MEASURED_DIR, NESTED, SEQUENTIAL,
                              measure)

FLAGS = flags.FLAGS
flags.DEFINE_bool("measure", False, "Time the loopback collectives and run the 2-rank "
                  "K-FAC job before validating.")

# ------------------------------------------------------------ (1) this machine
# What (1) compares, per step (amortized over the intervals), from what the saved
# measurement holds: distributed.json keeps per configuration the median step (each step
# at its slowest rank), each inverse step's decomposition clock (slowest rank) and each
# rank's phase-clock totals over the window, not every step's phases.
# - "every_step": the phases of a stale step (forward/backward, gradient reduction,
#   preconditioning and its sharing, update), measured as the MEDIAN step (32 of the 40
#   timed steps are stale; Keras's step and the benchmark's per-step callback are in it,
#   not in the prediction);
# - "factors": factor statistics and reduction, every factor interval: the factors clock
#   (the first of the step's K-FAC phases: it starts on the reduced gradients, so it times
#   them alone with either clock layout) over the window, the slowest rank's total (a
#   mean: the totals are all the file keeps);
# - "decomposition": decompositions and their sharing, every decomposition interval: the
#   MEDIAN over the window's inverse steps of the decomposition clock;
# - "step": their sum, the amortized step of medians (the mean step, outliers and all, is
#   printed beside it).
COLUMNS = {"every_step": ("forward_backward", "gradient_reduction", "preconditioning",
                          "preconditioned_sharing", "update"),
           "factors": ("factor_statistics", "factor_reduction"),
           "decomposition": ("decomposition", "decomposition_sharing")}
TOLERANCE = 0.15


def _predicted_columns(phases):
    columns = {name: sum(phases[p].per_step for p in parts) for name, parts in COLUMNS.items()}
    return {**columns, "step": sum(columns.values()),
            "terms": {name: phase.seconds for name, phase in phases.items()}}


def _measured_columns(timing, phase_totals, timed, decomposition_interval, layout):
    """`timing`: distributed.json's row (or "single"); `phase_totals`: per rank."""
    factors = max(p["factors"] for p in phase_totals) / timed
    inverse = timing["decomposition_seconds_each_inverse_step"]
    columns = {"every_step": timing["median_step_seconds"], "factors": factors,
               "decomposition": statistics.median(inverse) / decomposition_interval}
    # The split of the clock means: one rank's clocks (the one with the most K-FAC time).
    slowest = max(phase_totals, key=lambda p: p["factors"] + p["decomposition"]
                  + p["precondition"])
    clocks = {phase: seconds / timed for phase, seconds in slowest.items()}
    return {**columns, "step": sum(columns.values()), "mean_step": timing["step_seconds"],
            "inverse_steps_s": inverse,
            "clock_means": _clock_means(clocks, timing["step_seconds"], layout)}


def _clock_means(clocks, step, layout):
    """Means over the window (ms per step, the slowest rank's) of the split the clocks'
    layout supports: sequential clocks, every phase and the rest of the step; nested
    ones, the span factors..precondition (its three stamps follow each other) and the
    step around it ("update"'s clock spans nearly the whole step: not a phase)."""
    if layout == SEQUENTIAL:
        return {**clocks, "rest": step - sum(clocks.values())}
    span = sum(clocks[p] for p in ("factors", "decomposition", "precondition"))
    return {"factors..precondition": span, "rest": step - span,
            "nested update clock": clocks["update"],
            "step minus all clocks": step - sum(clocks.values())}


def this_machine():
    """(1): per model, engine, placement and wire dtypes, predicted (the local profile as
    the planner ships it, "predicted"; with its rates measured just before the job,
    "predicted_now") against the measured columns above."""
    from trainers.planning import collectives, hardware, step_model, workloads

    with open(os.path.join(MEASURED_DIR, "distributed.json")) as f:
        measured = json.load(f)
    with open(os.path.join(MEASURED_DIR, "rates.json")) as f:
        rates_file = json.load(f)
    now = rates_file["rates"]
    settings = measured["settings"]
    timed, interval = settings["timed_steps"], settings["decomposition_update_freq"]
    layout = measured.get("phase_clocks", NESTED)
    rows = []
    for name in LOCAL_MODELS:
        entry = measured["models"][name]
        device = hardware.device("local", name)
        devices = {"predicted": device, "predicted_now": dataclasses.replace(
            device, matmul={p: now["matmul"] for p in device.matmul},
            bandwidth=now["bandwidth"], eigh=now["eigh"],
            cholesky_inverse=now["cholesky_inverse"])}
        fabric = step_model.fabric(device, hardware.network("loopback"))
        unit = workloads.named(name)
        base = step_model.Configuration(factor_interval=settings["factor_update_freq"],
                                        decomposition_interval=interval)
        single = entry["single"]
        rows.append({"model": name, "ranks": 1, "engine": "-", "placement": "replicated",
                     "wire": "-", **{key: _predicted_columns(step_model.kfac_step(
                         unit.at_batch(settings["global_batch"]), base, 1, d, fabric))
                         for key, d in devices.items()},
                     "measured": _measured_columns(single, [single["phase_seconds"]],
                                                   timed, interval, layout)})
        half = unit.at_batch(settings["global_batch"] // 2)
        for row in entry["distributed"]:
            if "step_seconds" not in row:  # bytes-only configurations
                continue
            config = dataclasses.replace(base, placement=row["placement"],
                                         factor_wire=row["factor_wire"],
                                         decomposition_wire=row["eigen_wire"])
            steps = {key: step_model.kfac_step(half, config, 2, d, fabric)
                     for key, d in devices.items()}
            rows.append({"model": name, "ranks": 2, "engine": row["engine"],
                         "placement": row["placement"],
                         "wire": f"{row['factor_wire']}/{row['eigen_wire']}",
                         **{key: _predicted_columns(phases) for key, phases in steps.items()},
                         "measured": _measured_columns(row, row["phase_seconds_per_rank"],
                                                       timed, interval, layout),
                         "bytes_predicted": step_model.payload_per_step(steps["predicted"], 0),
                         "bytes_measured": row["bytes_per_step_per_rank"][0]})
    for row in rows:
        device = hardware.device("local", row["model"])
        single = measured["models"][row["model"]]["single"]
        row["notes"] = _notes(row, {
            "matmul": device.matmul["float32"], "matmul_now": now["matmul"],
            "load": settings.get("load_average_1min_at_start") or 0.0,
            "cores": settings.get("cpu_count"),
            "latency": collectives.allreduce(0, 2, fabric),
            "fraction": device.fractions["decomposition"]["float32"],
            "single_inverse": statistics.median(
                single["decomposition_seconds_each_inverse_step"])})
    with open(hardware.LOOPBACK_JSON) as f:
        loopback = json.load(f)
    fit = hardware.loopback_link()
    gathers = [{"bytes": 2 * n, "measured_s": t,
                "predicted_s": collectives.allgather(2 * n, 2, fabric)}
               for n, t in zip(loopback["sizes_bytes"], loopback["allgather_s"])]
    return {"rows": rows, "phase_clocks": layout,
            "library_commit": measured.get("library_commit"),
            "load_average": {"rates": rates_file.get("load_average"),
                             "benchmark_start": settings.get("load_average_1min_at_start"),
                             "benchmark_end": measured.get("machine", {}).get(
                                 "load_average_at_end")},
            "timed_steps": timed,
            "loopback_fit": {"ring_step_latency_s": fit.ring_step_latency,
                             "bandwidth_bytes_s": fit.bandwidth},
            "allgather_check": gathers}


def _notes(row, context):
    """Per column the prediction misses by more than TOLERANCE: the term and the reason,
    from the measurement itself."""
    predicted, now, measured = row["predicted"], row["predicted_now"], row["measured"]
    terms = predicted["terms"]
    miss = lambda key: abs(predicted[key] - measured[key]) > TOLERANCE * measured[key]
    loaded = context["load"] >= 1.0
    rates = (f"the profile's rates (matmul {context['matmul'] / 1e9:.0f} GFLOP/s) against "
             f"{context['matmul_now'] / 1e9:.0f} measured just before the job (load average "
             f"{context['load']:.1f} on {context['cores']} cores): with the latter {{}}")
    notes = []
    if miss("every_step"):
        note = "every step: " + rates.format(_error(now["every_step"], measured["every_step"]))
        if row["ranks"] == 2:
            note += ("; the 2 ranks share the cores with each other"
                     + (" and that load" if loaded else "") + " (the model gives each half); "
                     "the collectives' latency on loopback is "
                     f"{context['latency'] * 1e3:.1f} ms per allreduce")
        notes.append(note + "; Keras's step and the per-step callback are not modelled")
    if miss("factors"):
        note = "factors: " + rates.format(_error(now["factors"], measured["factors"]))
        if row["ranks"] == 2:
            note += ("; the clock includes the wait at the factor allreduce for the other "
                     "rank's backward")
        notes.append(note)
    if miss("decomposition"):
        inverse = measured["inverse_steps_s"]
        spread = f"inverse steps {min(inverse) * 1e3:.0f}-{max(inverse) * 1e3:.0f} ms"
        if row["ranks"] == 1:
            floor = terms["decomposition"] * context["fraction"]
            notes.append(
                f"decomposition: {spread}, {floor / statistics.median(inverse):.2f} of the "
                f"floor at the profile's LAPACK rate against the profile's fraction "
                f"{context['fraction']:.2f} (step_floor.json's decomposition clock): that "
                "fraction is the term")
        else:
            notes.append(
                f"decomposition: {spread} on the slowest rank (1 process: "
                f"{context['single_inverse'] * 1e3:.0f} ms), whose clock includes waiting "
                "for the other at the exchange; the cores shared"
                + (" under load" if loaded else "") + ", the inverse steps scatter by "
                f"{max(inverse) / min(inverse):.0f}x")
    return notes


# ------------------------------------------------------------------- (2) Ueno
def _replace(phases, **changes):
    from trainers.planning import step_model

    return {**phases, **{name: step_model.Phase(*value) for name, value in changes.items()}}


def ueno(unit):
    """(2): Table 1's rows as the model predicts them, and each optimization's effect.

    The system: the owner placement (each layer's owner inverts and preconditions it, the
    preconditioned gradients gathered: Osawa et al.'s design) with the Cholesky inverse;
    forward/backward from the paper's one-GPU throughput (744.8 images/s at 32, §3.2.4);
    the factor statistics on tensor cores (Osawa et al. 2019 §3.4). The factor reduction is
    an allreduce of full float32 factors, then packed triangles, then 21-bit values.
    ABCI nodes: 4 V100s, two EDR links; the table gives both one link and two.
    """
    from trainers.planning import collectives, hardware, step_model

    work = unit.at_batch(papers.UENO["batch"])
    v100 = hardware.device("v100")
    gpus = papers.UENO["gpus"]
    update = v100.seconds(work.update(), "sgd", "mixed")
    forward_backward = papers.UENO["batch"] / papers.UENO["images_per_s_one_gpu"] - update
    statistics_mixed = v100.seconds([k for ks in work.statistics("expand") for k in ks],
                                    "factor_statistics", "mixed")
    shapes = work.factor_shapes()
    full = 4 * (sum(s[-1] ** 2 for s in shapes if len(s) >= 2)
                + sum(s[0] for s in shapes if len(s) == 1))
    result = {}
    for links in (1, 2):
        fabric = step_model.fabric(v100, hardware.network("ib-edr"),
                                   papers.ABCI_GPUS_PER_NODE, links)

        def step(factor_bytes, interval=1):
            config = step_model.Configuration(placement="owner", method="inverse",
                                              factor_interval=interval,
                                              decomposition_interval=interval)
            phases = step_model.kfac_step(work, config, gpus, v100, fabric, "mixed",
                                          forward_backward)
            phases = _replace(phases, factor_statistics=(statistics_mixed, interval),
                              factor_reduction=(collectives.allreduce(factor_bytes, gpus, fabric),
                                                interval))
            return {name: phase.per_step * 1e3 for name, phase in phases.items()}

        packed = step_model.kfac_step(work, step_model.Configuration(), gpus, v100, fabric)[
            "factor_reduction"].payload[0]
        rows = {"distributed inverse": step(full), "+ symmetric": step(packed),
                "+ float21": step(packed * papers.FLOAT21_BYTES / 4),
                "+ stale": step(packed * papers.FLOAT21_BYTES / 4, papers.OSAWA_STALE_INTERVAL)}
        sgd = step_model.step_seconds(step_model.sgd_step(work, gpus, v100, fabric, "mixed",
                                                          forward_backward)) * 1e3
        totals = {name: sum(phases.values()) for name, phases in rows.items()}
        result[f"{links}_link"] = {
            "sgd_ms": sgd, "rows_ms": totals, "phases_ms": rows,
            "effects_ms": {"symmetric": totals["distributed inverse"] - totals["+ symmetric"],
                           "float21": totals["+ symmetric"] - totals["+ float21"],
                           "stale": totals["+ float21"] - totals["+ stale"]}}
    latency, rate = solve_cholesky()
    result["v100_cholesky_solved"] = {"latency_s": latency, "flops": rate}
    result["v100_cholesky_profile"] = {"latency_s": hardware.V100_CHOLESKY_LATENCY,
                                       "flops": hardware.V100_CHOLESKY}
    paper = papers.UENO["rows_ms"]
    result["paper"] = {"sgd_ms": papers.UENO["sgd_ms"], "rows_ms": paper, "effects_ms": {
        "symmetric": paper["distributed inverse"] - paper["+ symmetric"],
        "float21": paper["+ symmetric"] - paper["+ float21"],
        "stale": paper["+ hierarchical"] - paper["+ stale"]}}
    return result


# ------------------------------------------------------- (3) Pauloski and Osawa
def _rank_factors(dims, owners, size):
    """Per rank, the dims of the factors it decomposes."""
    ranks = [[] for _ in range(size)]
    for n, owner in zip(dims, owners):
        ranks[owner].append(n)
    return ranks


def fit_eigh(rank_dims, measured, points=4001):
    """(latency per call, FLOP/s at 9n³) with which the slowest rank takes `measured[p]`
    seconds at both worker counts given: for each latency on a grid, the rate that fits
    the first count; the latency that best fits the second."""
    (p1, t1), (p2, t2) = sorted(measured.items())
    flops = lambda ds: sum(9.0 * n ** 3 for n in ds)

    def rate_for(latency):  # the rate at which the first count's slowest rank takes t1
        return max(flops(ds) / (t1 - len(ds) * latency) for ds in rank_dims[p1] if ds)

    def slowest(p, latency, rate):
        return max(len(ds) * latency + flops(ds) / rate for ds in rank_dims[p])

    top = t1 / max(len(ds) for ds in rank_dims[p1])
    latencies = [top * i / points for i in range(points)]
    latency = min(latencies, key=lambda l: abs(slowest(p2, l, rate_for(l)) - t2))
    return latency, rate_for(latency)


def solve_cholesky():
    """(latency per call, FLOP/s at n³) that fit Ueno et al.'s two Cholesky timings on one
    V100 (papers.UENO_CHOLESKY): ResNet-34's factors and its largest layer's."""
    import numpy as np

    dims, cholesky = papers.resnet34_factor_dims(), papers.UENO_CHOLESKY
    largest = cholesky["largest_layer_dims"]
    latency, inverse_rate = np.linalg.solve(
        [[len(largest), sum(float(n) ** 3 for n in largest)],
         [len(dims), sum(float(n) ** 3 for n in dims)]],
        [cholesky["largest_layer_s"], cholesky["all_factors_s"]])
    return float(latency), float(1.0 / inverse_rate)


def pauloski(unit):
    """(3): Tables IV-VI with kfac_pytorch's rules and the model's terms: SGD's step from
    the paper's own SGD time on 64 GPUs (its forward/backward the same at every scale),
    K-FAC adding preconditioning every step, the factor phase (statistics at the float32
    roofline, full factors allreduced) every factor interval and the eigendecompositions
    (slowest rank under the round-robin, the V100 profile's eigh fitted to Table V on 16
    and 64 GPUs; all eigenbases allreduced) every eigen interval. Frontera: 4 V100s per
    node, one EDR link."""
    from trainers.planning import floor_model
    from trainers.planning import collectives, hardware, step_model

    work = unit.at_batch(papers.PAULOSKI["batch"])
    v100 = hardware.device("v100")
    blocks = papers.torchvision_order(work.blocks["expand"])
    dims = papers.kfac_pytorch_factor_dims(blocks)
    rank_dims = {p: _rank_factors(dims, papers.kfac_pytorch_owners(len(blocks), p), p)
                 for p in papers.PAULOSKI["gpus"]}
    fit = fit_eigh(rank_dims, {p: papers.PAULOSKI["table_v"][p][2] / 1e3 for p in (16, 64)})
    eigen = {p: [v100.seconds([floor_model.decomposition(n, 1, "eigen") for n in ds],
                              "decomposition") for ds in ranks if ds]  # ranks with work
             for p, ranks in rank_dims.items()}
    elements = {p: [sum(n * n for n in ds) for ds in rank_dims[p]] for p in (16, 64)}
    statistics_s = v100.seconds([k for ks in work.statistics("expand") for k in ks],
                                "factor_statistics")
    factor_bytes = 4 * sum(n * n for n in dims)
    eigen_bytes = 4 * sum(n * n + n for n in dims)
    steps_per_epoch = papers.PAULOSKI["imagenet_examples"] / (64 * papers.PAULOSKI["batch"])
    sgd_64 = (papers.PAULOSKI["sgd_minutes_64"] * 60
              / (papers.PAULOSKI["epochs"][1] * steps_per_epoch))
    fabric = step_model.fabric(v100, hardware.network("ib-edr"), papers.FRONTERA_GPUS_PER_NODE, 1)
    sgd_rest = lambda p: step_model.step_seconds(step_model.sgd_step(
        work, p, v100, fabric, "float32", 0.0))
    forward_backward = sgd_64 - sgd_rest(64)
    precondition = v100.seconds([k for ks in work.preconditioning("eigen") for k in ks]
                                + floor_model.kl_clip_kernels(sum(work.managed_parameters())),
                                "preconditioning")
    rows = []
    for i, p in enumerate(papers.PAULOSKI["gpus"]):
        eigen_interval = papers.PAULOSKI["eigen_interval_16"] * 16 / p
        factor_interval = eigen_interval / papers.PAULOSKI["factor_per_eigen"]
        factor_comm = collectives.allreduce(factor_bytes, p, fabric)
        eigen_comm = collectives.allreduce(eigen_bytes, p, fabric)
        sgd = forward_backward + sgd_rest(p)
        kfac = (sgd + precondition + (statistics_s + factor_comm) / factor_interval
                + (max(eigen[p]) + eigen_comm) / eigen_interval)
        kfac_epochs, sgd_epochs = papers.PAULOSKI["epochs"]
        measured = (1 - papers.PAULOSKI["improvement"][i]) * sgd_epochs / kfac_epochs
        row = {"gpus": p, "ratio_predicted": kfac / sgd, "ratio_paper": measured,
               "sgd_ms": sgd * 1e3, "kfac_ms": kfac * 1e3,
               "factor_ms": {"comp": statistics_s * 1e3, "comm": factor_comm * 1e3},
               "eigen_ms": {"comp": max(eigen[p]) * 1e3, "comm": eigen_comm * 1e3},
               "slowest_speedup": max(eigen[16]) / max(eigen[p]),
               "fastest_speedup": min(eigen[16]) / min(eigen[p])}
        if p in papers.PAULOSKI["table_v"]:
            row["table_v_ms"] = dict(zip(("factor_comp", "factor_comm", "eigen_comp",
                                          "eigen_comm"), papers.PAULOSKI["table_v"][p]))
        if p in papers.PAULOSKI["table_vi"]:
            row["table_vi"] = dict(zip(("slowest", "fastest"), papers.PAULOSKI["table_vi"][p]))
        rows.append(row)
    return {"rows": rows,
            "v100_eigh_fit": {"latency_s": fit[0], "flops": fit[1]},
            "v100_eigh_profile": {"latency_s": hardware.V100_EIGH_LATENCY,
                                  "flops": hardware.V100_EIGH},
            "sgd_ms_at_64_paper": sgd_64 * 1e3, "forward_backward_ms": forward_backward * 1e3,
            "precondition_ms": precondition * 1e3,
            "parameters_per_worker": {p: {"predicted": (min(e), max(e)),
                                          "paper": papers.PAULOSKI["parameters_per_worker"][p]}
                                      for p, e in elements.items()}}


def osawa(unit):
    """(3): Figure 4's factor data and §5.2's 1 vs 64 GPUs with the owner placement."""
    from trainers.planning import hardware, step_model

    work = unit.at_batch(papers.UENO["batch"])
    shapes = work.factor_shapes()
    kronecker = 4 * sum(s[-1] ** 2 for s in shapes if len(s) >= 2)
    diagonal = [s[0] for s in shapes if len(s) == 1]
    mib = lambda b: b / 2 ** 20
    v100 = hardware.device("v100")
    fabric = step_model.fabric(v100, hardware.network("ib-edr"), papers.ABCI_GPUS_PER_NODE, 1)
    config = step_model.Configuration(placement="owner", method="inverse")
    forward_backward = papers.UENO["batch"] / papers.UENO["images_per_s_one_gpu"]
    times = {p: step_model.step_seconds(step_model.kfac_step(
        work, dataclasses.replace(config, decomposition_interval=1), p, v100, fabric, "mixed",
        forward_backward)) for p in (1, 64)}
    return {"mib_diagonal_bn": {"predicted": mib(kronecker + 4 * sum(diagonal)),
                                "paper": papers.OSAWA["mib_diagonal_bn"]},
            "mib_full_bn": {"predicted": mib(kronecker + 4 * sum(n * n for n in diagonal)),
                            "paper": papers.OSAWA["mib_full_bn"]},
            "speedup_64": {"predicted": times[1] / times[64], "paper": papers.OSAWA["speedup_64"],
                           "step_ms": {p: t * 1e3 for p, t in times.items()}}}


# ------------------------------------------------------------------- (4) LPT
def lpt_saturation(unit):
    """(4): the slowest rank's decomposition work (cost n³ per factor, the library's owners)
    against the total, per rank count; kfac_pytorch's round-robin beside it."""
    from tfkfac import placement
    from trainers.planning.recommend import slowest_rank

    blocks = unit.blocks["expand"]
    costs = [placement.decomposition_cost(blocks[b].factor_shapes()[j])
             for b, j in placement.factor_items(blocks)]
    total = sum(costs)
    torch_blocks = papers.torchvision_order(blocks)
    torch_costs = [float(n) ** 3 for n in papers.kfac_pytorch_factor_dims(torch_blocks)]
    rows = []
    for p in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        slowest = slowest_rank(costs, placement.owners("replicated", blocks, p), p)
        robin = slowest_rank(torch_costs, papers.kfac_pytorch_owners(len(torch_blocks), p), p)
        rows.append({"ranks": p, "speedup": total / slowest,
                     "round_robin_speedup": sum(torch_costs) / robin})
    saturated = next(p for p in range(1, 1025) if slowest_rank(
        costs, placement.owners("replicated", blocks, p), p) <= max(costs))
    return {"factors": len(costs), "largest": max(b.factor_shapes()[j][-1] for b in blocks
                                                  for j in b.symmetric_factors()),
            "bound": total / max(costs), "saturation_ranks": saturated, "rows": rows,
            "outside_estimate": papers.LPT_OUTSIDE_ESTIMATE}


# ------------------------------------------------------------------- output
def _error(predicted, measured):
    return f"{(predicted - measured) / measured:+.0%}" if measured else "n/a"


def print_this_machine(local):
    fit = local["loopback_fit"]
    load = local["load_average"]
    print(f"\n(1) this machine; library {local['library_commit']}, phase clocks "
          f"{local['phase_clocks']}; load average (1, 5, 15 min) at the rates "
          f"{load['rates']}, 1 min at the benchmark's start {load['benchmark_start']}, at "
          f"its end {load['benchmark_end']}; loopback fit: ring step "
          f"{fit['ring_step_latency_s'] * 1e6:.0f} us, {fit['bandwidth_bytes_s'] / 1e9:.2f} GB/s")
    for key in ("predicted", "predicted_now"):
        print(f"{key} / measured, ms per step (amortized), error of the prediction; "
              f"every step: median step; decomposition: median over the "
              f"{len(local['rows'][0]['measured']['inverse_steps_s'])} inverse steps / "
              "interval; factors: clock total / steps (mean)")
        print("| model | ranks | engine | placement | wire | every step | factors | "
              "decomposition | step | mean step |")
        print("| --- " * 10 + "|")
        for row in local["rows"]:
            cells = [f"{row[key][k] * 1e3:.2f} / {row['measured'][k] * 1e3:.2f} "
                     f"({_error(row[key][k], row['measured'][k])})"
                     for k in list(COLUMNS) + ["step"]]
            cells.append(f"{row['measured']['mean_step'] * 1e3:.1f}")
            print(f"| {row['model']} | {row['ranks']} | {row['engine']} | {row['placement']} "
                  f"| {row['wire']} | " + " | ".join(cells) + " |")
    print(f"phase clocks ({local['phase_clocks']}), means over the {local['timed_steps']} "
          "timed steps (the rank with the most K-FAC time), ms per step:")
    for row in local["rows"]:
        clocks = row["measured"]["clock_means"]
        print(f"  {row['model']} {row['ranks']} {row['engine']} {row['placement']}: "
              + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in clocks.items()))
    for row in local["rows"]:
        for note in row["notes"]:
            print(f"  {row['model']} {row['ranks']} {row['engine']} {row['placement']}: {note}")
    for row in local["rows"]:
        if "bytes_predicted" in row:
            print(f"bytes/step rank 0 {row['model']} {row['engine']} {row['placement']}: "
                  f"predicted {row['bytes_predicted']}, measured {row['bytes_measured']}")
    for check in local["allgather_check"]:
        print(f"allgather {check['bytes']} B: predicted {check['predicted_s'] * 1e3:.3f} "
              f"ms, measured {check['measured_s'] * 1e3:.3f} ms")


def print_tables(report):
    if "this_machine" in report:
        print_this_machine(report["this_machine"])
    u = report["ueno"]
    print("\n(2) Ueno et al. Table 1, 128 V100s (ms per step: paper | predicted 1 link | 2 links)")
    print("| row | paper | 1 link | 2 links |\n| --- | --- | --- | --- |")
    print(f"| SGD | {u['paper']['sgd_ms']:.0f} | {u['1_link']['sgd_ms']:.1f} | "
          f"{u['2_link']['sgd_ms']:.1f} |")
    for name, paper in u["paper"]["rows_ms"].items():
        predicted = [u[f"{n}_link"]["rows_ms"].get(name) for n in (1, 2)]
        cells = " | ".join("not modelled" if v is None else f"{v:.1f}" for v in predicted)
        print(f"| {name} | {paper:.0f} | {cells} |")
    print("| effect | paper | 1 link | 2 links |\n| --- | --- | --- | --- |")
    for name, paper in u["paper"]["effects_ms"].items():
        one, two = (u[f"{n}_link"]["effects_ms"][name] for n in (1, 2))
        print(f"| {name} | {paper:.0f} | {one:.1f} ({_error(one, paper)}) | "
              f"{two:.1f} ({_error(two, paper)}) |")
    pa = report["pauloski"]
    fit, profile = pa["v100_eigh_fit"], pa["v100_eigh_profile"]
    solved, cholesky = u["v100_cholesky_solved"], u["v100_cholesky_profile"]
    print(f"\n(3) Pauloski et al.; V100 eigh fitted to Table V (16, 64 GPUs): "
          f"{fit['latency_s'] * 1e3:.1f} ms + 9n³ at {fit['flops'] / 1e12:.3f} TFLOP/s "
          f"(profile {profile['latency_s'] * 1e3:.1f} ms, {profile['flops'] / 1e12:.3f}); "
          f"Cholesky solved from Ueno §3.3.1: {solved['latency_s'] * 1e3:.2f} ms + n³ at "
          f"{solved['flops'] / 1e12:.2f} TFLOP/s (profile {cholesky['latency_s'] * 1e3:.2f}, "
          f"{cholesky['flops'] / 1e12:.2f}); SGD at 64 GPUs {pa['sgd_ms_at_64_paper']:.1f} ms")
    print("| GPUs | K-FAC/SGD paper | predicted | factor comp+comm paper / pred. ms | "
          "eigen comp paper / pred. | eigen comm paper / pred. | slowest worker speed-up "
          "paper / pred. | fastest paper / pred. |")
    print("| --- " * 8 + "|")
    for row in pa["rows"]:
        v, vi = row.get("table_v_ms"), row.get("table_vi")
        factor = row["factor_ms"]["comp"] + row["factor_ms"]["comm"]
        pair = lambda paper, predicted, digits: (
            f"{'-' if paper is None else f'{paper:.{digits}f}'} / {predicted:.{digits}f}")
        cells = [f"{row['ratio_paper']:.3f}",
                 f"{row['ratio_predicted']:.3f} "
                 f"({_error(row['ratio_predicted'], row['ratio_paper'])})",
                 pair(v and v["factor_comp"] + v["factor_comm"], factor, 0),
                 pair(v and v["eigen_comp"], row["eigen_ms"]["comp"], 0),
                 pair(v and v["eigen_comm"], row["eigen_ms"]["comm"], 0),
                 pair(vi and vi["slowest"], row["slowest_speedup"], 2),
                 pair(vi and vi["fastest"], row["fastest_speedup"], 2)]
        print(f"| {row['gpus']} | " + " | ".join(cells) + " |")
    for p, entry in pa["parameters_per_worker"].items():
        print(f"factor elements per worker on {p} GPUs (min, max): paper {entry['paper']}, "
              f"predicted ({entry['predicted'][0]:.3g}, {entry['predicted'][1]:.3g})")
    o = report["osawa"]
    for name, entry in o.items():
        print(f"Osawa {name}: paper {entry['paper']}, predicted {entry['predicted']:.3f} "
              f"({_error(entry['predicted'], entry['paper'])})")
    lpt = report["lpt"]
    print(f"\n(4) LPT on keras ResNet50: {lpt['factors']} factors, largest {lpt['largest']}; "
          f"bound {lpt['bound']:.3f}x, reached from {lpt['saturation_ranks']} ranks on "
          f"(outside estimate: {lpt['outside_estimate']['bound']}x from "
          f"{lpt['outside_estimate']['saturation_ranks']})")
    print("| ranks | " + " | ".join(str(r["ranks"]) for r in lpt["rows"]) + " |")
    print("| --- " * (1 + len(lpt["rows"])) + "|")
    print("| LPT speed-up | " + " | ".join(f"{r['speedup']:.2f}" for r in lpt["rows"]) + " |")
    print("| round-robin | " + " | ".join(f"{r['round_robin_speedup']:.2f}"
                                          for r in lpt["rows"]) + " |")


def plot(report):
    figure, axes = harness.subplots(2, 2, figsize=(13, 9))
    if "this_machine" in report:
        axis = axes[0][0]
        rows = report["this_machine"]["rows"]
        labels = [f"{r['model']} {r['ranks']}r\n{r['engine'][:5]} {r['placement'][:5]}"
                  for r in rows]
        for j, kind in enumerate(("predicted", "measured")):
            bottom = [0.0] * len(rows)
            for k, column in enumerate(COLUMNS):
                values = [r[kind][column] * 1e3 for r in rows]
                axis.bar([i + (j - 0.5) * 0.38 for i in range(len(rows))], values, 0.36,
                         bottom=bottom, color=f"C{k}", hatch="//" if j == 0 else None,
                         label=column.replace("_", " ") if j == 1 else None)
                bottom = [b + v for b, v in zip(bottom, values)]
        axis.plot(range(len(rows)), [r["measured"]["mean_step"] * 1e3 for r in rows], "kx",
                  label="mean step (outliers)")
        axis.set_xticks(range(len(rows)), labels, fontsize=6)
        axis.set_ylabel("ms per step")
        axis.set_title("(1) this machine: predicted (hatched) | measured (medians)",
                       fontsize=9)
        axis.legend(fontsize=7)
    axis = axes[0][1]
    u = report["ueno"]
    names = list(u["paper"]["effects_ms"])
    for j, (label, source) in enumerate((("paper", u["paper"]), ("1 link", u["1_link"]),
                                          ("2 links", u["2_link"]))):
        axis.bar([i + (j - 1) * 0.27 for i in range(len(names))],
                 [source["effects_ms"][n] for n in names], 0.26, label=label)
    axis.set_xticks(range(len(names)), names)
    axis.set_ylabel("ms saved per step")
    axis.set_title("(2) Ueno et al. Table 1: effect of each optimization, 128 V100s",
                   fontsize=9)
    axis.legend(fontsize=8)
    axis = axes[1][0]
    rows = report["pauloski"]["rows"]
    gpus = [r["gpus"] for r in rows]
    axis.plot(gpus, [r["ratio_paper"] for r in rows], "o-", label="K-FAC/SGD paper (Table IV)")
    axis.plot(gpus, [r["ratio_predicted"] for r in rows], "s--", label="predicted")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("GPUs")
    axis.set_title("(3) Pauloski et al.: K-FAC/SGD per step", fontsize=9)
    axis.legend(fontsize=8)
    axis = axes[1][1]
    lpt = report["lpt"]
    ranks = [r["ranks"] for r in lpt["rows"]]
    axis.plot(ranks, [r["speedup"] for r in lpt["rows"]], "o-", label="LPT (tfkfac)")
    axis.plot(ranks, [r["round_robin_speedup"] for r in lpt["rows"]], "s--",
              label="round-robin (kfac_pytorch)")
    axis.axhline(lpt["bound"], color="0.5", lw=0.8, label=f"bound {lpt['bound']:.2f}x")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("ranks")
    axis.set_ylabel("decomposition speed-up (slowest rank)")
    axis.set_title("(4) keras ResNet50: slowest rank's decomposition work", fontsize=9)
    axis.legend(fontsize=8)
    return figure


def main():
    if FLAGS.measure:
        measure()
    from trainers.planning import workloads

    report = {}
    if os.path.isfile(os.path.join(MEASURED_DIR, "distributed.json")):
        report["this_machine"] = this_machine()
    resnet50 = workloads.workload(workloads.load_model("resnet50"), 1, "resnet50")
    report.update(ueno=ueno(resnet50), pauloski=pauloski(resnet50), osawa=osawa(resnet50),
                  lpt=lpt_saturation(resnet50))
    print_tables(report)
    harness.write(report, "plan_validation", plot)


if __name__ == "__main__":
    harness.run(main)
