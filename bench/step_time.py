"""Per-step wall time of K-FAC versus SGD with momentum, same model and batch.

For each model, ten trainers are built exactly as `python -m trainers.train` builds
them (`trainers.runner.Trainer`): SGD compiled without and with XLA (`--xla`; the faster
of the two is the baseline of every ratio, per model), K-FAC doing factors and eigendecompositions every
step (`--factor_update_freq=1 --decomposition_update_freq=1`), amortized
K-FAC (`--factor_update_freq=10 --decomposition_update_freq=100`) with the eigen, the
inverse and the eigen_adam method (no KL clip, as its time-to-accuracy entry), the
amortized inverse and eigen_adam methods with `--xla` (stale steps compiled whole; K-FAC's
own stages on factor steps compiled where a GPU is visible), and the amortized inverse method with each of the step-cost options: factor
statistics from a quarter of each batch (`--factor_batch_fraction=0.25`), bfloat16
products (`--product_dtype=bfloat16`) and the reduce rule for convolutions
(`--weight_sharing=reduce`, also with factors and decompositions every step). Their
training steps then run in `--repeats` interleaved blocks (bench/harness.py) so drift of
the shared machine hits all of them alike. Batches come from the trainer's own
pipeline, cached in memory first, so the input pipeline (identical for all) is not
timed.

Each step is timed from asking for its batch to its finished update
(`trainers.reporting.StepTimer`); a warm-up block first runs every kind of step once
(tracing). Amortized K-FAC runs whole multiples of decomposition_update_freq, so its mean
holds stale, factor and eigendecomposition steps at their true proportions. K-FAC runs as
users run it, without its phase clocks (`phase_clocks=False`); the per-phase breakdown
against each phase's floor is bench/step_floor.py's.

`--compare=weight_sharing` measures instead what `weight_sharing="reduce"` saves against
"expand" in the factor phase: two K-FAC trainers (the trainer's defaults, factors every
step, decompositions only at the first) alternate blocks of `--weight_sharing_block_steps`
steps (expand, reduce, reduce, expand, ...); each block's factor-phase seconds (K-FAC's own
clock) over its factor updates gives one figure per block, and the median over the blocks
is reported with the ratio reduce / expand, beside the median step time of the blocks
(every step a factor step).

`--compare=stale` times the stale step alone, where most amortized steps are: K-FAC
(inverse, eigen and eigen_adam method, the inverse with bfloat16 products, and eigen_adam
with `--xla`, which compiles the stale step whole) computes factors and decompositions
at its first step only (in the warm-up), so every timed step preconditions with them and
does nothing else; SGD without and with XLA run beside it in the same interleaved
blocks. Reported per configuration: step time, its ratio to the faster SGD and its
overhead in ms over SGD without XLA (the same uncompiled forward/backward).
Both comparisons also report each configuration's ratio paired by repeat (its block
over the baseline's block of the same repeat; median and range), which drift of a
shared machine within the run moves less, for wall time and for this process's CPU time
(which waiting for a core taken by another process does not lengthen).
`--configurations=sgd,...` times a subset of either comparison (sgd among them).

Run (in the background; ~18 min on 2 idle cores):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/step_time.py \
      > /tmp/step_time.log 2>&1 &
Writes bench/results/step_time.json and step_time.png and prints the ratios.
Weight sharing (a few minutes):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/step_time.py \
      --compare=weight_sharing --models=cnn,resnet20,vit --repeats=5 \
      > /tmp/weight_sharing.log 2>&1 &
Writes bench/results/weight_sharing.json and weight_sharing.png.
Stale step (~8 min):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/step_time.py \
      --compare=stale --repeats=6 > /tmp/stale_step.log 2>&1 &
Writes bench/results/stale_step.json and stale_step.png.
"""

import os
import statistics
import tempfile
import time

from absl import flags

