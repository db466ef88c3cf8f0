"""Trainer runs as benchmark trials: run once, read back by name, resumed when cut short;
the time, steps and fresh examples each run took to a target accuracy; and the entries,
tuning grids and protocol (schedule, weight decay) of bench/time_to_accuracy.py.

A trial is one run of the trainer (`trainers.runner.run`, what `python -m trainers.train`
runs) in `work_dir/name`, so a benchmark's numbers are what a user gets from the
settings recorded beside them.
"""

import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import statistics
import time

from trainers import checkpoints, config as config_lib, errors, runner

# Tuning trains on TUNE_SPLIT and scores accuracy on the held-out VALIDATION_SPLIT.
TUNE_SPLIT, VALIDATION_SPLIT = "train[:54000]", "train[54000:]"
# K-FAC's curvature schedule and inner rule (momentum SGD, the earlier default), pinned so
# that changing the trainer's defaults does not change what an entry measures.
_KFAC = dict(optimizer="kfac", factor_update_freq=10, decomposition_update_freq=100,
             kfac_inner_optimizer="sgd")
_KFAC_SCHEDULE_FREE = dict(_KFAC, kfac_method="inverse",
                           kfac_inner_optimizer="schedule_free_adamw", kl_clip=None)
# Benchmark entry -> the trainer settings that make it. Every entry but those in
# CONSTANT_LEARNING_RATE trains on the protocol's schedule with its weight decay
# (`protocol`).
OPTIMIZERS = {
    # The declared default (docs/benchmarks.md, "Protocol"): what `tfkfac.KFAC()` and the
    # trainer give with no arguments, spelled out so that the entry measures it whatever
    # the defaults become; it tunes its learning rate alone.
    "kfac": dict(_KFAC_SCHEDULE_FREE, damping=0.03),
    "adamw": dict(optimizer="adamw"),
    # Nesterov momentum, tuned in learning rate x momentum (Shallue et al.'s space).
    "sgd": dict(optimizer="sgd", nesterov=True),
    "kfac_inverse": dict(_KFAC, kfac_method="inverse"),
    "kfac_eigen": dict(_KFAC, kfac_method="eigen"),
    # The earlier protocol, for reference: constant learning rate 0.05, KL clip 1e-3
    # (chosen on the CNN), no weight decay, damping tuned.
    "kfac_constant": dict(_KFAC, kfac_method="inverse", learning_rate=0.05, kl_clip=1e-3),
    # K-FAC in front of AdamW (the protocol's weight decay goes to the inner AdamW),
    # grafted to Adam's step length, and Adam in the Kronecker eigenbasis (docs/design.md
    # §11). Their step length is Adam's, so the KL clip is off.
    "kfac_adamw": dict(_KFAC, kfac_method="inverse", kfac_inner_optimizer="adamw",
                       kl_clip=None),
    "kfac_graft_adam": dict(_KFAC, kfac_method="inverse", grafting="adam", kl_clip=None),
    "kfac_eigen_adam": dict(_KFAC, kfac_method="eigen_adam", kl_clip=None),
    # K-FAC's directions into ScheduleFreeAdamW, the first-order entry that won the CNN:
    # its warm-up and weight decay go to the inner optimizer, no schedule, no KL clip.
    "kfac_schedule_free_adamw": _KFAC_SCHEDULE_FREE,
    # The same with adaptive stale statistics (docs/design.md §12): a layer's
    # factor interval doubles from 10 up to 80 steps while a refresh changes its running
    # factors by less than α = 0.05 = 1 - factor_decay (the batch's statistics closer to
    # the average than the average's own norm); on the CNN's first epoch the layers'
    # refreshes change them by 0.03-0.05.
    "kfac_schedule_free_adamw_adaptive": dict(_KFAC_SCHEDULE_FREE, stale_threshold=0.05,
                                              max_factor_interval=80),
    # Keras's strongest first-order optimizers, as the trainer builds them: Muon (its
    # output layer and biases on its AdamW step), ScheduleFreeAdamW (its own warm-up, no
    # schedule, evaluated at its averaged weights) and Lamb (the large-batch baseline).
    "muon": dict(optimizer="muon"),
    "schedule_free_adamw": dict(optimizer="schedule_free_adamw"),
    "lamb": dict(optimizer="lamb"),
}
# The options that lower K-FAC's floor (docs/design.md §8, §9), each an entry
# over a K-FAC entry: statistics from a quarter of each batch, bfloat16 preconditioning
# products, the reduce rule for convolutions. Each approximates its base entry's method,
# and the question is how many steps the approximation costs: it runs at the base's
# tuned point (`TUNED_AS`) instead of tuning again.
FLOOR_OPTIONS = {"f0.25": dict(factor_batch_fraction=0.25),
                 "bf16": dict(product_dtype="bfloat16"),
                 "reduce": dict(weight_sharing="reduce")}
