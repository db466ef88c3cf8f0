"""The planner (`python -m trainers.plan`) against the papers and this machine.

Every predicted figure of the papers' rows is one the binary prints or writes: each row
is a command (COMMON + the row's flags), run as a user runs it, its figure read from the
printed table or its plan.json (`printed`), its error against the paper, and a tolerance
(TOLERANCE; Osawa et al.'s 1024-GPU step OSAWA_1024_TOLERANCE). Inputs taken from the
papers are passed as flags and named in the row: Ueno's and Osawa's rows take one GPU's
throughput (Ueno §3.2.4); Pauloski's none (the V100 profile's own forward/backward); the
links of a node and the collectives. Each row also names what of
the fits it holds ("fitted"): the V100's eigh rate is fitted on Pauloski et al.'s
ResNet-50 rows of Table V at 16 and 64 GPUs and checked on the rest of that column
(`rate_checks`); the Cholesky inverse solved from Ueno et al.'s ResNet-34 timing
(§3.3.1), whose largest layer is ResNet-50's too; the V collectives' link sharing was
chosen on Ueno's float21 saving. tests/test_plan_papers.py reruns every row. The
papers' figures are in bench/papers.py; this machine's measurement and its comparison
in bench/plan_measurement.py (`--measure` runs it).

Writes bench/results/plan_validation.json and .png, the papers' table in
docs/benchmarks.md between its markers (`--docs_only`: that table alone, from the JSON),
and prints the tables.

Run (~8 min under load, 60 rows; with `--measure` ~3 min more, idle machine):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/plan_validation.py
"""

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile

from absl import flags

import doc_blocks
import harness
import papers
import plan_measurement

FLAGS = flags.FLAGS
flags.DEFINE_bool("measure", False, "Time the loopback collectives and run the 2-rank "
                  "K-FAC job before validating.")
flags.DEFINE_bool("docs_only", False, "Only rewrite docs/benchmarks.md's table from the "
                  "committed plan_validation.json.")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(REPO_ROOT, "docs", "benchmarks.md")
DOCS_BEGIN = ("<!-- planner validation table: written by bench/plan_validation.py from "
              "bench/results/plan_validation.json -->")
DOCS_END = "<!-- end of planner validation table -->"
TOLERANCE = 0.20
# Osawa et al.'s 1024-GPU step: its 10 minutes hold more than steps (validations).
OSAWA_1024_TOLERANCE = 0.30
# How far a row's error may drift from the error recorded in plan_validation.json (a
# change of the model moves it; the docs' table must then be rewritten).
DRIFT = 0.02
UENO_FORWARD_BACKWARD = papers.forward_backward_ms(papers.UENO["images_per_s_one_gpu"],
                                                   papers.UENO["batch"])
STALE_INTERVAL = round(papers.osawa_refresh_interval())
OSAWA_STALE_INTERVAL = round(papers.osawa_refresh_interval(papers.OSAWA["run_1024"]))
# What every row's command shares; a row adds its own flags.
COMMON = ("--batch=32", "--device=v100", "--network=ib-edr", "--weight_sharing=expand",
          "--decomposition_wires=float32")
# Ueno et al. and Osawa et al. ran ABCI: owners invert (Cholesky) and precondition their
# layers, ReduceScatterV/AllGatherV, mixed precision.
ABCI = ("--model=resnet50", f"--workers_per_node={papers.ABCI_GPUS_PER_NODE}",
        f"--links_per_node={papers.ABCI_LINKS_PER_NODE}",
        f"--forward_backward_ms={UENO_FORWARD_BACKWARD:.2f}", "--collective=reduce_scatter_v",
        "--placements=owner", "--methods=inverse")
ABCI_INPUTS = (f"forward/backward {UENO_FORWARD_BACKWARD:.2f} ms (Ueno §3.2.4: 744.8 "
               "images/s at 32 on one GPU)", "2 EDR links per ABCI node",
               "ReduceScatterV/AllGatherV (Ueno Algorithm 1, Osawa §3)")
# What the Ueno rows at 128 GPUs share with the fits (the docs' validation table says it).
CHOLESKY_POINT = ("decompositions: the slowest owner's are ResNet-50's largest layer, "
                  "factors 4608 and 512, whose 36 ms (Ueno §3.3.1, ResNet-34's largest "
                  "layer) the Cholesky rate is solved on")
