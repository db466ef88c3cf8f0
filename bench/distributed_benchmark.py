"""Distributed K-FAC benchmark: 1 process vs 2 ranks on this machine, on both engines:
Horovod (horovodrun --gloo) and tf.distribute (MultiWorkerMirroredStrategy, 2 workers on
localhost started by trainers.launch).

Same global batch (strong scaling): one process with batch G against 2 ranks with G/2
each, for the MLP and the small CNN of `trainers/models.py` on real Fashion-MNIST, with
`tfkfac.KFAC` in `model.fit` (factor_update_freq 5, decomposition_update_freq 10 by default).
Measured after warm-up steps (XLA compiles, first factor and inverse steps):
- time per training step (wall clock over the timed window; the slowest rank);
- decomposition phase per inverse step (`opt.summary()["phase_seconds"]`, which for 2
  ranks includes the exchange), on the slowest rank vs the single process;
- bytes per step handed to collectives (`comm.bytes_sent()`), per category, by placement
  and wire dtype, amortized over the timed window, plus the bytes of one factor step and
  one inverse step (measured in the warm-up);
for "replicated" and "owner" placements, float32 and float21 wires (timed) and float16
wires (bytes only, warm-up steps). Each rank uses cores/ranks intra-op threads. Each
timed configuration runs `--rounds` windows, the configurations interleaved round by round
(A B C A B C ...); its row is its median round, every round's step times beside it.

A configuration may end in a reduction option (docs/design.md §6):
- `:overlap` (`overlap_reduction=True`, both engines): without phase clocks, which would
  serialize the phases it overlaps, so its row has step times and no decomposition phase;
- `:hierarchical` (`hierarchical_reduction=True`): needs nodes of several ranks. Run by
  Horovod only (MultiWorkerMirroredStrategy takes a node from each worker address's host,
  and trainers.launch starts every worker on localhost); e.g. 4 ranks as 2 "nodes":
    .venv/bin/python bench/distributed_benchmark.py --engines=horovod --num_ranks=4 \
        --horovod_hosts=localhost:2,127.0.0.1:2 --bytes_configs= \
        --timed_configs=replicated:float32:float32,replicated:float32:float32:hierarchical \
        --output_dir=bench/results/distributed_hierarchical

Run (about 25 minutes on 2 idle cores; in the background):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/distributed_benchmark.py \\
      > /tmp/distributed_benchmark.log 2>&1 &
Writes bench/results/distributed.json and distributed.png; prints the ratios.
"""

import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

import harness  # noqa: E402
from trainers import launch  # noqa: E402

FLAGS = flags.FLAGS
ENGINES = ("horovod", "multi_worker")
flags.DEFINE_list("models", ["mlp", "cnn"], "Models of trainers/models.py to measure.")
flags.DEFINE_integer("global_batch", 128, "Examples per step over all ranks.")
flags.DEFINE_integer("warmup_steps", 6, "Untimed steps (include a factor and an inverse step).")
flags.DEFINE_integer("timed_steps", 40, "Timed steps per configuration.")
flags.DEFINE_integer("factor_update_freq", 5, "K-FAC factor update interval.")
flags.DEFINE_integer("decomposition_update_freq", 10, "K-FAC decomposition interval.")
flags.DEFINE_list("timed_configs", ["replicated:float32:float32", "owner:float32:float32",
                                    "replicated:float32:float32:overlap",
                                    "owner:float32:float32:overlap",
                                    "replicated:float21:float32"],
                  "2-rank configurations timed: placement:factor_wire:eigen_wire, optionally "
                  "then :overlap or :hierarchical (REDUCTION_OPTIONS).")
flags.DEFINE_list("bytes_configs", ["replicated:float16:float16", "owner:float16:float16"],
                  "2-rank configurations run for the warm-up steps only (bytes).")
flags.DEFINE_integer("num_ranks", 2, "Ranks of the distributed run.")
flags.DEFINE_string("horovod_hosts", None, "horovodrun -H of the Horovod run (default "
                    "localhost:<num_ranks>); several host names make several nodes.")
