"""How far K-FAC's step length is from Adam's, per layer, and how often the KL clip binds:
the diagnostic behind layer-wise grafting on the ViT.

Grafting (docs/design.md §11) keeps K-FAC's direction P_ℓ per managed layer ℓ and takes
the length of Adam's r_ℓ = ∇_ℓ / (√v̂ + ε): it multiplies P_ℓ by ‖r_ℓ‖ / ‖P_ℓ‖. What it
changes against K-FAC with the KL clip, which scales every layer by one ν, is therefore
the spread of ρ_ℓ = ‖P_ℓ‖ / ‖r_ℓ‖ between layers and over training: a common factor
is absorbed by the learning rate and ν, a spread is not. This script trains the ViT
(`trainers.models` "vit") as bench/time_to_accuracy.py's `kfac_inverse` entry does: the
trainer's own data (the real Fashion-MNIST train split, its pipeline), model and
optimizer (`trainers.runner.Trainer`), the protocol's warm-up + cosine schedule over the
run and its decoupled weight decay (`time_to_accuracy.run_settings`), the inverse method
with the KL clip on; learning rate, damping and KL clip default to the geometric middle
of the entry's ViT tuning grid (bench/trials.py GRIDS). The steps run in docs/guide.md §2's
custom loop (`optimizer.record()` as tape, `optimizer.minimize(loss, tape=tape)`), with a
plain tape on the same forward pass for the gradients the optimizer receives.
With public API and numpy only, every step updates Adam's v (β2-average of ∇² per
variable, from 0, bias-corrected; β2 and ε are the optimizer's `adam_beta_2` and
`adam_epsilon`, those grafting uses), and every `--every` steps it records, per managed
layer (its variables together), ‖P_ℓ‖ (`optimizer.precondition`: what the step
preconditioned with, before the clip), ‖r_ℓ‖ and ρ_ℓ, and the KL clip's
ν = min(1, sqrt(κ / (η² Σ_ℓ |<P_ℓ, ∇_ℓ>|))) (docs/design.md §5, η the step's learning
rate), which binds when ν < 1. tests/test_step_length.py checks these against numpy.

Printed: ρ's median and 10th / 90th percentiles over the run per layer, per layer kind and
per role (the same layer of every block), the spread between layers (90th / 10th percentile over the layers at one step, median over
the recorded steps), the share of recorded steps where the clip binds, the median ν, and
the final test accuracy (a sanity check that the run trains as the benchmark's does).
`--batch_size` (default 128) is bench/time_to_accuracy.py's flag; its others are refused.

Run (in the background; 936 steps, the default 2 epochs: 5.5 min on 2 cores at load 6-11):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/step_length.py \
      > /tmp/step_length.log 2>&1 &
Writes bench/results/step_length.json and step_length.png (ρ per layer over the steps,
log scale; ν and the learning rate).
"""

import collections
import dataclasses
import math
import re
import statistics
import tempfile
import time

from absl import flags
import numpy as np
import tensorflow as tf

import harness
import time_to_accuracy
import trials
from trainers import config as config_lib, data as data_lib, runner

MODEL, ENTRY = "vit", "kfac_inverse"


def grid_middle(name):
    """The geometric middle of `name`'s values in the entry's ViT grid, to 2 digits."""
    values = {point[name] for point in trials.GRIDS[MODEL][ENTRY]}
    return float(f"{math.exp(statistics.fmean(math.log(v) for v in values)):.2g}")


FLAGS = flags.FLAGS
flags.DEFINE_float("learning_rate", grid_middle("learning_rate"),
                   "Peak learning rate of the schedule (the inner SGD's).")
flags.DEFINE_float("damping", grid_middle("damping"), "K-FAC's damping λ.")
flags.DEFINE_float("kl_clip", grid_middle("kl_clip"), "The KL clip κ.")
flags.DEFINE_integer("steps", 0, "Training steps; 0: the entry's tuning budget "
                     "(time_to_accuracy.BUDGETS' tune_epochs of the train split). The "
                     "schedule spans them, with the protocol's 5% warm-up.")
flags.DEFINE_integer("every", 20, "Record every this many steps (and the last step).")
flags.DEFINE_integer("seed", 0, "The trainer's seed (model initialization, data order).")

PERCENTILES = (10, 50, 90)