LINK_SHARING = ("the V collectives' link sharing (a node's 4 GPUs share its links) was "
                "chosen to reproduce the 17 ms float21 saves between + symmetric and "
                "+ float21")
OVERLAP = ("overlap hides nothing on a device (`Device.overlap_hides`), chosen on Ueno "
           "§4.1's account of this overlap row; what it costs the backward pass beside it "
           "(`Device.overlap_slows`) is NCCL's 4 channels of a V100's 80 SMs, not fitted")
EIGH_FIT_ROWS = (("resnet50", 16), ("resnet50", 64))
EIGH_FIT = ("the eigh rate is fitted on this row under kfac_pytorch's round-robin owners; "
            "the planner assigns tfkfac's")
# A row whose own figure a rate was fitted on is a fit, not a check: the docs' table says so.
FITTED_ON_THE_ROW = {EIGH_FIT: "fit: eigh rate", LINK_SHARING: "fit: link sharing"}
EIGH_HELD = "the eigh rate, fitted on Table V's ResNet-50 rows at 16 and 64 GPUs"
PAULOSKI_FITS = ("the eigh rate is fitted on Table V's ResNet-50 rows at 16 and 64 GPUs "
                 "(amortized over 120-2000 steps here)")


def frontera(model):
    """Pauloski et al. ran Frontera: kfac_pytorch (eigendecompositions by their owners,
    shared by an allreduce-sum; factors allreduced whole, Horovod), float32. No step of
    theirs is an input: the forward/backward is the V100 profile's own (Table III's SGD
    step is a 64-GPU one)."""
    return (f"--model={model}", f"--workers_per_node={papers.FRONTERA_GPUS_PER_NODE}",
            "--links_per_node=1", "--collective=kfac_pytorch", "--precision=float32",
            "--placements=replicated", "--methods=eigen", "--factor_wires=float32")


FRONTERA_INPUTS = ("forward/backward: the V100 profile's float32 one (no figure of the "
                   "paper's)", "1 EDR link per Frontera node",
                   "kfac_pytorch's collectives (Horovod allreduces)")


def _ueno(factor_wire, interval, overlap=False, hierarchical=False):
    options = tuple(f"--{name}_reduction=true" for name, on in (
        ("overlap", overlap), ("hierarchical", hierarchical)) if on)
    return ABCI + (f"--workers={papers.UENO['gpus']}", f"--factor_wires={factor_wire}",
                   f"--factor_intervals={interval}",
                   f"--decomposition_intervals={interval}") + options


def _pauloski_label(gpus):
    """The label of Pauloski et al.'s configuration on `gpus` in the plan's JSON."""
    from trainers.planning import step_model

    factor, eigen = papers.pauloski_intervals(gpus)
    return step_model.Configuration("replicated", "float32", "float32", factor, eigen,
                                    "expand", "eigen").label()


