"""This machine's side of the planner's validation (`bench/plan_validation.py --measure`):
its rates now, the 2-rank collectives over loopback (bench/results/loopback.json, the
planner's "loopback" network) and the 2-rank K-FAC job of bench/distributed_benchmark.py,
stored in bench/results/plan_validation/; then `this_machine` compares them with the
planner's "local" device and "loopback" network: 1 process vs 2 ranks (Horovod, and
tf.distribute's MultiWorkerMirroredStrategy), K-FAC factors every 5 steps,
decompositions every 10, global batch 128; per step the stale step's phases (the median
step), the factor phases (their clock) and the decompositions (the median inverse step's
clock), each with its error, and notes that say which term misses and why (COLUMNS).

Each rank of the loopback timing runs this file: `plan_measurement.py OUT_PATH` under
horovodrun.
"""

import dataclasses
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402

MEASURED_DIR = os.path.join(harness.RESULTS_DIR, "plan_validation")
LOOPBACK_SIZES = [2 ** k for k in range(8, 23, 2)]  # float32 elements: 1 kB to 16 MB
LOOPBACK_REPEATS = 15
# The 2-rank K-FAC job (bench/distributed_benchmark.py's flags).
LOCAL_MODELS, LOCAL_BATCH, LOCAL_FACTOR, LOCAL_DECOMPOSITION = ("mlp", "cnn"), 128, 5, 10
# The layout of the phase clocks of a saved measurement. Before the fix (library 6a78fc7
# and earlier, no "phase_clocks" key in distributed.json) they nest: "update"'s start
# stamp waited for nothing, so it ran from the start of the step (forward, backward,
# gradient reduction and all K-FAC phases inside), and a phase's tf.function could run
# before its own start stamp, on the previous phase's clock (preconditioning under the
# decompositions'). Then the clocks sum to more than the step ("rest" < 0) and only
# the factors clock, the span factors..precondition and the decomposition clock of an
# inverse step (its own work plus at most that step's preconditioning) are usable.
# `measure` marks its results "sequential" (tfkfac.state.PhaseClocks since the fix).
NESTED, SEQUENTIAL = "nested", "sequential"


def loopback_worker(out_path):
    """One rank: median seconds of the communicator's allreduce and allgather per size,
    the two interleaved (both ranks run the same calls in the same order)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from tfkfac import distributed

    comm = distributed.get_communicator("horovod")
    reduce = tf.function(lambda t: comm.grouped_allreduce_mean([t], "gradients")[0])
    gather = tf.function(lambda t: comm.allgather(t, "allgather"))
    result = {"ranks": comm.size, "sizes_bytes": [4 * n for n in LOOPBACK_SIZES],
              "allreduce_s": [], "allgather_s": []}
    for n in LOOPBACK_SIZES:
        x = tf.ones([n])
        samples = harness.interleave(
            {name: lambda function=function: harness.seconds(lambda: function(x).numpy())
             for name, function in (("allreduce_s", reduce), ("allgather_s", gather))},
            LOOPBACK_REPEATS, warm_up=1)
        for name, seconds in samples.items():
            result[name].append(harness.spread(seconds)["median"])
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def fit_loopback(measured):
    """Least squares T = a + b·n over the allreduce sizes; on 2 ranks a ring allreduce is 2
    steps and moves n bytes: ring step latency a/2, bandwidth 1/b."""
    import numpy as np

    n, t = np.array(measured["sizes_bytes"], float), np.array(measured["allreduce_s"])
    b, a = np.polyfit(n, t, 1)
    return {"ring_step_latency": max(a, 0.0) / 2, "bandwidth": 1.0 / b}


def measure():
    """This machine's rates now, the loopback collectives, then the 2-rank K-FAC job."""
    import linalg_benchmark
    from trainers import launch
    from trainers.planning import hardware

    env = launch.job_environment()
    os.makedirs(MEASURED_DIR, exist_ok=True)
    rates = linalg_benchmark.rates(3)
    linalg_benchmark.print_rates(rates)
    with open(os.path.join(MEASURED_DIR, "rates.json"), "w") as f:
        json.dump({"rates": rates, "load_average": os.getloadavg()}, f, indent=1)
    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "loopback.json")
        command = launch.horovodrun_command([os.path.abspath(__file__), out], 2, env)
        code, output = launch.run_job(command, 600, env)
        if code:
            raise RuntimeError(f"loopback timing failed:\n{output[-3000:]}")
        with open(out) as f:
            measured = json.load(f)
    measured["fit"] = fit_loopback(measured)
    with open(hardware.LOOPBACK_JSON, "w") as f:
        json.dump(harness.stamp(measured), f, indent=1)
    print(f"loopback fit: {measured['fit']}", flush=True)
    command = [sys.executable, os.path.join(os.path.dirname(__file__), "distributed_benchmark.py"),
               f"--models={','.join(LOCAL_MODELS)}", f"--global_batch={LOCAL_BATCH}",
               f"--factor_update_freq={LOCAL_FACTOR}",
               f"--decomposition_update_freq={LOCAL_DECOMPOSITION}", "--bytes_configs=",
               # Phase clocks (the comparison's columns) time no overlapped configuration.
               "--timed_configs=replicated:float32:float32,owner:float32:float32",
               f"--output_dir={MEASURED_DIR}"]
    code, output = launch.run_job(command, 1200, env)
    print(output[-3000:], flush=True)
    if code:
        raise RuntimeError("bench/distributed_benchmark.py failed")
    path = os.path.join(MEASURED_DIR, "distributed.json")
    with open(path) as f:
        report = json.load(f)
    report["phase_clocks"] = SEQUENTIAL  # measured by this library's PhaseClocks
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


# ------------------------------------------------------- the comparison
# What `this_machine` compares, per step (amortized over the intervals), from what the saved
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


def plot_this_machine(axis, local):
    """The comparison's panel: predicted (hatched) and measured columns per row."""
    rows = local["rows"]
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


if __name__ == "__main__":
    loopback_worker(sys.argv[1])
