"""K-FAC's start-up against its inner optimizer's: what the declared default
(`tfkfac.KFAC()`, the trainer's `--optimizer=kfac` defaults) does before its steady
state that ScheduleFreeAdamW alone does not, per phase (issue 64, item 3: "first step
<= 1.5x the inner optimizer's on every model").

For each model (the trainer's, at `--batch_size`), each measurement is a FRESH process
(tracing and compilation caches are per process) that builds the trainer exactly as
`python -m trainers.train` builds it (bench/timed_steps.py: `trainers.runner.Trainer`,
batches cached in memory first), compiled as bench/time_to_accuracy.py BUDGETS say
(`first_order_xla` for ScheduleFreeAdamW, `kfac_xla` for K-FAC), and then runs:
1. `--first_steps` steps in one `fit`, each step's wall time kept with its kind
   (`trainers.runner.phase_fn`: K-FAC "factors_and_decompositions", "factors", "stale";
   "step" for ScheduleFreeAdamW), and the `fit` call's own set-up before its first step;
2. `--steady_steps` more steps in a second `fit` (K-FAC's factor steps among them), the
   steady time of each kind;
3. for K-FAC, `--decomposition_steps` single-step fits whose step is made a factor and
   decomposition step (its counters' next steps set to the current one): the steady
   time of the kind of its first step.
The processes of K-FAC and ScheduleFreeAdamW alternate, the order reversed every
other repeat (`harness.interleave`); the load average is kept before and after each.

Start-up of a process = the first fit's set-up + the first step's wall time + for every
other first step of a kind (K-FAC's first stale step, which traces and compiles the stale
train function; its first factor-only step) its excess over that kind's steady time.
That is K-FAC's "first step" of the issue, and ScheduleFreeAdamW's first step (trace +
compile + run). Its phases, from what TensorFlow exposes:
- tracing (Python): wall time in `tracing_compilation._create_concrete_function`, the
  outermost traces only (a nested tf.function traces inside its caller's), with each
  traced graph's size (nodes, its function library's included);
- graph optimization: Grappler's meta-optimizer, from its VLOG (`meta_optimizer=1`):
  each item's span from "Starting optimization" to "Optimized N functions";
- XLA compilation: `device_compiler=1`'s "Compilation of XLA executable time";
- first run: the steady time of the first step's kind (a later step of the same kind);
- other: the rest (instantiation TensorFlow does not log: placement, partitioning,
  executor and kernel creation, oneDNN primitives, first allocations; Keras's fit
  set-up).
All but "other" are clocked in the child and attributed by timestamp to the set-up or
step window they fall in (TensorFlow's log lines carry the same wall clock).

Steady ratios against ScheduleFreeAdamW (paired by repeat: the K-FAC process over the
ScheduleFreeAdamW process next to it): the stale step, and the amortized step over the
schedule (factor steps every `factor_update_freq`, decompositions every
`decomposition_update_freq`: (d - d/f) stale, d/f - 1 factor, 1 factor+decomposition
steps per d), beside the floor's (bench/results/step_floor.json, the inverse method
against SGD's forward/backward and update: trainers/planning/floor_model.py).

The same in this process's CPU time (`time.process_time`, all its threads), which
waiting for a core on a shared machine does not lengthen: tracing (the traces' own CPU
time), first run (the kind's steady CPU time) and the rest ("compilation_and_other").

Run (in the background; 28 min for the three models at 3 repeats on 2 cores at load 5-9:
CNN 5 min, ResNet-20 14.5, ViT 7.5):
  cd /work/main && PYTHONPATH=.:bench nohup .venv/bin/python bench/start_up.py \\
      > /tmp/start_up.log 2>&1 &
Writes bench/results/start_up.json and start_up.png; each child's TensorFlow log and
JSON go to `--child_log_dir`. bench/time_to_accuracy.py's --models and --batch_size
apply; its other flags are refused. The children inherit the environment, whose thread
settings (OPENBLAS_NUM_THREADS: the LAPACK decompositions' threads) the report records;
e.g. `OPENBLAS_NUM_THREADS=1 ... --output_dir=/tmp/x` measures single-threaded LAPACK.
`--resummarize=<report.json>` recomputes an earlier report's summaries from its runs and
their logs without measuring. `--child=<model>:<optimizer>` runs one measurement (what
the parent launches) and writes its JSON to `--child_output`.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags

import harness
import time_to_accuracy  # BUDGETS; its --models and --batch_size are this script's

FLAGS = flags.FLAGS
harness.define_repeats(3, "a fresh process of each optimizer")
flags.DEFINE_integer("first_steps", 12, "Steps timed one by one from the first.",
                     lower_bound=2)
flags.DEFINE_integer("steady_steps", 20, "Steps after them, for each kind's steady time "
                     "(K-FAC's factor steps every 10 among them).", lower_bound=1)
flags.DEFINE_integer("decomposition_steps", 2, "K-FAC: single steps made factor and "
                     "decomposition steps, for that kind's steady time.", lower_bound=1)
flags.DEFINE_integer("cached_batches", 16, "Distinct batches held in memory and cycled.")
flags.DEFINE_string("child_log_dir", os.path.join(tempfile.gettempdir(), "tfkfac_start_up"),
                    "Where each child's log and JSON go.")
flags.DEFINE_string("child", None, "Internal: <model>:<optimizer>, one measurement in "
                    "this process.")
flags.DEFINE_string("child_output", None, "Internal: where --child writes its JSON.")
flags.DEFINE_string("resummarize", None, "Recompute the summaries of this earlier report "
                    "from its runs and their logs (still in --child_log_dir) instead of "
                    "measuring.")

OPTIMIZERS = ("kfac", "schedule_free_adamw")  # the default, its inner rule alone
INNER = "schedule_free_adamw"
# TensorFlow's logs the phases are read from (VLOG 1 of these modules).
VMODULE = "meta_optimizer=1,device_compiler=1"
_LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:(\d+\.\d+)\s+\d+\s+([\w.]+):\d+\] (.*)$")
_XLA_COMPILE = re.compile(r"Compilation of XLA executable time: .*?\((\d+) us\)")
PHASES = ("tracing", "graph_optimization", "xla_compilation", "first_run", "other")
CPU_PHASES = ("tracing", "compilation_and_other", "first_run")
ENVIRONMENT = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
               "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "TF_XLA_FLAGS")


# ---------------------------------------------------------------- pure logic (tested)
def parse_log(lines):
    """TensorFlow log `lines` as timed spans [{"phase", "start", "end"}]: a Grappler
    item from its "Starting optimization" line to its "Optimized N functions" line
    ("graph_optimization"), an XLA compilation ending at its line ("xla_compilation").
    Lines that are not TensorFlow's, or of other kinds, are skipped."""
    spans, item_start = [], None
    for line in lines:
        match = _LOG_LINE.match(line.strip())
        if not match:
            continue
        stamp, source, message = float(match.group(1)), match.group(2), match.group(3)
        if source == "meta_optimizer.cc":
            if message.startswith("Starting optimization for grappler item"):
                item_start = stamp
            elif re.match(r"Optimized \d+ functions", message) and item_start is not None:
                spans.append({"phase": "graph_optimization", "start": item_start,
                              "end": stamp})
                item_start = None
        elif source == "device_compiler.h":
            compiled = _XLA_COMPILE.search(message)
            if compiled:
                spans.append({"phase": "xla_compilation",
                              "start": stamp - int(compiled.group(1)) / 1e6, "end": stamp})
    return spans


