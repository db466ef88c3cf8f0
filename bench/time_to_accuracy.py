"""Time to accuracy on real Fashion-MNIST: the declared default K-FAC (`tfkfac.KFAC()`,
entry `kfac`) against Keras's first-order optimizers (SGD with Nesterov momentum, AdamW,
Muon, ScheduleFreeAdamW, Lamb), every entry tuned on the same trial count on a
validation split and timed side by side; plus the deep autoencoder's training error
against time.

Every trial is one run of the trainer (`trainers.runner.run`, what
`python -m trainers.train` runs), so the numbers are what a user gets from the flags
recorded beside them. Entries: bench/trials.py OPTIMIZERS. The protocol (declared in
docs/benchmarks.md, "Protocol", before the runs it reports):
1. Schedule: linear warm-up over the first 5% of the run's budget, then half a cosine
   to 0 at the budget's end; a schedule-free rule (ScheduleFreeAdamW, alone or inside
   K-FAC) warms up over the same 5% with its own `warmup_steps`, has no schedule after
   it and is evaluated at its averaged weights. Decoupled weight decay of the same λ
   per step for every entry (BUDGETS' `weight_decay`, `trials.protocol`).
2. Tuning: 8 trials per entry (`trials.GRIDS`: the learning rate; SGD learning rate x
   momentum), each the model's `tune_epochs` on train[:54000] with the same schedule
   shape, scored by the final accuracy on the held-out train[54000:], seed 0. The test
   split is read only by the timed runs. Tuning trials of today's grid and protocol
   recorded in `--tuning_from` are not run again.
3. The race (bench/race.py): every entry at its tuned point over the model's whole
   budget (`max_epochs`) on the full train split, test accuracy evaluated a share
   `EVAL_SPACING` of the steps done apart; fresh seeds from 1, interleaved round by
   round; 5 seeds for `kfac` and the first-order entry with the best tuning accuracy,
   3 for the others. Targets: the best first-order entry's median final accuracy and
   two below it. Reported per target: each entry's median training time (evaluation
   excluded) and steps, per seed; and `kfac`'s ratio to every first-order entry, the
   median of per-round ratios with a bootstrap 90% interval.
4. Autoencoder (Martens & Grosse 784-1000-500-250-30-250-500-1000-784): four optimizers
   at a stated setting each, constant learning rate, for `--autoencoder_epochs`;
   squared reconstruction error on train[:10000] against training time.

Runs live in `--work_dir`; a finished trial is read back instead of rerun, an
interrupted tuning trial resumes from its checkpoint and an interrupted timed run starts
again, so the benchmark can be restarted and spread over sessions (a trial whose stored settings differ from the protocol's is an
error: use a new work dir when the protocol changes). `--tune_only` stops after the
tuning trials, which can run on a busy machine; the race needs it idle.

Run (hours on 2 cores; in the background, from a snapshot of the tree):
  TF_CPP_MIN_LOG_LEVEL=2 PYTHONPATH=.:bench .venv/bin/python bench/time_to_accuracy.py \
      --models=cnn --work_dir=/work/tta --autoencoder_epochs=0 > /tmp/tta.log 2>&1 &
Writes bench/results/time_to_accuracy.json and .png; the results of models a run does
not measure are kept. The earlier protocol's measurements of K-FAC's variants are in
bench/results/variants/.
"""

import copy
import json
import os

from absl import flags

import harness
import race
import trials
from race import DEFAULT_ENTRY, FIRST_ORDER
from race_tables import read_report
from trials import GRIDS, OPTIMIZERS, TUNE_SPLIT, VALIDATION_SPLIT, WARMUP_FRACTION

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["cnn", "resnet20", "vit"], "Classifiers to measure.")
flags.DEFINE_list("optimizers", ["kfac", "sgd", "adamw", "muon", "schedule_free_adamw",
                                 "lamb"],
                  f"Entries to race, among {', '.join(OPTIMIZERS)}; the first-order ones "
                  "are the baselines of the K-FAC ones.")