def rows():
    """Each row: its paper's figure, the command's flags, the figure read from the output
    ("step" or "x SGD" of a column at a worker count, "speed-up" of K-FAC's step between
    two worker counts, "factors GB" of the memory lines; from plan.json "config x SGD" of
    a configuration, "phase ms" of the fastest's phase each time it runs), the
    paper-derived inputs, the tolerance and what of the fits the row holds ("fitted")."""
    ueno = papers.UENO["rows_ms"]
    row = lambda paper, name, value, flags_, figure, inputs=ABCI_INPUTS, fitted=(), \
        tolerance=TOLERANCE: dict(paper=paper, row=name, value=value, flags=flags_,
                                  figure=figure, inputs=inputs, fitted=list(fitted),
                                  tolerance=tolerance)
    at_128 = ("step", 1, 128)
    table = [
        row("Ueno Table 1", "SGD", papers.UENO["sgd_ms"], _ueno("float32", 1),
            ("step", 0, 128)),
        row("Ueno Table 1", "+ symmetric packing (float32 factors)", ueno["+ symmetric"],
            _ueno("float32", 1), at_128, fitted=(LINK_SHARING, CHOLESKY_POINT)),
        row("Ueno Table 1", "+ float21 factors", ueno["+ float21"], _ueno("float21", 1),
            at_128, fitted=(LINK_SHARING, CHOLESKY_POINT)),
        row("Ueno Table 1", "+ overlap (A's reduction with the backward pass)",
            ueno["+ overlap"], _ueno("float21", 1, overlap=True), at_128,
            fitted=(CHOLESKY_POINT, OVERLAP)),
        row("Ueno Table 1", "+ hierarchical reduction", ueno["+ hierarchical"],
            _ueno("float21", 1, overlap=True, hierarchical=True), at_128,
            fitted=(CHOLESKY_POINT, OVERLAP)),
        row("Ueno Table 1", f"+ stale factors (every {STALE_INTERVAL} steps)", ueno["+ stale"],
            _ueno("float21", STALE_INTERVAL, overlap=True, hierarchical=True), at_128,
            fitted=(CHOLESKY_POINT, OVERLAP)),
        row("Osawa §5.2", "1 GPU / 64 GPUs, time per iteration", papers.OSAWA["speedup_64"],
            ABCI + ("--workers=1,64", "--factor_wires=float32", "--factor_intervals=1",
                    "--decomposition_intervals=1"), ("speed-up", 1, (1, 64))),
        row("Osawa Figure 4", "factor data, GB (587 MiB)",
            papers.OSAWA["mib_diagonal_bn"] * 2 ** 20 / 1e9,
            ABCI + ("--workers=1,64", "--factor_wires=float32", "--factor_intervals=1",
                    "--decomposition_intervals=1"), ("factors GB", None, None), inputs=()),
        row("Osawa Table 2", f"1024 GPUs, ms per iteration (stale factors, every "
            f"{OSAWA_STALE_INTERVAL} steps)", papers.osawa_1024_step_ms(),
            ABCI + ("--workers=1024", "--factor_wires=float32",
                    f"--factor_intervals={OSAWA_STALE_INTERVAL}",
                    f"--decomposition_intervals={OSAWA_STALE_INTERVAL}"),
            ("step", 1, 1024), tolerance=OSAWA_1024_TOLERANCE)]
    gpus = papers.PAULOSKI["gpus"]
    intervals = [papers.pauloski_intervals(p) for p in gpus]
    for model in papers.PAULOSKI["improvement"]:
        flags_ = frontera(model) + (
            f"--workers={','.join(map(str, gpus))}",
            f"--factor_intervals={','.join(str(f) for f, _ in intervals)}",
            f"--decomposition_intervals={','.join(str(d) for _, d in intervals)}")
        table += [row("Pauloski Table IV", f"{model} K-FAC/SGD per step, {p} GPUs",
                      papers.pauloski_ratio(p, model), flags_,
                      ("config x SGD", _pauloski_label(p), p), FRONTERA_INPUTS,
                      (PAULOSKI_FITS,)) for p in gpus]
    for model, by_gpus in papers.PAULOSKI["table_v_factor_comm_ms"].items():
        flags_ = frontera(model) + (f"--workers={','.join(map(str, by_gpus))}",
                                    "--factor_intervals=1", "--decomposition_intervals=1")
        table_v = papers.PAULOSKI
        for p in by_gpus:
            eigh_fit = (EIGH_FIT,) if (model, p) in EIGH_FIT_ROWS else (EIGH_HELD,)
            table += [row("Pauloski Table V", f"{model} {name}, {p} GPUs",
                          table_v[key][model][p], flags_, ("phase ms", phase, p),
                          FRONTERA_INPUTS, fitted)
                      for name, key, phase, fitted in (
                          ("factor computation", "table_v_factor_comp_ms",
                           "factor_statistics", ()),
                          ("factor communication", "table_v_factor_comm_ms",
                           "factor_reduction", ()),
                          ("eigendecompositions (slowest worker)", "table_v_eigen_ms",
                           "decomposition", eigh_fit),
                          ("eigendecomposition communication", "table_v_eigen_comm_ms",
                           "decomposition_sharing", ()))]
    return table


def command(flags_):
    """The command line of a row with flags `flags_`."""
    return ["python", "-m", "trainers.plan", *COMMON, *flags_]


