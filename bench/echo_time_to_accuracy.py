"""Wall time to a target accuracy with data echoing under a slow input pipeline, for SGD
with momentum and for K-FAC, on real Fashion-MNIST.

Choi et al. echo data to buy wall time when the input pipeline, not the training step,
is the bottleneck: with R = t_upstream / t_downstream, echoing each batch e times
raises steps/s by about min(e, R), at the price of the extra steps repeated data needs.
This benchmark measures what that buys in time to accuracy. Every trial is one run of
the trainer (bench/trials.py), the CNN with random crops (2-pixel padding) and
horizontal flips, so that echoing before and after augmentation differ. Entries: SGD,
K-FAC (inverse method) and echo-aware K-FAC (`factor_examples="fresh"`: factor
statistics count each source example once; at e = 1 it is plain K-FAC, whose tuning,
step time and e = 1 runs it shares). Protocol:

1. Tuning at e = 1 without read latency (scored by accuracy, not time), constant
   learning rate, as bench/time_to_accuracy.py tuned before its cosine schedule: each entry over
   its 4-point grid (GRIDS), `tune_epochs` on train[:54000], scored on
   train[54000:]; the best setting is kept for every e.
2. Calibration: t_down is the mean step time of a short SGD run with no read latency
   (the input overlapped by prefetching); for each R in `--ratios` the read latency per
   example that makes one plain batch of the trainer's own pipeline take R x t_down
   (bench/slow_input.py: corrected until within 5%). One latency serves every
   entry, as one storage system would; each entry's own R (t_up over its own step
   time) is reported. Stored in `work_dir/calibration.json` and reused, so a restarted
   benchmark keeps its latencies and a new R in `--ratios` is added beside them
   (delete the file to recalibrate).
3. Measurement: per R, entry, echo factor e and variant (e = 1: no echo stage),
   `--seeds` seeds on the full train split with that latency, test accuracy every
   `eval_every_steps` steps, stopping at the target or after `max_epochs` passes over
   the fresh data. Reported: medians over the seeds of wall time (evaluation
   excluded), steps and fresh examples to the target; per entry and R the best
   (e, variant) and its time ratio to e = 1, next to Choi's prediction for it:
   (steps_e / steps_1) / min(e, R_entry). A trial that already trained its whole
   budget without reaching the target at another R is not run again (its evaluations
   are the same at every R; `missed_at_another_ratio`).

Run (hours on 2 cores, resumable; on an otherwise idle machine):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/echo_time_to_accuracy.py \
      > /tmp/echo_time_to_accuracy.log 2>&1 &
`--tune_only` runs the tuning (a busy machine is fine for it) and stops.
Writes bench/results/echo_time_to_accuracy.json and .png and prints the ratios.
"""

import glob
import json
import os
import statistics

from absl import flags
import tensorflow as tf

import harness
import pipelines
import slow_input
import trials
from trainers import config as config_lib, runner
from trainers.data import TrainingData

FLAGS = flags.FLAGS
flags.DEFINE_list("ratios", ["2", "4"], "Target R = t_upstream / t_downstream (SGD's step).")
flags.DEFINE_list("entries", ["sgd", "kfac_inverse", "kfac_inverse_fresh"],
                  "Optimizer entries (ENTRIES).")
flags.DEFINE_list("echo_factors", ["2", "3", "4"], "Echo factors e > 1 measured beside e = 1.")
flags.DEFINE_list("variants", list(pipelines.ECHO_MODES[1:]), "Echo modes measured.")
flags.DEFINE_integer("seeds", 3, "Seeds per configuration.")
flags.DEFINE_float("target_accuracy", 0.88, "Test accuracy the runs stop at.")
flags.DEFINE_integer("max_epochs", 8, "Passes over the fresh data before a run gives up.")
flags.DEFINE_integer("tune_epochs", 2, "Epochs of each tuning trial.")
flags.DEFINE_integer("eval_every_steps", 100, "Test accuracy every this many steps.")
flags.DEFINE_integer("calibration_steps", 300, "Steps of the run that measures t_down.")
flags.DEFINE_bool("tune_only", False, "Run only the tuning trials and stop.")
flags.DEFINE_string("work_dir", "/tmp/tfkfac_echo_time_to_accuracy",
                    "Where the trials' runs and the calibration go.")