flags.DEFINE_integer("batch_size", 128, "Examples per step.")
flags.DEFINE_integer("autoencoder_epochs", 5, "Epochs of each autoencoder run (0 skips it).")
flags.DEFINE_list("tuned_only", [],
                  "Entries tuned like the others but not raced (an ablation's arms): "
                  "their tuning trials go to the JSON and to the plot's tuning panel.")
flags.DEFINE_bool("tune_only", False,
                  "Run only the tuning trials (scored by accuracy, not time, so a busy "
                  "machine is fine) and stop; a later run reads them back and races.")
flags.DEFINE_list("tuning_from", [os.path.join(harness.RESULTS_DIR, "time_to_accuracy.json"),
                                  os.path.join(harness.RESULTS_DIR, "variants",
                                               "time_to_accuracy.json")],
                  "JSON reports whose tuning trials of today's grid, budget and entry "
                  "settings are used instead of running them again.")
flags.DEFINE_string("work_dir", "/tmp/tfkfac_time_to_accuracy",
                    "Where the trials' runs (checkpoints, logs) go.")

# Evaluations of the timed runs a share of the steps done apart (trainer --eval_spacing):
# a time to a target is then at most 2.5% late, under the protocol's 3%.
EVAL_SPACING = 0.025
# Per-model budget and decoupled weight decay λ per step at the peak learning rate
# (`trials.protocol`). A ResNet-20 step costs ~8x a CNN step on 2 cores, so it tunes
# for one epoch. λ = 5e-5 is where both usual recipes meet (SGD: weight decay 5e-4 at
# learning rate 0.1; AdamW: 0.05 at 1e-3); it is not tuned, and the same for every
# model. `eval_every_steps`: the largest gap between two evaluations of a timed run.
# `first_order_xla` / `kfac_xla`: whether the timed runs compile their train step with
# XLA (`jit_compile=True`), each family the faster way for the model as measured side
# by side on the idle machine (bench/results/step_time_idle/, step_time.json): ResNet-20
# SGD 435 ms with XLA against 534 without and K-FAC's amortized step faster too; the
# CNN's SGD 99 ms with against 42 without; the ViT's AdamW 94 against 102 ms and
# K-FAC's amortized step 0.84-0.96x. Accuracy does not depend on it, so the tuning
# trials run without.
BUDGETS = {
    "cnn": dict(tune_epochs=2, max_epochs=10, eval_every_steps=100, weight_decay=5e-5,
                first_order_xla=False, kfac_xla=False),
    "resnet20": dict(tune_epochs=1, max_epochs=8, eval_every_steps=100, weight_decay=5e-5,
                     first_order_xla=True, kfac_xla=True),
    "vit": dict(tune_epochs=2, max_epochs=10, eval_every_steps=200, weight_decay=5e-5,
                first_order_xla=True, kfac_xla=True),
}
AUTOENCODER_EVAL_EVERY_STEPS = 100
# Stated settings, constant learning rate (not tuned).
AUTOENCODER_SETTINGS = {
    "sgd": dict(optimizer="sgd", learning_rate=0.1),
    "adam": dict(optimizer="adam", learning_rate=1e-3),
    "kfac": dict(optimizer="kfac", kfac_method="eigen", damping=1e-2,
                 kfac_inner_optimizer="sgd", kl_clip=1e-3, learning_rate=0.05),
    "kfac_inverse": dict(optimizer="kfac", kfac_method="inverse", damping=1e-2,
                         kfac_inner_optimizer="sgd", kl_clip=1e-3, learning_rate=0.05),
}
AUTOENCODER_EVAL_SPLIT = "train[:10000]"


def trial(name, timed=False, **settings):
    """One trainer run of this benchmark (see bench/trials.py)."""
    return trials.run(FLAGS.work_dir, name, timed=timed, batch_size=FLAGS.batch_size,
                      **settings)