# ------------------------------------------------------------------ arithmetic
def managed_groups(optimizer, variables):
    """Per managed layer, in `optimizer.summary()` order: (its path, its block kind, the
    indices in `variables` of its variables).

    A variable's own path is its layer's path, maybe below a prefix (a Sequential's name),
    and its name ("sequential/dense/kernel"); it belongs to the longest managed path
    that its layer part ends with ("dense"), none if no managed path matches."""
    managed = optimizer.summary()["managed"]
    by_layer = collections.defaultdict(list)
    for index, variable in enumerate(variables):
        layer = variable.path.rpartition("/")[0]
        matches = [m["layer"] for m in managed
                   if layer == m["layer"] or layer.endswith("/" + m["layer"])]
        if matches:
            by_layer[max(matches, key=len)].append(index)
    groups = [(m["layer"], m["kind"], by_layer[m["layer"]]) for m in managed]
    for path, _, indices in groups:
        names = [variables[i].path.rpartition("/")[2] for i in indices]
        if not names or len(set(names)) < len(names):  # none, or two layers' (two kernels)
            raise ValueError(f"cannot tell the variables of managed layer {path!r} apart: "
                             f"{[variables[i].path for i in indices]}")
    return groups


class AdamDirections:
    """Adam's direction r = ∇ / (√v̂ + ε) per variable (docs/design.md §11): v ← β2 v +
    (1-β2) ∇² from v = 0, v̂ = v / (1 - β2^t), t the 1-based count of updates; float64."""

    def __init__(self, beta_2, epsilon):
        self.beta_2, self.epsilon = beta_2, epsilon
        self.moments, self.steps = None, 0

    def update(self, gradients, directions=True):
        """Folds this step's `gradients` into v; returns r of each (None if not
        `directions`)."""
        gradients = [np.asarray(g, np.float64) for g in gradients]
        if self.moments is None:
            self.moments = [np.zeros_like(g) for g in gradients]
        self.steps += 1
        for moment, gradient in zip(self.moments, gradients):
            moment *= self.beta_2
            moment += (1.0 - self.beta_2) * np.square(gradient)
        if not directions:
            return None
        correction = 1.0 - self.beta_2 ** self.steps
        return [g / (np.sqrt(v / correction) + self.epsilon)
                for g, v in zip(gradients, self.moments)]


def group_norm(arrays, indices):
    """‖·‖_F of the arrays at `indices` taken together."""
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(arrays[i], np.float64))))
                         for i in indices))


def step_lengths(preconditioned, directions, groups):
    """Per group: (‖P_ℓ‖, ‖r_ℓ‖, ρ_ℓ = ‖P_ℓ‖ / ‖r_ℓ‖; None when ‖r_ℓ‖ = 0)."""
    lengths = []
    for _, _, indices in groups:
        p_norm, r_norm = group_norm(preconditioned, indices), group_norm(directions, indices)
        lengths.append((p_norm, r_norm, p_norm / r_norm if r_norm > 0 else None))
    return lengths


def kl_clip_scale(preconditioned, gradients, groups, learning_rate, kl_clip):
    """ν = min(1, sqrt(κ / (η² Σ_ℓ |<P_ℓ, ∇_ℓ>|))) over the managed layers (docs/design.md
    §5; each layer's inner product over all its variables before the absolute value);
    1 when η ≤ 0, and the sum floored at 1e-30, as tfkfac computes it."""
    total = sum(abs(sum(float(np.sum(np.asarray(preconditioned[i], np.float64)
                                     * np.asarray(gradients[i], np.float64)))
                        for i in indices)) for _, _, indices in groups)
    if learning_rate <= 0:
        return 1.0
    return min(1.0, math.sqrt(kl_clip / max(total, 1e-30)) / learning_rate)


def training_step(model, optimizer, loss_fn):
    """A tf.function `step(x, y)`: one K-FAC training step in docs/guide.md §2's custom loop;
    returns (loss, the gradients the optimizer received, as dense tensors, the learning
    rate the step used). The gradients come from a plain tape on the same forward pass
    (in one process they are the optimizer's, which no rank averaging changes); the
    learning rate is read before the step advances the schedule."""
    variables = model.trainable_variables

    @tf.function
    def step(x, y):
        learning_rate = tf.cast(optimizer.learning_rate, tf.float32)
        with tf.GradientTape() as plain, optimizer.record() as tape:
            loss = loss_fn(y, model(x, training=True))
        gradients = [tf.convert_to_tensor(g) for g in plain.gradient(loss, variables)]
        optimizer.minimize(loss, tape=tape)
        return loss, gradients, learning_rate

    return step


def record(optimizer, variables, groups, gradients, directions, learning_rate, kl_clip):
    """One step's measurement, right after the step: P from the decompositions the step
    used (`precondition` with the step's gradients), ‖P_ℓ‖, ‖r_ℓ‖, ρ_ℓ and ν."""
    preconditioned = [p.numpy() for p in optimizer.precondition(gradients, variables)]
    nu = kl_clip_scale(preconditioned, gradients, groups, learning_rate, kl_clip)
    lengths = step_lengths(preconditioned, directions, groups)
    return {"nu": nu, "binds": nu < 1.0,
            "layers": {path: {"p_norm": p, "r_norm": r, "ratio": ratio}
                       for (path, _, _), (p, r, ratio) in zip(groups, lengths)}}


