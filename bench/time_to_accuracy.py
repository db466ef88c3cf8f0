"""Wall time and steps to a target test accuracy on real Fashion-MNIST, K-FAC against
Keras's first-order optimizers (SGD with momentum, AdamW, Muon, ScheduleFreeAdamW, Lamb),
each trained the way it trains best today; plus the deep autoencoder's training error
against time.

Every trial is one run of the trainer (`trainers.runner.run`, what
`python -m trainers.train` runs), so the numbers are what a user gets from the flags
recorded beside them. Entries (bench/trials.py OPTIMIZERS): first-order `adamw`, `sgd`
(momentum 0.9), `muon` (Keras's Muon; output layer and biases on its AdamW step; not on
ResNet-20, whose only 2-D kernel is the output layer's), `schedule_free_adamw` and
`lamb`; K-FAC `kfac_inverse` and `kfac_eigen` (KL clip on), `kfac_constant` (the earlier
constant-learning-rate protocol, for reference), `kfac_adamw` (K-FAC in front of AdamW),
`kfac_graft_adam` (layer-wise grafting of Adam's step length), `kfac_eigen_adam`
(Adam in the Kronecker eigenbasis), `kfac_schedule_free_adamw` (K-FAC in front of
ScheduleFreeAdamW) and `kfac_schedule_free_adamw_adaptive` (the same with adaptive stale
statistics); the floor-lowering options over `kfac_eigen_adam` and
`kfac_schedule_free_adamw` (suffix `_f0.25`: factor statistics from a quarter of each
batch, `_bf16`: bfloat16 preconditioning products, `_reduce`: the reduce rule for
convolutions), each run at its base entry's tuned point (`trials.TUNED_AS`).
Protocol, identical for every entry but `kfac_constant`:
1. Schedule: linear warm-up over the first 5% of the run's budget, then half a cosine
   to 0 at the budget's last step (`--lr_schedule=cosine`); `schedule_free_adamw` (alone
   or inside K-FAC) warms up over the same 5% with its own `warmup_steps` and has no
   schedule after it (as its authors run it), and is evaluated at its averaged weights.
   Decoupled weight decay of the same λ per step for every entry (BUDGETS'
   `weight_decay`; `trials.protocol` sets Keras's `weight_decay` to λ / learning_rate).
   `kfac_constant` keeps a constant learning rate 0.05, KL clip 1e-3 and no weight decay.
2. Tuning: the same budget of 8 trials per entry (`trials.GRIDS`: learning rates for
   first-order entries; learning rate x damping (x KL clip where it is on) for K-FAC),
   each a compressed run: the model's `tune_epochs` on train[:54000] with the same
   schedule shape over those epochs (warm-up 5% of them, cosine to 0 at their end),
   scored by the final accuracy on the held-out train[54000:]. The best point is kept.
   Entries in `--tuned_only` stop here (an ablation's arms): their trials go to the JSON
   and to the plot's second row, bars of every entry's best tuning accuracy.
3. Measurement: the kept point with `--seeds` seeds on the full train split over the
   model's whole budget (`max_epochs`; the schedule spans the budget and the best
   accuracy within it is reported; with `--stop_at_last_target` a run stops at the first
   evaluation reaching the highest target: its times and steps to every target are
   those of the whole run, its best accuracy the best until then), test accuracy every
   `eval_every_steps` steps; first-order and K-FAC entries each compile with XLA where
   that is faster for the model (`first_order_xla`, `kfac_xla`). Reported for each
   target: median training wall time (evaluation excluded) and steps to it over the
   seeds (a seed that never reaches it counts as infinite); the best test accuracy of each seed within the budget; the
   accuracy-vs-time curves; the ratios of each K-FAC entry to each first-order one and,
   per target, to the best first-order entry measured (`<entry>_over_best_first_order`).
   `--fixed_entries` adds entries measured the same way at a stated, untuned setting.
4. Autoencoder (Martens & Grosse 784-1000-500-250-30-250-500-1000-784): four optimizers
   at a stated setting each, constant learning rate, for `--autoencoder_epochs`;
   squared reconstruction error on train[:10000] against training time.

Runs live in `--work_dir`; a finished trial is read back instead of rerun and an
interrupted one resumes from its checkpoint, so the benchmark can be restarted and
spread over sessions (a trial whose stored settings differ from the protocol's is an
error: use a new work dir when the protocol changes). `--tune_only` stops after the
tuning trials, which can run on a busy machine; the timed runs then need it idle.
The JSON is the record that outlives a work dir: a run keeps, of every model, the
entries it does not run itself (each with the commit it was measured at), and writes
the tuning as soon as it is done and each measured entry as soon as its seeds are, so a
model's entries can be measured one or a few at a time (`--optimizers=` with
`--tuned_only=x` tunes x alone) and each written result committed before the next
starts. Tuning trials the JSON records for today's grid and protocol are not run again
when the work dir holds none of them.

Run (hours on 2 cores; in the background):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/time_to_accuracy.py \
      --models=vit --optimizers=adamw,sgd --work_dir=/work/tta_vit_modern \
      > /tmp/time_to_accuracy.log 2>&1 &
Writes bench/results/time_to_accuracy.json and .png and prints the ratios; the results
of models a run does not measure are kept. The earlier constant-learning-rate protocol's
results are in bench/results/constant_lr/.
"""

