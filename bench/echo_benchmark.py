"""Data-echoing benchmark: an upstream-bound Fashion-MNIST pipeline feeding a real Keras
training step (the trainers' CNN, plain SGD), with and without echoing.

Upstream stands for slow storage: a simulated read latency per example (one reader,
reading 32 examples at a time), tuned so that R = t_upstream / t_downstream is about
`--ratio` (bench/slow_input.py), then measured again in every repeat: t_upstream is the
time per batch of the plain pipeline alone, t_downstream the time per training step on
a batch already in memory. Each echo variant runs with e = 1, 2, 3 (plus the pipeline without
an echo stage) and reports downstream steps/s and fresh examples/s; the paper predicts
steps/s growing like min(e, R) while fresh examples/s stays flat until e > R. The echo
stage's own overhead is measured twice: the CPU time it adds per batch on an
in-memory source, as a fraction of the training step, and steps/s at e = 1 versus
the pipeline without it.

Run (about 5 minutes on 2 cores; in the background):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/echo_benchmark.py \
      > /tmp/echo_benchmark.log 2>&1 &
Writes bench/results/echo_benchmark.json and .png.
"""

import functools
import gc
import json
import statistics
import time

from absl import flags
import keras
import numpy as np
import tensorflow as tf

import harness
import pipelines
from pipelines import counters, idx_dataset
import slow_input
from trainers import models

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch_size", 128, "Examples per training step.")
flags.DEFINE_float("ratio", 3.0, "Target R = t_upstream / t_downstream.")
flags.DEFINE_list("factors", ["1", "2", "3"], "Echo factors to measure.")
flags.DEFINE_list("variants", list(pipelines.ECHO_MODES[1:]), "Echo modes to measure.")
flags.DEFINE_float("seconds", 3.0, "Timed training seconds per measurement.")
flags.DEFINE_integer("warmup_steps", 8, "Untimed steps before each measurement.")
harness.define_repeats(3, "a timed window of training, and a measurement of R")
flags.DEFINE_integer("shuffle_buffer", 1024, "The pipeline's one shuffle buffer.")
flags.DEFINE_integer("seed", 0, "Data and model seed.")

AUGMENTATION = pipelines.Augmentation(crop_padding=2, flip=True)


class TimedWindow(keras.callbacks.Callback):
    """Lets `warmup` steps pass, then times `seconds` of steps (and the counters'
    progress) and stops `fit`."""

    def __init__(self, warmup, seconds, counters=None):
        super().__init__()
        self.warmup, self.seconds, self.counters = warmup, seconds, counters
        self.start = self.start_counts = None
        self.result = None

    def _counts(self):
        return self.counters.result() if self.counters else {}

    def on_train_batch_end(self, batch, logs=None):
        steps = batch + 1
        if steps == self.warmup:
            self.start, self.start_counts = time.perf_counter(), self._counts()
        elif steps > self.warmup and time.perf_counter() - self.start >= self.seconds:
            elapsed = time.perf_counter() - self.start
            counts = self._counts()
            self.result = {"seconds": elapsed, "steps_per_s": (steps - self.warmup) / elapsed}
            for name, value in counts.items():
                self.result[name + "_per_s"] = (value - self.start_counts[name]) / elapsed
            self.model.stop_training = True