MODEL, BATCH_SIZE = "cnn", 128
AUGMENTATION = dict(crop_padding=2, flip=True)
# Measured with the constant-learning-rate protocol bench/time_to_accuracy.py had then
# (trainer defaults: K-FAC learning rate 0.05, KL clip 1e-3), and kept, with its tuning
# grids, so that its trials are read back as they were run.
ENTRIES = {"sgd": dict(optimizer="sgd"),
           "kfac_inverse": dict(optimizer="kfac", kfac_method="inverse"),
           "kfac": dict(optimizer="kfac", kfac_method="eigen")}
_DAMPINGS = [dict(damping=d) for d in (1e-2, 3e-2, 1e-1, 3e-1)]
GRIDS = {"sgd": [dict(learning_rate=lr) for lr in (0.01, 0.03, 0.1, 0.3)],
         "kfac_inverse": _DAMPINGS, "kfac": _DAMPINGS}
# Echo-aware K-FAC (factor statistics over each source example once). With every example
# fresh (e = 1) it is bit-identical to plain K-FAC (tests/test_kfac_fresh_examples.py),
# so it shares that entry's tuning, step time and e = 1 runs.
ENTRIES["kfac_inverse_fresh"] = dict(ENTRIES["kfac_inverse"], factor_examples="fresh")
SAME_AT_E1 = {"kfac_inverse_fresh": "kfac_inverse"}
NAME = "echo_time_to_accuracy"


def trial(name, **settings):
    return trials.run(FLAGS.work_dir, name, model=MODEL, batch_size=BATCH_SIZE,
                      **AUGMENTATION, **settings)


def tune(entry):
    """The grid setting (GRIDS) with the best validation accuracy."""
    entry = SAME_AT_E1.get(entry, entry)
    scores = []
    for setting in GRIDS[entry]:
        summary = trial(f"{entry}-tune-{trials.slug(setting)}", **ENTRIES[entry],
                        train_split=trials.TUNE_SPLIT,
                        eval_split=trials.VALIDATION_SPLIT,
                        epochs=FLAGS.tune_epochs, **setting)
        scores.append({"setting": setting,
                       "validation_accuracy": summary["final_eval_accuracy"]})
    return {"trials": scores,
            "best": max(scores, key=lambda s: s["validation_accuracy"])["setting"]}


def step_seconds(entry, setting):
    """Mean step time of a short run of `entry` with the input in memory (no latency)."""
    entry = SAME_AT_E1.get(entry, entry)
    summary = trial(f"{entry}-calibration-{trials.slug(setting)}", **ENTRIES[entry],
                    steps=FLAGS.calibration_steps, epochs=1, **setting)
    return summary["mean_step_time_s"]["all"]


def training_pipeline(read_latency):
    """The trainer's own training pipeline at `read_latency`: what `slow_input` calibrates."""
    config = config_lib.TrainConfig(model=MODEL, batch_size=BATCH_SIZE,
                                    read_latency=read_latency, **AUGMENTATION)
    return TrainingData(config, 0, 1, tf.float32).train(0)