flags.DEFINE_list("engines", list(ENGINES), "Engines of the distributed runs.")
flags.DEFINE_string("engine", None, "Internal: the engine a worker runs under.")
flags.DEFINE_integer("rounds", 3, "Timed windows per configuration, the configurations "
                     "interleaved round by round; a row is its median round.")
flags.DEFINE_integer("timeout", 900, "Seconds before a run is killed.")
flags.DEFINE_string("replot", None, "Only redraw the PNG and reprint the figures from "
                    "this distributed.json (no runs).")
flags.DEFINE_string("worker_out", None, "Internal: run as a worker, write results here.")

PHASES = ("factors", "decomposition", "precondition", "update")
# A configuration's last field: the KFAC settings it adds, and the engines that run it.
REDUCTION_OPTIONS = {"overlap": ({"overlap_reduction": True}, ENGINES),
                     "hierarchical": ({"hierarchical_reduction": True}, ("horovod",))}


def parse_config(config):
    """(placement, factor_wire, eigen_wire, option or None) of a configuration string."""
    fields = config.split(":")
    if len(fields) not in (3, 4) or (len(fields) == 4 and fields[3] not in REDUCTION_OPTIONS):
        raise ValueError(f"a configuration is placement:factor_wire:eigen_wire[:option], "
                         f"option one of {sorted(REDUCTION_OPTIONS)}; received {config!r}")
    return tuple(fields) + (None,) * (4 - len(fields))
_ENGINE_LABELS = {"horovod": "Horovod ranks", "multi_worker": "MWMS workers"}