# ------------------------------------------------------------------ the run
def train_config(model_dir):
    """The kfac_inverse entry's trainer settings at the flags' point, over the tuning
    budget or `--steps` (warm-up 5% of the run either way)."""
    setting = dict(learning_rate=FLAGS.learning_rate, damping=FLAGS.damping,
                   kl_clip=FLAGS.kl_clip)
    epochs = time_to_accuracy.BUDGETS[MODEL]["tune_epochs"]
    config = config_lib.TrainConfig(
        **time_to_accuracy.run_settings(MODEL, ENTRY, setting, epochs),
        batch_size=FLAGS.batch_size, seed=FLAGS.seed, model_dir=model_dir, verbose=0)
    if FLAGS.steps:
        _, train_examples, _ = data_lib.split_sizes(config)
        steps_per_epoch = data_lib.steps_per_epoch(config, train_examples, 1)
        config = dataclasses.replace(
            config, steps=FLAGS.steps,
            warmup_epochs=trials.WARMUP_FRACTION * FLAGS.steps / steps_per_epoch)
    return config


def role(path):
    """A ViT layer's place in any of its blocks: "block2_attention/key" -> "attention/key"."""
    return re.sub(r"^block\d+_", "", path)


def percentiles(values):
    return dict(zip(("p10", "median", "p90"),
                    (float(v) for v in np.percentile(values, PERCENTILES))))


def summarize(records, groups):
    """ρ's percentiles over the run per layer and per kind (pooled), the spread between
    layers, the clip's binding share and ν's median."""
    ratios = {path: [r["layers"][path]["ratio"] for r in records
                     if r["layers"][path]["ratio"] is not None] for path, _, _ in groups}
    kinds, roles = collections.defaultdict(list), collections.defaultdict(list)
    for path, kind, _ in groups:
        kinds[kind] += ratios[path]
        roles[role(path)] += ratios[path]
    spreads = []
    for r in records:
        values = [layer["ratio"] for layer in r["layers"].values() if layer["ratio"]]
        low, high = np.percentile(values, (10, 90))
        spreads.append(float(high / low))
    nus = [r["nu"] for r in records]
    return {"per_layer": {path: dict(kind=kind, **percentiles(ratios[path]))
                          for path, kind, _ in groups},
            "per_kind": {kind: dict(layers=sum(k == kind for _, k, _ in groups),
                                    **percentiles(values)) for kind, values in kinds.items()},
            "per_role": {name: percentiles(values) for name, values in roles.items()},
            "between_layers_p90_over_p10": percentiles(spreads),
            "clip_binds_share": sum(r["binds"] for r in records) / len(records),
            "median_nu": statistics.median(nus), "nu": percentiles(nus)}


def print_summary(summary, records):
    print(f"\nρ = ‖P_ℓ‖ / ‖r_ℓ‖ over {len(records)} recorded steps "
          "(p10 / median / p90 over the run)")
    print(f"{'layer':40s} {'kind':13s} {'p10':>9s} {'median':>9s} {'p90':>9s}")
    for path, row in summary["per_layer"].items():
        print(f"{path:40s} {row['kind']:13s} {row['p10']:9.3g} {row['median']:9.3g} "
              f"{row['p90']:9.3g}")
    print("per layer kind (pooled over its layers and the run):")
    for kind, row in summary["per_kind"].items():
        print(f"{kind + ' x' + str(row['layers']):54s} {row['p10']:9.3g} "
              f"{row['median']:9.3g} {row['p90']:9.3g}")
    print("per role (the same layer in every block, pooled):")
    for name, row in summary["per_role"].items():
        print(f"{name:54s} {row['p10']:9.3g} {row['median']:9.3g} {row['p90']:9.3g}")
    spread = summary["between_layers_p90_over_p10"]
    print(f"between layers at one step, p90/p10 of ρ: median {spread['median']:.3g} "
          f"(p10 {spread['p10']:.3g}, p90 {spread['p90']:.3g} over the steps)")
    print(f"KL clip binds at {100 * summary['clip_binds_share']:.0f}% of the recorded steps; "
          f"median ν {summary['median_nu']:.3g} (p10 {summary['nu']['p10']:.3g}, "
          f"p90 {summary['nu']['p90']:.3g})", flush=True)