def run_settings(model, entry, setting, epochs):
    """The trainer settings of a run of `entry` at `setting` over `epochs` (the protocol,
    bench/trials.py)."""
    return dict(trials.protocol(entry, setting, epochs, BUDGETS[model]["weight_decay"]),
                model=model)


def tune(model, optimizer):
    """The grid point with the best validation accuracy after a compressed run: the
    model's tuning epochs, on the same schedule shape, seed 0. Trials recorded in
    `--tuning_from` for today's grid and protocol are used when the work dir holds none
    of them. An option entry (`trials.TUNED_AS`) takes its base entry's tuning."""
    if optimizer in trials.TUNED_AS:
        return tune(model, trials.TUNED_AS[optimizer])
    names = [f"{model}-{optimizer}-tune-{trials.slug(setting)}"
             for setting in GRIDS[model][optimizer]]
    scores = recorded_tuning(model, optimizer)
    if scores and not any(os.path.exists(os.path.join(FLAGS.work_dir, n)) for n in names):
        print(f"{model} {optimizer}: tuning trials read from a recorded report", flush=True)
    else:
        scores = []
        for name, setting in zip(names, GRIDS[model][optimizer]):
            summary = trials.run_or_diverged(
                FLAGS.work_dir, name, batch_size=FLAGS.batch_size,
                **run_settings(model, optimizer, setting, BUDGETS[model]["tune_epochs"]),
                train_split=TUNE_SPLIT, eval_split=VALIDATION_SPLIT)
            # A diverged trial scores None: below every finite accuracy.
            scores.append({"setting": setting,
                           "validation_accuracy": summary.get("final_eval_accuracy")})
    best = max(scores, key=lambda s: -1.0 if s["validation_accuracy"] is None
               else s["validation_accuracy"])
    return {"trials": scores, "best": best["setting"],
            "best_validation_accuracy": best["validation_accuracy"]}


def recorded_tuning(model, optimizer):
    """`optimizer`'s tuning trials on `model` as a report of `--tuning_from` records
    them, if they were run on today's grid, budget, schedule and entry settings (else
    None): a machine whose work dir is gone need not tune again."""
    today = json.loads(json.dumps({"budget": tuning_budget(BUDGETS[model]),
                                   "entry": OPTIMIZERS[optimizer],
                                   "grid": GRIDS[model][optimizer]}))
    for path in FLAGS.tuning_from:
        report = read_report(path)
        if report is None or report["protocol"].get("warmup_fraction") != WARMUP_FRACTION:
            continue
        scores = recorded_scores(report, model, optimizer)
        recorded = {"budget": tuning_budget(report["budgets"].get(model) or {}),
                    "entry": report["protocol"]["entries"].get(optimizer),
                    "grid": [score["setting"] for score in scores or ()]}
        if scores and recorded == today:
            return scores
    return None


def recorded_scores(report, model, optimizer):
    """The tuning trials of `optimizer` on `model` in `report` (this script's format,
    or the earlier one's), or None."""
    result = report.get("models", {}).get(model, {})
    tuning = result.get("tuning", {}).get(optimizer)
    if tuning:
        return tuning["trials"]
    return (result.get("optimizers", {}).get(optimizer, {}).get("tuning")
            or result.get("tuned_only", {}).get(optimizer, {}).get("trials"))


# What of a model's budget only the timed runs read.
TIMED_ONLY = ("max_epochs", "eval_every_steps", "target_accuracies", "first_order_xla",
              "kfac_xla")


def tuning_budget(budget):
    """What of a model's budget the tuning trials depend on: all but `TIMED_ONLY`."""
    return {key: value for key, value in budget.items() if key not in TIMED_ONLY}