_OPTION_BASES = ("kfac_eigen_adam", "kfac_schedule_free_adamw")
OPTIMIZERS.update({f"{base}_{suffix}": dict(OPTIMIZERS[base], **option)
                   for base in _OPTION_BASES for suffix, option in FLOOR_OPTIONS.items()})
TUNED_AS = {f"{base}_{suffix}": base for base in _OPTION_BASES for suffix in FLOOR_OPTIONS}
CONSTANT_LEARNING_RATE = ("kfac_constant",)
# The schedule of every other entry: linear warm-up over this share of the run's budget
# (AlgoPerf's baselines warm up over 5% of theirs), then half a cosine to 0 at the
# budget's end; tuning trials and timed runs alike, each over its own budget. Entries
# whose update rule runs without a schedule (config.SCHEDULE_FREE_OPTIMIZERS) take the
# same warm-up as their own and a constant learning rate after it, as their authors run
# them.
WARMUP_FRACTION = 0.05
# Every entry tunes on the same number of trials.
TUNING_TRIALS = 8


SERIES_MANTISSAS = (1, 2, 5)


def series_value(index):
    """The `index`-th value of the 1-2-5 series, counted from 1 (index 0): 2 is 1, 5 is
    2, 10 is 3, 0.5 is -1, ..."""
    exponent, position = divmod(index, len(SERIES_MANTISSAS))
    return float(f"{SERIES_MANTISSAS[position]}e{exponent}")


