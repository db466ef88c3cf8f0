"""Steps to a target accuracy against the batch size, per optimizer, each tuned at every
batch size (Shallue et al., "Measuring the Effects of Data Parallelism on Neural Network
Training", JMLR 2019): whether the declared default K-FAC keeps cutting steps as the
batch grows where first-order optimizers stop, and the critical batch size of each,
under the race protocol of docs/benchmarks.md ("Protocol") and bench/race.py.

Protocol (docs/benchmarks.md, "Batch scaling"), the small CNN on
Fashion-MNIST, one process (a global batch is what data-parallel workers would share):
- Batch sizes 128, 2048 and 8192 (`--batch_sizes`; 512 and 16384 available), each with
  a budget in epochs of the full train split (BATCHES: 10 at 128; above it twice the
  earlier protocol's, 24 at 512, 32 at 2048, 64 at 8192, 96 at 16384) spent on
  bench/trials.py's schedule (linear warm-up over 5% of the budget, then half a cosine
  to 0 at its end; a schedule-free rule the warm-up, then constant) and its decoupled
  weight decay λ = 5e-5 per step.
- Entries (ENTRIES; their settings are bench/trials.py OPTIMIZERS'): `kfac`, the declared
  default (inverse method into ScheduleFreeAdamW, damping 0.03, no KL clip), its
  curvature refreshed per examples rather than per steps: factors every ~1280 examples
  and decompositions every ~12800 (batch 128's 10 and 100 steps), down to every step,
  and above batch 2048 its factor statistics from 2048 examples of each batch
  (`factor_batch_fraction`; BATCHES); `sgd` (Nesterov momentum); `schedule_free_adamw`;
  `muon` (Keras's: 2-D kernels orthogonalized, every other variable on its AdamW
  step); `adamw`; `lamb`.
- Tuning reads no test data. Every trial trains seed 0 on trials.TUNE_SPLIT
  (train[:54000]) for the batch's budget in steps (the steps, warm-up and schedule of a
  final run) and evaluates on trials.VALIDATION_SPLIT (train[54000:]) at the steps a
  final run does (below), stopping at the primary target 0.90. Its score: its steps to 0.90
  (fewest wins; one that never reaches it ranks below every one that did, by its best
  accuracy; a diverged one last). Every (entry, batch) runs trials.TUNING_TRIALS = 8
  trials: GRID_TRIALS = 4 around the entry's batch-128 pick x √(B/128) on the 1-2-5
  series (the scaled pick rounded to it on a log scale, two series steps below it and
  one above), then the other 4 one series step at a time beyond the grid's edge: the
  edge the best trial so far sits at, else the edge whose trial ranks better (the
  lower on a tie). SGD tunes learning rate x momentum (Shallue et al.'s space):
  momentum 0.9 and 0.97 (trials.SGD_MOMENTA) at each effective rate η / (1 - μ) of the
  series, 2 effective rates (the scaled pick and one below) and 2 more by the same rule,
  8 trials too. Trials run from the grid's centre outward, each giving up at its first
  evaluation past the fewest steps to 0.90 of the cell's trials so far unless it reached
  0.90 by then (the trainer's `give_up_steps`): it could no longer win, and the pick is
  the one full runs would give. Before any trial of the cell has reached 0.90, one below
  0.5 at a tenth of the budget gives up (EARLY_ACCURACY: it has collapsed).
- The race (bench/race.py) per batch size, once its entries are tuned: every entry at
  its tuned point on the full train split, its test accuracy evaluated at the steps the
  trainer's `eval_spacing` places (EVAL_SPACING, 2.5% of the steps done apart, at least
  5 steps, at most the batch's `eval_every_steps`: every step from 2048 up), so a run's
  steps to a target are late by at most the larger of 2.5% and 5 steps (1 step from
  2048 up): under 3% of K-FAC's steps to each target in the earlier protocol (275 or
  more at 128, 44 or more above); each crossing records its own. Each run stops at the
  top target 0.91 or at the end of its budget. Seeds are fresh (race.FIRST_SEED = 1, 2,
  ...): 5 for `kfac` and for the first-order entry with the best tuning score at that
  batch, 3 for the others, interleaved round by round (race.rounds: seed k of every
  entry, the order reversed every other round). A run's time to a target is its
  training clock there (evaluation excluded); `kfac` compiles with XLA at 8192 and
  above, every other run without (each family's faster mode in the earlier protocol's
  retimes).
- Budgets: an entry whose median over its seeds misses 0.90 within the budget runs its
  seeds again at EXTENSION = 2 times it (its tuned point, the schedule stretched),
  interleaved the same way: its curve at twice the budget, reported beside the budget's
  figures (`extended`), not mixed into them.
- Reported per batch size: every run's curve, and per seed its steps and time to each
  target with their quantization; medians over the seeds; `kfac`'s ratio of steps and
  of time to each target over each first-order entry, the median of the per-round
  ratios with race.ratio's bootstrap 90% interval over the rounds, the headline against
  the batch's best first-order entry by tuning (5 rounds); the load average before and
  after every run.
- The gradient noise scale B_simple (McCandlish et al.'s predictor of the critical batch
  size) per epoch, from one more run of each entry at batch 128 (NOISE_BATCH) at its
  tuned point: a tuning trial's data and seed, stopping at 0.91 on the validation split
  (plain, and for K-FAC also preconditioned).
- Times side by side: after a batch size's race, every entry's tuned point trains
  RETIME_REPEATS interleaved blocks in one process (`retime`, bench/timed_steps.py),
  compiled with XLA and without (COMPILATIONS); `retimed` is an entry's time to a
  target from its first steps' time (tracing included) plus the rest of its median
  steps at its median block step time, in the compilation that gets there first.

Critical batch size, defined before measuring: on our grid a step from B to rB "still
scales" when it cuts the median steps to the target by at least 1.5x per doubling, i.e.
by 1.5^log2(r) (2.25x for r = 4, 5.06x for r = 16). An entry's critical batch size at a
target is the largest measured B whose step to the next grid batch still scales; none
when even the first step does not (it lies below the smallest batch), and at least the
last B but one when the last step still scales (the grid cannot see further). A step to
a batch where the target was not reached within the budget is judged on the bound (the
cut is less than steps(B) / the budget's steps): it fails when the bound is below the
threshold, and is undetermined otherwise. Its interval: each batch's seeds resampled
with replacement (race.bootstrap_medians, race.BOOTSTRAP_SAMPLES times) and the
critical batch recomputed from the resampled medians; reported, the 5th and 95th
percentiles of the outcomes in their order (below the smallest batch, then each batch,
"at least B" just above B) and each outcome's share (undetermined ones counted apart).
Beside it, McCandlish et al.'s curve S(B) = S_min (1 + B_crit / B) fitted to the median
steps of the batches that reached the target (least squares in 1/B): its B_crit is what
the noise scale B_simple predicts.

Runs live in `--work_dir`: each run's summary.json is written when it finishes, a
restarted run skips finished runs (and diverged ones, marked trials.DIVERGED_FILE) and resumes
an interrupted one from its checkpoint. The work, batch size by batch size in
`--batch_sizes`' order: every entry's tuning (`--entries`' order), the noise runs at
128, the race, the misses at twice the budget, the retime. `--tune_only` runs the tuning
(and noise runs) of every batch size and stops: it can run on a busy machine, the race
needs an idle one. After each tuning cell and each round, and with `--collect` (no
training), it writes batch_scaling.json and .png to `--output_dir` from every run the
work dir holds. The earlier protocol's measurements (tuned on the test split, 2 seeds
including the tuning one) are in bench/results/variants/.

Run in the background from a snapshot of the tree (benchmarks never run from a tree that
others edit). Estimated on 2 idle cores from the earlier protocol's step times (batch
128: 24-34 ms; 2048: 0.29 s, K-FAC 0.60 s; 8192: 1.0 s, K-FAC 1.5 s) and a test
evaluation of 0.3-0.7 s: batch 128 about 2 h, 2048 about 7 h, 8192 about 10 h (each
tuning about half of it; 2-3 times that on a loaded machine); it can be stopped and
restarted at any time:
  PYTHONPATH=.:bench TF_CPP_MIN_LOG_LEVEL=2 nohup .venv/bin/python bench/batch_scaling.py \\
      --work_dir=/work/bs_race > /work/logs/batch_scaling.log 2>&1 &
  PYTHONPATH=.:bench .venv/bin/python bench/batch_scaling.py --work_dir=/work/bs_race --collect
"""