def timed_run(model, entry, setting, seed):
    """One timed run of `entry` at `setting`: the whole budget on the full train split,
    evaluated on the test split `EVAL_SPACING` of the steps done apart."""
    family = "first_order" if entry in FIRST_ORDER else "kfac"
    xla = BUDGETS[model][f"{family}_xla"]
    summary = trial(f"{model}-{entry}-seed{seed}-{trials.slug(setting)}"
                    + ("-xla" if xla else ""),
                    **run_settings(model, entry, setting, BUDGETS[model]["max_epochs"]),
                    seed=seed, eval_every_steps=BUDGETS[model]["eval_every_steps"],
                    eval_spacing=EVAL_SPACING, xla=xla, timed=True)
    curve = trials.curve(summary)
    return {"seed": seed, "xla": xla, "mean_step_time_s": summary["mean_step_time_s"]["all"],
            "final_accuracy": curve[-1][2], "best_accuracy": max(p[2] for p in curve),
            "machine": summary.get("machine"), "curve": curve}


def best_first_order(tunings):
    """The first-order entry with the best tuning (validation) accuracy: the other
    entry of the race that runs `race.HEADLINE_SEEDS` seeds."""
    return max((entry for entry in tunings if entry in FIRST_ORDER),
               key=lambda entry: tunings[entry]["best_validation_accuracy"])


def race_model(model, entries, tunings):
    """The timed runs of `model`'s `entries` (`race.rounds`), each at its tuned point,
    and what they give (`summarize`)."""
    leader = best_first_order({entry: tunings[entry] for entry in entries})
    counts = race.seed_counts(entries, headline=(DEFAULT_ENTRY, leader))
    runs = {entry: [] for entry in entries}
    for seed, entry in race.rounds(counts):
        runs[entry].append(timed_run(model, entry, tunings[entry]["best"], seed))
        run = runs[entry][-1]
        print(f"{model} {entry} seed {seed}: final accuracy {run['final_accuracy']:.4f}, "
              f"mean step {run['mean_step_time_s'] * 1e3:.1f} ms", flush=True)
    return summarize(runs)


def summarize(runs):
    """The targets (`race.final_target`, `race.targets`), every entry's crossings of them
    per seed with medians, and the ratios of each K-FAC entry to each first-order one."""
    final, leader = race.final_target(runs, FIRST_ORDER)
    model_targets = race.targets(final)
    to_target = {}
    for entry, entry_runs in runs.items():
        to_target[entry] = {}
        for target in model_targets:
            crossings = {run["seed"]: race.crossing(run, target) for run in entry_runs}
            times = race.per_seed(entry_runs, target, "time_s")
            steps = race.per_seed(entry_runs, target, "steps")
            to_target[entry][str(target)] = {
                "per_seed": crossings, "reached": sum(c is not None for c in crossings.values()),
                "median_time_s": race.median_or_none(times.values()),
                "median_steps": race.median_or_none(steps.values())}
    ratios = {}
    for entry in (e for e in runs if e not in FIRST_ORDER):
        ratios[entry] = {}
        for baseline in (e for e in runs if e in FIRST_ORDER):
            ratios[entry][baseline] = {str(target): {
                key: race.ratio(race.per_seed(runs[entry], target, key),
                                race.per_seed(runs[baseline], target, key))
                for key in ("time_s", "steps")} for target in model_targets}
    return {"final_target": {"accuracy": final, "entry": leader}, "targets": model_targets,
            "runs": runs, "to_target": to_target, "ratios": ratios}


def autoencoder(optimizer):
    settings = AUTOENCODER_SETTINGS[optimizer]
    setting = {key: value for key, value in settings.items()
               if key not in ("optimizer", "kfac_method", "kfac_inner_optimizer")}
    summary = trial(f"autoencoder-{optimizer}-{trials.slug(setting)}", model="autoencoder",
                    eval_split=AUTOENCODER_EVAL_SPLIT, epochs=FLAGS.autoencoder_epochs,
                    eval_every_steps=AUTOENCODER_EVAL_EVERY_STEPS, **settings)
    return {"setting": setting,
            "final_train_squared_error": summary["final_metrics"].get("val_squared_error"),
            "curve": [(p["train_time_s"], p["steps"], p["val_squared_error"])
                      for p in summary["evaluations"]]}


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
            plot_race(axis, panel, report["models"][panel])
        axis.set_xlabel("training wall time (s)")
        axis.legend()
    return figure