def plot(report):
    records = report["records"]
    steps = [r["step"] for r in records]
    kinds = list(report["summary"]["per_kind"])
    figure, (ratio_axis, nu_axis) = harness.subplots(1, 2, figsize=(13, 4.8))
    for layer in report["layers"]:
        color = f"C{kinds.index(layer['kind'])}"
        ratio_axis.plot(steps, [r["layers"][layer["path"]]["ratio"] for r in records],
                        color=color, alpha=0.6, linewidth=1)
    for index, kind in enumerate(kinds):
        ratio_axis.plot([], [], color=f"C{index}", label=kind)
    ratio_axis.set_yscale("log")
    ratio_axis.set_xlabel("step")
    ratio_axis.set_ylabel("‖P_ℓ‖ / ‖r_ℓ‖ (K-FAC / Adam direction)")
    ratio_axis.set_title(f"Per managed layer, ViT, {ENTRY}")
    ratio_axis.legend(fontsize=8)
    nu_axis.plot(steps, [r["nu"] for r in records], color="C0", label="KL clip ν")
    nu_axis.set_yscale("log")
    nu_axis.set_xlabel("step")
    nu_axis.set_ylabel("ν (1: the clip does not bind)")
    lr_axis = nu_axis.twinx()
    lr_axis.plot(steps, [r["learning_rate"] for r in records], color="C1", linestyle="--",
                 label="learning rate")
    lr_axis.set_ylabel("learning rate η")
    settings = report["settings"]
    nu_axis.set_title(f"KL clip κ={settings['kl_clip']:g}, λ={settings['damping']:g}, "
                      f"peak η={settings['learning_rate']:g}")
    nu_axis.legend(loc="lower left", fontsize=8)
    lr_axis.legend(loc="lower right", fontsize=8)
    return figure


def main():
    harness.refuse_unread("time_to_accuracy", ("batch_size",))
    if FLAGS.every < 1:
        raise ValueError(f"every must be >= 1; got {FLAGS.every}")
    started = time.time()
    with tempfile.TemporaryDirectory() as model_dir:
        trainer = runner.Trainer(train_config(model_dir))
        config, model, optimizer = trainer.config, trainer.model, trainer.optimizer
        variables = model.trainable_variables
        groups = managed_groups(optimizer, variables)
        unmanaged = sorted(set(range(len(variables)))
                           - {i for _, _, indices in groups for i in indices})
        kfac_config = optimizer.get_config()
        adam = AdamDirections(kfac_config["adam_beta_2"], kfac_config["adam_epsilon"])
        step = training_step(model, optimizer, model.loss)
        total = trainer.total_steps
        print(f"{total} steps of {MODEL} with {ENTRY} (learning rate {config.learning_rate}, "
              f"damping {config.damping}, KL clip {config.kl_clip}, weight decay "
              f"{config.weight_decay:.3g}); {len(groups)} managed layers, "
              f"{len(unmanaged)} variables unmanaged", flush=True)
        records = []
        batches = iter(trainer.data.train(epoch=0))
        for index in range(total):
            x, y = next(batches)[:2]
            loss, gradients, learning_rate = step(x, y)
            recorded = index % FLAGS.every == 0 or index == total - 1
            directions = adam.update(gradients, directions=recorded)
            if not recorded:
                continue
            entry = record(optimizer, variables, groups, gradients, directions,
                           float(learning_rate), config.kl_clip)
            records.append({"step": index, "learning_rate": float(learning_rate),
                            "loss": float(loss), **entry})
            ratios = [layer["ratio"] for layer in entry["layers"].values() if layer["ratio"]]
            print(f"step {index}: loss {float(loss):.4f} lr {float(learning_rate):.4g} "
                  f"ν {entry['nu']:.3g} ρ median {statistics.median(ratios):.3g} "
                  f"[{min(ratios):.3g}, {max(ratios):.3g}] ({time.time() - started:.0f} s)",
                  flush=True)
        accuracy = model.evaluate(trainer.data.evaluation(), verbose=0,
                                  return_dict=True)["accuracy"]
    summary = summarize(records, groups)
    print_summary(summary, records)
    print(f"{config.eval_split} accuracy after {total} steps: {accuracy:.4f}; "
          f"{time.time() - started:.0f} s", flush=True)
    report = {
        "what": "per managed layer ρ = ‖P_ℓ‖/‖r_ℓ‖ (K-FAC's preconditioned gradient before "
                "the KL clip / Adam's ∇/(√v̂+ε)), and the KL clip's ν, every `every` steps",
        "model": MODEL, "entry": ENTRY,
        "settings": {"learning_rate": config.learning_rate, "damping": config.damping,
                     "kl_clip": config.kl_clip},
        "trainer_config": config.to_dict(), "steps": total, "every": FLAGS.every,
        "adam": {"beta_2": adam.beta_2, "epsilon": adam.epsilon},
        "layers": [{"path": path, "kind": kind, "variables": [variables[i].path for i in idx]}
                   for path, kind, idx in groups],
        "unmanaged_variables": [variables[i].path for i in unmanaged],
        "summary": summary, "final_eval_accuracy": float(accuracy),
        "eval_split": config.eval_split, "seconds": time.time() - started,
        "records": records,
    }
    harness.write(report, "step_length", plot)


if __name__ == "__main__":
    harness.run(main)