import copy
import json
import os
import statistics

from absl import flags

import harness
import trials
from trials import GRIDS, OPTIMIZERS, TUNE_SPLIT, VALIDATION_SPLIT, WARMUP_FRACTION

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["cnn", "resnet20"], "Classifiers to measure.")
flags.DEFINE_list("optimizers", ["adamw", "sgd", "kfac_inverse", "kfac_eigen",
                                   "kfac_constant"],
                  f"Entries to compare, among {', '.join(OPTIMIZERS)}.")
flags.DEFINE_list("target_accuracies", [],
                  "Test accuracies to report time to, for every model measured. Empty: each "
                  "model's own (BUDGETS).")
flags.DEFINE_integer("seeds", 3, "Seeds per optimizer in the measurement.")
flags.DEFINE_integer("batch_size", 128, "Examples per step.")
flags.DEFINE_integer("autoencoder_epochs", 5, "Epochs of each autoencoder run (0 skips it).")
flags.DEFINE_list("fixed_entries", [],
                  "Extra entries measured untuned at a stated setting after the tuned ones, "
                  "as optimizer:key=value (e.g. sgd:learning_rate=0.01, a setting an earlier "
                  "tuning picked), reported as optimizer@key=value with ratios against them.")
flags.DEFINE_list("tuned_only", [],
                  "Entries tuned like the others but not measured (an ablation's arms): "
                  "their tuning trials go to the JSON and to the plot's tuning panel.")
flags.DEFINE_bool("stop_at_last_target", False,
                  "Timed runs stop at the first evaluation reaching the highest target (the "
                  "schedule still spans the budget, so times and steps to each target are "
                  "the whole run's; a seed that never reaches it runs the whole budget).")
flags.DEFINE_bool("tune_only", False,
                  "Run only the tuning trials (scored by accuracy, not time, so a busy "
                  "machine is fine) and stop; a later run reads them back and measures.")
flags.DEFINE_bool("keep_other_results", True,
                  "Carry over from the existing JSON the models (and the autoencoder) this "
                  "run does not measure; each result keeps the commit it was measured at.")
flags.DEFINE_string("work_dir", "/tmp/tfkfac_time_to_accuracy",
                    "Where the trials' runs (checkpoints, logs) go.")