import json
import math
import os
import statistics
import tempfile

import numpy as np
from absl import flags

import harness
import race
import timed_steps
import trials
from race import DEFAULT_ENTRY, FIRST_ORDER, NAMES
from trainers import config as config_lib

FLAGS = flags.FLAGS
MODEL = "cnn"
TARGETS = (0.89, 0.90, 0.91)
PRIMARY_TARGET = 0.90
WEIGHT_DECAY = 5e-5  # bench/time_to_accuracy.py's λ per step for the CNN
SMALLEST_BATCH = 128
TUNING_SEED = 0
# The tuning trials of a cell placed before any result; the rest of
# trials.TUNING_TRIALS go one series step at a time beyond an edge (`next_index`).
GRID_TRIALS = 4
CUT_PER_DOUBLING = 1.5
# Before any tuning trial of a cell has reached the primary target, one below this
# validation accuracy at EARLY_FRACTION of the budget gives up: it has collapsed (dead
# ReLUs at chance accuracy). Every trial of the earlier protocol that reached 0.90 at
# any batch was at 0.76 or more there.
EARLY_FRACTION, EARLY_ACCURACY = 0.1, 0.5
# Fashion-MNIST's training examples, and those of trials.TUNE_SPLIT (the trainer drops
# each epoch's partial batch).
TRAIN_EXAMPLES, TUNE_EXAMPLES = 60000, 54000
assert trials.TUNE_SPLIT == f"train[:{TUNE_EXAMPLES}]"
# Evaluations a share of the steps done apart (trainer --eval_spacing; at least 5 steps,
# at most the batch's `eval_every_steps`): a step count to a target is at most this
# share late.
EVAL_SPACING = 0.025
# An entry that misses the primary target within the budget runs again at this many
# times the budget.
EXTENSION = 2
# Per batch size: the budget in epochs; the most steps between two evaluations (0: no
# bound; fine enough that K-FAC's steps to 0.89, 275 at 128, 117 at 512, 44-48 at 2048
# and 8192 in the earlier protocol, are resolved to under 3%); K-FAC's refresh intervals
# and the share of each batch its factor statistics see; whether K-FAC compiles with XLA
# (its faster mode at 8192 in the earlier protocol's retimes; every first-order entry
# was faster without at every batch); the steps of a timed block (`retime`), a multiple
# of the decomposition interval so that every block holds K-FAC's kinds of step at their
# proportions in training.
BATCHES = {
    128: dict(epochs=10, eval_every_steps=0, factor_update_freq=10,
              decomposition_update_freq=100, factor_batch_fraction=1.0, kfac_xla=False,
              timing_block_steps=100),
    512: dict(epochs=24, eval_every_steps=3, factor_update_freq=2,
              decomposition_update_freq=20, factor_batch_fraction=1.0, kfac_xla=False,
              timing_block_steps=20),
    2048: dict(epochs=32, eval_every_steps=1, factor_update_freq=1,
               decomposition_update_freq=5, factor_batch_fraction=1.0, kfac_xla=False,
               timing_block_steps=10),
    8192: dict(epochs=64, eval_every_steps=1, factor_update_freq=1,
               decomposition_update_freq=2, factor_batch_fraction=0.25, kfac_xla=True,
               timing_block_steps=4),
    16384: dict(epochs=96, eval_every_steps=1, factor_update_freq=1,
                decomposition_update_freq=1, factor_batch_fraction=0.125, kfac_xla=True,
                timing_block_steps=2),
}
KFAC_BATCH_SETTINGS = ("factor_update_freq", "decomposition_update_freq",
                       "factor_batch_fraction")
# Entry (of bench/trials.py OPTIMIZERS) -> its batch-128 pick, the centre of its grids:
# kfac's among the CNN's tuning trials of inverse → ScheduleFreeAdamW at damping 0.03,
# its settings (bench/results/trial_summaries/cnn); sgd's the momentum-SGD pick of
# bench/results/variants/time_to_accuracy.json (effective rate 1); adamw's from there;
# muon's and lamb's from bench/results/trial_summaries/cnn; schedule_free_adamw's from
# bench/results/cnn_kfac_schedule_free/time_to_accuracy.json. All tuned on the
# validation split.
ENTRIES = {
    "kfac": dict(pick=dict(learning_rate=0.02)),
    "sgd": dict(pick=dict(learning_rate=0.1, momentum=0.9)),
    "schedule_free_adamw": dict(pick=dict(learning_rate=0.01)),
    "muon": dict(pick=dict(learning_rate=0.005)),
    "adamw": dict(pick=dict(learning_rate=0.01)),
    "lamb": dict(pick=dict(learning_rate=0.01)),
}
# The gradient noise scale (docs/design.md §13), which McCandlish et al. find
# predicts the critical batch size: measured per epoch in one more run of each entry at
# batch 128 and its tuned point (a tuning trial's split and seed, stopping at the top
# target), every NOISE_INTERVAL steps from the batch's halves; K-FAC entries also give
# it in the preconditioned metric. A separate run, so that no timed run carries the
# measuring.
NOISE_BATCH, NOISE_INTERVAL = SMALLEST_BATCH, 5
NOISE_KEYS = ("noise_scale", "preconditioned_noise_scale")
# Times to target side by side (`retime`): per batch size, the tuned points' steps timed
# in RETIME_REPEATS interleaved blocks in one process, from RETIME_CACHED_BATCHES batches
# cycled in memory (the input pipeline, the same for all, is not timed).
RETIME_REPEATS, RETIME_CACHED_BATCHES = 5, 4
# Each tuned point is retimed compiled both ways (`--xla` or not; its steps are the same
# either way) and its times to target are those of the faster.
COMPILATIONS = {"graph": False, "xla": True}

flags.DEFINE_list("batch_sizes", ["128", "2048", "8192"],
                  f"Batch sizes to run, in this order, among {', '.join(map(str, BATCHES))}.")
flags.DEFINE_list("entries", list(ENTRIES),
                  f"Entries to run at each batch size, in this order, among "
                  f"{', '.join(ENTRIES)}; at least one first-order entry.")
flags.DEFINE_bool("collect", False,
                  "Run nothing: write batch_scaling.json and .png from the runs the work "
                  "dir holds.")
flags.DEFINE_bool("tune_only", False,
                  "Run only the tuning trials (and noise runs) of every batch size, which "
                  "a busy machine does not change, and stop; a later run reads them back "
                  "and races.")
flags.DEFINE_bool("extend", True,
                  f"After a batch size's race, run every entry whose median misses "
                  f"{PRIMARY_TARGET} again at {EXTENSION}x the budget.")
