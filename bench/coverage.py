"""How much of common architectures K-FAC preconditions, and what its steps cost there.

For five keras.applications models (weights=None, so nothing is downloaded; 32x32x3
inputs, the smallest they accept; 10 classes; logits) and the trainer's classifiers
(28x28x1, Fashion-MNIST's shape), it reports:
- trainable parameters, and the fraction in layers K-FAC manages (`KFAC.attach`, then
  `KFAC.summary()`); a layer counts with all its trainable weights;
- the layers left on the plain gradient, each with K-FAC's reason;
- the losses of `--steps` K-FAC training steps (all must be finite);
- one K-FAC step's time against one SGD-with-momentum step's, on the same batch.

K-FAC uses the trainer's defaults (`trainers.config.TrainConfig`: lr, damping, momentum,
KL clip, method) except that it updates factors and decompositions every second step
(factor_update_freq = decomposition_update_freq = 2), so consecutive steps are one of each kind:
"full" (factors, decompositions, preconditioning) and "stale" (preconditioning only).
The trainer's default 10/100 schedule costs between the two per step. Both optimizers
run Keras's compiled train step with jit_compile=False (the trainer's default; Keras's
jit_compile="auto" made SGD steps 2-3x slower on this CPU), K-FAC with its own XLA off
(its default on CPU). After `--steps` warm-up steps each, `--repeats` steps of each
optimizer are interleaved (bench/harness.py) so drift of the shared machine hits both
alike; the medians are reported, with their ranges. The batch is random pixels and
labels: what is timed does not depend on their values.

Run (in the background; tracing each keras.applications model takes ~100 s here):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/coverage.py \
      > /tmp/coverage.log 2>&1 &
Writes bench/results/coverage.json and coverage.png and prints one line per model.
"""

import collections
import time
import warnings

from absl import flags
import keras
import numpy as np

import harness
import tfkfac
from tfkfac import keras_integration
from trainers import config as config_lib, models

APPLICATIONS = {
    "resnet50": keras.applications.ResNet50,
    "mobilenet_v2": keras.applications.MobileNetV2,
    "efficientnet_b0": keras.applications.EfficientNetB0,
    "convnext_tiny": keras.applications.ConvNeXtTiny,
    "densenet121": keras.applications.DenseNet121,
}
APPLICATION_INPUT_SHAPE = (32, 32, 3)  # min_size of every model above without weights
TRAINER_INPUT_SHAPE = (28, 28, 1)
NUM_CLASSES = 10
MODEL_NAMES = tuple(APPLICATIONS) + models.CLASSIFIERS
# Factors and decompositions every this many steps: steps alternate full and stale.
KFAC_UPDATE_EVERY = 2

FLAGS = flags.FLAGS
flags.DEFINE_list("models", list(MODEL_NAMES), f"Models to measure, among {MODEL_NAMES}.")
flags.DEFINE_integer("batch_size", 64, "Examples per step, the same for both optimizers.")
flags.DEFINE_integer("steps", 5, "K-FAC training steps whose losses must be finite; also "
                     "each optimizer's warm-up before timing (at least 2: both K-FAC kinds).")
harness.define_repeats(10, "one step of each optimizer; K-FAC's alternate full and stale, "
                       "so at least 2")

_TRAINER = config_lib.TrainConfig()
KFAC_SETTINGS = dict(learning_rate=_TRAINER.learning_rate, damping=_TRAINER.damping,
                     momentum=_TRAINER.momentum, kl_clip=_TRAINER.kl_clip,
                     method=_TRAINER.kfac_method, weight_sharing=_TRAINER.weight_sharing,
                     factor_update_freq=KFAC_UPDATE_EVERY,
                     decomposition_update_freq=KFAC_UPDATE_EVERY)
SGD_SETTINGS = dict(learning_rate=_TRAINER.learning_rate, momentum=_TRAINER.momentum)
COMPILE = ("jit_compile=False for both (Keras's 'auto' made SGD steps 2-3x slower on this "
           "CPU); K-FAC's own xla='auto' is off on CPU")


def build(name):
    if name in APPLICATIONS:
        keras.utils.set_random_seed(0)  # their initializers are unseeded
        return APPLICATIONS[name](weights=None, input_shape=APPLICATION_INPUT_SHAPE,
                                  classes=NUM_CLASSES, classifier_activation=None)
    return models.build_model(name, TRAINER_INPUT_SHAPE, NUM_CLASSES, seed=0)


def compiled(name, optimizer):
    """A fresh `name` compiled with `optimizer` (K-FAC attached first)."""
    model = build(name)
    if isinstance(optimizer, tfkfac.KFAC):
        with warnings.catch_warnings():  # the layers it skips are in the report instead
            warnings.simplefilter("ignore")
            optimizer.attach(model)
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def parameters(variables):
    return int(sum(np.prod(variable.shape) for variable in variables))


