"""Per-step wall time of K-FAC versus SGD with momentum, same model and batch.

For each model, four trainers are built exactly as `python -m trainers.train` builds
them (`trainers.runner.Trainer`): SGD, K-FAC doing factors and eigendecompositions every
step (`--factor_update_freq=1 --inv_update_freq=1`), and amortized K-FAC
(`--factor_update_freq=10 --inv_update_freq=100`) with the eigen and the inverse
method. Their training steps then run in interleaved blocks (SGD, K-FAC amortized, ...,
SGD, ...) so drift of the shared machine hits all of them alike. Batches come from the
trainer's own pipeline, cached in memory first, so the input pipeline (identical for
all four) is not timed.

Each step is timed from asking for its batch to its finished update
(`trainers.reporting.StepTimer`); a warm-up block first runs every kind of step once
(tracing). Amortized K-FAC runs whole multiples of inv_update_freq, so its mean holds
stale, factor and eigendecomposition steps at their true proportions. K-FAC's own
per-phase clocks (factors, decomposition, preconditioning, update) give the breakdown.

Run (in the background; ~15 min on 2 idle cores):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/step_time.py \
      > /tmp/step_time.log 2>&1 &
Writes bench/results/step_time.json and step_time.png and prints the ratios.
"""

import os
import statistics
import tempfile
import time

from absl import app, flags, logging
import matplotlib

import outputs
from trainers import config as config_lib, models, reporting, runner

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402  (after choosing the backend)

FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["mlp", "cnn", "resnet20"], "Models to time.")
flags.DEFINE_integer("batch_size", 128, "Examples per step, the same for every optimizer.")
flags.DEFINE_integer("blocks", 4, "Interleaved timed blocks per configuration.")
flags.DEFINE_integer("amortized_block_steps", 50,
                     "Steps per block for SGD and amortized K-FAC; blocks x this must be a "
                     "multiple of the amortized inv_update_freq (100).")
flags.DEFINE_integer("every_step_block_steps", 5,
                     "Steps per block for K-FAC with factors and eigendecompositions every step.")
flags.DEFINE_integer("cached_batches", 16, "Distinct batches held in memory and cycled.")
flags.DEFINE_string("output_dir", outputs.RESULTS_DIR, "Where step_time.json/.png go.")

# name -> (TrainConfig overrides, timed steps per block flag)
CONFIGURATIONS = {
    "sgd": dict(optimizer="sgd"),
    "kfac_amortized": dict(optimizer="kfac", factor_update_freq=10, inv_update_freq=100,
                           kfac_method="eigen"),
    # The same schedule with the inverse method: A⁻¹ ∇ G⁻¹ is half the eigen method's
    # per-step matmul work, and an inverse is cheaper than an eigendecomposition.
    "kfac_amortized_inverse": dict(optimizer="kfac", factor_update_freq=10,
                                   inv_update_freq=100, kfac_method="inverse"),
    "kfac_every_step": dict(optimizer="kfac", factor_update_freq=1, inv_update_freq=1,
                            kfac_method="eigen"),
}


class Timed:
    """One configuration's trainer, its cached batches and its step timer."""

    def __init__(self, name, model, model_dir):
        config = config_lib.TrainConfig(model=model, batch_size=FLAGS.batch_size,
                                        model_dir=model_dir, verbose=0,
                                        **CONFIGURATIONS[name])
        self.name = name
        self.config = config
        self.trainer = runner.Trainer(config)
        batches = self.trainer.data.train(epoch=0).take(FLAGS.cached_batches).cache()
        for _ in batches:  # fill the cache now, outside any timing
            pass
        self._batches = batches.repeat()
        self.totals = {}
        self.timer = reporting.StepTimer(runner.phase_fn(config), self.totals)
        self.block_steps = (FLAGS.every_step_block_steps if name == "kfac_every_step"
                            else FLAGS.amortized_block_steps)
        self._kfac_start = None

    def run(self, steps):
        self.trainer.model.fit(self._batches, steps_per_epoch=steps, epochs=1, verbose=0,
                               callbacks=[self.timer])

    def warm_up(self):
        """Runs every kind of step once (each traces), then starts the clocks afresh."""
        if self.config.optimizer == "kfac":
            self.run(self.config.factor_update_freq + 1)
        else:
            self.run(2)
        self.totals.clear()
        self._kfac_start = self._kfac_phase_seconds()

    def _kfac_phase_seconds(self):
        if self.config.optimizer != "kfac":
            return {}
        return self.trainer.optimizer.summary()["phase_seconds"]

    def result(self):
        steps = sum(count for count, _ in self.totals.values())
        means = reporting.mean_step_times(self.totals)
        result = {"timed_steps": steps, "mean_step_s": means.pop("all"),
                  "mean_step_s_by_kind": means}
        if self.config.optimizer == "kfac":
            end = self._kfac_phase_seconds()
            result["kfac_phase_s_per_step"] = {
                phase: (end[phase] - self._kfac_start[phase]) / steps for phase in end}
        return result