import harness
import timed_steps
from trainers import config as config_lib, models

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp", "cnn", "resnet20"], "Models to time.")
flags.DEFINE_integer("batch_size", 128, "Examples per step, the same for every optimizer.")
harness.define_repeats(4, "a block of training steps")
flags.DEFINE_integer("amortized_block_steps", 50,
                     "Steps per block for SGD and amortized K-FAC; repeats x this must be a "
                     "multiple of the amortized decomposition_update_freq (100).")
flags.DEFINE_integer("every_step_block_steps", 5,
                     "Steps per block for K-FAC with factors and eigendecompositions every step.")
flags.DEFINE_integer("cached_batches", 16, "Distinct batches held in memory and cycled.")
flags.DEFINE_enum("compare", "optimizers", ["optimizers", "weight_sharing", "stale"],
                  "optimizers: K-FAC vs SGD step times (step_time.json); weight_sharing: "
                  "K-FAC's factor phase with weight_sharing reduce vs expand "
                  "(weight_sharing.json); stale: K-FAC's stale step vs SGD "
                  "(stale_step.json).")
flags.DEFINE_list("configurations", [],
                  "optimizers and stale: time only these configurations, sgd among them "
                  "(default: all).")
flags.DEFINE_integer("weight_sharing_block_steps", 10,
                     "Steps per block of each weight-sharing rule (every step a factor step).")

# name -> (TrainConfig overrides, timed steps per block flag)
CONFIGURATIONS = {
    "sgd": dict(optimizer="sgd"),  # jit_compile=False, the trainer's default
    "sgd_xla": dict(optimizer="sgd", xla=True),  # jit_compile=True
    "kfac_amortized": dict(optimizer="kfac", factor_update_freq=10,
                           decomposition_update_freq=100, kfac_method="eigen"),
    # The same schedule with the inverse method: A⁻¹ ∇ G⁻¹ is half the eigen method's
    # per-step matmul work, and an inverse is cheaper than an eigendecomposition.
    "kfac_amortized_inverse": dict(optimizer="kfac", factor_update_freq=10,
                                   decomposition_update_freq=100, kfac_method="inverse"),
    # Adam in the eigenbasis (the time-to-accuracy entry kfac_eigen_adam, no KL clip).
    "kfac_amortized_eigen_adam": dict(optimizer="kfac", factor_update_freq=10,
                                      decomposition_update_freq=100,
                                      kfac_method="eigen_adam", kl_clip=None),
    # ... with jit_compile=True: the stale steps compile whole with XLA, the factor steps
    # run K-FAC's statistics and preconditioning compiled (the `xla` setting).
    "kfac_amortized_eigen_adam_xla": dict(optimizer="kfac", factor_update_freq=10,
                                          decomposition_update_freq=100,
                                          kfac_method="eigen_adam", kl_clip=None, xla=True),
    "kfac_amortized_inverse_xla": dict(optimizer="kfac", factor_update_freq=10,
                                       decomposition_update_freq=100, kfac_method="inverse",
                                       xla=True),
    "kfac_every_step": dict(optimizer="kfac", factor_update_freq=1,
                            decomposition_update_freq=1, kfac_method="eigen"),
    # The inverse schedule with factor statistics from a quarter of each batch.
    "kfac_amortized_inverse_f0.25": dict(optimizer="kfac", factor_update_freq=10,
                                         decomposition_update_freq=100, kfac_method="inverse",
                                         factor_batch_fraction=0.25),
    # ... and with bfloat16 Gram and preconditioning products.
    "kfac_amortized_inverse_bf16": dict(optimizer="kfac", factor_update_freq=10,
                                        decomposition_update_freq=100, kfac_method="inverse",
                                        product_dtype="bfloat16"),
    # ... and with the reduce rule for convolutions' factors (weight_sharing="reduce").
    "kfac_amortized_inverse_reduce": dict(optimizer="kfac", factor_update_freq=10,
                                          decomposition_update_freq=100, kfac_method="inverse",
                                          weight_sharing="reduce"),
    "kfac_every_step_reduce": dict(optimizer="kfac", factor_update_freq=1,
                                   decomposition_update_freq=1, kfac_method="eigen",
                                   weight_sharing="reduce"),
}