def _overlap(span, start, end):
    return max(0.0, min(span["end"], end) - max(span["start"], start))


def window_phases(spans, traces, start, end):
    """Seconds of each clocked phase inside the window [start, end]: outermost traces
    (depth 0) as "tracing", XLA compilations, and Grappler's spans less what of them
    overlaps an XLA compilation (which may run passes of its own)."""
    xla = [s for s in spans if s["phase"] == "xla_compilation"]
    phases = {"tracing": sum(_overlap(t, start, end) for t in traces if t["depth"] == 0),
              "xla_compilation": sum(_overlap(s, start, end) for s in xla)}
    grappler = 0.0
    for span in spans:
        if span["phase"] == "graph_optimization":
            inside = _overlap(span, start, end)
            clipped = {"start": max(span["start"], start), "end": min(span["end"], end)}
            grappler += max(0.0, inside - sum(_overlap(s, clipped["start"], clipped["end"])
                                              for s in xla))
    phases["graph_optimization"] = grappler
    return phases


def steady_times(steps, figure="wall"):
    """{kind: median seconds} over `steps` (dicts with "kind" and `figure`: "wall", or
    "cpu" for this process's CPU time)."""
    kinds = {}
    for step in steps:
        kinds.setdefault(step["kind"], []).append(step[figure])
    return {kind: statistics.median(walls) for kind, walls in kinds.items()}