def time_model(model):
    with tempfile.TemporaryDirectory() as model_dir:
        timed = [Timed(name, model, os.path.join(model_dir, name)) for name in CONFIGURATIONS]
        for entry in timed:
            entry.warm_up()
        started = time.time()
        for _ in range(FLAGS.blocks):
            for entry in timed:
                entry.run(entry.block_steps)
        results = {entry.name: entry.result() for entry in timed}
    sgd = results["sgd"]["mean_step_s"]
    for name, result in results.items():
        result["ratio_to_sgd"] = result["mean_step_s"] / sgd
    return {"configurations": results, "wall_s": time.time() - started}


def plot(report, path):
    names = list(CONFIGURATIONS)
    model_names = list(report["models"])
    figure, (times, breakdown) = plt.subplots(1, 2, figsize=(12, 4.5))
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
    phases = ("factors", "decomposition", "precondition", "update")
    amortized = [name for name in names if name.startswith("kfac_amortized")]
    width = 0.8 / len(amortized)
    for i, name in enumerate(amortized):
        positions = [x + (i - (len(amortized) - 1) / 2) * width
                     for x in range(len(model_names))]
        bottoms = [0.0] * len(model_names)
        for j, phase in enumerate(phases):
            values = [report["models"][m]["configurations"][name]
                      ["kfac_phase_s_per_step"][phase] * 1e3 for m in model_names]
            breakdown.bar(positions, values, width * 0.9, bottom=bottoms, color=f"C{j}",
                          hatch="//" if i else None, label=phase if i == 0 else None)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    sgd = [report["models"][m]["configurations"]["sgd"]["mean_step_s"] * 1e3
           for m in model_names]
    breakdown.scatter(range(len(model_names)), sgd, color="black", marker="_", s=600,
                      label="SGD step", zorder=3)
    breakdown.set_xticks(range(len(model_names)), model_names)
    breakdown.set_ylabel("ms per step")
    breakdown.set_title("Amortized K-FAC (10/100) phases: eigen | inverse (hatched)")
    breakdown.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # TFDS logs every dataset it opens at INFO
    report = {"batch_size": FLAGS.batch_size, "blocks": FLAGS.blocks,
              "machine": outputs.machine(), "configurations": CONFIGURATIONS, "models": {}}
    for model in FLAGS.models:
        if model not in models.CLASSIFIERS:
            raise ValueError(f"models must be among {', '.join(models.CLASSIFIERS)}; "
                             f"got {model!r}")
        report["models"][model] = time_model(model)
        for name, result in report["models"][model]["configurations"].items():
            print(f"{model:9s} {name:22s} {result['mean_step_s'] * 1e3:9.1f} ms/step  "
                  f"K-FAC/SGD = {result['ratio_to_sgd']:.2f}", flush=True)
    report["median_amortized_inverse_ratio"] = statistics.median(
        r["configurations"]["kfac_amortized_inverse"]["ratio_to_sgd"]
        for r in report["models"].values())
    report["median_amortized_ratio"] = statistics.median(
        r["configurations"]["kfac_amortized"]["ratio_to_sgd"] for r in report["models"].values())
    outputs.write(report, FLAGS.output_dir, "step_time", plot)


if __name__ == "__main__":
    app.run(main)