def plot_race(axis, model, result):
    """Every timed run's test accuracy against its training time, the targets dashed."""
    for entry, runs in result["runs"].items():
        for index, run in enumerate(runs):
            times, _, accuracies = zip(*(point[:3] for point in run["curve"]))
            axis.plot(times, accuracies, color=entry_color(entry), alpha=0.8,
                      label=f"{entry} ({len(runs)} seeds)" if index == 0 else None)
    for target in result["targets"]:
        axis.axhline(target, color="gray", linestyle="--", linewidth=0.8)
    axis.set_ylim(max(0.0, min(result["targets"]) - 0.1),
                  min(1.0, max(result["targets"]) + 0.02))
    axis.set_ylabel("test accuracy")
    axis.set_title(f"{model} on Fashion-MNIST")


def best_tuning(model_result):
    """Each entry's best validation accuracy among its tuning trials."""
    return {entry: tuning["best_validation_accuracy"]
            for entry, tuning in model_result["tuning"].items()}


def plot_tuning(axis, model, report):
    """Bars of each entry's best tuning accuracy; tuned-only entries hatched."""
    best = best_tuning(report["models"][model])
    entries = sorted(best, key=best.get)
    raced = report["models"][model].get("runs", {})
    bars = axis.barh(entries, [best[o] for o in entries],
                     color=[entry_color(o) for o in entries],
                     hatch=["" if o in raced else "//" for o in entries])
    axis.bar_label(bars, fmt="%.4f", padding=2, fontsize=8)
    axis.set_xlim(min(best.values()) - 0.02, max(best.values()) + 0.015)
    axis.set_xlabel(f"best validation accuracy after {report['budgets'][model]['tune_epochs']} "
                    f"epoch(s), {trials.TUNING_TRIALS} trials each")
    axis.set_title(f"{model}: tuning (hatched: tuned, not raced)")


def carry_over(report):
    """The models (and the autoencoder entries) this run did not measure, from the JSON
    of `--output_dir` as the last run left it, each marked with the commit it was
    measured at; a kept model's entries keep their settings in the protocol's."""
    previous = read_report(os.path.join(FLAGS.output_dir, "time_to_accuracy.json"))
    if previous is None or "race" not in previous["protocol"]:
        return
    measured_at = previous.get("library_commit", "unrecorded")
    for model, result in previous["models"].items():
        if model not in report["models"]:
            report["models"][model] = dict(result, measured_at_commit=result.get(
                "measured_at_commit", measured_at))
            report["budgets"][model] = previous["budgets"][model]
            report["tuning"]["grids"][model] = previous["tuning"]["grids"][model]
            for entry in previous["tuning"]["grids"][model]:  # the settings of its entries
                if entry in previous["protocol"]["entries"]:
                    report["protocol"]["entries"].setdefault(
                        entry, previous["protocol"]["entries"][entry])
    for optimizer, result in previous.get("autoencoder", {}).items():
        if optimizer not in report["autoencoder"]:
            report["autoencoder"][optimizer] = dict(result, measured_at_commit=result.get(
                "measured_at_commit", measured_at))