def first_of_each_kind(steps):
    """The steps (in order) that are the first of their kind."""
    seen, firsts = set(), []
    for step in steps:
        if step["kind"] not in seen:
            seen.add(step["kind"])
            firsts.append(step)
    return firsts


def start_up(setup, first_steps, steady, figure="wall"):
    """A process's start-up from its first fit's `setup` (a window dict with `figure`,
    "wall" or "cpu"), its `first_steps` (dicts with "index", "kind" and `figure`, from
    step 1) and the `steady` median per kind of that figure: the set-up, the first step whole, and each later first step of a
    kind by its excess over the kind's steady time (None where no steady time).
    Returns {"total_s", "parts": [{"label", "measured", "steady", "counted"}], "first_run_s",
    "excess_over_steady_s"} where `excess_over_steady_s` adds every one of
    `first_steps`' excess over its kind's steady time (not only the first of a kind)."""
    parts = [{"label": "setup", "measured": setup[figure], "steady": 0.0,
              "counted": setup[figure]}]
    firsts = first_of_each_kind(first_steps)
    for position, step in enumerate(firsts):
        base = steady.get(step["kind"])
        if position == 0:
            counted = step[figure]
        else:
            counted = None if base is None else step[figure] - base
        parts.append({"label": f"first {step['kind']} (step {step['index']})",
                      "index": step["index"], "kind": step["kind"], "measured": step[figure],
                      "steady": base, "counted": counted})
    first = firsts[0]
    excess = sum(step[figure] - steady[step["kind"]] for step in first_steps[1:]
                 if step["kind"] in steady)
    return {"total_s": sum(p["counted"] for p in parts if p["counted"] is not None),
            "parts": parts, "first_run_s": steady.get(first["kind"]),
            "excess_over_steady_s": setup[figure] + first[figure] + excess}


def amortized_step(steady, factor_every, decompose_every):
    """The mean step over K-FAC's schedule from `steady` {kind: seconds}: per
    `decompose_every` steps one factor+decomposition step, decompose_every /
    factor_every - 1 factor steps, the rest stale."""
    factor_steps = decompose_every // factor_every
    stale = decompose_every - factor_steps
    return (stale * steady["stale"] + (factor_steps - 1) * steady["factors"]
            + steady["factors_and_decompositions"]) / decompose_every


def median_range(values):
    """{"median", "min", "max"} of `values` without Nones (None if none)."""
    values = [v for v in values if v is not None]
    return harness.spread(values) if values else None


# ---------------------------------------------------------------- the child
def _timed_traces():
    """Wraps TensorFlow's trace of a tf.function (`_create_concrete_function`) so that
    each trace's wall clock span, name and nesting depth is kept; returns (the list they
    go to, the concrete functions, kept to size their graphs after the steps)."""
    from tensorflow.python.eager.polymorphic_function import tracing_compilation

    traces, functions, depth = [], [], [0]
    original = tracing_compilation._create_concrete_function

    def traced(function_type, type_context, func_graph, tracing_options):
        start, cpu = time.time(), time.process_time()
        depth[0] += 1
        try:
            function = original(function_type, type_context, func_graph, tracing_options)
        finally:
            depth[0] -= 1
        traces.append({"name": tracing_options.name, "start": start, "end": time.time(),
                       "cpu": time.process_time() - cpu, "depth": depth[0]})
        functions.append(function)
        return function

    tracing_compilation._create_concrete_function = traced
    return traces, functions


def _graph_nodes(function):
    graph_def = function.graph.as_graph_def()
    return len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)