def run_plan(args):
    """(stdout, plan.json) of `python -m trainers.plan *args`, run as a user runs it."""
    with tempfile.TemporaryDirectory() as output_dir:
        done = subprocess.run([sys.executable, "-m", "trainers.plan", *args,
                               f"--output_dir={output_dir}"],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                              env=dict(os.environ, PYTHONPATH=REPO_ROOT))
        if done.returncode:
            raise RuntimeError(f"trainers.plan failed: {done.stderr[-2000:]}")
        with open(os.path.join(output_dir, "plan.json")) as f:
            return done.stdout, json.load(f)


def outputs(specs):
    """{flags: run_plan's (stdout, plan.json)} of every distinct command of `specs`, two
    processes at a time (each is mostly one core's TensorFlow import and model build)."""
    distinct = list(dict.fromkeys(spec["flags"] for spec in specs))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(lambda flags_: run_plan(command(flags_)[3:]), distinct)
        return dict(zip(distinct, runs))


def printed(text, plan, figure):
    """The figure `figure` (see `rows`) as the binary printed it in `text` or wrote it
    in `plan` (its plan.json)."""
    line, column, workers = figure
    if line == "factors GB":
        return float(re.search(r", factors (\d+\.\d+), eigen_adam", text).group(1))
    if line == "speed-up":
        one, many = (printed(text, plan, ("step", column, p)) for p in workers)
        return one / many
    if line in ("config x SGD", "phase ms"):
        entry = next(r for r in plan["results"] if r["workers"] == workers)
        if line == "phase ms":
            return entry["best_phases"][column]["ms_per_occurrence"]
        return entry["kfac_ms"][column] / entry["sgd_ms"]
    block = text.split(f"\n{workers} worker(s), global batch")[1]
    label = next(l for l in block.splitlines() if l.startswith(f"  {line} "))
    return float(label[2 + 32:].split()[column])


def _phases_ms(plan, workers):
    entry = next(r for r in plan["results"] if r["workers"] == workers)
    return {name: phase["ms_per_step"] for name, phase in entry["best_phases"].items()}


def _miss_note(row, plan):
    """Which term misses, and why, for a row beyond its tolerance."""
    if row["row"].startswith("+ stale"):
        phases = _phases_ms(plan, 128)
        refreshed = sum(phases[p] for p in ("factor_statistics", "factor_reduction",
                                            "decomposition"))
        paper = papers.UENO["rows_ms"]
        before = paper["+ hierarchical"]
        over_sgd = before - papers.UENO["sgd_ms"]
        saving = before - paper["+ stale"]
        return (f"the factor phases every {STALE_INTERVAL} steps ({refreshed:.1f} ms of the "
                "step; Osawa et al.'s eq. 20 averaged over the run's 35 epochs): the "
                f"paper's adaptive rule refreshed more often, its {saving:.0f} ms saving "
                f"({before:.0f} to {paper['+ stale']:.0f}) is {saving / over_sgd:.0%} of its "
                f"{over_sgd:.0f} ms over SGD, an interval near "
                f"{1 / (1 - saving / over_sgd):.1f}")
    if row["row"].startswith(("+ overlap", "+ hierarchical")):
        paper = papers.UENO["rows_ms"]
        return (f"the paper's overlap made the step slower ({paper['+ float21']:.0f} to "
                f"{paper['+ overlap']:.0f} ms): NCCL sums on the GPU's streaming "
                "multiprocessors, which the backward pass needs (Ueno et al. §4.1, Fig. 8); "
                "the planner's overlap hides nothing and costs the backward pass only the "
                "SMs NCCL's 4 channels hold")
    if row["figure"][0] == "speed-up":
        one, many = (_phases_ms(plan, p) for p in (1, 64))
        rest = lambda phases: sum(phases.values()) - phases["forward_backward"]
        needed = (rest(one) - row["value"] * rest(many)) / (row["value"] - 1)
        return (f"the 1-GPU step's inverses ({one['decomposition']:.0f} of "
                f"{sum(one.values()):.0f} ms) against a step around them from Ueno et al.'s "
                "2020 implementation: Osawa et al. 2019's is unpublished and slower "
                "(before ChainerX and NHWC); a forward/backward of "
                f"{needed:.0f} ms would give {row['value']}")
    if row["figure"][0] == "config x SGD":
        _, label, gpus = row["figure"]
        entry = next(r for r in plan["results"] if r["workers"] == gpus)
        printed_ms = entry["kfac_ms"][label] - entry["sgd_ms"]
        paper_ms = (row["value"] - 1) * entry["sgd_ms"]
        return (f"K-FAC's step over SGD's: {paper_ms:.0f} ms in the paper (at the printed SGD "
                f"step), {printed_ms:.0f} ms printed; at these intervals the factors and "
                "eigendecompositions amortize to a few ms, so the gap is in the work of every "
                "step (preconditioning, kfac_pytorch's hooks), which the planner counts at its "
                "floor")
    if row["figure"][0] == "step" and row["figure"][2] == papers.OSAWA["run_1024"]["gpus"]:
        return (f"the refresh interval is the mean of Osawa et al.'s schedule over the run "
                f"({papers.osawa_refresh_interval(papers.OSAWA['run_1024']):.2f}: every step "
                "for 500 iterations, then eq. 20); the paper's 10 minutes also hold 45 "
                "validations and the job's start, and its step is Osawa et al. 2019's "
                "Chainer one (before ChainerX and NHWC, Ueno et al. §3.2), where the row "
                "takes Ueno et al.'s single-GPU throughput")
    if row["figure"][1] in ("factor_reduction", "decomposition_sharing"):
        return ("kfac_pytorch's allreduces of whole factors and zero-filled decompositions "
                "at the EDR link's rate; Table V's ResNet-101 and -152 rows grow with the "
                "bytes at about that rate but start from a fixed 20-70 ms a phase, which "
                "no term of the planner holds")
    return "not analysed"