def coverage(model, optimizer):
    """Managed parameters by layer class, and every weighted layer on the plain gradient."""
    summary = optimizer.summary()
    kinds = {entry["layer"]: entry["kind"] for entry in summary["managed"]}
    reasons = {entry["layer"]: entry["reason"] for entry in summary["skipped"]}
    managed = collections.defaultdict(lambda: {"layers": 0, "params": 0})
    plain = []
    for path, layer in keras_integration.leaf_layers(model).items():
        params = parameters(layer.trainable_weights)
        if not params:
            continue
        if path in kinds:
            entry = managed[f"{type(layer).__name__} ({kinds[path]} block)"]
            entry["layers"] += 1
            entry["params"] += params
        else:
            plain.append({"layer": path, "class": type(layer).__name__,
                          "params": params, "reason": reasons[path]})
    total = parameters(model.trainable_weights)
    managed_params = sum(entry["params"] for entry in managed.values())
    return {"trainable_params": total, "managed_params": managed_params,
            "fraction_preconditioned": managed_params / total,
            "managed_by_class": dict(managed), "plain_gradient_layers": plain}


def measure(name):
    optimizer = tfkfac.KFAC(**KFAC_SETTINGS)
    kfac_model = compiled(name, optimizer)
    rng = np.random.default_rng(0)
    batch = (rng.random((FLAGS.batch_size, *kfac_model.input_shape[1:]), dtype=np.float32),
             rng.integers(0, NUM_CLASSES, FLAGS.batch_size))
    started = time.perf_counter()
    losses = [float(kfac_model.train_on_batch(*batch)) for _ in range(FLAGS.steps)]
    kfac_warm_up_s = time.perf_counter() - started
    result = dict(coverage(kfac_model, optimizer), input_shape=list(batch[0].shape[1:]),
                  kfac_losses=losses, finite=bool(np.all(np.isfinite(losses))),
                  kfac_warm_up_s=kfac_warm_up_s)

    sgd_model = compiled(name, keras.optimizers.SGD(**SGD_SETTINGS))
    for _ in range(FLAGS.steps):
        sgd_model.train_on_batch(*batch)

    def kfac_step():  # by its kind; train_on_batch returns with the loss on the host
        full = int(optimizer.iterations) % KFAC_UPDATE_EVERY == 0
        return {"kfac_full" if full else "kfac_stale":
                harness.seconds(kfac_model.train_on_batch, *batch)}

    samples = harness.interleave(
        {"sgd": lambda: {"sgd": harness.seconds(sgd_model.train_on_batch, *batch)},
         "kfac": kfac_step}, FLAGS.repeats)
    times = harness.by_figure(samples["sgd"] + samples["kfac"])
    result["step_s"] = {kind: harness.spread(values) for kind, values in times.items()}
    medians = {kind: step["median"] for kind, step in result["step_s"].items()}
    result["median_step_s"] = medians
    result["timed_steps"] = {kind: len(values) for kind, values in times.items()}
    result["ratio_to_sgd"] = {kind: medians[kind] / medians["sgd"]
                              for kind in ("kfac_stale", "kfac_full")}
    return result


def plot(report):
    names = list(report["models"])
    results = [report["models"][name] for name in names]
    positions = np.arange(len(names))
    figure, (fraction, ratio) = harness.subplots(1, 2,
                                                 figsize=(max(10, 1.6 * len(names)), 4.5))
    bars = fraction.bar(positions, [100 * r["fraction_preconditioned"] for r in results])
    fraction.bar_label(bars, fmt="%.1f%%", fontsize=8)
    fraction.set_ylim(0, 110)
    fraction.set_ylabel("% of trainable parameters")
    fraction.set_title("Preconditioned by K-FAC")
    width = 0.4
    for offset, kind in ((-width / 2, "kfac_stale"), (width / 2, "kfac_full")):
        bars = ratio.bar(positions + offset, [r["ratio_to_sgd"][kind] for r in results],
                         width, label=kind.replace("kfac_", "") + " step")
        ratio.bar_label(bars, fmt="%.1fx", fontsize=7)
    ratio.axhline(1.0, color="black", linewidth=0.8)
    ratio.set_yscale("log")
    ratio.set_ylabel("K-FAC step / SGD step (median, log)")
    ratio.set_title(f"Step time, batch {report['batch_size']}")
    ratio.legend()
    for axis in (fraction, ratio):
        axis.set_xticks(positions, names, rotation=30, ha="right")
    return figure


def main():
    harness.check_among("models", FLAGS.models, MODEL_NAMES)
    if FLAGS.steps < KFAC_UPDATE_EVERY or FLAGS.repeats < KFAC_UPDATE_EVERY:
        raise ValueError(f"steps and repeats must be >= {KFAC_UPDATE_EVERY}, so both kinds "
                         "of K-FAC step run")
    report = {"batch_size": FLAGS.batch_size, "steps": FLAGS.steps,
              "timed_steps": FLAGS.repeats, "kfac": KFAC_SETTINGS, "sgd": SGD_SETTINGS,
              "compile": COMPILE, "models": {}}
    for name in FLAGS.models:
        result = report["models"][name] = measure(name)
        ratios = result["ratio_to_sgd"]
        print(f"{name:16s} {result['trainable_params']:>10,d} params  "
              f"{100 * result['fraction_preconditioned']:5.1f}% preconditioned  "
              f"{len(result['plain_gradient_layers'])} layers plain  "
              f"finite={result['finite']}  SGD {result['median_step_s']['sgd'] * 1e3:.1f} ms, "
              f"K-FAC stale {ratios['kfac_stale']:.2f}x, full {ratios['kfac_full']:.2f}x",
              flush=True)
    harness.write(report, "coverage", plot)


if __name__ == "__main__":
    harness.run(main)