def main():
    harness.check_among("models", FLAGS.models, BUDGETS)
    harness.check_among("optimizers", FLAGS.optimizers, OPTIMIZERS)
    harness.check_among("tuned_only", FLAGS.tuned_only, OPTIMIZERS)
    if not any(entry in FIRST_ORDER for entry in FLAGS.optimizers) and not FLAGS.tune_only:
        raise ValueError(f"optimizers must hold a first-order entry ({', '.join(FIRST_ORDER)}): "
                         "the race's targets are the best first-order entry's")
    entries = FLAGS.optimizers + [o for o in FLAGS.tuned_only if o not in FLAGS.optimizers]
    for model in FLAGS.models:
        ungridded = [o for o in entries if o not in GRIDS[model]]
        if ungridded:
            raise ValueError(f"{model} has no tuning grid for {ungridded}; its entries are "
                             f"{', '.join(GRIDS[model])}")
        for optimizer in entries:  # before hours of runs, not at this entry's turn
            trials.check_entry(optimizer, run_settings(
                model, optimizer, GRIDS[model][optimizer][0], BUDGETS[model]["tune_epochs"]))
    report = {
        "batch_size": FLAGS.batch_size,
        "budgets": {model: BUDGETS[model] for model in FLAGS.models},
        "protocol": {"lr_schedule": "cosine", "warmup_fraction": WARMUP_FRACTION,
                     "weight_decay": "per step at the peak learning rate (budgets)",
                     "entries": {o: OPTIMIZERS[o] for o in entries},
                     "race": {"first_seed": race.FIRST_SEED,
                              "headline_seeds": race.HEADLINE_SEEDS,
                              "other_seeds": race.OTHER_SEEDS,
                              "headline_entries": [DEFAULT_ENTRY, "best first-order by tuning"],
                              "final_target": "best first-order entry's median final accuracy",
                              "earlier_target_offsets": race.EARLIER_TARGET_OFFSETS,
                              "eval_spacing": EVAL_SPACING, "interval": race.INTERVAL,
                              "bootstrap_samples": race.BOOTSTRAP_SAMPLES,
                              "ratio": "median of per-round ratios over the common seeds"}},
        "tuning": {"grids": {m: {o: GRIDS[m][o] for o in entries} for m in FLAGS.models},
                   "trials_per_entry": trials.TUNING_TRIALS, "seed": 0,
                   "train_split": TUNE_SPLIT, "validation_split": VALIDATION_SPLIT},
        "models": {}, "autoencoder": {}, "library_commit": harness.library_commit(),
    }
    for model in FLAGS.models:
        tunings = {optimizer: tune(model, optimizer) for optimizer in entries}
        print(f"{model} tuned: " + json.dumps({o: t["best"] for o, t in tunings.items()}),
              flush=True)
        if FLAGS.tune_only:
            continue
        result = race_model(model, FLAGS.optimizers, tunings)
        raced = {entry: tunings[entry] for entry in FLAGS.optimizers}
        report["models"][model] = dict(result, tuning=tunings,
                                       best_first_order_by_tuning=best_first_order(raced),
                                       measured_at_commit=report["library_commit"])
        print_ratios(model, report["models"][model])
        save(report)  # each model as soon as its race is done
    if FLAGS.tune_only:
        return
    if FLAGS.autoencoder_epochs:
        for optimizer in AUTOENCODER_SETTINGS:
            report["autoencoder"][optimizer] = dict(autoencoder(optimizer),
                                                    measured_at_commit=report["library_commit"])
            print(f"autoencoder {optimizer}: final squared error "
                  f"{report['autoencoder'][optimizer]['final_train_squared_error']:.3f}",
                  flush=True)
        save(report)


def print_ratios(model, result):
    for entry, by_baseline in result["ratios"].items():
        for baseline, by_target in by_baseline.items():
            for target, ratio in by_target.items():
                time = ratio["time_s"]
                print(f"{model} {entry}/{baseline} to {target}: time {time['median']} "
                      f"[{time['low']}, {time['high']}]", flush=True)


def save(report):
    """Writes the JSON and PNG of `report` with what `carry_over` keeps from the existing
    JSON."""
    report = copy.deepcopy(report)
    carry_over(report)
    harness.write(report, "time_to_accuracy", plot)


if __name__ == "__main__":
    harness.run(main)