# ------------------------------------------------------------------- the V100's rates
def _rank_factors(dims, owners, size):
    """Per rank, the dims of the factors it decomposes."""
    ranks = [[] for _ in range(size)]
    for n, owner in zip(dims, owners):
        ranks[owner].append(n)
    return ranks


def _round_robin(name, gpus):
    """{p: per rank the factor dims kfac_pytorch's round-robin gives it} for keras `name`."""
    from trainers.planning import workloads

    blocks = papers.torchvision_order(workloads.named(name).blocks["expand"])
    dims = papers.kfac_pytorch_factor_dims(blocks)
    return {p: _rank_factors(dims, papers.kfac_pytorch_owners(len(blocks), p), p)
            for p in gpus}


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


def rate_checks():
    """The V100 profile's eigh against its fit on Pauloski et al.'s ResNet-50 rows of
    Table V (16, 64 GPUs) and its check on its other rows (slowest
    worker under kfac_pytorch's round-robin); its Cholesky inverse against the solution
    of Ueno et al. §3.3.1."""
    from trainers.planning import hardware

    measured = papers.PAULOSKI["table_v_eigen_ms"]
    fit = fit_eigh(_round_robin("resnet50", (16, 64)),
                   {p: measured["resnet50"][p] / 1e3 for p in (16, 64)})
    latency, rate = hardware.V100_EIGH_LATENCY, hardware.V100_EIGH
    checks = {}
    for name in ("resnet50", "resnet101", "resnet152"):
        for p, ranks in _round_robin(name, (32,) if name == "resnet50" else (16, 32, 64)).items():
            predicted = max(len(ds) * latency + sum(9.0 * n ** 3 for n in ds) / rate
                            for ds in ranks)
            checks[f"{name} {p}"] = {"predicted_ms": predicted * 1e3,
                                     "paper_ms": measured[name][p]}
    cholesky = solve_cholesky()
    return {"eigh_fit": {"latency_s": fit[0], "flops": fit[1]},
            "eigh_profile": {"latency_s": latency, "flops": rate}, "eigh_checks": checks,
            "cholesky_solved": {"latency_s": cholesky[0], "flops": cholesky[1]},
            "cholesky_profile": {"latency_s": hardware.V100_CHOLESKY_LATENCY,
                                 "flops": hardware.V100_CHOLESKY}}


