"""Trainer runs as benchmark trials: run once, read back by name, resumed when cut short;
the time, steps and fresh examples each run took to a target accuracy; and the entries
and tuning grids the time-to-accuracy benchmarks share.

A trial is one run of the trainer (`trainers.runner.run`, what `python -m trainers.train`
runs) in `work_dir/name`, so a benchmark's numbers are what a user gets from the
settings recorded beside them.
"""

import json
import math
import os
import statistics

from trainers import checkpoints, config as config_lib, runner

# Tuning trains on TUNE_SPLIT and scores accuracy on the held-out VALIDATION_SPLIT.
TUNE_SPLIT, VALIDATION_SPLIT = "train[:54000]", "train[54000:]"
# Benchmark entry -> the trainer settings that make it.
OPTIMIZERS = {
    "kfac": dict(optimizer="kfac", kfac_method="eigen"),
    "kfac_inverse": dict(optimizer="kfac", kfac_method="inverse"),
    "sgd": dict(optimizer="sgd"),
    "adam": dict(optimizer="adam"),
    "kfac_reduce": dict(optimizer="kfac", kfac_method="eigen", weight_sharing="reduce"),
    "adamw": dict(optimizer="adamw"),
    # Factor statistics from a quarter of each batch (docs/design.md §8).
    "kfac_inverse_f0.25": dict(optimizer="kfac", kfac_method="inverse",
                               factor_batch_fraction=0.25),
    # Gram and preconditioning products with bfloat16 operands (docs/design.md §9).
    "kfac_inverse_bf16": dict(optimizer="kfac", kfac_method="inverse",
                              product_dtype="bfloat16"),
    # Each example's positions reduced to one row of the factors (docs/design.md §2).
    "kfac_inverse_reduce": dict(optimizer="kfac", kfac_method="inverse",
                                weight_sharing="reduce"),
}
# Tuning grids: the same number of trials for every optimizer. Where the best setting
# sat at a grid's edge, the grid moved one step past it: the CNN's K-FAC grid started
# at 1e-3..3e-2, then 3e-3..0.1 (best 0.1, the edge again), now 1e-2..0.3 (best 0.1);
# ResNet-20's K-FAC grid was 3e-3..0.1 (best 3e-3, the lower edge), now 1e-3..3e-2;
# its SGD grid was 0.01..0.3 and its Adam grid 3e-4..1e-2 (best at the lower edges).
def learning_rate_grid(*learning_rates):
    return [dict(learning_rate=lr) for lr in learning_rates]


def kfac_grids(*dampings, entries=("kfac", "kfac_inverse", "kfac_inverse_f0.25",
                                    "kfac_inverse_bf16", "kfac_inverse_reduce")):
    """The K-FAC entries tune damping over the same values."""
    grid = [dict(damping=d) for d in dampings]
    return {entry: grid for entry in entries}


GRIDS = {
    "cnn": dict(sgd=learning_rate_grid(0.01, 0.03, 0.1, 0.3),
                adam=learning_rate_grid(3e-4, 1e-3, 3e-3, 1e-2),
                **kfac_grids(1e-2, 3e-2, 1e-1, 3e-1)),
    "resnet20": dict(sgd=learning_rate_grid(1e-3, 3e-3, 0.01, 0.03),
                     adam=learning_rate_grid(1e-4, 3e-4, 1e-3, 3e-3),
                     **kfac_grids(1e-3, 3e-3, 1e-2, 3e-2)),
    # ViT: AdamW at its default decoupled weight decay (0.004). Adam-family rates around
    # 1e-3 are the usual ViT choice; K-FAC's damping brackets the CNN's (0.1) and
    # ResNet-20's (3e-3) picks. SGD's grid started at 0.01..0.3 (best 0.01, the edge),
    # then 3e-3..0.1 (best 3e-3, the edge again); the K-FAC grid started at 3e-3..0.1
    # (kfac's best 0.1, the edge; kfac_reduce's 3e-2).
    "vit": dict(sgd=learning_rate_grid(1e-3, 3e-3, 0.01, 0.03),
                adam=learning_rate_grid(3e-4, 1e-3, 3e-3, 1e-2),
                adamw=learning_rate_grid(3e-4, 1e-3, 3e-3, 1e-2),
                **kfac_grids(1e-2, 3e-2, 1e-1, 3e-1,
                             entries=("kfac", "kfac_reduce", "kfac_inverse"))),
}

# The fields of a curve point, in order; the first three are always present.
POINT_FIELDS = ("time_s", "steps", "accuracy", "fresh_examples")


def slug(setting):
    """A directory-name form of a setting, e.g. "damping=0.03"."""
    return ",".join(f"{key}={value}" for key, value in sorted(setting.items()))


def run(work_dir, name, **settings):
    """Runs (or reads back) one trainer run in `work_dir/name`; returns its summary.

    `name` must say everything that differs between trials (settings included), since
    a finished trial is read back by name. An interrupted one (or one whose epoch budget
    has grown) resumes from its checkpoint.
    """
    model_dir = os.path.join(work_dir, name)
    summary_path = os.path.join(model_dir, runner.SUMMARY_FILE)
    if os.path.exists(summary_path):
        with open(summary_path, encoding="utf-8") as f:
            summary = json.load(f)
        if finished(summary, settings["epochs"]):
            return summary
    config = config_lib.TrainConfig(
        model_dir=model_dir, verbose=2,
        resume=checkpoints.read_state(model_dir) is not None, **settings)
    print(f"--- {name}: {json.dumps(settings, sort_keys=True)}", flush=True)
    return runner.run(config)


def finished(summary, epochs):
    """Whether a run is done: it stopped at its target or ran `epochs` or more. A run that
    ran out of a smaller epoch budget (the budget grew since) resumes from its last
    checkpoint, which ends as an uninterrupted run of the new length would."""
    config = summary["config"]
    stopped_at_target = config["stop_at_target"] and summary["to_target"] is not None
    return stopped_at_target or config["epochs"] >= epochs


def curve(summary, fresh_examples=False):
    """A run's evaluations as points (time_s, steps, accuracy[, fresh_examples])."""
    keys = ("train_time_s", "steps", "val_accuracy") + (
        ("fresh_examples",) if fresh_examples else ())
    return [tuple(point[key] for key in keys) for point in summary["evaluations"]]


def to_target(runs, target):
    """First evaluation at or above `target` per seed, and the medians over the seeds.

    `runs` hold curves of `curve` points. A run stops at the highest target, so it has
    crossed every lower one before. A seed that never reaches `target` counts as
    infinite; a median that is infinite (fewer than half the seeds reached it) is None,
    and `median_above` holds what it exceeds: more than half the seeds are beyond their
    whole run, so the median is beyond the shortest of those runs.
    """
    def fields(point):
        return {key: value for key, value in zip(POINT_FIELDS, point) if key != "accuracy"}

    firsts = [next((fields(point) for point in run["curve"] if point[2] >= target), None)
              for run in runs]
    keys = list(fields(runs[0]["curve"][0])) if runs[0]["curve"] else ["time_s", "steps"]
    result = {"per_seed": firsts, "reached": sum(f is not None for f in firsts)}
    for key in keys:
        median = statistics.median(math.inf if f is None else f[key] for f in firsts)
        result[f"median_{key}"] = None if math.isinf(median) else median
    if result["median_time_s"] is None:
        ends = [fields(run["curve"][-1]) for run, first in zip(runs, firsts) if first is None]
        result["median_above"] = {key: min(end[key] for end in ends) for key in keys}
    return result