# ----------------------------------------------------------------------------- worker
def worker_main(out_path):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfkfac
    from pipelines import idx_dataset
    from tfkfac import distributed
    from trainers import models

    # Threading must be set before TensorFlow starts (the communicator makes variables).
    processes = (FLAGS.num_ranks if FLAGS.engine == "multi_worker"
                 else distributed.launched_world_size())
    threads = max(1, (os.cpu_count() or 1) // processes)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    strategy = (tf.distribute.MultiWorkerMirroredStrategy() if FLAGS.engine == "multi_worker"
                else tf.distribute.get_strategy())
    options = {parse_config(c)[3] for c in FLAGS.timed_configs + FLAGS.bytes_configs}
    communicators = {}
    if "hierarchical" in options and FLAGS.engine == "horovod":
        # First: it initializes Horovod with the dynamic process sets it adds (for every
        # row of this run, which costs Horovod "some slight extra synchronization").
        communicators["hierarchical"] = distributed.get_communicator("horovod",
                                                                     hierarchical=True)
    with strategy.scope():
        comm = distributed.get_communicator("auto")
    communicator = lambda option: communicators.get(option, comm)
    local_batch = FLAGS.global_batch // comm.size
    total_steps = FLAGS.warmup_steps + FLAGS.timed_steps
    ds = idx_dataset.load_idx("fashion_mnist", f"train[:{total_steps * FLAGS.global_batch}]")
    x, y = next(iter(ds.map(lambda e: (tf.cast(e["image"], tf.float32) / 255.0, e["label"]))
                     .batch(total_steps * FLAGS.global_batch)))
    x, y = x.numpy(), y.numpy()
    fit_batch = FLAGS.global_batch  # tf.distribute: Keras gives each replica its part
    if FLAGS.engine != "multi_worker":  # Horovod rank r takes the r-th part of each batch
        shape = (total_steps, comm.size, local_batch)
        x = x.reshape(shape + (28, 28, 1))[:, comm.rank].reshape((-1, 28, 28, 1))
        y = y.reshape(shape)[:, comm.rank].reshape(-1)
        fit_batch = local_batch

    class Probe(keras.callbacks.Callback):
        """Per-step bytes in the warm-up; time, phases and bytes over the timed window."""

        def __init__(self, optimizer, comm, warmup):
            super().__init__()
            self.optimizer, self.comm, self.warmup = optimizer, comm, warmup
            self.warmup_bytes, self.marks = [], {}
            self.times, self.decomposition = [], []  # After every step.

        def snapshot(self):
            summary = self.optimizer.summary()
            return {"time": time.perf_counter(), "bytes": self.comm.bytes_sent(),
                    "calls": self.comm.collective_calls(),
                    "phases": summary["phase_seconds"], "counters": summary["counters"]}

        def on_train_begin(self, logs=None):
            self.comm.reset_counters()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter())
            # None without phase clocks (an overlapped configuration)
            self.decomposition.append(
                self.optimizer.summary()["phase_seconds"].get("decomposition"))
            if batch < self.warmup:
                self.warmup_bytes.append(self.comm.bytes_sent())
            if batch == self.warmup - 1:
                self.marks["start"] = self.snapshot()

        def on_train_end(self, logs=None):
            self.marks["end"] = self.snapshot()

    def measure(model_name, placement, factor_wire, eigen_wire, option, steps):
        settings = REDUCTION_OPTIONS[option][0] if option else {}
        with strategy.scope():
            model = models.build_model(model_name, (28, 28, 1), 10, seed=0)
            optimizer = tfkfac.KFAC(
                learning_rate=0.02, damping=1e-2, placement=placement,
                factor_wire_dtype=factor_wire, decomposition_wire_dtype=eigen_wire,
                factor_update_freq=FLAGS.factor_update_freq,
                decomposition_update_freq=FLAGS.decomposition_update_freq,
                phase_clocks=option != "overlap", communicator=communicator(option),
                **settings).attach(model)
            probe = Probe(optimizer, communicator(option), FLAGS.warmup_steps)
            model.compile(optimizer=optimizer,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        start = time.perf_counter()
        model.fit(x[: steps * fit_batch], y[: steps * fit_batch], batch_size=fit_batch,
                  epochs=1, shuffle=False, verbose=0, callbacks=[probe])
        result = {
            "model": model_name, "placement": placement, "factor_wire": factor_wire,
            "eigen_wire": eigen_wire, "option": option, "rank": comm.rank, "size": comm.size,
            "threads": threads, "local_batch": local_batch, "steps": steps,
            "wall_seconds": time.perf_counter() - start,
            "parameters": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
            "factor_dims": [s[0] for b in optimizer.summary()["managed"]
                            for s in b["factor_shapes"] if len(s) == 2],
            "warmup_bytes": probe.warmup_bytes,
            "kfac_state_bytes": optimizer.summary()["state_bytes"],
        }
        if steps > FLAGS.warmup_steps:
            a, b = probe.marks["start"], probe.marks["end"]
            timed = steps - FLAGS.warmup_steps
            result["timed"] = {
                "steps": timed,
                "step_seconds": (b["time"] - a["time"]) / timed,
                "phase_seconds": {p: b["phases"][p] - a["phases"][p] for p in PHASES
                                  if p in b["phases"]},
                "factor_updates": b["counters"]["factor_updates"]
                - a["counters"]["factor_updates"],
                "decomposition_updates": b["counters"]["decomposition_updates"]
                - a["counters"]["decomposition_updates"],
                "bytes_per_step": {c: (b["bytes"][c] - a["bytes"][c]) / timed
                                   for c in b["bytes"]},
                "calls_per_step": {c: (b["calls"][c] - a["calls"][c]) / timed
                                   for c in b["calls"]},
                # Per step s of the window (s = warmup .. steps-1): its wall time and
                # its decomposition-phase seconds.
                "step_seconds_each": list(np.diff(probe.times[FLAGS.warmup_steps - 1:])),
                "decomposition_seconds_each":
                    None if probe.decomposition[0] is None else
                    list(np.diff(probe.decomposition[FLAGS.warmup_steps - 1:])),
            }
        print(f"rank {comm.rank}/{comm.size}: {model_name} {placement} {factor_wire}/"
              f"{eigen_wire} {option or ''} {steps} steps in {result['wall_seconds']:.1f} s",
              flush=True)
        return result

    def runs_here(configs):
        return [c for c in map(parse_config, configs)
                if c[3] is None or FLAGS.engine in REDUCTION_OPTIONS[c[3]][1]]

    results = []
    total = FLAGS.warmup_steps + FLAGS.timed_steps
    for model_name in FLAGS.models:
        timed = ([("replicated", "float32", "float32", None)] if comm.size == 1
                 else runs_here(FLAGS.timed_configs))
        for _ in range(FLAGS.rounds):  # A B A B ...: drift of the machine hits each alike
            results += [measure(model_name, *config, total) for config in timed]
        if comm.size > 1:
            results += [measure(model_name, *config, FLAGS.warmup_steps)
                        for config in runs_here(FLAGS.bytes_configs)]
    with open(f"{out_path}.rank{comm.rank}.json", "w") as f:
        json.dump(results, f)


# ----------------------------------------------------------------------------- driver
def _run(name, job):
    """Runs `job()` -> (exit code, output); returns the output's per-run lines."""
    start = time.time()
    code, output = job()
    if code:
        raise RuntimeError(f"{name} exited {code}:\n{output[-3000:]}")
    print(f"{name} took {time.time() - start:.0f} s", flush=True)
    return [line for line in output.splitlines() if "steps in" in line]


def _worker_args(out):
    args = [os.path.abspath(__file__), f"--worker_out={out}"]
    for name in ("models", "timed_configs", "bytes_configs"):
        args.append(f"--{name}={','.join(getattr(FLAGS, name))}")
    for name in ("global_batch", "warmup_steps", "timed_steps", "factor_update_freq",
                 "decomposition_update_freq", "rounds", "num_ranks"):
        args.append(f"--{name}={getattr(FLAGS, name)}")
    return args


def run_all(work_dir):
    """(the single process's results, {engine: [results of each rank]})."""
    env = launch.job_environment()
    single = os.path.join(work_dir, "single")
    for line in _run("1 process", lambda: launch.run_job(
            [sys.executable] + _worker_args(single), FLAGS.timeout, env)):
        print("  " + line)
    n = FLAGS.num_ranks
    load = lambda path: json.load(open(path))
    per_engine = {}
    for engine in FLAGS.engines:
        out = os.path.join(work_dir, engine)
        args = _worker_args(out) + [f"--engine={engine}"]
        if engine == "horovod":
            command = launch.horovodrun_command(args, n, env, FLAGS.horovod_hosts)
            lines = _run(f"{n} Horovod ranks", lambda: launch.run_job(command, FLAGS.timeout,
                                                                       env))
        else:
            lines = _run(f"{n} MultiWorkerMirroredStrategy workers",
                         lambda: launch.run_multi_worker_job(args, n, FLAGS.timeout, env))
        for line in lines:
            print("  " + line)
        per_engine[engine] = [load(f"{out}.rank{r}.json") for r in range(n)]
    return load(f"{single}.rank0.json"), per_engine


def _fmt(value, digits=3):
    return "n/a" if value is None else f"{value:.{digits}f}"


def _timing(timed_ranks):
    """Times of the window; with several ranks each step counts at its slowest rank.

    step_seconds: mean over the window (amortizes factor and inverse steps);
    median_step_seconds: the typical (stale) step; decomposition: the decomposition
    phase of each inverse step (s % decomposition_update_freq == 0), median and min over
    them.
    The machine is shared, so the min is the least disturbed measurement.
    """
    steps = range(len(timed_ranks[0]["step_seconds_each"]))
    slowest = lambda key, i: max(t[key][i] for t in timed_ranks)
    inverse = [i for i in steps
               if (FLAGS.warmup_steps + i) % FLAGS.decomposition_update_freq == 0]
    decomposition = ([] if timed_ranks[0]["decomposition_seconds_each"] is None else
                     [slowest("decomposition_seconds_each", i) for i in inverse])
    spread = harness.spread(decomposition) if decomposition else {}
    return {
        "step_seconds": max(t["step_seconds"] for t in timed_ranks),
        "median_step_seconds": statistics.median(slowest("step_seconds_each", i)
                                                 for i in steps),
        "decomposition_seconds_per_inverse_step": spread.get("median"),
        "decomposition_seconds_min": spread.get("min"),
        "decomposition_seconds_each_inverse_step": decomposition,
    }


def _range(row):
    """The printed range of a row's mean step over its rounds (ms); empty for one round."""
    rounds = row.get("step_seconds_rounds", [])
    return f" [{min(rounds) * 1e3:.1f}-{max(rounds) * 1e3:.1f}]" if len(rounds) > 1 else ""


def _megabytes(count):
    """Byte counts (one or a list) in MB for printing."""
    if isinstance(count, list):
        return "/".join(f"{c / 1e6:.2f}" for c in count)
    return f"{count / 1e6:.2f}"


def _ratio(a, b):
    return a / b if a is not None and b else None


def _lpt_shares(dims, size):
    """Share of the total dim^3 cost each rank owns under the LPT assignment (replicated)."""
    import numpy as np
    from tfkfac import distributed

    costs = [distributed.eigen_cost(n) for n in dims]
    loads = np.bincount(distributed.lpt_assignment(costs, size), weights=costs, minlength=size)
    return [float(load) / sum(costs) for load in loads]


def _step_bytes(warmup_bytes, step):
    before = warmup_bytes[step - 1] if step else {c: 0 for c in warmup_bytes[0]}
    return {c: warmup_bytes[step][c] - before[c] for c in warmup_bytes[step]}


def summarize(single, per_engine, load_at_start):
    """One entry per model: the single process and each engine's 2-rank configurations."""
    report = {"settings": {
        "global_batch": FLAGS.global_batch, "warmup_steps": FLAGS.warmup_steps,
        "timed_steps": FLAGS.timed_steps, "factor_update_freq": FLAGS.factor_update_freq,
        "decomposition_update_freq": FLAGS.decomposition_update_freq,
        "num_ranks": FLAGS.num_ranks, "engines": list(per_engine),
        "cpu_count": os.cpu_count(), "load_average_1min_at_start": load_at_start},
        "models": {}}
    for name, (rounds,) in _by_config([single]).items():
        base = rounds[0][0]
        timed = _median_round(rounds)
        entry = {
            "parameters": base["parameters"], "factor_dims": base["factor_dims"],
            "lpt_cost_share_per_rank": _lpt_shares(base["factor_dims"], FLAGS.num_ranks),
            "single": dict(_timing(timed), threads=base["threads"],
                           kfac_state_bytes=base["kfac_state_bytes"],
                           batch=base["local_batch"],
                           phase_seconds=timed[0]["phase_seconds"],
                           **_round_times(rounds)),
            "distributed": []}
        for engine, per_rank in per_engine.items():
            entry["distributed"] += _rows(name, engine, per_rank, entry["single"])
        report["models"][name] = entry
    return report


def _by_config(per_rank):
    """{model: [the rounds of each configuration: [its record on each rank]]} of one run's
    record lists (one per rank), configurations in order."""
    grouped = {}
    for ranks in zip(*per_rank):
        r = ranks[0]
        key = (r["placement"], r["factor_wire"], r["eigen_wire"], r["option"], r["steps"])
        grouped.setdefault(r["model"], {}).setdefault(key, []).append(list(ranks))
    return {model: list(configs.values()) for model, configs in grouped.items()}


def _median_round(rounds):
    """The timed windows (per rank) of the round whose mean step is the median one."""
    windows = sorted(([r["timed"] for r in ranks] for ranks in rounds),
                     key=lambda w: max(t["step_seconds"] for t in w))
    return windows[(len(windows) - 1) // 2]


def _round_times(rounds):
    """Every round's mean and median step (each at its slowest rank): their spread."""
    timings = [_timing([r["timed"] for r in ranks]) for ranks in rounds]
    return {f"{key}_rounds": [t[key] for t in timings]
            for key in ("step_seconds", "median_step_seconds")}


def _rows(name, engine, per_rank, single_row):
    """The rows of one engine's configurations of model `name`."""
    rows = []
    for rounds in _by_config(per_rank)[name]:
        ranks = rounds[0]
        config = ranks[0]
        row = {"engine": engine, "placement": config["placement"],
               "factor_wire": config["factor_wire"], "option": config["option"],
               "eigen_wire": config["eigen_wire"], "batch_per_rank": config["local_batch"],
               "threads_per_rank": config["threads"],
               "kfac_state_bytes_per_rank": [r["kfac_state_bytes"] for r in ranks]}
        # Warm-up step 0 is a factor + inverse step; step 1 is stale; the first
        # factor-only step is factor_update_freq (if inside the warm-up).
        per_step = [_step_bytes(r["warmup_bytes"], 0) for r in ranks]
        row["inverse_step_bytes_per_rank"] = [sum(b.values()) for b in per_step]
        row["factor_bytes_per_factor_step"] = per_step[0]["factors"]
        row["decomposition_bytes_per_inverse_step_all_ranks"] = sum(
            b["decompositions"] for b in per_step)
        stale = [_step_bytes(r["warmup_bytes"], 1) for r in ranks]
        row["stale_step_bytes_mean_of_ranks"] = {
            c: sum(b[c] for b in stale) / len(stale) for c in stale[0]}
        if "timed" in config:
            timed_ranks = _median_round(rounds)
            row.update(_timing(timed_ranks), **_round_times(rounds))
            row.update({
                "speedup_vs_single": _ratio(single_row["step_seconds"],
                                            row["step_seconds"]),
                "median_step_speedup_vs_single": _ratio(
                    single_row["median_step_seconds"], row["median_step_seconds"]),
                "decomposition_speedup_vs_single": _ratio(
                    single_row["decomposition_seconds_per_inverse_step"],
                    row["decomposition_seconds_per_inverse_step"]),
                "phase_seconds_per_rank": [t["phase_seconds"] for t in timed_ranks],
                "bytes_per_step_per_rank": [t["bytes_per_step"] for t in timed_ranks],
                "calls_per_step": timed_ranks[0]["calls_per_step"],
            })
        rows.append(row)
    return rows


def plot(report):
    names = list(report["models"])
    fig, axes = harness.subplots(2, 2, figsize=(13, 9))
    axes = axes.ravel()
    # (1) mean step time, (2) median step time, (3) decomposition per inverse step.
    for ax, key, title in (
            (axes[0], "step_seconds", "mean time per training step (s)"),
            (axes[1], "median_step_seconds", "median time per step (s): a stale step"),
            (axes[2], "decomposition_seconds_per_inverse_step",
             "decomposition phase per inverse step (s, median)\n"
             "2 ranks: slowest rank, exchange included")):
        for i, name in enumerate(names):
            entry = report["models"][name]
            rows = [r for r in entry["distributed"] if key in r]
            bars = [("1 process", entry["single"][key])] + [
                (f"{FLAGS.num_ranks} {_ENGINE_LABELS[r['engine']]} "
                 f"{r['placement']} {r.get('option') or ''}", r[key]) for r in rows]
            width = 0.9 / len(bars)
            for j, (label, value) in enumerate(bars):
                value = value or 0.0  # No inverse step in the window, or no phase clocks.
                x = i + (j - (len(bars) - 1) / 2) * width
                ax.bar(x, value, width, color=f"C{j}", label=label if i == 0 else None)
                ax.text(x, value, f"{value:.3g}", ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title)
        ax.legend(fontsize=8)
    # (4) bytes per step by configuration (amortized over the schedule), stacked.
    ax = axes[3]
    categories = ("gradients", "factors", "decompositions", "preconditioned")
    labels, stacks = [], []
    for name in names:
        for row in report["models"][name]["distributed"]:
            labels.append(f"{name} {row['engine'][:5]}\n"
                          f"{row['placement'][:5]}\n{row['factor_wire']}"
                          f"{' ' + row['option'][:4] if row.get('option') else ''}")
            stacks.append([row["amortized_bytes_per_step_per_rank"][c] / 1e6
                           for c in categories])
    bottom = [0.0] * len(labels)
    for k, category in enumerate(categories):
        values = [s[k] for s in stacks]
        ax.bar(range(len(labels)), values, 0.6, bottom=bottom, label=category, color=f"C{k}")
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.margins(y=0.1)
    ax.set_xticks(range(len(labels)), labels, fontsize=6)
    ax.set_title(f"MB per step per rank (amortized: factors every "
                 f"{FLAGS.factor_update_freq}, inverse every "
                 f"{FLAGS.decomposition_update_freq})")
    ax.legend(fontsize=8)
    fig.suptitle(f"Distributed K-FAC on {report['settings']['cpu_count']} cores: 1 process "
                 f"vs {FLAGS.num_ranks} ranks (Horovod Gloo, tf.distribute "
                 f"MultiWorkerMirroredStrategy), global batch {FLAGS.global_batch}")
    return fig


def add_amortized_bytes(report):
    """Bytes per step per rank (mean of ranks) under the benchmark's update schedule,
    from the measured per-step bytes: gradients (and preconditioned) every step,
    factors every factor_update_freq steps, decompositions every decomposition_update_freq."""
    for entry in report["models"].values():
        for row in entry["distributed"]:
            stale = row["stale_step_bytes_mean_of_ranks"]
            n = FLAGS.num_ranks
            row["amortized_bytes_per_step_per_rank"] = {
                "gradients": stale["gradients"],
                "preconditioned": stale["preconditioned"],
                "factors": row["factor_bytes_per_factor_step"] / FLAGS.factor_update_freq,
                "decompositions": row["decomposition_bytes_per_inverse_step_all_ranks"] / n
                / FLAGS.decomposition_update_freq,
            }
            row["amortized_bytes_per_step_per_rank"]["total"] = sum(
                row["amortized_bytes_per_step_per_rank"].values())


def main():
    if FLAGS.worker_out:
        worker_main(FLAGS.worker_out)
        return
    start = time.time()
    if FLAGS.replot:
        with open(FLAGS.replot) as f:
            report = json.load(f)
        settings = report["settings"]
        for name in ("factor_update_freq", "decomposition_update_freq", "num_ranks",
                     "global_batch"):
            setattr(FLAGS, name, settings[name])
        harness.save_plot(report, "distributed", plot)
    else:
        load_at_start = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as work_dir:
            single, per_engine = run_all(work_dir)
        report = summarize(single, per_engine, load_at_start)
        add_amortized_bytes(report)
        report["settings"]["benchmark_seconds"] = time.time() - start
        harness.write(report, "distributed", plot)
    for name, entry in report["models"].items():
        single_row = entry["single"]
        print(f"{name}: {entry['parameters']} parameters, factor dims {entry['factor_dims']}")
        print(f"  LPT share of the dim^3 cost per rank: "
              f"{[round(x, 3) for x in entry['lpt_cost_share_per_rank']]}")
        print(f"  1 process: {single_row['step_seconds'] * 1e3:.1f} ms/step"
              f"{_range(single_row)} (median "
              f"{single_row['median_step_seconds'] * 1e3:.1f}), decomposition "
              f"{_fmt(single_row['decomposition_seconds_per_inverse_step'])} s per inverse "
              f"step (min {_fmt(single_row['decomposition_seconds_min'])}), K-FAC state "
              f"{_megabytes(single_row['kfac_state_bytes'])} MB")
        for row in entry["distributed"]:
            label = (f"{row['engine']:>12} {row['placement']:>10} "
                     f"{row['factor_wire']}/{row['eigen_wire']} {row['option'] or ''}")
            text = (f"  {FLAGS.num_ranks} ranks {label}: "
                    f"{row['amortized_bytes_per_step_per_rank']['total'] / 1e3:.1f} kB/step/rank"
                    f" (factor step {row['factor_bytes_per_factor_step'] / 1e3:.1f} kB), "
                    f"K-FAC state {_megabytes(row['kfac_state_bytes_per_rank'])} MB/rank")
            if "step_seconds" in row:
                text += (f", {row['step_seconds'] * 1e3:.1f} ms/step{_range(row)} "
                         f"(x{_fmt(row['speedup_vs_single'], 2)} vs 1 process; median "
                         f"{row['median_step_seconds'] * 1e3:.1f} ms, "
                         f"x{_fmt(row['median_step_speedup_vs_single'], 2)}), decomposition "
                         f"{_fmt(row['decomposition_seconds_per_inverse_step'])} s on the "
                         f"slowest rank (x{_fmt(row['decomposition_speedup_vs_single'], 2)}"
                         f"; min {_fmt(row['decomposition_seconds_min'])} s)")
            print(text)
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    harness.run(main)