FIRST_ORDER = ("sgd", "adamw", "muon", "schedule_free_adamw", "lamb")
# The ViT's targets, from a probe of AdamW at its tuned learning rate (1e-3), seed 0, on
# the full train split: test accuracy 0.838 / 0.845 / 0.852 / 0.867 after 3 / 4 / 5 / 9
# epochs (0.866 after 10), so the first-order optimizers reach them within 10 epochs.
VIT_TARGETS = (0.84, 0.85, 0.86)
# Per-model budget, target test accuracies and decoupled weight decay λ per step at the
# peak learning rate (`trials.protocol`). A ResNet-20 step costs ~8x a CNN step on 2
# cores, so it tunes for one epoch; it measures up to 8 epochs because within 4 no SGD
# or Adam seed reached 0.90 at a constant learning rate. λ = 5e-5 is where both usual
# recipes meet (SGD: weight decay 5e-4 at learning rate 0.1; AdamW: 0.05 at 1e-3); it is
# not tuned (that would double every entry's budget), and the same for every model.
# `first_order_xla` / `kfac_xla`: whether the timed runs of the first-order and of the
# K-FAC entries compile their train step with XLA (`jit_compile=True`), each the faster
# way for the model as measured side by side on the idle machine: ResNet-20 batch 128
# (bench/results/step_time_idle/, 2026-11-27) SGD 435 ms with XLA against 534 without,
# amortized eigen_adam 1.08x against 1.17x the faster SGD's step; the CNN's SGD 99 ms
# with against 42 without (step_time.json); the ViT's AdamW 94 against 102 ms (300 steps,
# idle), its K-FAC not measured with XLA (off). Accuracy does not depend on it, so the
# tuning trials run without, and a recorded tuning is reused whatever these say.
# ResNet-20 evaluates every 50 steps: ScheduleFreeAdamW reaches 0.90 between its
# evaluations at 200 and 400 steps (0.872-0.884, then 0.904-0.912; 2026-11-28), so every
# 200 steps could not tell a ratio between 0.5x and 1x.
BUDGETS = {
    "cnn": dict(tune_epochs=2, max_epochs=10, eval_every_steps=100,
                target_accuracies=(0.88, 0.89, 0.90), weight_decay=5e-5,
                first_order_xla=False, kfac_xla=False),
    "resnet20": dict(tune_epochs=1, max_epochs=8, eval_every_steps=50,
                     target_accuracies=(0.88, 0.89, 0.90), weight_decay=5e-5,
                     first_order_xla=True, kfac_xla=True),
    # The ViT: a first-order step is ~0.12 s at batch 128 in the trainer (2 idle cores),
    # K-FAC's (10/100 schedule) ~1.05-1.1x that; a timed run to 0.86 takes 3-8 min. K-FAC's
    # amortized step compiled is 0.84x (eigen_adam) and 0.96x (inverse) its step without
    # XLA (bench/results/step_time_idle/vit).
    "vit": dict(tune_epochs=2, max_epochs=10, eval_every_steps=200,
                target_accuracies=VIT_TARGETS, weight_decay=5e-5, first_order_xla=True,
                kfac_xla=True),
}
AUTOENCODER_EVAL_EVERY_STEPS = 100
# Stated settings, constant learning rate (measured under the earlier protocol; not tuned).
AUTOENCODER_SETTINGS = {
    "sgd": dict(optimizer="sgd", learning_rate=0.1),
    "adam": dict(optimizer="adam", learning_rate=1e-3),
    "kfac": dict(optimizer="kfac", kfac_method="eigen", damping=1e-2),
    "kfac_inverse": dict(optimizer="kfac", kfac_method="inverse", damping=1e-2),
}
AUTOENCODER_EVAL_SPLIT = "train[:10000]"


def trial(name, **settings):
    """One trainer run of this benchmark (see bench/trials.py)."""
    return trials.run(FLAGS.work_dir, name, batch_size=FLAGS.batch_size, **settings)


def run_settings(model, entry, setting, epochs):
    """The trainer settings of a run of `entry` at `setting` over `epochs` (the protocol,
    bench/trials.py)."""
    return dict(trials.protocol(entry, setting, epochs, BUDGETS[model]["weight_decay"]),
                model=model)