# ------------------------------------------------------------------- the rows
def papers_rows():
    """Every row of `rows()` with its command, printed figure and error (each command run
    once: rows sharing one read the same output), whether it is within its tolerance,
    and `float21_effect`."""
    results, specs = [], rows()
    printed_by_flags = outputs(specs)
    for row in specs:
        text, plan = printed_by_flags[row["flags"]]
        predicted = printed(text, plan, row["figure"])
        error = (predicted - row["value"]) / row["value"]
        result = {key: row[key] for key in ("paper", "row", "value", "figure", "inputs",
                                            "fitted", "tolerance")}
        result.update(command=" ".join(command(row["flags"])), predicted=predicted,
                      error=error, within=abs(error) <= row["tolerance"])
        if not result["within"]:
            result["miss"] = _miss_note(row, plan)
        results.append(result)
        print(f"{row['paper']}, {row['row']}: paper {row['value']:.3f}, printed "
              f"{predicted:.3f} ({error:+.0%})", flush=True)
    return results, float21_effect(outputs)


def float21_effect(outputs):
    """Ueno et al.'s saving from float21 factors (+ symmetric to + float21) against the
    printed one, each as the bandwidth it implies for the factor bytes float21 saves: the
    factor collective's own term, which rows within the tolerance can hide."""
    (text32, plan32), (text21, plan21) = (outputs[_ueno(wire, 1)]
                                          for wire in ("float32", "float21"))
    sent = lambda plan: plan["results"][0]["best_phases"]["factor_reduction"][
        "payload_bytes_per_rank"][0]
    saved = sent(plan32) - sent(plan21)
    figure = ("step", 1, papers.UENO["gpus"])
    paper_ms = papers.UENO["rows_ms"]["+ symmetric"] - papers.UENO["rows_ms"]["+ float21"]
    printed_ms = printed(text32, plan32, figure) - printed(text21, plan21, figure)
    return {"bytes_saved": saved, "paper_ms": paper_ms, "printed_ms": printed_ms,
            "paper_bytes_per_s": saved / (paper_ms / 1e3),
            "printed_bytes_per_s": saved / (printed_ms / 1e3)}


def used_for(row):
    """"check", or what was fitted on the row's own figure."""
    return "; ".join(FITTED_ON_THE_ROW[f] for f in row["fitted"] if f in FITTED_ON_THE_ROW
                     ) or "check"


def docs_table(papers_rows_):
    """The table of every paper row that docs/benchmarks.md holds between its markers."""
    lines = ["| paper | row | paper's figure | printed | error | within | used for |",
             "| --- " * 7 + "|"]
    lines += [f"| {row['paper']} | {row['row']} | {row['value']:.4g} | {row['predicted']:.4g} "
              f"| {row['error']:+.0%} | {'yes' if row['within'] else 'no'} "
              f"({row['tolerance']:.0%}) | {used_for(row)} |" for row in papers_rows_]
    checks = [row for row in papers_rows_ if used_for(row) == "check"]
    lines += ["", f"Within tolerance: {sum(row['within'] for row in papers_rows_)} of "
              f"{len(papers_rows_)} rows; of the {len(checks)} checks (rows no rate was "
              f"fitted on), {sum(row['within'] for row in checks)}."]
    return "\n".join(lines)


def write_docs(report):
    doc_blocks.write(BENCHMARKS, DOCS_BEGIN, DOCS_END, docs_table(report["papers"]))