FIRST_STEP_ONLY = timed_steps.FIRST_STEP_ONLY
# --compare=weight_sharing: factors every step, decompositions once (at the first step,
# in the warm-up), so every timed step is a factor step and nothing else differs.
WEIGHT_SHARING_CONFIGURATIONS = {
    rule: dict(optimizer="kfac", factor_update_freq=1, phase_clocks=True,
               decomposition_update_freq=FIRST_STEP_ONLY, weight_sharing=rule)
    for rule in ("expand", "reduce")
}
# --compare=stale: every timed K-FAC step is stale (factors and decompositions from the
# warm-up's first step).
STALE = dict(optimizer="kfac", factor_update_freq=FIRST_STEP_ONLY,
             decomposition_update_freq=FIRST_STEP_ONLY)
STALE_CONFIGURATIONS = {
    "sgd": CONFIGURATIONS["sgd"],
    "sgd_xla": CONFIGURATIONS["sgd_xla"],
    "kfac_stale_inverse": dict(STALE, kfac_method="inverse"),
    "kfac_stale_eigen": dict(STALE, kfac_method="eigen"),
    "kfac_stale_inverse_bf16": dict(STALE, kfac_method="inverse", product_dtype="bfloat16"),
    "kfac_stale_eigen_adam": dict(STALE, kfac_method="eigen_adam", kl_clip=None),
    # ... with jit_compile=True: in one process the stale step compiles with XLA.
    "kfac_stale_eigen_adam_xla": dict(STALE, kfac_method="eigen_adam", kl_clip=None,
                                      xla=True),
}


def timed_configuration(name, model, model_dir, configurations=None):
    """`timed_steps.Timed` of configuration `name` (of CONFIGURATIONS by default) on
    `model` at --batch_size, with its block of this script's flags."""
    config = config_lib.TrainConfig(model=model, batch_size=FLAGS.batch_size,
                                    model_dir=model_dir, verbose=0,
                                    **(configurations or CONFIGURATIONS)[name])
    every_step = config.optimizer == "kfac" and config.decomposition_update_freq == 1
    return timed_steps.Timed(config, FLAGS.cached_batches,
                             FLAGS.every_step_block_steps if every_step
                             else FLAGS.amortized_block_steps)


def factor_block(entry):
    """A block of --weight_sharing_block_steps steps of `entry` (a `timed_steps.Timed`):
    factor-phase seconds (K-FAC's clock) per factor update, and the mean step."""
    seconds, updates = factor_clock(entry.trainer.optimizer)
    step_s = entry.block(FLAGS.weight_sharing_block_steps)["wall"]
    end_seconds, end_updates = factor_clock(entry.trainer.optimizer)
    return {"factor_s_per_update": (end_seconds - seconds) / (end_updates - updates),
            "step_s": step_s}


def time_model(model, configurations=None):
    """Mean step times of `configurations` (default CONFIGURATIONS) in interleaved
    blocks (and the range of the blocks' means), with K-FAC's phase clocks where a
    configuration has them on, and each one's ratio to the fastest SGD configuration
    (`sgd_baseline`). On a shared machine whose load changes within a run, the paired
    ratios hold better: per repeat, a block's mean over the baseline's block of the same
    repeat (run next to it), and their spread over the repeats; so do the ratios of CPU
    time, which waiting for a core shared with other processes does not lengthen."""
    configurations = configurations or CONFIGURATIONS
    with tempfile.TemporaryDirectory() as model_dir:
        timed = {name: timed_configuration(name, model, os.path.join(model_dir, name),
                                           configurations)
                 for name in configurations}
        for entry in timed.values():
            entry.warm_up()
        started = time.time()
        samples = harness.interleave(
            {name: entry.block
             for name, entry in timed.items()}, FLAGS.repeats)
        blocks = {name: harness.by_figure(samples[name]) for name in timed}
        results = {name: dict(entry.result(),
                              block_mean_step_s=harness.spread(blocks[name]["wall"]),
                              blocks_mean_step_s=blocks[name]["wall"],
                              blocks_cpu_step_s=blocks[name]["cpu"])
                   for name, entry in timed.items()}
    baseline = min((name for name in results if configurations[name]["optimizer"] == "sgd"),
                   key=lambda name: results[name]["mean_step_s"])
    for name, result in results.items():
        result["ratio_to_sgd"] = result["mean_step_s"] / results[baseline]["mean_step_s"]
        for figure, key in (("wall", "paired_ratio_to_sgd"), ("cpu", "paired_cpu_ratio_to_sgd")):
            result[key] = harness.spread([block / sgd for block, sgd in zip(
                blocks[name][figure], blocks[baseline][figure])])
    return {"configurations": results, "sgd_baseline": baseline,
            "wall_s": time.time() - started}