flags.DEFINE_bool("noise_scale", True,
                  f"After the batch-{NOISE_BATCH} tuning, measure each entry's gradient "
                  "noise scale there at its tuned point (one run each).")
flags.DEFINE_bool("retime", True,
                  "After each batch size's race, time its tuned points' training steps "
                  "side by side (interleaved blocks in one process).")
flags.DEFINE_string("work_dir", "/tmp/tfkfac_batch_scaling",
                    "Where the runs (summaries, checkpoints) go.")


# ---------------------------------------------------------------------- the protocol
def budget_steps(batch, extension=1):
    """The steps of a final run's budget at `batch` (and of a tuning trial's)."""
    return extension * BATCHES[batch]["epochs"] * (TRAIN_EXAMPLES // batch)


def points_at(entry, index):
    """The tuning points of `entry` at series index `index` (`trials.series_value`):
    that learning rate; for SGD, that effective rate η / (1 - μ) at each momentum."""
    rate = trials.series_value(index)
    if entry != "sgd":
        return [{"learning_rate": rate}]
    return [{"learning_rate": float(f"{rate * (1 - momentum):.6g}"), "momentum": momentum}
            for momentum in trials.SGD_MOMENTA]


def effective_rate(point):
    """The learning rate a point's series index is of (SGD's: η / (1 - μ))."""
    return point["learning_rate"] / (1 - point.get("momentum", 0.0))


def centre(entry, batch):
    """The series index of `entry`'s grid centre at `batch`: its batch-128 pick's
    (effective) rate x √(batch / 128), rounded to the series."""
    return trials.series_index(effective_rate(ENTRIES[entry]["pick"])
                               * math.sqrt(batch / SMALLEST_BATCH))


def grid(entry, batch):
    """The series indices of `entry`'s grid at `batch` before any result: GRID_TRIALS
    points, half of its indices below the centre."""
    count = GRID_TRIALS // len(points_at(entry, 0))
    start = centre(entry, batch) - count // 2
    return list(range(start, start + count))


assert all((trials.TUNING_TRIALS - GRID_TRIALS) % len(points_at(entry, 0)) == 0
           for entry in ENTRIES)


def run_settings(entry, batch, point, epochs, seed):
    """The trainer settings of a run of `entry` at `point` over `epochs` of the full
    train split: the protocol's (bench/trials.py), the evaluation schedule, and K-FAC's
    batch settings."""
    budget = BATCHES[batch]
    settings = dict(trials.protocol(entry, point, epochs, WEIGHT_DECAY), model=MODEL,
                    batch_size=batch, seed=seed, eval_every_steps=budget["eval_every_steps"],
                    eval_spacing=EVAL_SPACING)
    if settings["optimizer"] == "kfac":
        settings.update({key: budget[key] for key in KFAC_BATCH_SETTINGS})
    return settings


def tuning_settings(entry, batch, point):
    """A tuning trial: seed 0 on the tuning split for a final run's steps and warm-up,
    evaluated on the validation split, stopping at the primary target."""
    steps = budget_steps(batch)
    return dict(run_settings(entry, batch, point, BATCHES[batch]["epochs"], TUNING_SEED),
                train_split=trials.TUNE_SPLIT, eval_split=trials.VALIDATION_SPLIT,
                steps=steps, target_accuracy=PRIMARY_TARGET, stop_at_target=True,
                warmup_epochs=trials.WARMUP_FRACTION * steps / (TUNE_EXAMPLES // batch))


def xla(entry, batch):
    return entry == DEFAULT_ENTRY and BATCHES[batch]["kfac_xla"]


def final_settings(entry, batch, point, seed, extension=1):
    """A final run: `seed` on the full train split over the budget (x `extension`),
    evaluated on the test split, stopping at the top target."""
    return dict(run_settings(entry, batch, point, extension * BATCHES[batch]["epochs"], seed),
                target_accuracy=max(TARGETS), stop_at_target=True, xla=xla(entry, batch))


def tuning_name(entry, batch, point):
    return f"tune-{entry}-batch{batch}-{trials.slug(point)}"


def final_name(entry, batch, point, seed, extension=1):
    epochs = extension * BATCHES[batch]["epochs"]
    return (f"{entry}-batch{batch}-epochs{epochs}-{trials.slug(point)}-seed{seed}"
            + ("-xla" if xla(entry, batch) else ""))


# ---------------------------------------------------------------- runs and their records
def trial(name, settings, run, give_up=None):
    """The summary of the run `name` in the work dir with `settings`, {"diverged":
    message} for one that diverged (marked so that a restart skips it), or None: not
    finished there and not `run`. A run is run (or resumed) with `run`, and with
    `give_up` (steps, accuracy) stops once past those steps without having reached that
    accuracy by then; the machine's load around it is kept beside it (`trials.run`)."""
    summary = (trials.diverged(FLAGS.work_dir, name)
               or trials.read(FLAGS.work_dir, name, **settings))
    if summary is not None or not run:
        return summary
    if give_up is not None:
        settings = dict(settings, give_up_steps=give_up[0], give_up_accuracy=give_up[1])
    return trials.run_or_diverged(FLAGS.work_dir, name, **settings)


def tuning_record(summary, point):
    """What the report keeps of a tuning trial: its steps to the primary target on the
    validation split (None: not reached), its best accuracy and its curve (steps,
    validation accuracy)."""
    if "diverged" in summary:
        return {"point": point, "diverged": True, "message": summary["diverged"]}
    curve = [(steps, accuracy) for _, steps, accuracy in trials.curve(summary)]
    return {"point": point, "diverged": False, "gave_up": summary.get("gave_up", False),
            "steps": summary["steps"],
            "steps_to_primary": next((steps for steps, accuracy in curve
                                      if accuracy >= PRIMARY_TARGET), None),
            "best_accuracy": max((accuracy for _, accuracy in curve), default=0.0),
            "curve": curve}


def run_tuning_trial(entry, batch, run, point, give_up=None):
    """The record of a tuning trial, run (`run`) unless the work dir holds it finished;
    None when it does not and not `run`."""
    summary = trial(tuning_name(entry, batch, point), tuning_settings(entry, batch, point),
                    run, give_up)
    return None if summary is None else tuning_record(summary, point)


def final_run(entry, batch, point, seed, run, extension=1):
    """The record of a final run (`race`'s form: its seed and curve of (time_s, steps,
    test accuracy)), run (`run`) unless the work dir holds it finished; None when it
    does not and not `run`."""
    name = final_name(entry, batch, point, seed, extension)
    summary = trial(name, final_settings(entry, batch, point, seed, extension), run)
    if summary is None:
        return None
    record = {"seed": seed, "epochs": extension * BATCHES[batch]["epochs"],
              "xla": xla(entry, batch), "machine": summary.get("machine")}
    if "diverged" in summary:
        return dict(record, diverged=True, message=summary["diverged"], curve=[])
    curve = trials.curve(summary)
    return dict(record, diverged=False, steps=summary["steps"],
                mean_step_time_s=summary["mean_step_time_s"]["all"],
                best_accuracy=max(point[2] for point in curve),
                final_accuracy=curve[-1][2], curve=curve)


# ------------------------------------------------------------------------ the tuning
def rank(trial_record):
    """Sort key of a tuning trial: fewest steps to the primary target (then the best
    accuracy); then those that never reached it, by best accuracy; diverged ones last."""
    if trial_record["diverged"]:
        return (2, 0.0, 0.0)
    steps = trial_record["steps_to_primary"]
    if steps is not None:
        return (0, steps, -trial_record["best_accuracy"])
    return (1, -trial_record["best_accuracy"], 0.0)


def give_up_rule(found, batch):
    """When a tuning trial gives up, as (steps, accuracy) it must have reached by then:
    past the fewest steps to the primary target of the trials `found` (it can no longer
    win), or before any has reached it, at EARLY_FRACTION of the budget below
    EARLY_ACCURACY (it has collapsed)."""
    fewest = min((rank(t)[1] for t in found.values() if rank(t)[0] == 0), default=None)
    if fewest is not None:
        return fewest, PRIMARY_TARGET
    return int(EARLY_FRACTION * budget_steps(batch)), EARLY_ACCURACY


def next_index(indices, found):
    """The series index the next trials go to: one step beyond the edge of `indices`
    the best trial of `found` ({(index, position): record}) sits at, else beyond the
    edge whose best trial ranks better (the lower on a tie)."""
    low, high = min(indices), max(indices)
    best = {index: min(rank(t) for (i, _), t in found.items() if i == index)
            for index in (low, high)}
    overall = min(rank(t) for t in found.values())
    if best[low] == overall:
        return low - 1
    if best[high] == overall:
        return high + 1
    return low - 1 if best[low] <= best[high] else high + 1


def tune(entry, batch, get):
    """One (entry, batch)'s tuning with the trials `get(point, give_up)` returns (None:
    not run yet; the tuning is then incomplete, with the trials it has): the grid from
    its centre outward, each trial with `give_up_rule`'s (steps, accuracy), then one
    index at a time by `next_index` up to trials.TUNING_TRIALS trials."""
    indices, middle = grid(entry, batch), centre(entry, batch)
    found = {}

    def run(index):
        for position, point in enumerate(points_at(entry, index)):
            if (index, position) not in found:
                record = get(point, give_up_rule(found, batch))
                if record is None:
                    return False
                found[index, position] = dict(record, index=index, point=point)
        return True

    for index in sorted(indices, key=lambda index: (abs(index - middle), index)):
        if not run(index):
            return {"complete": False, "trials": sorted_trials(found)}
    added = []
    while len(found) < trials.TUNING_TRIALS:
        index = next_index(indices, found)
        indices, added = indices + [index], added + [index]
        if not run(index):
            return {"complete": False, "trials": sorted_trials(found)}
    best = min(found, key=lambda key: rank(found[key]))
    return {"complete": True, "trials": sorted_trials(found),
            "initial_grid": [point for index in grid(entry, batch)
                             for point in points_at(entry, index)],
            "added_rates": [trials.series_value(index) for index in added],
            "best_at_edge": best[0] in (min(indices), max(indices)),
            "chosen": found[best]["point"], "score": list(rank(found[best]))}


def sorted_trials(found):
    return [found[key] for key in sorted(found)]


def leader(tunings):
    """The first-order entry of `tunings` ({entry: complete tuning}) with the best tuning
    score: the other entry of the race that runs race.HEADLINE_SEEDS seeds."""
    return min((entry for entry in tunings if entry in FIRST_ORDER),
               key=lambda entry: tunings[entry]["score"], default=None)


# --------------------------------------------------------------------------- the race
def race_batch(batch, entries, tunings):
    """The final runs of `entries` at `batch`, each at its tuned point (`tunings`), in
    race.rounds' order, and then (`--extend`) those whose median misses the primary
    target at EXTENSION times the budget, in the same order. Writes the report after
    each round."""
    counts = race.seed_counts(entries, headline=(DEFAULT_ENTRY, leader(tunings)))
    runs = {entry: [] for entry in entries}
    race_rounds(batch, counts, tunings, runs, 1)
    missed = {entry: count for entry, count in counts.items()
              if median_steps(runs[entry], PRIMARY_TARGET) is None}
    if FLAGS.extend and missed:
        race_rounds(batch, missed, tunings, {entry: [] for entry in missed}, EXTENSION)


def race_rounds(batch, counts, tunings, runs, extension):
    """The runs of race.rounds(counts) at `extension` times the budget, appended to
    `runs` {entry: [run]}; the report written after each round."""
    order = race.rounds(counts)
    for index, (seed, entry) in enumerate(order):
        runs[entry].append(final_run(entry, batch, tunings[entry]["chosen"], seed, True,
                                     extension))
        print_run(entry, batch, runs[entry][-1])
        if index + 1 == len(order) or order[index + 1][0] != seed:
            collect()


def print_run(entry, batch, run):
    steps = {str(target): (race.crossing(run, target) or {}).get("steps")
             for target in TARGETS}
    print(f"{entry} batch {batch} seed {run['seed']} ({run['epochs']} epochs): steps to "
          f"target {json.dumps(steps)}", flush=True)


def median_steps(runs, target):
    return race.median_or_none(race.per_seed(runs, target, "steps").values())


def crossing(run, target):
    """race.crossing with its quantization in steps too: the steps since the evaluation
    before it, as a share of its steps."""
    found = race.crossing(run, target)
    if found is not None:
        before = max((point[1] for point in run["curve"] if point[1] < found["steps"]),
                     default=0)
        found["steps_quantization"] = (found["steps"] - before) / found["steps"]
    return found


def to_target(runs, budget):
    """Per target: each seed's crossing (`crossing`), how many reached it, and the
    medians of steps and time over the seeds (a seed that never reached it counts as
    infinite; an infinite median is None, with `steps_above` the budget it exceeds)."""
    result = {}
    for target in TARGETS:
        crossings = {str(run["seed"]): crossing(run, target) for run in runs}
        found = {"per_seed": crossings,
                 "reached": sum(c is not None for c in crossings.values()),
                 "median_steps": median_steps(runs, target),
                 "median_time_s": race.median_or_none(
                     race.per_seed(runs, target, "time_s").values())}
        if found["median_steps"] is None:
            found["steps_above"] = budget
        result[str(target)] = found
    return result


def final_cell(entry, batch, point, seeds):
    """The final runs of `entry` at `batch` and `point` the work dir holds (of `seeds`
    planned), their crossings, and its runs at EXTENSION times the budget, if any."""
    def held(extension):
        found = (final_run(entry, batch, point, race.FIRST_SEED + index, False, extension)
                 for index in range(race.HEADLINE_SEEDS))
        return [run for run in found if run is not None]

    runs = held(1)
    cell = {"chosen": point, "seeds_planned": seeds, "complete": len(runs) >= seeds,
            "runs": runs, "to_target": to_target(runs, budget_steps(batch)) if runs else None}
    extended = held(EXTENSION)
    if extended:
        cell["extended"] = {"epochs": EXTENSION * BATCHES[batch]["epochs"], "runs": extended,
                            "to_target": to_target(extended, budget_steps(batch, EXTENSION))}
    return cell


# ---------------------------------------------------------------------- noise scale
def noise_name(entry, point):
    return f"noise-{tuning_name(entry, NOISE_BATCH, point)}"


def noise_settings(entry, point):
    return dict(tuning_settings(entry, NOISE_BATCH, point), target_accuracy=max(TARGETS),
                noise_scale=True, noise_scale_interval=NOISE_INTERVAL)


def noise_record(summary, point):
    """Per epoch of a noise run: its steps and the noise scales it logged."""
    return {"point": point, "batch": NOISE_BATCH, "interval": NOISE_INTERVAL,
            "epochs": [dict({"epoch": row["epoch"], "steps": row["steps"]},
                            **{key: row[key] for key in NOISE_KEYS if key in row})
                       for row in summary["history"]]}


def noise_scale(entry, tuning, run):
    """The noise run of `entry` at its batch-128 `tuning`'s tuned point, run (`run`) or
    read back; None while that tuning is incomplete or the run is not there."""
    if not tuning or not tuning["complete"]:
        return None
    point = tuning["chosen"]
    summary = trial(noise_name(entry, point), noise_settings(entry, point), run)
    return None if summary is None or "diverged" in summary else noise_record(summary, point)


# --------------------------------------------------------------------------- retime
def retime_path(batch):
    return os.path.join(FLAGS.work_dir, f"retime-batch{batch}.json")


def read_retime(batch):
    """The retime run of `batch` in the work dir, else None (also for a run of other
    compilations than COMPILATIONS: it is run again)."""
    if not os.path.exists(retime_path(batch)):
        return None
    with open(retime_path(batch), encoding="utf-8") as f:
        done = json.load(f)
    return done if done.get("compilations") == list(COMPILATIONS) else None


def retime(batch, chosen):
    """The tuned points `chosen` ({entry: point}) at `batch` trained side by side in one
    process, in each of COMPILATIONS, RETIME_REPEATS interleaved blocks each, so that
    their step times compare in one window. Kept in the work dir; run again when the
    points (or the compilations) there are others."""
    done = read_retime(batch)
    if not chosen or (done is not None and {entry: timing["chosen"] for entry, timing
                                            in done["entries"].items()} == chosen):
        return done
    block_steps = BATCHES[batch]["timing_block_steps"]
    print(f"--- retiming batch {batch}: {', '.join(chosen)}; {', '.join(COMPILATIONS)}",
          flush=True)
    with tempfile.TemporaryDirectory() as model_dir:
        timed = {(entry, compilation): timed_steps.Timed(config_lib.TrainConfig(**dict(
            final_settings(entry, batch, point, race.FIRST_SEED), verbose=0, xla=compiled,
            model_dir=os.path.join(model_dir, f"{entry}-{compilation}"))),
            RETIME_CACHED_BATCHES, block_steps)
            for entry, point in chosen.items() for compilation, compiled in COMPILATIONS.items()}
        for run in timed.values():
            run.warm_up()
        samples = harness.interleave({key: run.block for key, run in timed.items()},
                                     RETIME_REPEATS)
    entries = {entry: {"chosen": point, "compilations": {}} for entry, point in chosen.items()}
    for (entry, compilation), run in timed.items():
        entries[entry]["compilations"][compilation] = {
            "start_steps": run.warm_up_steps, "start_s": run.warm_up_s,
            "blocks_step_s": harness.by_figure(samples[entry, compilation])["wall"]}
    result = {"batch": batch, "block_steps": block_steps, "repeats": RETIME_REPEATS,
              "compilations": list(COMPILATIONS), "entries": entries}
    with open(retime_path(batch), "w", encoding="utf-8") as f:
        json.dump(harness.stamp(result), f, indent=1)
    return read_retime(batch)


def retimed(cell, timing):
    """A complete `cell`'s times to target from its entry's `timing` in a retime run, in
    the compilation that reaches the primary target first (else the one with the faster
    step): its start (the first steps, tracing included) and the rest of its median
    steps at the median step time of its blocks; the other compilation's step beside."""
    by_compilation = {}
    for compilation, run in timing["compilations"].items():
        step_s = statistics.median(run["blocks_step_s"])
        times = {}
        for target, reached in cell["to_target"].items():
            steps = reached["median_steps"]
            times[target] = (None if steps is None else
                             run["start_s"] + (steps - run["start_steps"]) * step_s)
        by_compilation[compilation] = {
            "compilation": compilation, "start_s": run["start_s"],
            "start_steps": run["start_steps"], "step_s": harness.spread(run["blocks_step_s"]),
            "time_s_to_target": times}
    faster = min(by_compilation.values(), key=lambda found: (
        found["time_s_to_target"][str(PRIMARY_TARGET)] or math.inf,
        found["step_s"]["median"]))
    return dict(faster, other_step_s={name: found["step_s"]["median"]
                                      for name, found in by_compilation.items()
                                      if name != faster["compilation"]})


# ---------------------------------------------------------------------- the analysis
def scaling_steps(medians, budgets):
    """Per step between consecutive measured batches of `medians` ({batch: median steps
    to a target, or None where not reached within `budgets[batch]` steps}): the cut,
    the threshold, and whether it still scales (None: undetermined)."""
    batches = sorted(medians)
    steps = []
    for low, high in zip(batches, batches[1:]):
        needed = CUT_PER_DOUBLING ** math.log2(high / low)
        item = {"from": low, "to": high, "needed_cut": needed}
        if medians[low] is None:
            item.update(cut=None, scales=None)
        elif medians[high] is not None:
            cut = medians[low] / medians[high]
            item.update(cut=cut, scales=cut >= needed)
        else:
            bound = medians[low] / budgets[high]
            item.update(cut_below=bound, scales=False if bound < needed else None)
        steps.append(item)
    return steps


def critical_batch(medians, budgets):
    """The critical batch size (module docstring) from `medians` and `budgets` as
    `scaling_steps` takes them: the batch, whether it is a lower bound, and the steps
    judged."""
    steps = scaling_steps(medians, budgets)
    batch = max((step["from"] for step in steps if step["scales"]), default=None)
    return {"critical_batch": batch,
            "at_least": bool(steps) and steps[-1]["scales"] is True,
            "below_smallest": bool(steps) and batch is None and steps[0]["scales"] is False,
            "undetermined": [step["from"] for step in steps if step["scales"] is None],
            "steps": steps}


def outcome(critical):
    """A critical batch as an ordered outcome (order, label): below the smallest batch
    first, then each batch, "at least B" just above B; None when undetermined."""
    batch = critical["critical_batch"]
    if batch is not None:
        return (batch + 0.5, f"≥ {batch}") if critical["at_least"] else (batch, str(batch))
    if critical["below_smallest"]:
        return (0, f"< {SMALLEST_BATCH}")
    return None


def critical_batch_interval(per_seed, budgets):
    """The critical batch's bootstrap interval: each batch's seeds (`per_seed`: {batch:
    [steps to the target per seed, inf where not reached]}) resampled with replacement,
    the critical batch recomputed from the resampled medians; the race.INTERVAL
    percentiles of the outcomes (`outcome`) and each outcome's share."""
    samples = race.BOOTSTRAP_SAMPLES
    draws = race.bootstrap_medians(per_seed, samples)
    outcomes, known = [], {}  # a few seeds' medians take few values: each judged once
    for sample in range(samples):
        medians = tuple((batch, None if math.isinf(values[sample]) else float(values[sample]))
                        for batch, values in draws.items())
        if medians not in known:
            known[medians] = outcome(critical_batch(dict(medians), budgets))
        outcomes.append(known[medians])
    labels = {}
    for found in outcomes:
        label = found[1] if found else "?"
        labels[label] = labels.get(label, 0) + 1
    result = {"samples": samples, "low": None, "high": None,
              "shares": {label: count / len(outcomes) for label, count in labels.items()}}
    determined = sorted(found for found in outcomes if found)
    if determined:
        tail = (1 - race.INTERVAL) / 2
        result["low"] = determined[round(tail * (len(determined) - 1))][1]
        result["high"] = determined[round((1 - tail) * (len(determined) - 1))][1]
    return result


def fitted_critical_batch(medians):
    """McCandlish et al.'s S(B) = S_min (1 + B_crit / B) fitted by least squares in 1/B to
    the median steps `medians` ({batch: steps or None}) of the batches that reached the
    target: the critical batch in the units of the noise scale B_simple, which predicts
    it. None with fewer than two such batches, or where the steps do not fall as that
    curve can (S_min or B_crit not positive)."""
    points = [(1 / batch, steps) for batch, steps in sorted(medians.items())
              if steps is not None]
    if len(points) < 2:
        return None
    slope, min_steps = statistics.linear_regression(*zip(*points))
    if min_steps <= 0 or slope <= 0:
        return None
    return {"min_steps": min_steps, "critical_batch": slope / min_steps,
            "batches": [round(1 / x) for x, _ in points]}


def entry_critical_batch(cells, target):
    """An entry's critical batch at `target` from its complete cells {batch: cell}, with
    its bootstrap interval and McCandlish et al.'s fit."""
    medians = {batch: cell["to_target"][str(target)]["median_steps"]
               for batch, cell in cells.items()}
    budgets = {batch: budget_steps(batch) for batch in cells}
    per_seed = {batch: list(race.per_seed(cell["runs"], target, "steps").values())
                for batch, cell in cells.items()}
    return dict(critical_batch(medians, budgets),
                interval=critical_batch_interval(per_seed, budgets) if len(cells) > 1
                else None,
                fitted=fitted_critical_batch(medians))


def ratios(cells, batch):
    """`kfac`'s ratio to each first-order entry at `batch` ({entry: {batch: cell}}): per
    target, of steps and of time, the median of the per-round ratios with its bootstrap
    interval (race.ratio), where both cells are complete."""
    mine = cells.get(DEFAULT_ENTRY, {}).get(batch)
    if not mine or not mine.get("complete"):
        return {}
    out = {}
    for baseline in FIRST_ORDER:
        theirs = cells.get(baseline, {}).get(batch)
        if theirs and theirs.get("complete"):
            out[baseline] = {str(target): {key: race.ratio(
                race.per_seed(mine["runs"], target, key),
                race.per_seed(theirs["runs"], target, key)) for key in ("steps", "time_s")}
                for target in TARGETS}
    return out


def report(cells, leaders, noise):
    """The JSON document of `cells` {entry: {batch: cell}}, each batch's best first-order
    entry by tuning `leaders` {batch: entry} and the noise runs `noise` {entry: record
    or None}."""
    entries, batches = {}, {}
    for entry, by_batch in cells.items():
        complete = {batch: c for batch, c in by_batch.items() if c["complete"]}
        entries[entry] = {
            "settings": trials.OPTIMIZERS[entry], "batch_128_pick": ENTRIES[entry]["pick"],
            "batches": {str(batch): c for batch, c in sorted(by_batch.items())},
            "critical_batch": {str(target): entry_critical_batch(complete, target)
                               for target in TARGETS},
            "noise_scale": noise.get(entry)}
    for batch in sorted({batch for by_batch in cells.values() for batch in by_batch}):
        found = {"best_first_order_by_tuning": leaders.get(batch),
                 "ratios": ratios(cells, batch)}
        headline = found["ratios"].get(leaders.get(batch))
        if headline:
            found["headline"] = dict(headline[str(PRIMARY_TARGET)]["steps"],
                                     baseline=leaders[batch])
        kfac = cells.get(DEFAULT_ENTRY, {}).get(batch)
        if kfac and kfac.get("runs"):
            found["kfac_steps_quantization"] = {
                target: max((c["steps_quantization"] for c in reached["per_seed"].values()
                             if c), default=None)
                for target, reached in kfac["to_target"].items()}
        batches[str(batch)] = found
    return {
        "model": MODEL, "dataset": "fashion_mnist", "targets": list(TARGETS),
        "primary_target": PRIMARY_TARGET, "batches": batches, "entries": entries,
        "protocol": {
            "budgets": {str(batch): dict(budget, steps=budget_steps(batch))
                        for batch, budget in BATCHES.items()},
            "schedule": f"linear warm-up over {trials.WARMUP_FRACTION:.0%} of the budget, "
                        "then half a cosine to 0 at its end (schedule-free rules: the "
                        "warm-up, then constant)",
            "weight_decay_per_step": WEIGHT_DECAY,
            "tuning": {
                "trials_per_entry_and_batch": trials.TUNING_TRIALS, "seed": TUNING_SEED,
                "train_split": trials.TUNE_SPLIT, "eval_split": trials.VALIDATION_SPLIT,
                "steps": "the final runs' budget in steps, their warm-up and schedule",
                "score": f"fewest validation steps to {PRIMARY_TARGET}; then best accuracy",
                "grid": f"{GRID_TRIALS} points of the 1-2-5 series around the batch-128 "
                        "pick x sqrt(B/128) (2 series steps below, 1 above; SGD: its "
                        f"effective rate at momenta {list(trials.SGD_MOMENTA)}, 1 below), "
                        "the rest one series step at a time beyond the edge the best "
                        "sits at, else beyond the edge ranking better",
                "give_up": f"past the fewest steps to {PRIMARY_TARGET} so far unless "
                           f"reached by then; before any has, below {EARLY_ACCURACY} at "
                           f"{EARLY_FRACTION:.0%} of the budget"},
            "race": {"first_seed": race.FIRST_SEED, "headline_seeds": race.HEADLINE_SEEDS,
                     "other_seeds": race.OTHER_SEEDS,
                     "headline_entries": [DEFAULT_ENTRY, "best first-order by tuning"],
                     "order": "race.rounds: seed by seed, entries alternating, reversed "
                              "every other round",
                     "eval_split": "test", "eval_spacing": EVAL_SPACING,
                     "stop": f"at the top target {max(TARGETS)} or the budget's end",
                     "extension": f"entries whose median misses {PRIMARY_TARGET} run "
                                  f"their seeds again at {EXTENSION}x the budget",
                     "interval": race.INTERVAL, "bootstrap_samples": race.BOOTSTRAP_SAMPLES,
                     "ratio": "median of per-round ratios over the common seeds"},
            "critical_batch": f"the largest measured B whose step to the next grid batch rB "
                              f"cuts the median steps by >= {CUT_PER_DOUBLING}^log2(r); "
                              "interval: seeds resampled per batch, the critical batch "
                              "recomputed, 5th-95th percentile of the outcomes; fitted: "
                              "S(B) = S_min (1 + B_crit / B) by least squares in 1/B",
            "noise_scale": f"B_simple per epoch of one run at batch {NOISE_BATCH}, the "
                           f"tuned point, tuning split and seed, every {NOISE_INTERVAL} "
                           "steps from the batch's halves",
            "retimed": "per batch size, every tuned point trained side by side in one "
                       f"process, compiled with XLA and without, {RETIME_REPEATS} "
                       "interleaved blocks of timing_block_steps steps each from cached "
                       "batches; time to a target = the first steps' time (tracing "
                       "included) + the rest of the median steps x the median block step "
                       "time, in the compilation that reaches the primary target first"},
    }


# ---------------------------------------------------------------------- the tables
TABLES_BEGIN = "<!-- batch_scaling tables: bench/batch_scaling.py --collect prints them -->"
TABLES_END = "<!-- end of batch_scaling tables -->"
SUMMARY_BEGIN = "<!-- batch_scaling summary: bench/batch_scaling.py --collect prints it -->"
SUMMARY_END = "<!-- end of batch_scaling summary -->"


def complete_cells(document, batch):
    return {name: r["batches"][str(batch)] for name, r in document["entries"].items()
            if r["batches"].get(str(batch), {}).get("complete")}


def raced_batches(document):
    return sorted(int(batch) for batch in document["batches"]
                  if complete_cells(document, batch))


def tables(document):
    """The Markdown tables of `document` (`report`'s) that docs/benchmarks.md holds
    between TABLES_BEGIN and TABLES_END: per batch size each complete cell's tuned
    point, seeds, step time and median steps [range over seeds] (seconds) to each
    target, the fewest median steps to the primary target in bold; the misses at twice
    the budget; `kfac`'s ratios with their intervals; per entry the critical batch sizes
    with their interval, McCandlish et al.'s fit and the noise scale."""
    lines = [TABLES_BEGIN]
    for batch in raced_batches(document):
        complete = complete_cells(document, batch)
        found = document["batches"][str(batch)]
        fewest = min(_primary_steps(c) for c in complete.values())
        lines += ["", f"Batch {batch} (budget {budget_steps(batch)} steps; best first-order "
                      f"entry by tuning: {NAMES.get(found['best_first_order_by_tuning'])}): "
                      "median steps [range over seeds] (seconds) to each target", "",
                  "| entry | tuned point | seeds | step ms | "
                  + " | ".join(f"{t:.2f}" for t in TARGETS) + " |",
                  "| --- | --- | --- | --- |" + " --- |" * len(TARGETS)]
        for name, cell in sorted(complete.items(), key=lambda item: _primary_steps(item[1])):
            cells = [_reached(cell, target, fewest) for target in TARGETS]
            lines.append(f"| {NAMES[name]} | {_point(cell['chosen'])} | {len(cell['runs'])} "
                         f"| {_step_ms(cell.get('retimed'))} | " + " | ".join(cells) + " |")
        for name, cell in complete.items():
            if "extended" in cell:
                extended = cell["extended"]
                steps = ", ".join(_reached(extended, t, None) for t in TARGETS)
                lines += ["", f"{NAMES[name]} at {EXTENSION}x the budget "
                              f"({extended['epochs']} epochs, {len(extended['runs'])} seeds): "
                              f"{steps} steps to {', '.join(f'{t:.2f}' for t in TARGETS)}."]
        for baseline, by_target in found["ratios"].items():
            ratio = by_target[str(PRIMARY_TARGET)]
            lines += ["", f"{NAMES[DEFAULT_ENTRY]} over {NAMES[baseline]} to "
                          f"{PRIMARY_TARGET:.2f}: steps {_ratio(ratio['steps'])}, time "
                          f"{_ratio(ratio['time_s'])} ({len(ratio['steps']['seeds'])} rounds)."]
    lines += ["", f"Critical batch size per entry at {' / '.join(f'{t:.2f}' for t in TARGETS)} "
                  f"(threshold rule; ? where a budget leaves it undetermined, – before two "
                  f"batches are complete), its 90% bootstrap interval over seeds at "
                  f"{PRIMARY_TARGET:.2f}, McCandlish et al.'s fitted B_crit (S_min) at "
                  f"{PRIMARY_TARGET:.2f} and the noise scale B_simple at batch "
                  f"{NOISE_BATCH}, epochs 1 / 2 (preconditioned for K-FAC):", "",
              "| entry | critical batch | interval | fitted B_crit (S_min) | B_simple |",
              "| --- | --- | --- | --- | --- |"]
    for name, r in document["entries"].items():
        if not any(c["complete"] for c in r["batches"].values()):
            continue
        critical = " / ".join(_critical(r["critical_batch"][str(t)]) for t in TARGETS)
        primary = r["critical_batch"][str(PRIMARY_TARGET)]
        lines.append(f"| {NAMES[name]} | {critical} | {_interval(primary)} | "
                     f"{_fit(primary)} | {_noise(r['noise_scale'])} |")
    return "\n".join(lines + ["", TABLES_END])


def summary(document):
    """The Markdown table of `document` that docs/benchmarks.md holds between
    SUMMARY_BEGIN and SUMMARY_END, the headline of `tables`: per entry the median steps
    to the primary target at every batch size (the fewest per batch in bold), its
    critical batch there with its interval and McCandlish et al.'s fit; under it, per
    batch `kfac`'s steps over the best first-order entry's with their interval."""
    batches = raced_batches(document)
    fewest = {batch: min(_primary_steps(c) for c in complete_cells(document, batch).values())
              for batch in batches}
    lines = [SUMMARY_BEGIN, "", f"| entry | {' | '.join(f'batch {b}' for b in batches)} | "
             "critical batch (interval) | fitted B_crit (S_min) |",
             "| --- |" + " --- |" * (len(batches) + 2)]
    for name, r in document["entries"].items():
        steps = [_reached(r["batches"][str(batch)], PRIMARY_TARGET, fewest[batch])
                 if r["batches"].get(str(batch), {}).get("complete") else "–"
                 for batch in batches]
        if any(cell != "–" for cell in steps):
            critical = r["critical_batch"][str(PRIMARY_TARGET)]
            lines.append(f"| {NAMES[name]} | {' | '.join(steps)} | {_critical(critical)} "
                         f"({_interval(critical)}) | {_fit(critical)} |")
    for batch in batches:
        headline = document["batches"][str(batch)].get("headline")
        if headline:
            lines += ["", f"Batch {batch}: {NAMES[DEFAULT_ENTRY]}'s steps to "
                          f"{PRIMARY_TARGET:.2f} over {NAMES[headline['baseline']]}'s "
                          f"{_ratio(headline)} ({len(headline['seeds'])} rounds)."]
    return "\n".join(lines + ["", SUMMARY_END])


def _primary_steps(cell):
    return cell["to_target"][str(PRIMARY_TARGET)]["median_steps"] or math.inf


def _reached(cell, target, fewest):
    """Median steps [range] (seconds) to `target`, in bold at the primary target where
    they are `fewest`; "> budget" where the median is beyond it."""
    reached = cell["to_target"][str(target)]
    if reached["median_steps"] is None:
        return f"> {reached['steps_above']}"
    steps = [c["steps"] for c in reached["per_seed"].values() if c]
    text = f"{reached['median_steps']:g}"
    if len(reached["per_seed"]) > 1:
        unreached = "+" if len(steps) < len(reached["per_seed"]) else ""
        text += f" [{min(steps)}-{max(steps)}{unreached}]"
    if reached["median_time_s"] is not None:
        text += f" ({reached['median_time_s']:.1f} s)"
    return f"**{text}**" if target == PRIMARY_TARGET and reached["median_steps"] == fewest \
        else text


def _point(point):
    text = f"{point['learning_rate']:g}"
    return text + (f", momentum {point['momentum']:g}" if "momentum" in point else "")


def _ratio(ratio):
    if ratio["median"] is None:
        return "–"
    return f"{ratio['median']:.2f}x [{ratio['low']:.2f}, {ratio['high']:.2f}]"


def _step_ms(timing):
    if not timing:
        return "–"
    step = {key: value * 1e3 for key, value in timing["step_s"].items()}
    return (f"{step['median']:.1f} [{step['min']:.1f}-{step['max']:.1f}]"
            f"{' XLA' if COMPILATIONS[timing['compilation']] else ''}")


def _critical(critical):
    found = outcome(critical)
    if found:
        return found[1]
    return "?" if critical["undetermined"] else "–"


def _interval(critical):
    interval = critical["interval"]
    if not interval or interval["low"] is None:
        return "–"
    return interval["low"] if interval["low"] == interval["high"] else \
        f"{interval['low']} to {interval['high']}"


def _fit(critical):
    fitted = critical["fitted"]
    return f"{fitted['critical_batch']:.0f} ({fitted['min_steps']:.0f})" if fitted else "–"


def _noise(noise):
    if not noise:
        return "–"
    key = "preconditioned_noise_scale"
    return " / ".join(f"{row.get(key, row['noise_scale']):.0f}" for row in noise["epochs"][:2])


# ------------------------------------------------------------------------ the plot
def plot(document):
    """Top row: median steps to each target against batch size, log-log, each seed a
    dot, each entry's perfect scaling (steps ∝ 1/B from its smallest batch) dotted,
    McCandlish et al.'s fitted curve dashed, the runs at twice the budget open squares.
    Bottom row: per batch size every run's test accuracy against its steps (those at
    twice the budget dashed), the targets grey."""
    batches = raced_batches(document)
    columns = max(len(TARGETS), len(batches), 1)
    figure, axes = harness.subplots(2, columns, figsize=(6 * columns, 10), squeeze=False)
    for axis, target in zip(axes[0], TARGETS):
        for entry, result in document["entries"].items():
            color = f"C{list(ENTRIES).index(entry)}"  # the same in every run's figure
            cells = {int(b): c for b, c in result["batches"].items() if c["complete"]}
            medians = sorted((b, c["to_target"][str(target)]["median_steps"])
                             for b, c in cells.items())
            reached = [(b, s) for b, s in medians if s is not None]
            for b, c in cells.items():
                seeds = [s["steps"] for s in c["to_target"][str(target)]["per_seed"].values()
                         if s]
                axis.plot([b] * len(seeds), seeds, ".", color=color, alpha=0.4)
                extended = c.get("extended", {}).get("to_target", {}).get(str(target))
                if extended and extended["median_steps"] is not None:
                    axis.plot(b, extended["median_steps"], "s", color=color,
                              fillstyle="none")
            if reached:
                axis.plot(*zip(*reached), "o-", color=color, label=entry)
                first_batch, first_steps = reached[0]
                ends = [first_batch, max(cells)]
                axis.plot(ends, [first_steps * first_batch / b for b in ends], ":",
                          color=color, linewidth=0.8)
                fitted = result["critical_batch"][str(target)]["fitted"]
                if fitted:
                    low, high = (math.log2(b) for b in (min(fitted["batches"]), ends[1]))
                    curve = [2 ** (low + (high - low) * i / 32) for i in range(33)]
                    axis.plot(curve, [fitted["min_steps"] * (1 + fitted["critical_batch"] / b)
                                      for b in curve], "--", color=color, linewidth=0.8)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("batch size")
        axis.set_ylabel(f"steps to test accuracy {target}")
        axis.set_title(f"{document['model']} on Fashion-MNIST, target {target}: median "
                       "(line), seeds (dots)\ndotted: perfect scaling; dashed: S_min "
                       f"(1 + B_crit / B); squares: median at {EXTENSION}x the budget",
                       fontsize=9)
        if axis.get_legend_handles_labels()[0]:  # none before a cell is complete
            axis.legend(fontsize=8)
    for axis, batch in zip(axes[1], batches):
        for entry, cell in complete_cells(document, batch).items():
            color = f"C{list(ENTRIES).index(entry)}"
            for style, runs in (("-", cell["runs"]),
                                ("--", cell.get("extended", {}).get("runs", []))):
                for index, run in enumerate(r for r in runs if r["curve"]):
                    axis.plot([p[1] for p in run["curve"]], [p[2] for p in run["curve"]],
                              style, color=color, alpha=0.7, linewidth=0.8,
                              label=entry if index == 0 and style == "-" else None)
        for target in TARGETS:
            axis.axhline(target, color="gray", linewidth=0.6)
        axis.set_xscale("log")
        axis.set_ylim(0.8, 0.93)
        axis.set_xlabel("steps")
        axis.set_ylabel("test accuracy")
        axis.set_title(f"batch {batch}: every run (dashed: {EXTENSION}x the budget)",
                       fontsize=9)
        axis.legend(fontsize=8)
    for axis in list(axes[0][len(TARGETS):]) + list(axes[1][len(batches):]):
        axis.axis("off")
    return figure


# ------------------------------------------------------------------------- the run
def collect():
    """Every tuning, final run and noise run the work dir holds, complete or not,
    written out; returns (cells {entry: {batch: cell}}, leaders {batch: entry})."""
    cells, leaders = {}, {}
    for batch in BATCHES:
        tunings = {entry: tune(entry, batch, lambda point, _, e=entry: run_tuning_trial(
            e, batch, False, point)) for entry in ENTRIES}
        tunings = {entry: found for entry, found in tunings.items() if found["trials"]}
        leaders[batch] = leader({e: t for e, t in tunings.items() if t["complete"]})
        for entry, tuning in tunings.items():
            cell = {"tuning": tuning, "complete": False}
            if tuning["complete"]:
                seeds = (race.HEADLINE_SEEDS if entry in (DEFAULT_ENTRY, leaders[batch])
                         else race.OTHER_SEEDS)
                cell.update(final_cell(entry, batch, tuning["chosen"], seeds))
            cells.setdefault(entry, {})[batch] = cell
        timing = read_retime(batch) or {"entries": {}}
        for entry, timed in timing["entries"].items():
            cell = cells.get(entry, {}).get(batch)
            if cell and cell["complete"] and cell["chosen"] == timed["chosen"]:
                cell["retimed"] = retimed(cell, timed)
    leaders = {batch: entry for batch, entry in leaders.items() if entry}
    noise = {entry: noise_scale(entry, by_batch.get(NOISE_BATCH, {}).get("tuning"), False)
             for entry, by_batch in cells.items()}
    document = report(cells, leaders, noise)
    harness.write(document, "batch_scaling", plot)
    if FLAGS.collect:
        print(summary(document), tables(document), sep="\n\n")
    return cells, leaders


def batch_sizes():
    """`--batch_sizes` as integers, checked against BATCHES."""
    try:
        sizes = [int(size) for size in FLAGS.batch_sizes]
    except ValueError:
        sizes = None
    if not sizes or any(size not in BATCHES for size in sizes):
        raise ValueError(f"batch_sizes must be among {', '.join(map(str, BATCHES))}; got "
                         f"{','.join(FLAGS.batch_sizes)}")
    return sizes


def main():
    sizes = batch_sizes()
    harness.check_among("entries", FLAGS.entries, ENTRIES)
    if FLAGS.collect:
        collect()
        return
    if not any(entry in FIRST_ORDER for entry in FLAGS.entries):
        raise ValueError(f"entries must hold a first-order entry ({', '.join(FIRST_ORDER)}): "
                         "the race's headline is the best of them")
    for batch in sizes:  # every run's settings, before hours of runs
        for entry in FLAGS.entries:
            point = ENTRIES[entry]["pick"]
            trials.check_entry(entry, tuning_settings(entry, batch, point))
            trials.check_entry(entry, final_settings(entry, batch, point, race.FIRST_SEED))
    for batch in sizes:
        tunings = {}
        for entry in FLAGS.entries:
            tunings[entry] = tune(entry, batch, lambda point, give_up, e=entry:
                                  run_tuning_trial(e, batch, True, point, give_up))
            print(f"{entry} batch {batch}: tuned {json.dumps(tunings[entry]['chosen'])}, "
                  f"score {tunings[entry]['score']}", flush=True)
            collect()
        if FLAGS.noise_scale and batch == NOISE_BATCH:
            for entry in FLAGS.entries:
                noise_scale(entry, tunings[entry], True)
            collect()
        if FLAGS.tune_only:
            continue
        race_batch(batch, FLAGS.entries, tunings)
        if FLAGS.retime:
            retime(batch, {entry: tunings[entry]["chosen"] for entry in FLAGS.entries})
            collect()


if __name__ == "__main__":
    harness.run(main)