def print_tables(report):
    if "this_machine" in report:
        plan_measurement.print_this_machine(report["this_machine"])
    print(f"\npapers; every command: {' '.join(command(()))} + the row's flags")
    print("| paper | row | paper's | printed | error | within | the row's flags |")
    print("| --- " * 7 + "|")
    for row in report["papers"]:
        flags_ = row["command"].split(" ".join(COMMON) + " ")[1]
        print(f"| {row['paper']} | {row['row']} | {row['value']:.4g} | "
              f"{row['predicted']:.2f} | {row['error']:+.0%} | "
              f"{'yes' if row['within'] else 'no'} ({row['tolerance']:.0%}) | `{flags_}` |")
    for row in report["papers"]:
        if "miss" in row:
            print(f"miss, {row['paper']} {row['row']}: {row['miss']}")
    effect = report["float21_effect"]
    print(f"float21's saving: paper {effect['paper_ms']:.0f} ms, printed "
          f"{effect['printed_ms']:.2f} ms for {effect['bytes_saved'] / 1e6:.1f} MB less per "
          f"rank: {effect['paper_bytes_per_s'] / 1e9:.1f} GB/s against "
          f"{effect['printed_bytes_per_s'] / 1e9:.1f} GB/s modelled")
    rates = report["rates"]
    fit, profile = rates["eigh_fit"], rates["eigh_profile"]
    print(f"V100 eigh fitted to Pauloski Table V ResNet-50 (16, 64 GPUs): "
          f"{fit['latency_s'] * 1e3:.1f} ms + 9n³ at {fit['flops'] / 1e12:.3f} TFLOP/s "
          f"(profile {profile['latency_s'] * 1e3:.1f}, {profile['flops'] / 1e12:.3f}); "
          "checked on the other models' rows (slowest worker, ms):")
    for name, check in rates["eigh_checks"].items():
        print(f"  {name} GPUs: paper {check['paper_ms']:.0f}, profile "
              f"{check['predicted_ms']:.0f} "
              f"({(check['predicted_ms'] - check['paper_ms']) / check['paper_ms']:+.0%})")
    solved, cholesky = rates["cholesky_solved"], rates["cholesky_profile"]
    print(f"V100 Cholesky inverse solved from Ueno §3.3.1: {solved['latency_s'] * 1e3:.2f} ms "
          f"+ n³ at {solved['flops'] / 1e12:.2f} TFLOP/s (profile "
          f"{cholesky['latency_s'] * 1e3:.2f}, {cholesky['flops'] / 1e12:.2f})")


def plot(report):
    figure, axes = harness.subplots(1, 3, figsize=(17, 5))
    if "this_machine" in report:
        plan_measurement.plot_this_machine(axes[0], report["this_machine"])
    axis = axes[1]
    shown = [row for row in report["papers"] if row["paper"] != "Pauloski Table IV"]
    axis.bar(range(len(shown)), [row["predicted"] / row["value"] for row in shown], 0.6,
             zorder=2)
    axis.axhspan(1 - TOLERANCE, 1 + TOLERANCE, color="0.9", label=f"±{TOLERANCE:.0%}",
                 zorder=1)
    axis.axhline(1.0, color="0.5", lw=0.8)
    axis.set_xticks(range(len(shown)), [f"{row['paper']}\n{row['row'].split(' (')[0]}"
                                        for row in shown], fontsize=6, rotation=20)
    axis.set_ylabel("printed / paper")
    axis.set_title("Ueno et al., Osawa et al., Pauloski et al. Table V", fontsize=9)
    axis.legend(fontsize=8)
    axis = axes[2]
    for k, model in enumerate(papers.PAULOSKI["improvement"]):
        pauloski = [row for row in report["papers"] if row["paper"] == "Pauloski Table IV"
                    and row["row"].startswith(model)]
        gpus = [row["figure"][2] for row in pauloski]
        axis.plot(gpus, [row["value"] for row in pauloski], "o-", color=f"C{k}",
                  label=f"{model}, paper (Table IV)")
        axis.plot(gpus, [row["predicted"] for row in pauloski], "s--", color=f"C{k}",
                  label=f"{model}, trainers.plan")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("GPUs")
    axis.set_title("Pauloski et al.: K-FAC/SGD per step", fontsize=9)
    axis.legend(fontsize=8)
    return figure


def main():
    if FLAGS.docs_only:
        with open(os.path.join(harness.RESULTS_DIR, "plan_validation.json")) as f:
            write_docs(json.load(f))
        return
    if FLAGS.measure:
        plan_measurement.measure()
    report = {}
    if os.path.isfile(os.path.join(plan_measurement.MEASURED_DIR, "distributed.json")):
        report["this_machine"] = plan_measurement.this_machine()
    report["papers"], report["float21_effect"] = papers_rows()
    report["rates"] = rate_checks()
    print_tables(report)
    harness.write(report, "plan_validation", plot)
    write_docs(report)


if __name__ == "__main__":
    harness.run(main)