def factor_clock(optimizer):
    """(seconds in K-FAC's factor phase so far, factor updates so far)."""
    summary = optimizer.summary()
    return summary["phase_seconds"]["factors"], summary["counters"]["factor_updates"]


def time_weight_sharing(model):
    """Factor-phase seconds per factor update, reduce vs expand, in interleaved blocks."""
    with tempfile.TemporaryDirectory() as model_dir:
        timed = {rule: timed_configuration(rule, model, os.path.join(model_dir, rule),
                                           WEIGHT_SHARING_CONFIGURATIONS)
                 for rule in WEIGHT_SHARING_CONFIGURATIONS}
        for entry in timed.values():
            entry.warm_up()
        started = time.time()
        samples = harness.interleave({rule: lambda entry=entry: factor_block(entry)
                                      for rule, entry in timed.items()},
                                     FLAGS.repeats)
        results = {}
        for rule, entry in timed.items():
            blocks = harness.by_figure(samples[rule])
            results[rule] = {
                "per_block": blocks,
                "median_factor_s_per_update": statistics.median(blocks["factor_s_per_update"]),
                "median_step_s": statistics.median(blocks["step_s"]),
                "state_bytes": entry.trainer.optimizer.summary()["state_bytes"]}
    expand, reduce = results["expand"], results["reduce"]
    return {"rules": results, "wall_s": time.time() - started,
            "reduce_over_expand": {
                "factor_phase": (reduce["median_factor_s_per_update"]
                                 / expand["median_factor_s_per_update"]),
                "step": reduce["median_step_s"] / expand["median_step_s"]}}


def plot_weight_sharing(report):
    model_names = list(report["models"])
    figure, (factors, steps) = harness.subplots(1, 2, figsize=(11, 4.2))
    width = 0.4
    for axis, key, title in (
            (factors, "median_factor_s_per_update", "K-FAC factor phase per factor step"),
            (steps, "median_step_s", "Training step, factors every step")):
        for i, rule in enumerate(WEIGHT_SHARING_CONFIGURATIONS):
            values = [report["models"][m]["rules"][rule][key] * 1e3 for m in model_names]
            bars = axis.bar([x + (i - 0.5) * width for x in range(len(model_names))], values,
                            width, label=f'weight_sharing="{rule}"')
            if rule == "reduce":
                ratio_key = "factor_phase" if key.startswith("median_factor") else "step"
                labels = [f"{report['models'][m]['reduce_over_expand'][ratio_key]:.2f}x"
                          for m in model_names]
                axis.bar_label(bars, labels, fontsize=8)
        axis.set_ylim(0, 1.25 * max(report["models"][m]["rules"][r][key] * 1e3
                                    for m in model_names for r in WEIGHT_SHARING_CONFIGURATIONS))
        axis.set_xticks(range(len(model_names)), model_names)
        axis.set_ylabel("ms (median over blocks)")
        axis.set_title(f"{title}, batch {report['batch_size']}")
        axis.legend()
    return figure