def tune(model, optimizer):
    """The grid point with the best validation accuracy after a compressed run: the
    model's tuning epochs, on the same schedule shape. Trials the JSON records for
    today's grid and protocol are used when the work dir holds none of them. An option
    entry (`trials.TUNED_AS`) takes its base entry's tuning."""
    if optimizer in trials.TUNED_AS:
        return tune(model, trials.TUNED_AS[optimizer])
    names = [f"{model}-{optimizer}-tune-{trials.slug(setting)}"
             for setting in GRIDS[model][optimizer]]
    scores = recorded_tuning(model, optimizer)
    if scores and not any(os.path.exists(os.path.join(FLAGS.work_dir, n)) for n in names):
        print(f"{model} {optimizer}: tuning trials read from the JSON", flush=True)
    else:
        scores = []
        for name, setting in zip(names, GRIDS[model][optimizer]):
            summary = trial(name, **run_settings(model, optimizer, setting,
                                                 BUDGETS[model]["tune_epochs"]),
                            train_split=TUNE_SPLIT, eval_split=VALIDATION_SPLIT)
            scores.append({"setting": setting,
                           "validation_accuracy": summary["final_eval_accuracy"]})
    best = max(scores, key=lambda s: s["validation_accuracy"])
    return {"trials": scores, "best": best["setting"]}