def child(model, optimizer, output):
    """One fresh process's measurement of `optimizer` on `model` (see the docstring)."""
    load_before = os.getloadavg()
    traces, functions = _timed_traces()
    import keras

    import timed_steps
    from trainers import config as config_lib, runner

    budget = time_to_accuracy.BUDGETS[model]
    settings = (dict(xla=budget["kfac_xla"]) if optimizer == "kfac"
                else dict(optimizer=optimizer, xla=budget["first_order_xla"]))
    with tempfile.TemporaryDirectory() as model_dir:
        built = time.time()
        config = config_lib.TrainConfig(model=model, batch_size=FLAGS.batch_size,
                                        model_dir=model_dir, verbose=0, **settings)
        entry = timed_steps.Timed(config, FLAGS.cached_batches, FLAGS.steady_steps)
        trainer = entry.trainer
        built = time.time() - built
        kind_of = runner.phase_fn(trainer.optimizer)
        steps, setups = [], []

        class Recorder(keras.callbacks.Callback):
            def __init__(self, label):
                super().__init__()
                self.label = label

            def on_train_batch_begin(self, batch, logs=None):
                now, cpu = time.time(), time.process_time()
                if batch == 0:
                    setups.append({"label": self.label, "start": self.fit_start,
                                   "end": now, "wall": now - self.fit_start,
                                   "cpu": cpu - self.fit_cpu})
                self.begin, self.cpu = now, cpu

            def on_train_batch_end(self, batch, logs=None):
                now, cpu = time.time(), time.process_time()
                steps.append({"index": len(steps) + 1, "kind": kind_of(), "fit": self.label,
                              "start": self.begin, "end": now, "wall": now - self.begin,
                              "cpu": cpu - self.cpu})

        def fit(label, count):
            recorder = Recorder(label)
            recorder.fit_start, recorder.fit_cpu = time.time(), time.process_time()
            trainer.model.fit(entry._batches, steps_per_epoch=count, epochs=1, verbose=0,
                              callbacks=[recorder])

        first_traces = len(traces)
        fit("first", FLAGS.first_steps)
        fit("steady", FLAGS.steady_steps)
        if optimizer == "kfac":
            counters = trainer.optimizer.state.counters  # the schedule stale_steps reads
            for _ in range(FLAGS.decomposition_steps):
                now = int(trainer.optimizer.iterations)
                counters.next_factor_step.assign(now)
                counters.next_decomposition_step.assign(now)
                fit("decomposition", 1)
        for trace, function in zip(traces, functions):
            if trace["end"] >= setups[0]["start"]:
                trace["graph_nodes"] = _graph_nodes(function)
        result = {"model": model, "optimizer": optimizer, "config": {
                      key: getattr(config, key) for key in (
                          "optimizer", "xla", "learning_rate", "kfac_inner_optimizer",
                          "kfac_method", "damping", "kl_clip", "factor_update_freq",
                          "decomposition_update_freq") if hasattr(config, key)},
                  "build_s": built, "setups": setups, "steps": steps,
                  "traces": traces[first_traces:], "traces_before_fit": len(traces[:first_traces]),
                  "load_average_before": load_before, "load_average_after": os.getloadavg()}
    with open(output, "w", encoding="utf-8") as f:
        json.dump(result, f)