def plot(report):
    names = list(report["configurations"])
    model_names = list(report["models"])
    figure, times = harness.subplots(figsize=(7, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [report["models"][m]["configurations"][name]["mean_step_s"] * 1e3
                  for m in model_names]
        bars = times.bar([x + i * width for x in range(len(model_names))], values, width,
                         label=name)
        for bar, m in zip(bars, model_names):
            ratio = report["models"][m]["configurations"][name]["ratio_to_sgd"]
            times.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                             bar.get_height()), ha="center", va="bottom",
                           fontsize=8)
    times.set_yscale("log")
    times.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(model_names))],
                     model_names)
    times.set_ylabel("ms per step (log)")
    times.set_title(f"Step time, batch {report['batch_size']} (ratio to SGD on bars)")
    times.legend()
    return figure


def main():
    harness.check_among("models", FLAGS.models, models.CLASSIFIERS)
    if FLAGS.compare == "weight_sharing":
        if FLAGS.configurations:
            raise ValueError("--configurations selects among --compare=optimizers or stale's")
        weight_sharing_main()
        return
    stale = FLAGS.compare == "stale"
    configurations = STALE_CONFIGURATIONS if stale else CONFIGURATIONS
    if FLAGS.configurations:
        harness.check_among("configurations", FLAGS.configurations, configurations)
        if "sgd" not in FLAGS.configurations:
            raise ValueError("--configurations must hold sgd: every overhead is over it")
        configurations = {name: configurations[name] for name in FLAGS.configurations}
    report = {"batch_size": FLAGS.batch_size, "blocks": FLAGS.repeats,
              "configurations": configurations, "models": {}}
    for model in FLAGS.models:
        report["models"][model] = time_model(model, configurations)
        baseline = report["models"][model]["sgd_baseline"]
        sgd_ms = report["models"][model]["configurations"]["sgd"]["mean_step_s"] * 1e3
        for name, result in report["models"][model]["configurations"].items():
            result["over_sgd_ms"] = result["mean_step_s"] * 1e3 - sgd_ms
            paired, cpu = result["paired_ratio_to_sgd"], result["paired_cpu_ratio_to_sgd"]
            print(f"{model:9s} {name:29s} {result['mean_step_s'] * 1e3:9.1f} ms/step  "
                  f"/ {baseline} = {result['ratio_to_sgd']:.2f} (paired by repeat: median "
                  f"{paired['median']:.2f}, {paired['min']:.2f}-{paired['max']:.2f}; CPU time "
                  f"{cpu['median']:.2f}, {cpu['min']:.2f}-{cpu['max']:.2f})  "
                  f"{result['over_sgd_ms']:+.1f} ms over sgd", flush=True)
    if stale:
        harness.write(report, "stale_step", plot)
        return
    for key, name in (("median_amortized_inverse_ratio", "kfac_amortized_inverse"),
                      ("median_amortized_ratio", "kfac_amortized")):
        if name in configurations:
            report[key] = statistics.median(r["configurations"][name]["ratio_to_sgd"]
                                            for r in report["models"].values())
    harness.write(report, "step_time", plot)


def weight_sharing_main():
    report = {"batch_size": FLAGS.batch_size, "blocks": FLAGS.repeats,
              "block_steps": FLAGS.weight_sharing_block_steps,
              "configurations": WEIGHT_SHARING_CONFIGURATIONS, "models": {}}
    for model in FLAGS.models:
        result = report["models"][model] = time_weight_sharing(model)
        rules = result["rules"]
        print(f"{model:9s} factor phase per factor step: expand "
              f"{rules['expand']['median_factor_s_per_update'] * 1e3:.1f} ms, reduce "
              f"{rules['reduce']['median_factor_s_per_update'] * 1e3:.1f} ms "
              f"({result['reduce_over_expand']['factor_phase']:.2f}x); step: expand "
              f"{rules['expand']['median_step_s'] * 1e3:.1f} ms, reduce "
              f"{rules['reduce']['median_step_s'] * 1e3:.1f} ms "
              f"({result['reduce_over_expand']['step']:.2f}x)", flush=True)
    harness.write(report, "weight_sharing", plot_weight_sharing)


if __name__ == "__main__":
    harness.run(main)