def recorded_report():
    """The JSON in `--output_dir` as the last run left it, or None."""
    path = os.path.join(FLAGS.output_dir, "time_to_accuracy.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def recorded_tuning(model, optimizer):
    """`optimizer`'s tuning trials on `model` as the JSON records them, if they were run
    on today's grid, budget, schedule and entry settings (else None): a machine whose
    work dir is gone need not tune again."""
    previous = recorded_report()
    if previous is None:
        return None
    result = previous.get("models", {}).get(model, {})
    scores = (result.get("optimizers", {}).get(optimizer, {}).get("tuning")
              or result.get("tuned_only", {}).get(optimizer, {}).get("trials"))
    today = json.loads(json.dumps({"budget": tuning_budget(BUDGETS[model]),
                                   "entry": OPTIMIZERS[optimizer],
                                   "grid": GRIDS[model][optimizer]}))
    recorded = {"budget": tuning_budget(previous["budgets"].get(model) or {}),
                "entry": previous["protocol"]["entries"].get(optimizer),
                "grid": [score["setting"] for score in scores or ()]}
    same_schedule = previous["protocol"].get("warmup_fraction") == WARMUP_FRACTION
    return scores if scores and same_schedule and recorded == today else None


# What of a model's budget only the timed runs read: their length, evaluation interval,
# targets and XLA choices.
TIMED_ONLY = ("max_epochs", "eval_every_steps", "target_accuracies", "first_order_xla",
              "kfac_xla")


def tuning_budget(budget):
    """What of a model's budget the tuning trials depend on: all but `TIMED_ONLY`."""
    return {key: value for key, value in budget.items() if key not in TIMED_ONLY}


def measure(model, optimizer, setting):
    """`--seeds` runs over the model's whole budget (or to its highest target,
    `--stop_at_last_target`): time and steps to each target, and the best test accuracy
    within the run."""
    family = "first_order" if optimizer in FIRST_ORDER else "kfac"
    xla = BUDGETS[model][f"{family}_xla"]
    stop = (dict(target_accuracy=targets(model)[-1], stop_at_target=True)
            if FLAGS.stop_at_last_target else {})
    runs = []
    for seed in range(FLAGS.seeds):
        summary = trial(f"{model}-{optimizer}-seed{seed}-{trials.slug(setting)}"
                        + ("-xla" if xla else ""),
                        **run_settings(model, optimizer, setting, BUDGETS[model]["max_epochs"]),
                        seed=seed, eval_every_steps=BUDGETS[model]["eval_every_steps"], xla=xla,
                        **stop)
        curve = trials.curve(summary)
        runs.append({"seed": seed,
                     "mean_step_time_s": summary["mean_step_time_s"]["all"],
                     "best_accuracy": max(point[2] for point in curve),
                     "stopped_at_target": bool(summary["config"]["stop_at_target"]
                                               and summary["to_target"] is not None),
                     "curve": curve})
    return {"setting": setting, "runs": runs,
            "median_step_time_s": statistics.median(r["mean_step_time_s"] for r in runs),
            "median_best_accuracy": statistics.median(r["best_accuracy"] for r in runs),
            "to_target": {str(target): trials.to_target(runs, target)
                          for target in targets(model)}}


def targets(model):
    """The target test accuracies of `model`: `--target_accuracies`, else its BUDGETS'."""
    return sorted(float(t) for t in
                  (FLAGS.target_accuracies or BUDGETS[model]["target_accuracies"]))


def autoencoder(optimizer):
    settings = AUTOENCODER_SETTINGS[optimizer]
    setting = {key: value for key, value in settings.items()
               if key not in ("optimizer", "kfac_method")}
    summary = trial(f"autoencoder-{optimizer}-{trials.slug(setting)}", model="autoencoder",
                    eval_split=AUTOENCODER_EVAL_SPLIT, epochs=FLAGS.autoencoder_epochs,
                    eval_every_steps=AUTOENCODER_EVAL_EVERY_STEPS, **settings)
    return {"setting": setting,
            "final_train_squared_error": summary["final_metrics"].get("val_squared_error"),
            "curve": [(p["train_time_s"], p["steps"], p["val_squared_error"])
                      for p in summary["evaluations"]]}


def fixed_entry(text):
    """"sgd:learning_rate=0.01" -> ("sgd", {"learning_rate": 0.01})."""
    optimizer, _, assignment = text.partition(":")
    key, _, value = assignment.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = None
    if optimizer not in OPTIMIZERS or not key or number is None:
        raise ValueError(f"fixed_entries must be optimizer:key=number with optimizer among "
                         f"{', '.join(OPTIMIZERS)}; got {text!r}")
    return optimizer, {key: number}


def baselines(results):
    """The first-order entries in `results`; fixed entries count when their optimizer is
    first-order."""
    return [name for name in results if name.split("@")[0] in FIRST_ORDER]


def best_baseline(results, target):
    """The best first-order entry at `target`: the one with the least median time to it,
    or, when none reached it, the one whose bound (`median_above`) is least, so that a
    ratio's bound against it holds against each of them. None when there is none."""
    def time_to(baseline):
        reached = results[baseline]["to_target"][target]
        return ((0, reached["median_time_s"]) if reached["median_time_s"] is not None
                else (1, reached["median_above"]["time_s"]))
    return min(baselines(results), key=time_to, default=None)


def ratios_over_best(results, entry):
    """`ratios` of `entry` per target against the best first-order entry there, named."""
    out = {}
    for target in results[entry]["to_target"]:
        best = best_baseline(results, target)
        ratio = ratios(results, entry, best).get(target) if best else None
        if ratio is not None:
            out[target] = dict(ratio, baseline=best)
    return out


def ratios(results, entry, baseline="sgd"):
    """`entry` / `baseline` of the median time and steps to each target `entry` reached:
    the ratio where `baseline` reached it too, else the bound it is below."""
    if entry not in results or baseline not in results:
        return {}
    out = {}
    for target, mine in results[entry]["to_target"].items():
        theirs = results[baseline]["to_target"][target]
        if mine["median_time_s"] is None:
            continue
        if theirs["median_time_s"] is not None:
            out[target] = {"time": mine["median_time_s"] / theirs["median_time_s"],
                           "steps": mine["median_steps"] / theirs["median_steps"]}
        else:
            above = theirs["median_above"]
            out[target] = {"time_below": mine["median_time_s"] / above["time_s"],
                           "steps_below": mine["median_steps"] / above["steps"]}
    return out


# Matplotlib's cycle has 10 colours ("C0".."C9"); entries past them take these.
EXTRA_COLORS = ("black", "darkkhaki", "lightcoral", "teal", "indigo")


def entry_color(entry):
    """One colour per entry of OPTIMIZERS, the same in every panel."""
    index = list(OPTIMIZERS).index(entry)
    return f"C{index}" if index < 10 else EXTRA_COLORS[(index - 10) % len(EXTRA_COLORS)]


def plot(report):
    panels = list(report["models"]) + (["autoencoder"] if report["autoencoder"] else [])
    # The tuning panels' entry names need ~3 inches beside their bars.
    figure, axes = harness.subplots(2, len(panels), figsize=(5.5 * len(panels) + 3, 8.4),
                                squeeze=False)
    for axis, panel in zip(axes[1], panels):
        if panel == "autoencoder":
            axis.axis("off")
        else:
            plot_tuning(axis, panel, report)
    for axis, panel in zip(axes[0], panels):
        if panel == "autoencoder":
            for optimizer, result in report["autoencoder"].items():
                times, _, errors = zip(*result["curve"])
                axis.plot(times, errors, label=optimizer)
            axis.set_yscale("log")
            axis.set_ylabel(f"squared error on {AUTOENCODER_EVAL_SPLIT}")
            axis.set_title("Deep autoencoder: training error")
        else:
            for optimizer, result in report["models"][panel]["optimizers"].items():
                base = optimizer.split("@")[0]  # fixed entries: dashed, in their base's colour
                for run in result["runs"]:
                    times, _, accuracies = zip(*run["curve"])
                    axis.plot(times, accuracies, color=entry_color(base),
                              linestyle="--" if "@" in optimizer else "-", alpha=0.8,
                              label=optimizer if run["seed"] == 0 else None)
            model_targets = report["target_accuracies"][panel]
            for target in model_targets:
                axis.axhline(target, color="gray", linestyle="--", linewidth=0.8)
            axis.set_ylim(max(0.0, min(model_targets) - 0.15),
                          min(1.0, max(model_targets) + 0.03))
            axis.set_ylabel("test accuracy")
            axis.set_title(f"{panel} on Fashion-MNIST ({report['seeds']} seeds each)")
        axis.set_xlabel("training wall time (s)")
        axis.legend()
    return figure


def best_tuning(model_result):
    """Each entry's best validation accuracy among its tuning trials, the measured
    entries' and the tuned-only ones' (the ablation's table)."""
    trials_by_entry = {o: r["tuning"] for o, r in model_result["optimizers"].items()
                       if "tuning" in r}
    trials_by_entry.update({o: t["trials"]
                            for o, t in model_result.get("tuned_only", {}).items()})
    return {o: max(t["validation_accuracy"] for t in scores)
            for o, scores in trials_by_entry.items()}


def plot_tuning(axis, model, report):
    """Bars of each entry's best tuning accuracy; tuned-only entries hatched."""
    best = best_tuning(report["models"][model])
    entries = sorted(best, key=best.get)
    tuned_only = report["models"][model].get("tuned_only", {})
    bars = axis.barh(entries, [best[o] for o in entries],
                     color=[entry_color(o) for o in entries],
                     hatch=["//" if o in tuned_only else "" for o in entries])
    axis.bar_label(bars, fmt="%.4f", padding=2, fontsize=8)
    axis.set_xlim(min(best.values()) - 0.02, max(best.values()) + 0.015)
    axis.set_xlabel(f"best validation accuracy after {report['budgets'][model]['tune_epochs']} "
                    f"epoch(s), {trials.TUNING_TRIALS} trials each")
    axis.set_title(f"{model}: tuning (hatched: tuned, not timed)")


def comparisons(results):
    """(K-FAC entry, first-order baseline) pairs present in `results`; fixed entries count
    as baselines when their optimizer is first-order."""
    entries = kfac_entries(results)
    return [(entry, baseline) for entry in entries for baseline in baselines(results)]


def kfac_entries(results):
    """The tuned K-FAC entries in `results`."""
    return [name for name in results if name.startswith("kfac") and "@" not in name]


def carry_over(report):
    """From the JSON (`recorded_report`): the models this run did not measure, and of the
    models it measured the entries it did not run (measured or tuned only), each marked
    with the commit it was measured at."""
    previous = recorded_report() if FLAGS.keep_other_results else None
    if previous is None:
        return
    measured_at = previous.get("library_commit", previous.get("commit", "unrecorded"))
    grids = previous["tuning"]["grids"]  # older files: one grid per optimizer for all
    for model, result in previous.get("models", {}).items():
        model_at = result.get("measured_at_commit", measured_at)
        for kind in ("optimizers", "tuned_only"):  # the settings of every kept entry
            for entry in result.get(kind, {}):
                base = entry.split("@")[0]
                if base in previous["protocol"]["entries"]:
                    report["protocol"]["entries"].setdefault(
                        base, previous["protocol"]["entries"][base])
        if model not in report["models"]:
            report["models"][model] = dict(result, measured_at_commit=model_at)
            report["budgets"][model] = previous["budgets"][model]
            report["tuning"]["grids"][model] = grids.get(model, grids)
            report["target_accuracies"][model] = previous["target_accuracies"][model]
            continue
        mine = report["models"][model]
        for kind in ("optimizers", "tuned_only"):
            for entry, entry_result in result.get(kind, {}).items():
                if entry not in mine["optimizers"] and entry not in mine["tuned_only"]:
                    mine[kind][entry] = dict(entry_result, measured_at_commit=entry_result.get(
                        "measured_at_commit", model_at))
                    base = entry.split("@")[0]
                    report["tuning"]["grids"][model].setdefault(
                        base, grids.get(model, grids).get(base))
    for optimizer, result in previous.get("autoencoder", {}).items():
        if optimizer not in report["autoencoder"]:
            report["autoencoder"][optimizer] = dict(result, measured_at_commit=result.get(
                "measured_at_commit", measured_at))


def main():
    harness.check_among("models", FLAGS.models, BUDGETS)
    harness.check_among("optimizers", FLAGS.optimizers, OPTIMIZERS)
    harness.check_among("tuned_only", FLAGS.tuned_only, OPTIMIZERS)
    entries = FLAGS.optimizers + [o for o in FLAGS.tuned_only if o not in FLAGS.optimizers]
    for model in FLAGS.models:
        ungridded = [o for o in entries if o not in GRIDS[model]]
        for optimizer in ungridded:  # the trainer's reason, where it refuses the entry here
            trials.check_entry(optimizer, dict(OPTIMIZERS[optimizer], model=model))
        if ungridded:
            raise ValueError(f"{model} has no tuning grid for {ungridded}; its entries are "
                             f"{', '.join(GRIDS[model])}")
        for optimizer in entries:  # before hours of runs, not at this entry's turn
            trials.check_entry(optimizer, run_settings(
                model, optimizer, GRIDS[model][optimizer][0], BUDGETS[model]["tune_epochs"]))
    fixed = [fixed_entry(text) for text in FLAGS.fixed_entries]
    report = {
        "target_accuracies": {model: targets(model) for model in FLAGS.models},
        "seeds": FLAGS.seeds,
        "batch_size": FLAGS.batch_size,
        "budgets": {model: BUDGETS[model] for model in FLAGS.models},
        "protocol": {"lr_schedule": "cosine", "warmup_fraction": WARMUP_FRACTION,
                     "weight_decay": "per step at the peak learning rate (budgets)",
                     "constant_learning_rate_entries": list(trials.CONSTANT_LEARNING_RATE),
                     "entries": {o: OPTIMIZERS[o] for o in entries}},
        "tuning": {"grids": {m: {o: GRIDS[m][o] for o in entries}
                             for m in FLAGS.models},
                   "trials_per_entry": trials.TUNING_TRIALS,
                   "train_split": TUNE_SPLIT, "validation_split": VALIDATION_SPLIT},
        "models": {}, "autoencoder": {}, "library_commit": harness.library_commit(),
    }
    for model in FLAGS.models:
        # All tuning first, then all measured runs back to back, so the timed runs of
        # every entry share the same stretch of machine conditions.
        tunings = {optimizer: tune(model, optimizer) for optimizer in entries}
        if FLAGS.tune_only:
            print(f"{model} tuned: " + json.dumps({o: t["best"] for o, t in tunings.items()}),
                  flush=True)
            continue
        results = {}
        # Entries awaiting their timed runs count as tuned only until measured.
        report["models"][model] = {"optimizers": results, "tuned_only": dict(tunings),
                                   "measured_at_commit": report["library_commit"]}
        save(report)  # the tuning, before hours of timed runs
        for optimizer in FLAGS.optimizers:
            tuning = tunings[optimizer]
            results[optimizer] = dict(measure(model, optimizer, tuning["best"]),
                                      tuning=tuning["trials"])
            for target, reached in results[optimizer]["to_target"].items():
                print(f"{model} {optimizer} {json.dumps(tuning['best'])} to {target}: "
                      f"{reached['reached']}/{FLAGS.seeds} seeds, median "
                      f"{reached['median_time_s']} s, {reached['median_steps']} steps",
                      flush=True)
            print(f"{model} {optimizer} best accuracy per seed: "
                  f"{[run['best_accuracy'] for run in results[optimizer]['runs']]}", flush=True)
            del report["models"][model]["tuned_only"][optimizer]
            report["models"][model]["load_average_after"] = os.getloadavg()
            save(report)  # each measured entry as soon as it is done
        for optimizer, setting in fixed:
            results[f"{optimizer}@{trials.slug(setting)}"] = measure(model, optimizer, setting)
        report["models"][model]["load_average_after"] = os.getloadavg()
    if FLAGS.tune_only:
        return
    if FLAGS.autoencoder_epochs:
        for optimizer in AUTOENCODER_SETTINGS:
            report["autoencoder"][optimizer] = dict(autoencoder(optimizer),
                                                    measured_at_commit=report["library_commit"])
            print(f"autoencoder {optimizer}: final squared error "
                  f"{report['autoencoder'][optimizer]['final_train_squared_error']:.3f}",
                  flush=True)
    for model in FLAGS.models:
        print(f"{model} best tuning validation accuracy: "
              f"{json.dumps(best_tuning(report['models'][model]))}", flush=True)
    save(report, print_ratios=True)


def save(report, print_ratios=False):
    """Writes the JSON and PNG of `report` with what `carry_over` keeps from the existing
    JSON, and the ratios over every entry of the models this run measures. Called after
    each measured entry too, so that a run cut short (or a machine replaced) loses at
    most the entry under way."""
    report = copy.deepcopy(report)
    measured = list(report["models"])
    carry_over(report)
    for model in measured:  # over this run's entries and those kept from the JSON
        model_result = report["models"][model]
        for entry, baseline in comparisons(model_result["optimizers"]):
            model_result[f"{entry}_over_{baseline}"] = ratios(
                model_result["optimizers"], entry, baseline)
            if print_ratios:
                print(f"{model} {entry}/{baseline} by target: "
                      f"{model_result[f'{entry}_over_{baseline}']}", flush=True)
        for entry in kfac_entries(model_result["optimizers"]):
            model_result[f"{entry}_over_best_first_order"] = ratios_over_best(
                model_result["optimizers"], entry)
            if print_ratios:
                print(f"{model} {entry}/best first-order by target: "
                      f"{model_result[f'{entry}_over_best_first_order']}", flush=True)
    harness.write(report, "time_to_accuracy", plot)


if __name__ == "__main__":
    harness.run(main)