def calibrated_latencies(tunings):
    """{R: read latency} and every entry's step time, for the R in `--ratios`. Both are
    kept in work_dir/calibration.json: a restarted benchmark reuses them, and an R not
    yet there is calibrated and added beside the others."""
    path = os.path.join(FLAGS.work_dir, "calibration.json")
    calibration = {"t_downstream_s": {}, "ratios": {}}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            calibration = json.load(f)
    t_down = calibration["t_downstream_s"]
    for entry in FLAGS.entries:
        if entry not in t_down:
            t_down[entry] = step_seconds(entry, tunings[entry]["best"])
    for ratio in FLAGS.ratios:
        if ratio not in calibration["ratios"]:
            calibration["ratios"][ratio] = slow_input.calibrate(
                training_pipeline, float(ratio) * t_down["sgd"], BATCH_SIZE)
        latency = calibration["ratios"][ratio]
        latency["ratio_by_entry"] = {e: latency["t_upstream_s"] / t_down[e]
                                     for e in FLAGS.entries}
        print(f"R {ratio}: read latency {1e6 * latency['read_latency_s']:.0f} us/example, "
              f"t_up {1e3 * latency['t_upstream_s']:.1f} ms/batch, R by entry "
              f"{latency['ratio_by_entry']}", flush=True)
    os.makedirs(FLAGS.work_dir, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(calibration, f, indent=2)
    return calibration


def configurations():
    """(echo_mode, echo_factor) pairs: e = 1 without an echo stage, then each variant."""
    return [("none", 1.0)] + [(mode, float(e)) for mode in FLAGS.variants
                              for e in FLAGS.echo_factors]


def missed_at_another_ratio(name, ratio):
    """The summary of the same trial at another R if it trained its whole budget without
    reaching the target, else None.

    Read latency only delays the input: a trial's evaluations (accuracy at every step,
    fresh examples) are bit-identical at every R (every trial measured at two R agrees,
    docs/benchmarks.md), so a run that missed the target at one R misses it at all, and
    running it again would spend its whole budget to learn only its step time.
    """
    if os.path.exists(os.path.join(FLAGS.work_dir, name, runner.SUMMARY_FILE)):
        return None  # ran at this R: read back as it is
    for path in sorted(glob.glob(os.path.join(
            FLAGS.work_dir, name.replace(f"-R{ratio}-", "-R*-"), runner.SUMMARY_FILE))):
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        if summary["to_target"] is None and trials.finished(summary, FLAGS.max_epochs):
            return summary
    return None


def measure(entry, setting, ratio, read_latency):
    results = []
    for mode, factor in configurations():
        runs = []
        measured_as = SAME_AT_E1.get(entry, entry) if mode == "none" else entry
        for seed in range(FLAGS.seeds):
            name = f"{measured_as}-R{ratio}-{mode}-e{factor:g}-seed{seed}-{trials.slug(setting)}"
            missed = missed_at_another_ratio(name, ratio)
            summary = missed or trial(
                name, **ENTRIES[measured_as], seed=seed, read_latency=read_latency,
                echo_mode=mode, echo_factor=factor, epochs=FLAGS.max_epochs,
                eval_every_steps=FLAGS.eval_every_steps,
                target_accuracy=FLAGS.target_accuracy, stop_at_target=True, **setting)
            runs.append({"seed": seed, "curve": trials.curve(summary, fresh_examples=True),
                         # a step time belongs to the R it ran at
                         "mean_step_time_s": (None if missed
                                              else summary["mean_step_time_s"]["all"]),
                         "missed_at": missed and missed["model_dir"]})
        reached = trials.to_target(runs, FLAGS.target_accuracy)
        step_times = [r["mean_step_time_s"] for r in runs if r["mean_step_time_s"] is not None]
        results.append({"echo_mode": mode, "echo_factor": factor, "runs": runs,
                        "median_step_time_s": (statistics.median(step_times)
                                               if step_times else None),
                        "to_target": reached})
        print(f"{entry} R={ratio} {mode} e={factor:g}: {reached['reached']}/{FLAGS.seeds} "
              f"seeds, median {reached['median_time_s']} s, {reached['median_steps']} steps, "
              f"{reached.get('median_fresh_examples')} fresh examples", flush=True)
    return results


def best_against_e1(results, ratio_entry):
    """The fastest configuration to the target, its time ratio to e = 1 and Choi's
    prediction (steps_e / steps_1) / min(e, R); None where e = 1 or nothing reached it."""
    base = results[0]["to_target"]
    reached = [r for r in results[1:] if r["to_target"]["median_time_s"] is not None]
    if base["median_time_s"] is None or not reached:
        return None
    best = min(reached, key=lambda r: r["to_target"]["median_time_s"])
    steps_ratio = best["to_target"]["median_steps"] / base["median_steps"]
    return {"echo_mode": best["echo_mode"], "echo_factor": best["echo_factor"],
            "time_ratio": best["to_target"]["median_time_s"] / base["median_time_s"],
            "steps_ratio": steps_ratio,
            "fresh_examples_ratio": (best["to_target"]["median_fresh_examples"]
                                     / base["median_fresh_examples"]),
            "predicted_time_ratio": steps_ratio / min(best["echo_factor"], ratio_entry)}


SHORT_MODE_NAMES = {"none": "none", "example_before_augment": "before aug.",
                    "example_after_augment": "after aug.", "batch": "batch"}


def plot(report):
    ratios, entries = list(report["results"]), FLAGS.entries
    figure, axes = harness.subplots(len(ratios), len(entries), squeeze=False,
                                figsize=(6 * len(entries), 3.8 * len(ratios)))
    for row, ratio in zip(axes, ratios):
        for axis, entry in zip(row, entries):
            results = report["results"][ratio][entry]["configurations"]
            labels = [f"{SHORT_MODE_NAMES[r['echo_mode']]}\ne={r['echo_factor']:g}"
                      for r in results]
            times = [r["to_target"]["median_time_s"] or 0.0 for r in results]
            colors = ["gray"] + [f"C{FLAGS.variants.index(r['echo_mode'])}"
                                 for r in results[1:]]
            axis.bar(range(len(results)), times, color=colors)
            axis.axhline(times[0], color="gray", linestyle="--", linewidth=0.8)
            axis.set_xticks(range(len(results)), labels, fontsize=6)
            axis.set_ylabel(f"median s to {FLAGS.target_accuracy} (0: not reached)")
            own_ratio = report["calibration"]["ratios"][ratio]["ratio_by_entry"][entry]
            axis.set_title(f"{entry}, R = {own_ratio:.2f}")
    figure.suptitle(f"Data echoing: wall time to test accuracy {FLAGS.target_accuracy}, "
                    f"Fashion-MNIST CNN, {FLAGS.seeds} seeds")
    return figure


def main():
    harness.check_among("entries", FLAGS.entries, ENTRIES)
    if "sgd" not in FLAGS.entries:
        raise ValueError(f"entries must include sgd (R is set by its step); got "
                         f"{FLAGS.entries}")
    harness.check_among("variants", FLAGS.variants, pipelines.ECHO_MODES[1:])
    report = {"model": MODEL, "batch_size": BATCH_SIZE, "augmentation": AUGMENTATION,
              "target_accuracy": FLAGS.target_accuracy, "seeds": FLAGS.seeds,
              "max_epochs": FLAGS.max_epochs, "library_commit": harness.library_commit()}
    tunings = {entry: tune(entry) for entry in FLAGS.entries}
    if FLAGS.tune_only:
        print("tuned: " + json.dumps({e: t["best"] for e, t in tunings.items()}), flush=True)
        return
    report["tuning"] = tunings
    report["calibration"] = calibrated_latencies(tunings)
    report["results"] = {}
    for ratio in FLAGS.ratios:
        calibrated = report["calibration"]["ratios"][ratio]
        report["results"][ratio] = {}
        for entry in FLAGS.entries:
            results = measure(entry, tunings[entry]["best"], ratio,
                              calibrated["read_latency_s"])
            best = best_against_e1(results, calibrated["ratio_by_entry"][entry])
            report["results"][ratio][entry] = {"configurations": results, "best": best}
            print(f"{entry} R={ratio} best: {json.dumps(best)}", flush=True)
    harness.write(report, NAME, plot)


if __name__ == "__main__":
    harness.run(main)