# ---------------------------------------------------------------- the parent
def measure(model, optimizer, serial):
    """Runs one child process; returns its result with its phases (`summarize`)."""
    os.makedirs(FLAGS.child_log_dir, exist_ok=True)
    stem = os.path.join(FLAGS.child_log_dir, f"{model}-{optimizer}-{serial}")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE=VMODULE)
    bench = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join([harness.REPO_ROOT, bench,
                                         env.get("PYTHONPATH", "")])
    command = [sys.executable, os.path.abspath(__file__), f"--child={model}:{optimizer}",
               f"--child_output={stem}.json", f"--batch_size={FLAGS.batch_size}",
               f"--first_steps={FLAGS.first_steps}", f"--steady_steps={FLAGS.steady_steps}",
               f"--decomposition_steps={FLAGS.decomposition_steps}",
               f"--cached_batches={FLAGS.cached_batches}"]
    load_before = os.getloadavg()
    started = time.time()
    with open(f"{stem}.log", "w", encoding="utf-8") as log:
        subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, check=True,
                       cwd=harness.REPO_ROOT)
    with open(f"{stem}.json", encoding="utf-8") as f:
        result = json.load(f)
    with open(f"{stem}.log", encoding="utf-8", errors="replace") as f:
        spans = parse_log(f)
    result.update(process_s=time.time() - started, log=f"{stem}.log",
                  parent_load_before=load_before, parent_load_after=os.getloadavg())
    summarize(result, spans)
    print(f"{model:9s} {optimizer:20s} start-up {result['start_up']['total_s']:7.2f} s "
          f"(" + ", ".join(f"{p} {s:.2f}" for p, s in result["phases"].items()) +
          f"); steady {json.dumps({k: round(v * 1e3, 1) for k, v in result['steady'].items()})}"
          f" ms; load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    return result


def summarize(result, spans):
    """Adds to a child's `result` its steady times, start-up and phases."""
    first = [s for s in result["steps"] if s["fit"] == "first"]
    later = [s for s in result["steps"] if s["fit"] != "first"]
    steady = result["steady"] = steady_times(later)
    setup = result["setups"][0]
    up = result["start_up"] = start_up(setup, first, steady)
    result["steady_cpu"] = steady_times(later, "cpu")
    result["start_up_cpu"] = start_up(setup, first, result["steady_cpu"], "cpu")
    windows = [setup] + [first[p["index"] - 1] for p in up["parts"][1:]]
    phases = {"tracing": 0.0, "graph_optimization": 0.0, "xla_compilation": 0.0}
    for window, part in zip(windows, up["parts"]):
        clocked = window_phases(spans, result["traces"], window["start"], window["end"])
        part["phases"] = clocked
        part["traces"] = [
            {"name": t["name"], "depth": t["depth"], "wall": t["end"] - t["start"],
             "cpu": t["cpu"], "graph_nodes": t.get("graph_nodes")}
            for t in result["traces"] if window["start"] <= t["start"] <= window["end"]]
        if part["counted"] is not None:
            for phase, seconds in clocked.items():
                phases[phase] += seconds
    phases["first_run"] = up["first_run_s"] or 0.0
    phases["other"] = up["total_s"] - sum(phases.values())
    result["phases"] = phases
    # In CPU time: the traces' own, the first run's (the kind's steady CPU time), and the
    # rest (graph optimization, XLA, instantiation: not clocked in CPU time).
    windows = [(w["start"], w["end"]) for w, p in zip(windows, up["parts"])
               if p["counted"] is not None]
    tracing_cpu = sum(t["cpu"] for t in result["traces"] if t["depth"] == 0 and any(
        start <= t["start"] <= end for start, end in windows))
    first_run_cpu = result["start_up_cpu"]["first_run_s"] or 0.0
    result["phases_cpu"] = {"tracing": tracing_cpu, "first_run": first_run_cpu,
                            "compilation_and_other": result["start_up_cpu"]["total_s"]
                            - tracing_cpu - first_run_cpu}
    if result["optimizer"] == "kfac" and {"stale", "factors",
                                          "factors_and_decompositions"} <= set(steady):
        config = result["config"]
        for key, times in (("amortized_step_s", steady),
                           ("amortized_step_cpu_s", result["steady_cpu"])):
            result[key] = amortized_step(times, config["factor_update_freq"],
                                         config["decomposition_update_freq"])


def floors(model):
    """The floor's stale and amortized step ratios (inverse method over SGD) of `model`
    in bench/results/step_floor.json, or None."""
    path = os.path.join(harness.RESULTS_DIR, "step_floor.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    entry = report["models"].get(model)
    if entry is None:
        return None
    method, sgd = entry["methods"]["inverse"], entry["sgd"]["step"]["floor_s"]
    return {"stale": method["step_kinds"]["stale"]["floor_s"] / sgd,
            "amortized": method["step"]["floor_s"] / sgd,
            "source": "bench/results/step_floor.json (inverse method over SGD; "
                      f"library {report.get('library_commit')})"}


def compare(runs):
    """Per model, K-FAC against ScheduleFreeAdamW over the repeats: medians with
    ranges, and ratios paired by repeat."""
    kfac, inner = runs["kfac"], runs[INNER]
    pairs = list(zip(kfac, inner))

    def paired(figure):
        return median_range([figure(k, i) for k, i in pairs])

    def phase(run, name):
        return run["phases"][name]

    summary = {
        "kfac_start_up_s": median_range([k["start_up"]["total_s"] for k in kfac]),
        "inner_first_step_s": median_range([i["start_up"]["total_s"] for i in inner]),
        "start_up_ratio": paired(lambda k, i: k["start_up"]["total_s"]
                                 / i["start_up"]["total_s"]),
        # The same in this process's CPU time, which waiting for a core does not lengthen.
        "kfac_start_up_cpu_s": median_range([k["start_up_cpu"]["total_s"] for k in kfac]),
        "inner_first_step_cpu_s": median_range([i["start_up_cpu"]["total_s"] for i in inner]),
        "start_up_cpu_ratio": paired(lambda k, i: k["start_up_cpu"]["total_s"]
                                     / i["start_up_cpu"]["total_s"]),
        "kfac_phases_s": {p: median_range([phase(k, p) for k in kfac]) for p in PHASES},
        "inner_phases_s": {p: median_range([phase(i, p) for i in inner]) for p in PHASES},
        "kfac_phases_cpu_s": {p: median_range([k["phases_cpu"][p] for k in kfac])
                              for p in CPU_PHASES},
        "inner_phases_cpu_s": {p: median_range([i["phases_cpu"][p] for i in inner])
                               for p in CPU_PHASES},
        "kfac_parts_s": {},
        "stale_ratio": paired(lambda k, i: k["steady"]["stale"] / i["steady"]["step"]),
        "amortized_ratio": paired(lambda k, i: k.get("amortized_step_s", float("nan"))
                                  / i["steady"]["step"]),
        "stale_cpu_ratio": paired(lambda k, i: k["steady_cpu"]["stale"]
                                  / i["steady_cpu"]["step"]),
        "amortized_cpu_ratio": paired(lambda k, i: k.get("amortized_step_cpu_s",
                                                         float("nan"))
                                      / i["steady_cpu"]["step"]),
        "kfac_steady_ms": {kind: median_range([k["steady"].get(kind, 0) * 1e3 for k in kfac])
                           for kind in ("stale", "factors", "factors_and_decompositions")},
        "inner_steady_ms": median_range([i["steady"]["step"] * 1e3 for i in inner]),
    }
    for position in range(len(kfac[0]["start_up"]["parts"])):
        parts = [k["start_up"]["parts"][position] for k in kfac
                 if len(k["start_up"]["parts"]) > position]
        summary["kfac_parts_s"][parts[0]["label"]] = part_summary(parts)
    summary["inner_parts_s"] = {
        part["label"]: part_summary([i["start_up"]["parts"][position] for i in inner])
        for position, part in enumerate(inner[0]["start_up"]["parts"])}
    summary["floor"] = floors(kfac[0]["model"])
    return summary


def part_summary(parts):
    """One start-up part over the repeats: its counted and measured seconds, its clocked
    phases and, per function traced in it, the trace's wall and CPU seconds and its
    graph's nodes (medians with ranges)."""
    summary = {"counted": median_range([p["counted"] for p in parts]),
               "measured": median_range([p["measured"] for p in parts]),
               **{name: median_range([p["phases"][name] for p in parts])
                  for name in parts[0]["phases"]}, "traces": []}
    for position, trace in enumerate(parts[0]["traces"]):
        same = [p["traces"][position] for p in parts if len(p["traces"]) > position
                and p["traces"][position]["name"] == trace["name"]]
        summary["traces"].append({
            "name": trace["name"], "depth": trace["depth"],
            **{figure: median_range([t[figure] for t in same])
               for figure in ("wall", "cpu", "graph_nodes")}})
    return summary


def plot(report):
    model_names = list(report["models"])
    figure, axes = harness.subplots(1, 2, figsize=(12, 4.8))
    colours = {"tracing": "tab:blue", "graph_optimization": "tab:orange",
               "xla_compilation": "tab:red", "first_run": "tab:green", "other": "tab:gray",
               "compilation_and_other": "tab:purple"}
    width = 0.38
    for axis, suffix, phases, ratio_key, title in (
            (axes[0], "phases_s", PHASES, "start_up_ratio", "wall time"),
            (axes[1], "phases_cpu_s", CPU_PHASES, "start_up_cpu_ratio", "process CPU time")):
        for m, model in enumerate(model_names):
            summary = report["models"][model]["summary"]
            for o, (key, label) in enumerate(((f"kfac_{suffix}", "K-FAC"),
                                              (f"inner_{suffix}", "SFAdamW"))):
                bottom = 0.0
                x = m + (o - 0.5) * width
                for phase in phases:
                    value = max(0.0, summary[key][phase]["median"])
                    axis.bar(x, value, width, bottom=bottom, color=colours[phase],
                             label=phase if m == 0 and o == 0 else None)
                    bottom += value
                axis.annotate(label, (x, bottom), ha="center", va="bottom", fontsize=7)
            ratio = summary[ratio_key]
            axis.annotate(f"{ratio['median']:.1f}x ({ratio['min']:.1f}-{ratio['max']:.1f})",
                          (m, 0), xytext=(0, -24), textcoords="offset points",
                          ha="center", fontsize=8)
        axis.set_xticks(range(len(model_names)), model_names)
        axis.set_ylabel("s (median over fresh processes)")
        axis.set_title(f"Start-up by phase, {title} (batch {report['batch_size']}; "
                       "ratio paired by repeat)", fontsize=9)
        axis.legend(fontsize=8)
    return figure


def resummarize(path):
    """Recomputes the summaries of the report at `path` from its runs and their logs (no
    measurement), keeping its provenance; writes it to --output_dir."""
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    for result in report["models"].values():
        for runs in result["runs"].values():
            for run in runs:
                with open(run["log"], encoding="utf-8", errors="replace") as f:
                    summarize(run, parse_log(f))
        result["summary"] = compare(result["runs"])
    report["machine"]["load_average_at_end_of_measurement"] = report["machine"].get(
        "load_average_at_end_of_measurement", report["machine"]["load_average_at_end"])
    harness.write(report, "start_up", plot)


def main():
    if FLAGS.child:
        model, optimizer = FLAGS.child.split(":")
        child(model, optimizer, FLAGS.child_output)
        return
    if FLAGS.resummarize:
        resummarize(FLAGS.resummarize)
        return
    harness.refuse_unread("time_to_accuracy", ("models", "batch_size"))
    harness.check_among("models", FLAGS.models, time_to_accuracy.BUDGETS)
    report = {"batch_size": FLAGS.batch_size, "repeats": FLAGS.repeats,
              "first_steps": FLAGS.first_steps, "steady_steps": FLAGS.steady_steps,
              "decomposition_steps": FLAGS.decomposition_steps,
              "optimizers": {"kfac": "the trainer's defaults (tfkfac.KFAC())",
                             INNER: "--optimizer=schedule_free_adamw"},
              "compiled_as": "bench/time_to_accuracy.py BUDGETS (first_order_xla, kfac_xla)",
              "vmodule": VMODULE,
              # Thread settings the children inherit (LAPACK's threads set the cost of a
              # decomposition on a loaded machine).
              "environment": {name: os.environ[name] for name in ENVIRONMENT
                              if name in os.environ},
              "models": {}}
    serial = iter(range(10 ** 6))
    for model in FLAGS.models:
        started = time.time()
        runs = harness.interleave(
            {optimizer: lambda optimizer=optimizer: measure(model, optimizer, next(serial))
             for optimizer in OPTIMIZERS}, FLAGS.repeats)
        summary = compare(runs)
        report["models"][model] = {"summary": summary, "runs": runs,
                                   "wall_s": time.time() - started}
        ratio = summary["start_up_ratio"]
        print(f"{model}: K-FAC start-up {summary['kfac_start_up_s']['median']:.2f} s, "
              f"{INNER} first step {summary['inner_first_step_s']['median']:.2f} s, ratio "
              f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}); stale "
              f"{summary['stale_ratio']['median']:.2f}x, amortized "
              f"{summary['amortized_ratio']['median']:.2f}x", flush=True)
        harness.write(report, "start_up", plot)  # after every model: a partial report


if __name__ == "__main__":
    harness.run(main)