def make_model():
    model = models.build_model("cnn", (28, 28, 1), 10, seed=FLAGS.seed)
    model.compile(keras.optimizers.SGD(0.02),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def timed_fit(model, dataset, counters=None):
    window = TimedWindow(FLAGS.warmup_steps, FLAGS.seconds, counters)
    model.fit(dataset, epochs=1, steps_per_epoch=10**9, verbose=0, callbacks=[window])
    return window.result


def build(echo_mode="none", echo_factor=1, read_latency=0.0, source="fashion_mnist"):
    return pipelines.build(source, batch_size=FLAGS.batch_size, echo_mode=echo_mode,
                           echo_factor=echo_factor, shuffle_buffer=FLAGS.shuffle_buffer,
                           augmentation=AUGMENTATION, seed=FLAGS.seed, num_epochs=None,
                           read_latency=read_latency)


def plain_pipeline(read_latency):
    """The pipeline without an echo stage: what `slow_input` calibrates."""
    return build(read_latency=read_latency)[0]


def downstream_seconds(model):
    """Seconds per training step on one batch already in memory."""
    batch = next(iter(build()[0]))
    return 1.0 / timed_fit(model, tf.data.Dataset.from_tensors(batch).repeat())["steps_per_s"]


def ratio_now(model, latency):
    """t_down, t_up at `latency` and their ratio R, measured now."""
    t_down = downstream_seconds(model)
    t_up = slow_input.upstream_seconds(plain_pipeline, latency, FLAGS.batch_size)
    print(f"t_down {1e3 * t_down:.1f} ms, t_up {1e3 * t_up:.1f} ms, R = {t_up / t_down:.2f}",
          flush=True)
    return {"t_downstream_s": t_down, "t_upstream_s": t_up, "ratio": t_up / t_down}


def echo_stage_overhead(t_down, tries=3):
    """CPU time the echo stage itself (e = 1) adds per training batch, on in-memory
    decoded Fashion-MNIST examples, and that time as a fraction of the training step.
    CPU time of this process, unlike wall time, does not move with other load on the
    machine; the least of `tries` interleaved passes is kept."""
    raw = next(idx_dataset.load_idx("fashion_mnist", "train[:20000]").batch(20000)
               .as_numpy_iterator())
    examples = tf.data.Dataset.from_tensor_slices(
        {"image": raw["image"].astype(np.float32) / 255, "label": raw["label"]}
    ).map(counters.mark_fresh).cache()
    for _ in examples.batch(4096):  # fill the cache
        pass
    batch = FLAGS.batch_size
    stages = {
        "example": (examples.batch(batch), examples.apply(pipelines.echo(1)).batch(batch)),
        "batch": (examples.batch(batch), examples.batch(batch).apply(pipelines.echo(1))),
    }
    num_batches = 20000 // batch - 2
    gc.collect()  # end the iterators of earlier measurements and their threads
    overhead = {}
    for name, datasets in stages.items():
        times = harness.interleave(
            {kind: functools.partial(slow_input.seconds_per_batch, dataset, num_batches,
                                     time.process_time)
             for kind, dataset in zip(("plain", "echoed"), datasets)}, tries)
        extra = min(times["echoed"]) - min(times["plain"])
        overhead[name] = {"plain_cpu_ms_per_batch": 1e3 * min(times["plain"]),
                          "echoed_cpu_ms_per_batch": 1e3 * min(times["echoed"]),
                          "extra_cpu_ms_per_batch": 1e3 * extra,
                          "percent_of_step": 100.0 * extra / t_down}
    return overhead


def measure_all(model, latency):
    """Runs every configuration `--repeats` times, interleaved with a measurement of
    t_down and t_up (so R); keeps medians (the machine is shared)."""
    def run(mode, factor):
        dataset, counters = build(mode, factor, latency)
        result = timed_fit(model, dataset, counters)
        print(f"{mode:24s} e={factor:g}: {result['steps_per_s']:6.2f} steps/s, "
              f"{result['fresh_examples_per_s']:7.1f} fresh ex/s", flush=True)
        return result

    configs = [("none", 1.0)] + [(mode, float(e)) for mode in FLAGS.variants for e in FLAGS.factors]
    runs = harness.interleave(
        {"R": functools.partial(ratio_now, model, latency),
         **{config: functools.partial(run, *config) for config in configs}}, FLAGS.repeats)
    ratios = runs.pop("R")
    summary = []
    for (mode, factor), results in runs.items():
        entry = {"echo_mode": mode, "echo_factor": factor, "runs": results}
        for key in ("steps_per_s", "fresh_examples_per_s", "trained_examples_per_s"):
            entry[key] = statistics.median(r[key] for r in results)
        summary.append(entry)
    return summary, ratios


def add_speedups(summary):
    by_config = {(s["echo_mode"], s["echo_factor"]): s for s in summary}
    plain = by_config[("none", 1.0)]["steps_per_s"]
    for entry in summary:
        base = by_config.get((entry["echo_mode"], 1.0), by_config[("none", 1.0)])
        entry["speedup_vs_e1"] = entry["steps_per_s"] / base["steps_per_s"]
        entry["speedup_vs_plain"] = entry["steps_per_s"] / plain


def plot(report):
    figure, (steps_axis, fresh_axis) = harness.subplots(1, 2, figsize=(11, 4.2))
    factors = sorted({s["echo_factor"] for s in report["results"]})
    t_up, t_down = report["t_upstream_s"], report["t_downstream_s"]
    ideal = [min(e / t_up, 1 / t_down) for e in factors]
    steps_axis.plot(factors, ideal, "k--", label="ideal min(e/t_up, 1/t_down)")
    for mode in FLAGS.variants:
        entries = sorted((s for s in report["results"] if s["echo_mode"] == mode),
                         key=lambda s: s["echo_factor"])
        xs = [s["echo_factor"] for s in entries]
        steps_axis.plot(xs, [s["steps_per_s"] for s in entries], "o-", label=mode)
        fresh_axis.plot(xs, [s["fresh_examples_per_s"] for s in entries], "o-", label=mode)
    plain = next(s for s in report["results"] if s["echo_mode"] == "none")
    for axis, key in ((steps_axis, "steps_per_s"), (fresh_axis, "fresh_examples_per_s")):
        axis.axhline(plain[key], color="gray", linestyle=":", label="no echo stage")
        axis.set_xlabel("echo factor e")
        axis.set_xticks(factors)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    steps_axis.set_ylabel("training steps / s")
    fresh_axis.set_ylabel("fresh examples / s")
    steps_axis.set_title(f"Steps/s at R = {report['ratio_measured']:.2f}")
    fresh_axis.set_title("Fresh (upstream) examples/s")
    steps_axis.legend(fontsize=8)
    figure.suptitle(f"Data echoing, Fashion-MNIST CNN, batch {FLAGS.batch_size}, "
                    f"{report['machine']['cpus']} CPU cores")
    return figure


def main():
    harness.check_among("variants", FLAGS.variants, pipelines.ECHO_MODES[1:])
    started = time.time()
    model = make_model()
    t_down = downstream_seconds(model)
    calibrated = slow_input.calibrate(plain_pipeline, FLAGS.ratio * t_down, FLAGS.batch_size)
    latency, t_up = calibrated["read_latency_s"], calibrated["t_upstream_s"]
    print(f"t_down {1e3 * t_down:.1f} ms/step, read latency {1e6 * latency:.0f} us/example, "
          f"t_up {1e3 * t_up:.1f} ms/batch, R = {t_up / t_down:.2f}", flush=True)
    overhead = echo_stage_overhead(t_down)
    print("echo stage overhead:", json.dumps(overhead), flush=True)
    summary, ratios = measure_all(model, latency)
    add_speedups(summary)
    report = {
        "batch_size": FLAGS.batch_size,
        "read_latency_us_per_example": 1e6 * latency,
        "t_downstream_s": statistics.median(r["t_downstream_s"] for r in ratios),
        "t_upstream_s": statistics.median(r["t_upstream_s"] for r in ratios),
        "ratio_target": FLAGS.ratio,
        "ratio_measured": statistics.median(r["ratio"] for r in ratios),
        "ratio_calibration": {"t_downstream_s": t_down, "t_upstream_s": t_up, "ratio": t_up / t_down},
        "ratio_per_repeat": ratios,
        "seconds_per_measurement": FLAGS.seconds,
        "repeats": FLAGS.repeats,
        "shuffle_buffer": FLAGS.shuffle_buffer,
        "augmentation": "random crop (padding 2) + horizontal flip",
        "echo_stage_overhead": overhead,
        "results": summary,
        "wall_seconds": time.time() - started,
    }
    harness.write(report, "echo_benchmark", plot)
    print(f"\n{'echo mode':24s} {'e':>3s} {'steps/s':>8s} {'vs e=1':>7s} {'vs plain':>8s} "
          f"{'fresh ex/s':>11s}")
    for s in summary:
        print(f"{s['echo_mode']:24s} {s['echo_factor']:3g} {s['steps_per_s']:8.2f} "
              f"{s['speedup_vs_e1']:6.2f}x {s['speedup_vs_plain']:7.2f}x "
              f"{s['fresh_examples_per_s']:11.1f}")
    for name, stage in overhead.items():
        print(f"echo stage ({name}, e=1): +{stage['extra_cpu_ms_per_batch']:.2f} CPU ms per batch = "
              f"{stage['percent_of_step']:.2f}% of a {1e3 * t_down:.1f} ms training step "
              "(at calibration)")
    per_repeat = ", ".join(f"{r['ratio']:.2f}" for r in ratios)
    print(f"R = {report['ratio_measured']:.2f} (per repeat: {per_repeat}); "
          f"measured in {report['wall_seconds']:.0f} s")


if __name__ == "__main__":
    harness.run(main)