def series_index(value):
    """The index (`series_value`) of the 1-2-5 value nearest to `value` on a log scale,
    e.g. 0.4 -> that of 0.5 (ties go to the smaller)."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"a 1-2-5 series value must be a finite number > 0; got {value}")
    below = len(SERIES_MANTISSAS) * math.floor(math.log10(value))
    return min(range(below, below + len(SERIES_MANTISSAS) + 1),
               key=lambda index: abs(math.log(series_value(index) / value)))


def series(first, count=TUNING_TRIALS):
    """`count` values of the 1-2-5 series from `first`, e.g. 1e-4, 2e-4, 5e-4, 1e-3..."""
    start = series_index(first)
    if series_value(start) != first:
        raise ValueError(f"a series starts at a 1-2-5 value; got {first}")
    return tuple(series_value(start + i) for i in range(count))


def points(**axes):
    """Every combination of the axes' values, as settings: points(a=(1, 2), b=(3,)) ->
    [{"a": 1, "b": 3}, {"a": 2, "b": 3}]."""
    names = sorted(axes)
    return [dict(zip(names, values)) for values in itertools.product(
        *(axes[name] for name in names))]


def grids(model, sgd_effective_from, dampings, grafted_from=5e-5, adam_like_from=5e-4,
          eigen_adam_from=1e-5, schedule_free_like_from=2e-3):
    """The tuning points of every entry `model` runs: 8 each. First-order entries and
    Adam-length K-FAC (eigen_adam, whose damping does not enter) tune the learning rate
    over the 1-2-5 series (AdamW from 1e-4); SGD with Nesterov momentum tunes learning
    rate x momentum (`sgd_points`, from the effective rate `sgd_effective_from`); the
    declared default K-FAC tunes its learning rate on ScheduleFreeAdamW's series (its
    inner rule's), 5e-4 to 0.1, as the other entries with an Adam-type step length (its
    damping is the declared one); K-FAC with the KL
    clip tunes learning rate x damping x KL clip jointly (2 x 2 x 2; once the clip binds,
    the step length is the clip's and the learning rate sets when the decayed schedule
    takes over); K-FAC under an inner AdamW or grafted to Adam tunes 4 Adam-like
    learning rates x 2 dampings; the constant-rate reference tunes damping alone, as it
    did before. `dampings`: the two K-FAC dampings around the model's earlier picks.
    Grafted and eigen_adam K-FAC hand Adam-scaled steps to the default inner SGD with
    momentum 0.9, whose steady step is 10x its learning rate: their rates are AdamW's
    divided by 10 (from `grafted_from` and `eigen_adam_from`; the inner AdamW's from
    `adam_like_from`). K-FAC under an inner ScheduleFreeAdamW, with or without adaptive
    stale statistics, tunes 4 of its rates x 2 dampings, from `schedule_free_like_from`
    (by default 2e-3 to 2e-2, around ScheduleFreeAdamW's own picks; moved per model in
    GRIDS).

    Keras's Muon tunes on AdamW's grid: its `rms_rate` scales the orthogonalized step to
    AdamW's update size, so AdamW's learning rates apply. ScheduleFreeAdamW's authors
    find its best learning rate 1-10x that of AdamW with a schedule: AdamW's series moved
    up two steps, 5e-4 to 0.1, holds 1-10x AdamW's best on every model (2e-3 on the ViT,
    1e-2 on the CNN and ResNet-20). Lamb's step is the learning rate times each layer's
    weight norm (its trust ratio), a relative step of the size AdamW's best rates make,
    and it is tuned at Adam-like rates that grow with the batch (ResNet strikes back:
    5e-3 at batch 2048); on the MLP (one epoch) 5e-3 beat 2e-2 and 5e-2 diverged, so its
    series is AdamW's moved up one step, 2e-4 to 5e-2. On a model with no weight Muon
    orthogonalizes (config.MODELS_WITHOUT_MUON_WEIGHTS) Muon is its AdamW step on every
    weight: what a Keras user gets, raced as such."""
    adam_like = points(learning_rate=series(adam_like_from, 4), damping=dampings)
    grafted = points(learning_rate=series(grafted_from, 4), damping=dampings)
    clipped = points(learning_rate=(0.05, 0.2), damping=dampings, kl_clip=(1e-3, 1e-2))
    schedule_free_kfac = points(learning_rate=series(schedule_free_like_from, 4),
                                damping=dampings)
    entries = {
        "kfac": points(learning_rate=series(5e-4)),
        "adamw": points(learning_rate=series(1e-4)),
        "sgd": sgd_points(sgd_effective_from),
        "kfac_inverse": clipped, "kfac_eigen": clipped,
        "kfac_constant": points(damping=series(2e-3)),
        "kfac_adamw": adam_like, "kfac_graft_adam": grafted,
        "kfac_eigen_adam": points(learning_rate=series(eigen_adam_from)),
        "kfac_schedule_free_adamw": schedule_free_kfac,
        "kfac_schedule_free_adamw_adaptive": schedule_free_kfac,
        "muon": points(learning_rate=series(1e-4)),
        "schedule_free_adamw": points(learning_rate=series(5e-4)),
        "lamb": points(learning_rate=series(2e-4)),
    }
    entries.update({entry: entries[base] for entry, base in TUNED_AS.items()})
    return entries


# SGD's momenta: Shallue et al. (JMLR 2019) find the best 1 - momentum anywhere from 1e-3
# to 0.3 and trading off against the learning rate through the effective rate
# η / (1 - μ); two momenta x four effective rates keep SGD at the common trial count.
SGD_MOMENTA = (0.9, 0.97)


def sgd_points(effective_from):
    """SGD's 8 tuning points: momentum in SGD_MOMENTA x 4 effective learning rates
    η / (1 - μ) of the 1-2-5 series from `effective_from` (so the two momenta try the
    same step sizes)."""
    return [dict(learning_rate=float(f"{rate * (1 - momentum):.6g}"), momentum=momentum)
            for momentum in SGD_MOMENTA for rate in series(effective_from, 4)]


# Dampings from the constant-rate tuning (docs/benchmarks.md): the CNN picked 0.1 (both
# methods), ResNet-20 1e-2 (inverse) and 3e-3 (eigen), the ViT 3e-2 (inverse) and 0.1
# (eigen). SGD (momentum 0.9, no Nesterov) picked 0.1 on the CNN and the ViT and 0.05 on
# ResNet-20 on the 8-rate learning-rate grids of the warm-up + cosine protocol: effective
# rates 1 and 0.5, so its effective rates span 0.5 to 5 (CNN, ViT) and 0.2 to 2
# (ResNet-20). Grafted K-FAC's and K-FAC over AdamW's bests on the ViT
# were at their top learning rates (5e-4 and 5e-3, damping 3e-2), so their series moved
# one step too: 1e-4 to 1e-3, and 1e-3 to 1e-2. On ResNet-20 eigen_adam's best was its
# top rate (2e-3: 0.9108 against 1e-3's 0.9107), so its series moved one step up.
# On the CNN K-FAC over ScheduleFreeAdamW was best at its top rate (2e-2, damping 0.1:
# 0.9207 against 1e-2's 0.9202), so its series moved one step up: 5e-3 to 5e-2. It picked
# 2x ScheduleFreeAdamW's own best (1e-2); ResNet-20's ScheduleFreeAdamW picked 2e-2, so
# its K-FAC series starts there the same step up, 5e-3 to 5e-2 (before any trial); its
# best there was the top rate (5e-2, damping 3e-3: 0.9215 against 2e-2's 0.9210), so it
# moved one step more: 1e-2 to 1e-1.
GRIDS = {
    "cnn": grids("cnn", sgd_effective_from=0.5, dampings=(3e-2, 0.1),
                 schedule_free_like_from=5e-3),
    "resnet20": grids("resnet20", sgd_effective_from=0.2, dampings=(3e-3, 1e-2),
                      eigen_adam_from=2e-5, schedule_free_like_from=1e-2),
    "vit": grids("vit", sgd_effective_from=0.5, dampings=(3e-2, 0.1), grafted_from=1e-4,
                 adam_like_from=1e-3),
}
assert all(len(grid) == TUNING_TRIALS for model in GRIDS.values() for grid in model.values())


def protocol(entry, setting, epochs, weight_decay):
    """The trainer settings of a run of `entry` at its tuning point `setting` over a
    budget of `epochs`: the entry's, the point's, and the protocol's schedule and weight
    decay.

    `weight_decay` is decoupled weight decay per step at the peak learning rate, as
    Loshchilov & Hutter define it: w <- w - s(t) λ w, s(t) the schedule's multiplier
    (warm-up, cosine; 1 throughout for a schedule-free entry, which decays its weights
    at its constant learning rate). Keras's `weight_decay` is multiplied by the learning
    rate, so it is set to λ / learning_rate: every optimizer then shrinks the weights by
    the same amount per step whatever learning rate it tunes to.
    """
    settings = dict(OPTIMIZERS[entry], **setting, epochs=epochs)
    if entry in CONSTANT_LEARNING_RATE:
        return settings
    rule = config_lib.update_rule(settings["optimizer"], settings.get(
        "kfac_inner_optimizer", config_lib.TrainConfig.kfac_inner_optimizer))
    schedule_free = rule in config_lib.SCHEDULE_FREE_OPTIMIZERS
    return dict(settings, lr_schedule="constant" if schedule_free else "cosine",
                warmup_epochs=WARMUP_FRACTION * epochs,
                weight_decay=weight_decay / settings["learning_rate"])


def check_entry(entry, settings):
    """Raises ValueError when this trainer cannot run `entry` with the trainer settings
    `settings`, e.g. an entry of a library feature not merged yet."""
    fields = {field.name for field in dataclasses.fields(config_lib.TrainConfig)}
    missing = sorted(set(settings) - fields)
    if missing:
        raise ValueError(f"entry {entry} needs the trainer setting(s) {', '.join(missing)}, "
                         f"which this trainer does not have")
    try:
        config_lib.TrainConfig(**settings).validate()
    except ValueError as error:
        raise ValueError(f"entry {entry}: {error}") from error


# The fields of a curve point, in order; the first three are always present.
POINT_FIELDS = ("time_s", "steps", "accuracy", "fresh_examples")


def slug(setting):
    """A directory-name form of a setting, e.g. "damping=0.03"."""
    return ",".join(f"{key}={value}" for key, value in sorted(setting.items()))


def run(work_dir, name, timed=False, **settings):
    """Runs (or reads back) one trainer run in `work_dir/name`; returns its summary.

    `name` must say everything that differs between trials (settings included), since
    a finished trial is read back by name (a read-back trial whose settings differ from
    `settings` is an error). An interrupted one (or one whose epoch budget has grown and
    whose schedule does not depend on it) resumes from its checkpoint, unless `timed`:
    a timed run cut short starts again, since its clock would hold a second start-up.
    """
    summary = read(work_dir, name, **settings)
    if summary is not None:
        return summary
    model_dir = os.path.join(work_dir, name)
    if timed and os.path.isdir(model_dir):
        print(f"--- {name}: cut short before; starting it again", flush=True)
        shutil.rmtree(model_dir)
    config = config_lib.TrainConfig(
        model_dir=model_dir, verbose=2,
        resume=checkpoints.read_state(model_dir) is not None, **settings)
    print(f"--- {name}: {json.dumps(settings, sort_keys=True)}", flush=True)
    with machine_record(model_dir, config.resume) as machine:
        summary = runner.run(config)
    return dict(summary, machine=machine)


# Beside a run's summary: the machine's load averages before and after the run and this
# process's CPU time over it (of its last part when `resumed`), so that what else ran
# while a run was timed is on record.
MACHINE_FILE = "machine.json"


@contextlib.contextmanager
def machine_record(model_dir, resumed):
    """Yields a dict that holds, once the block is done, the MACHINE_FILE record of the
    run made inside it (also written to `model_dir`)."""
    machine = {"load_average_before": os.getloadavg(), "resumed": resumed}
    cpu_before = time.process_time()
    yield machine
    machine.update(load_average_after=os.getloadavg(),
                   cpu_time_s=time.process_time() - cpu_before)
    with open(os.path.join(model_dir, MACHINE_FILE), "w", encoding="utf-8") as f:
        json.dump(machine, f)


# Marks the directory of a run that diverged, so that a restarted benchmark skips it.
DIVERGED_FILE = "diverged.json"


def diverged(work_dir, name):
    """{"diverged": message} if the run `name` diverged (`run_or_diverged`), else None."""
    marker = os.path.join(work_dir, name, DIVERGED_FILE)
    if not os.path.exists(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        return {"diverged": json.load(f)["message"]}


def run_or_diverged(work_dir, name, **settings):
    """`run`, or {"diverged": message} for a run whose weights stopped being finite
    (marked with DIVERGED_FILE, so that it is not run again): a tuning point past the
    stable learning rates is a result, not an error."""
    marker = os.path.join(work_dir, name, DIVERGED_FILE)
    if os.path.exists(marker):
        return diverged(work_dir, name)
    try:
        return run(work_dir, name, **settings)
    except errors.RunError as error:
        if "training diverged" not in str(error):
            raise
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "w", encoding="utf-8") as f:
            json.dump({"message": str(error)}, f)
        print(f"--- {name}: diverged", flush=True)
        return {"diverged": str(error)}


def read(work_dir, name, **settings):
    """The summary of trial `name` in `work_dir` if it has finished (`finished`), else
    None; a trial there whose settings differ from `settings` is an error (see `run`)."""
    model_dir = os.path.join(work_dir, name)
    summary_path = os.path.join(model_dir, runner.SUMMARY_FILE)
    if not os.path.exists(summary_path):
        return None
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    differ = {key: (summary["config"].get(key), value) for key, value in settings.items()
              if key not in config_lib.RESUME_MAY_CHANGE_FIELDS
              and summary["config"].get(key) != value}
    if differ:  # e.g. the protocol changed since: a stale trial, not this one
        raise ValueError(f"{model_dir} holds a trial with other settings "
                         f"(theirs, these): {differ}; use another work_dir")
    if not finished(summary, settings["epochs"]):
        return None
    machine_path = os.path.join(model_dir, MACHINE_FILE)
    if os.path.exists(machine_path):
        with open(machine_path, encoding="utf-8") as f:
            summary["machine"] = json.load(f)
    return summary


def finished(summary, epochs):
    """Whether a run is done: it stopped at its target, gave up (`give_up_steps`) or ran
    `epochs` or more. A run that ran out of a smaller epoch budget (the budget grew
    since) resumes from its last checkpoint, which ends as an uninterrupted run of the
    new length would."""
    config = summary["config"]
    stopped_at_target = config["stop_at_target"] and summary["to_target"] is not None
    return stopped_at_target or summary.get("gave_up", False) or config["epochs"] >= epochs


def curve(summary, fresh_examples=False):
    """A run's evaluations as points (time_s, steps, accuracy[, fresh_examples])."""
    keys = ("train_time_s", "steps", "val_accuracy") + (
        ("fresh_examples",) if fresh_examples else ())
    return [tuple(point[key] for key in keys) for point in summary["evaluations"]]


def to_target(runs, target):
    """First evaluation at or above `target` per seed, and the medians over the seeds.

    `runs` hold curves of `curve` points. A seed that never reaches `target` counts as
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
