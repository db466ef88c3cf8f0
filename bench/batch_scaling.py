"""Steps to a target test accuracy against the batch size, per optimizer, tuned at every
batch size (Shallue et al., "Measuring the Effects of Data Parallelism on Neural Network
Training", JMLR 2019): whether K-FAC keeps cutting steps as the batch grows where
first-order optimizers stop, and the critical batch size of each.

Protocol (docs/benchmarks.md "Batch scaling"), the small CNN on Fashion-MNIST, one
process (a global batch is what data-parallel workers would share):
- Batch sizes 128, 512, 2048, 8192 (16384 optional), each with a budget in epochs
  (BATCHES) spent on bench/trials.py's schedule (linear warm-up over 5% of the budget,
  half a cosine to 0 at its end) and its decoupled weight decay λ = 5e-5 per step.
- Entries (ENTRIES): ScheduleFreeAdamW (the best first-order entry at batch 128 on the
  CNN), SGD with Nesterov momentum 0.9, AdamW, Lamb, Muon (the trainer's
  `--optimizer=muon`: the output layer and biases on its AdamW step, as its docstring
  asks), the best K-FAC variant at batch 128 on the CNN (K-FAC in front of
  ScheduleFreeAdamW) and the other one (inverse method with the KL clip, last in the
  default order), and, where the budget allows, eigen_adam; ablations of the
  momentum-SGD K-FAC entry: Osawa et al.'s recipe pieces (weight rescaling, momentum
  coupled to the learning rate) and the sampled Fisher
  (`--entries=kfac_inverse_recipe,kfac_inverse_sampled_fisher`).
- Tuning: the learning rate alone, on the same number of trials per (entry, batch):
  GRID_POINTS points of the 1-2-5 series around the entry's batch-128 pick scaled by
  √(B/128) (the scaled pick rounded to the series on a log scale, GRID_BELOW points below
  it); a grid whose best point sits at its edge moves one point outward (at most
  MAX_EDGE_MOVES times). K-FAC keeps its batch-128 damping, and its KL clip scales with
  the square of the learning rate (κ = κ₁₂₈ η² / η₁₂₈²): the clipped step
  η·min(1, √(κ/(η² Σ))) is then η times a factor the learning rate does not change, so
  the learning rate scales the step length whether or not the clip binds.
- K-FAC's curvature is refreshed per examples, not per steps: factors every ~1280
  examples and decompositions every ~12800 (batch 128's 10 and 100 steps), down to every
  step; above batch 2048 the factor statistics come from 2048 examples of each batch
  (`factor_batch_fraction`), which bounds their memory and time (BATCHES).
- Every trial is a run of the trainer (`trainers.runner.run`, what
  `python -m trainers.train` runs) with the test accuracy evaluated every
  `eval_every_steps` steps, stopping at the top target (0.91). A trial is scored by its
  steps to the primary target 0.90 (fewest wins; one that never reaches it ranks below
  every one that did, by its best accuracy; a diverged one last). A cell's trials run
  from the grid's centre (the scaled pick) outward, and each gives up at its first
  evaluation past the fewest steps to 0.90 of the cell's trials so far unless it reached
  0.90 by then (the trainer's `give_up_steps`): it could no longer win, and the pick is
  the one the full runs would give. Before any trial of the cell has reached 0.90, one
  below 0.5 at a tenth of the budget gives up (EARLY_ACCURACY; from 2026-12-02 12:43
  UTC, batch 8192's SGD on): it has collapsed. The chosen point runs again with a
  second seed; an entry's steps and wall time (training only, evaluation excluded) to
  each target are the medians over the two seeds.
- The gradient noise scale B_simple (McCandlish et al.'s predictor of the critical batch
  size) per epoch, from one more run of each entry at batch 128 and its chosen point
  (NOISE_BATCH; plain, and for K-FAC also preconditioned).
- Steps are the primary measure: they do not depend on the machine's load. Wall time is
  secondary, and not the trials' own clocks: those ran hours or sessions apart, on
  machines that differ (AdamW's batch-2048 step 2.4x apart on two of them) and shared
  with other work. After a batch size's cells, every chosen point trains RETIME_REPEATS
  interleaved blocks in one process (`retime`, bench/timed_steps.py), compiled with XLA
  and without (COMPILATIONS; the trials ran without); an entry's time to a target is its
  first steps' time (tracing included) plus the rest of its median steps at its median
  block step time, in the compilation that gets there first.

Critical batch size, defined before measuring: on our grid (each batch 4x the last) a
step from B to rB "still scales" when it cuts the median steps to the target by at least
1.5x per doubling, i.e. by 1.5^log2(r) (2.25x for r = 4). An entry's critical batch size
at a target is the largest measured B whose step to the next grid batch still scales;
none when even the first step does not (it lies below the smallest batch), and at least
the last B but one when the last step still scales (the grid cannot see further). A step
to a batch where the target was not reached within the budget is judged on the bound
(the cut is less than steps(B) / the budget's steps): it fails when the bound is below
the threshold, and is undetermined otherwise. Beside it, McCandlish et al.'s curve
S(B) = S_min (1 + B_crit / B) fitted to the batches that reached the target (least
squares in 1/B): its B_crit is what the gradient noise scale B_simple predicts.

Runs live in `--work_dir`: each trial's summary.json is written when it finishes, a
restarted run skips finished trials (and diverged ones, marked DIVERGED_FILE) and resumes
an interrupted one from its checkpoint. The order of `--batch_sizes` and `--entries` is
the order of the work: the default runs every entry at 128 and 2048 first, then 512 and
8192. After each (entry, batch) cell, and with `--collect` (no training), it writes
batch_scaling.json and .png to `--output_dir` from every trial the work dir holds.

Run in the background from a snapshot of the tree (benchmarks never run from a tree that
others edit). Estimated from batch 128's step times (K-FAC 44 ms, SGD 35 ms, idle) with
the step time growing about with the batch: about 13 h on 2 idle cores for the default four batch
sizes (128 and 2048, run first, about 6 h), two to three times that on a loaded machine;
it can be stopped and restarted at any time:
  PYTHONPATH=. TF_CPP_MIN_LOG_LEVEL=2 nohup .venv/bin/python bench/batch_scaling.py \\
      --work_dir=/work/bs_cnn > /work/logs/batch_scaling.log 2>&1 &
  .venv/bin/python bench/batch_scaling.py --work_dir=/work/bs_cnn --collect
"""

import functools
import json
import math
import os
import statistics
import tempfile

from absl import flags

import harness
import timed_steps
import trials
from trainers import config as config_lib, errors

FLAGS = flags.FLAGS
MODEL = "cnn"
TARGETS = (0.89, 0.90, 0.91)
PRIMARY_TARGET = 0.90
WEIGHT_DECAY = 5e-5  # bench/time_to_accuracy.py's λ per step for the CNN
SMALLEST_BATCH = 128
GRID_POINTS, GRID_BELOW, MAX_EDGE_MOVES = 6, 2, 2
SEEDS = (0, 1)  # the tuning seed, then the chosen point's second seed
CUT_PER_DOUBLING = 1.5
# Before any trial of a cell has reached the primary target, a trial below this test
# accuracy at EARLY_FRACTION of the budget gives up: it has collapsed (dead ReLUs at
# chance accuracy). Every trial that reached 0.90 at any batch was at 0.76 or more there.
EARLY_FRACTION, EARLY_ACCURACY = 0.1, 0.5
# Fashion-MNIST's training examples (the trainer drops each epoch's partial batch).
TRAIN_EXAMPLES = 60000
# Per batch size: the budget in epochs, the evaluation interval in steps (fine enough
# that a step count to a target of the order expected is resolved to about 10%: batch
# 128's K-FAC needed 600 and 1000 steps to 0.89 and 0.90, SGD 1400 and 1872), and
# K-FAC's refresh intervals and share of each batch its factor statistics see; the
# steps of a timed block (`retime`), a multiple of the decomposition interval so that
# every block holds K-FAC's kinds of step at their proportions in training.
BATCHES = {
    128: dict(epochs=10, eval_every_steps=50, factor_update_freq=10,
              decomposition_update_freq=100, factor_batch_fraction=1.0,
              timing_block_steps=100),
    512: dict(epochs=12, eval_every_steps=20, factor_update_freq=2,
              decomposition_update_freq=20, factor_batch_fraction=1.0,
              timing_block_steps=20),
    2048: dict(epochs=16, eval_every_steps=8, factor_update_freq=1,
               decomposition_update_freq=5, factor_batch_fraction=1.0,
               timing_block_steps=10),
    8192: dict(epochs=32, eval_every_steps=4, factor_update_freq=1,
               decomposition_update_freq=2, factor_batch_fraction=0.25,
               timing_block_steps=4),
    16384: dict(epochs=48, eval_every_steps=2, factor_update_freq=1,
                decomposition_update_freq=1, factor_batch_fraction=0.125,
                timing_block_steps=2),
}
KFAC_BATCH_SETTINGS = ("factor_update_freq", "decomposition_update_freq",
                       "factor_batch_fraction")
# Entry -> its bench/trials.py entry, the settings added to it, and its batch-128 pick:
# bench/results/variants/time_to_accuracy.json (cnn: sgd, adamw, kfac_inverse, kfac_eigen_adam),
# bench/results/trial_summaries/cnn (muon, lamb) and
# bench/results/cnn_kfac_schedule_free/time_to_accuracy.json (the batch-128 race's
# winners: schedule_free_adamw among first-order entries, kfac_schedule_free_adamw among
# K-FAC's); SGD's pick is heavy-ball's.
ENTRIES = {
    "kfac_schedule_free_adamw": dict(base="kfac_schedule_free_adamw", extra={},
                                     pick=dict(learning_rate=0.02, damping=0.1)),
    "schedule_free_adamw": dict(base="schedule_free_adamw", extra={},
                                pick=dict(learning_rate=0.01)),
    "kfac_inverse": dict(base="kfac_inverse", extra={},
                         pick=dict(learning_rate=0.05, damping=0.1, kl_clip=1e-3)),
    "sgd_nesterov": dict(base="sgd", extra=dict(nesterov=True), pick=dict(learning_rate=0.1)),
    "adamw": dict(base="adamw", extra={}, pick=dict(learning_rate=0.01)),
    "lamb": dict(base="lamb", extra={}, pick=dict(learning_rate=0.01)),
    "muon": dict(base="muon", extra={}, pick=dict(learning_rate=0.005)),
    "kfac_eigen_adam": dict(base="kfac_eigen_adam", extra={}, pick=dict(learning_rate=1e-3)),
}
# Ablations of the K-FAC entry (not in the default --entries; run at 128 and the largest
# batch): Osawa et al.'s weight rescaling and momentum coupled to the learning rate
# (docs/large_batch.md), and the sampled (true) Fisher in place of the empirical one,
# each tuned around kfac_inverse's pick like the entry itself.
ENTRIES.update({
    "kfac_inverse_recipe": dict(base="kfac_inverse",
                                extra=dict(weight_rescaling=True, couple_momentum_to_lr=True),
                                pick=ENTRIES["kfac_inverse"]["pick"]),
    "kfac_inverse_sampled_fisher": dict(base="kfac_inverse", extra=dict(fisher="sampled"),
                                        pick=ENTRIES["kfac_inverse"]["pick"]),
})
# How the tables (`tables`) name the entries.
LABELS = {
    "kfac_schedule_free_adamw": "K-FAC → ScheduleFreeAdamW (damping 0.1)",
    "schedule_free_adamw": "ScheduleFreeAdamW",
    "kfac_inverse": "K-FAC inverse, KL clip (momentum SGD)",
    "sgd_nesterov": "SGD, Nesterov",
    "adamw": "AdamW",
    "lamb": "Lamb",
    "muon": "Muon",
    "kfac_eigen_adam": "K-FAC, Adam in the eigenbasis",
    "kfac_inverse_recipe": "K-FAC inverse + weight rescaling + coupled momentum",
    "kfac_inverse_sampled_fisher": "K-FAC inverse, sampled Fisher",
}
FIRST_ORDER = ("schedule_free_adamw", "sgd_nesterov", "adamw", "lamb", "muon")
DIVERGED_FILE = "diverged.json"
# The gradient noise scale (docs/design_options.md §13), which McCandlish et al. find
# predicts the critical batch size: measured per epoch in one more run of each entry at
# batch 128 and its chosen point (seed 0, stopping at the top target like the trials),
# every NOISE_INTERVAL steps from the batch's halves; K-FAC entries also give it in the
# preconditioned metric. A separate run, so that the trials' times carry no measuring.
NOISE_BATCH, NOISE_INTERVAL = SMALLEST_BATCH, 5
NOISE_KEYS = ("noise_scale", "preconditioned_noise_scale")
# Times to target side by side (`retime`): per batch size, the chosen points' steps timed
# in RETIME_REPEATS interleaved blocks in one process, from RETIME_CACHED_BATCHES batches
# cycled in memory (the input pipeline, the same for all, is not timed).
RETIME_REPEATS, RETIME_CACHED_BATCHES = 5, 4
# Each chosen point is retimed compiled both ways (`--xla` or not; its steps are the same
# either way) and its times to target are those of the faster, so that every entry runs
# as it runs best at every batch size.
COMPILATIONS = {"graph": False, "xla": True}

flags.DEFINE_list("batch_sizes", ["128", "2048", "512", "8192"],
                  f"Batch sizes to run, in this order, among {', '.join(map(str, BATCHES))}.")
flags.DEFINE_list("entries", ["kfac_schedule_free_adamw", "schedule_free_adamw",
                              "sgd_nesterov", "adamw", "lamb", "muon", "kfac_inverse"],
                  f"Entries to run at each batch size, in this order, among "
                  f"{', '.join(ENTRIES)}.")
flags.DEFINE_bool("collect", False,
                  "Run nothing: write batch_scaling.json and .png from the trials the work "
                  "dir holds.")
flags.DEFINE_bool("noise_scale", True,
                  f"After the batch-{NOISE_BATCH} cells, measure each entry's gradient noise "
                  "scale there at its chosen point (one run each).")
flags.DEFINE_bool("retime", True,
                  "After each batch size's cells, time their chosen points' training steps "
                  "side by side (interleaved blocks in one process): the report's times "
                  "to target.")
flags.DEFINE_string("work_dir", "/tmp/tfkfac_batch_scaling",
                    "Where the trials' runs (summaries, checkpoints) go.")


# ---------------------------------------------------------------------- the protocol
def grid(entry, batch):
    """The series indices (`trials.series_value`) of the learning rates `entry` is tuned
    on at `batch` before any edge move: GRID_POINTS around its pick x √(batch / 128)."""
    center = trials.series_index(ENTRIES[entry]["pick"]["learning_rate"]
                                 * math.sqrt(batch / SMALLEST_BATCH))
    return list(range(center - GRID_BELOW, center - GRID_BELOW + GRID_POINTS))


def outward(indices, best):
    """The index a grid of `indices` moves out to when its best point `best` sits at its
    edge, else None."""
    if best == min(indices):
        return best - 1
    if best == max(indices):
        return best + 1
    return None


def setting(entry, learning_rate):
    """The tuned point: the pick's settings at `learning_rate`; the KL clip, where the
    entry has one, scaled with the learning rate's square."""
    pick = ENTRIES[entry]["pick"]
    point = dict(pick, learning_rate=learning_rate)
    if pick.get("kl_clip"):
        scaled = pick["kl_clip"] * (learning_rate / pick["learning_rate"]) ** 2
        point["kl_clip"] = float(f"{scaled:.3g}")  # 0.1, not 0.10000000000000002
    return point


def trial_settings(entry, batch, learning_rate, seed):
    """The trainer settings of one trial."""
    spec, budget = ENTRIES[entry], BATCHES[batch]
    settings = dict(trials.protocol(spec["base"], setting(entry, learning_rate),
                                    budget["epochs"], WEIGHT_DECAY),
                    **spec["extra"], model=MODEL, batch_size=batch, seed=seed,
                    eval_every_steps=budget["eval_every_steps"],
                    target_accuracy=max(TARGETS), stop_at_target=True)
    if settings["optimizer"] == "kfac":
        settings.update({key: budget[key] for key in KFAC_BATCH_SETTINGS})
    return settings


def trial_name(entry, batch, learning_rate, seed):
    return f"{entry}-batch{batch}-{trials.slug(setting(entry, learning_rate))}-seed{seed}"


# ------------------------------------------------------------------- trials and cells
def record(summary, learning_rate, seed):
    """What the report keeps of a finished trial: steps and training time to each target
    (None where not reached), its best accuracy and its mean step time."""
    curve = trials.curve(summary)
    firsts = {str(target): next(({"steps": steps, "time_s": time_s}
                                 for time_s, steps, accuracy in curve if accuracy >= target),
                                None) for target in TARGETS}
    return {"learning_rate": learning_rate, "seed": seed, "diverged": False,
            "gave_up": summary.get("gave_up", False),
            "steps": summary["steps"], "best_accuracy": max(point[2] for point in curve),
            "mean_step_time_s": summary["mean_step_time_s"]["all"], "to_target": firsts}


def diverged_record(learning_rate, seed, message):
    return {"learning_rate": learning_rate, "seed": seed, "diverged": True,
            "message": message}


def read_trial(entry, batch, learning_rate, seed):
    """The record of a finished (or diverged) trial in the work dir, else None."""
    name = trial_name(entry, batch, learning_rate, seed)
    marker = os.path.join(FLAGS.work_dir, name, DIVERGED_FILE)
    if os.path.exists(marker):
        with open(marker, encoding="utf-8") as f:
            return diverged_record(learning_rate, seed, json.load(f)["message"])
    summary = trials.read(FLAGS.work_dir, name,
                          **trial_settings(entry, batch, learning_rate, seed))
    return None if summary is None else record(summary, learning_rate, seed)


def run_trial(entry, batch, learning_rate, seed, give_up=None):
    """The record of a trial, run (or resumed) unless the work dir holds it finished. A
    run that diverges is marked so that a restart skips it. With `give_up` (steps,
    accuracy), the run stops once past those steps without having reached that
    accuracy by then."""
    done = read_trial(entry, batch, learning_rate, seed)
    if done is not None:
        return done
    name = trial_name(entry, batch, learning_rate, seed)
    settings = trial_settings(entry, batch, learning_rate, seed)
    if give_up is not None:
        settings.update(give_up_steps=give_up[0], give_up_accuracy=give_up[1])
    try:
        summary = trials.run(FLAGS.work_dir, name, **settings)
    except errors.RunError as error:
        if "training diverged" not in str(error):
            raise
        with open(os.path.join(FLAGS.work_dir, name, DIVERGED_FILE), "w",
                  encoding="utf-8") as f:
            json.dump({"message": str(error)}, f)
        print(f"--- {name}: diverged", flush=True)
        return diverged_record(learning_rate, seed, str(error))
    return record(summary, learning_rate, seed)


def rank(trial):
    """Sort key of a tuning trial: fewest steps to the primary target; then those that
    never reached it, by best accuracy; diverged ones last."""
    if trial["diverged"]:
        return (2, 0.0)
    reached = trial["to_target"][str(PRIMARY_TARGET)]
    return (0, reached["steps"]) if reached else (1, -trial["best_accuracy"])


def over_seeds(runs, target, budget):
    """Median steps and training time to `target` over the seeds' records `runs`
    (a seed that did not reach it counts as infinite; an infinite median is None, with
    `steps_above` the budget it exceeds)."""
    firsts = [None if run["diverged"] else run["to_target"][str(target)] for run in runs]
    result = {"reached": sum(first is not None for first in firsts)}
    for key in ("steps", "time_s"):
        median = statistics.median(math.inf if first is None else first[key]
                                   for first in firsts)
        result[f"median_{key}"] = None if math.isinf(median) else median
    if result["median_steps"] is None:
        result["steps_above"] = budget
    return result


def cell(entry, batch, get):
    """One (entry, batch): its tuning, edge moves, chosen point and second seed, with the
    trials `get(learning_rate, seed, give_up)` returns (None: not run yet; the cell is
    then incomplete, with the trials it has). Tuning trials run from the grid's centre
    outward, each with `give_up_rule`'s (steps, accuracy)."""
    indices = grid(entry, batch)
    center = indices[GRID_BELOW]
    found, moves = {}, 0
    while True:
        for index in sorted(indices, key=lambda index: (abs(index - center), index)):
            if index not in found:
                trial = get(trials.series_value(index), SEEDS[0],
                            give_up_rule(found, batch))
                if trial is None:
                    return {"complete": False, "trials": sorted_trials(found)}
                found[index] = trial
        best = min(indices, key=lambda index: rank(found[index]))
        further = outward(indices, best)
        if further is None or moves == MAX_EDGE_MOVES:
            break
        indices, moves = indices + [further], moves + 1
    chosen = found[best]
    second = get(chosen["learning_rate"], SEEDS[1], None)
    if second is None:
        return {"complete": False, "trials": sorted_trials(found)}
    budget = budget_steps(batch)
    return {"complete": True, "trials": sorted_trials(found),
            "initial_grid": [trials.series_value(i) for i in grid(entry, batch)],
            "edge_moves": moves, "best_at_edge": further is not None,
            "chosen": setting(entry, chosen["learning_rate"]), "seeds": [chosen, second],
            "to_target": {str(target): over_seeds([chosen, second], target, budget)
                          for target in TARGETS}}


def budget_steps(batch):
    return BATCHES[batch]["epochs"] * (TRAIN_EXAMPLES // batch)


def give_up_rule(found, batch):
    """When a tuning trial gives up, as (steps, accuracy) it must have reached by then:
    past the fewest steps to the primary target of the trials `found` (it can no longer
    win), or before any has reached it, at EARLY_FRACTION of the budget below
    EARLY_ACCURACY (it has collapsed)."""
    fewest = fewest_steps(found)
    if fewest is not None:
        return fewest, PRIMARY_TARGET
    return int(EARLY_FRACTION * budget_steps(batch)), EARLY_ACCURACY


def fewest_steps(found):
    """The fewest steps to the primary target among the trials `found`, or None."""
    return min((rank(trial)[1] for trial in found.values() if rank(trial)[0] == 0),
               default=None)


def sorted_trials(found):
    return [found[index] for index in sorted(found)]


def noise_name(entry, learning_rate):
    return f"noise-{trial_name(entry, NOISE_BATCH, learning_rate, SEEDS[0])}"


def noise_settings(entry, learning_rate):
    return dict(trial_settings(entry, NOISE_BATCH, learning_rate, SEEDS[0]),
                noise_scale=True, noise_scale_interval=NOISE_INTERVAL)


def noise_record(summary, learning_rate):
    """Per epoch of a noise run: its steps and the noise scales it logged."""
    return {"learning_rate": learning_rate, "batch": NOISE_BATCH,
            "interval": NOISE_INTERVAL,
            "epochs": [dict({"epoch": row["epoch"], "steps": row["steps"]},
                            **{key: row[key] for key in NOISE_KEYS if key in row})
                       for row in summary["history"]]}


def noise_scale(entry, cells, run):
    """The noise run of `entry` at its batch-128 cell's chosen point, run (`run`) or read
    back; None while that cell is incomplete or the run is not there."""
    found = cells.get(entry, {}).get(NOISE_BATCH)
    if not found or not found["complete"]:
        return None
    learning_rate = found["chosen"]["learning_rate"]
    settings = noise_settings(entry, learning_rate)
    summary = (trials.run if run else trials.read)(FLAGS.work_dir,
                                                   noise_name(entry, learning_rate), **settings)
    return None if summary is None else noise_record(summary, learning_rate)


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


def retime(batch, cells):
    """The chosen points of every complete cell at `batch` (of `cells`, {entry: {batch:
    cell}}) trained side by side in one process, in each of COMPILATIONS,
    RETIME_REPEATS interleaved blocks each, so that their times to target compare on one
    machine at one time; the trials' own clocks ran hours or sessions apart, on machines
    that differ. Kept in the work dir; run again when the complete cells there (or the
    compilations) are others."""
    chosen = {entry: by_batch[batch]["chosen"] for entry, by_batch in cells.items()
              if batch in by_batch and by_batch[batch]["complete"]}
    done = read_retime(batch)
    if not chosen or (done is not None and set(done["entries"]) == set(chosen)):
        return done
    block_steps = BATCHES[batch]["timing_block_steps"]
    print(f"--- retiming batch {batch}: {', '.join(chosen)}; {', '.join(COMPILATIONS)}",
          flush=True)
    with tempfile.TemporaryDirectory() as model_dir:
        timed = {(entry, compilation): timed_steps.Timed(config_lib.TrainConfig(
            model_dir=os.path.join(model_dir, f"{entry}-{compilation}"), verbose=0, xla=xla,
            **trial_settings(entry, batch, point["learning_rate"], SEEDS[0])),
            RETIME_CACHED_BATCHES, block_steps)
            for entry, point in chosen.items() for compilation, xla in COMPILATIONS.items()}
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
def scaling_steps(cells, target):
    """Per step between consecutive measured batches: the cut in median steps to
    `target`, the threshold, and whether it still scales (None: undetermined)."""
    batches = sorted(cells)
    steps = []
    for low, high in zip(batches, batches[1:]):
        needed = CUT_PER_DOUBLING ** math.log2(high / low)
        before = cells[low]["to_target"][str(target)]
        after = cells[high]["to_target"][str(target)]
        item = {"from": low, "to": high, "needed_cut": needed}
        if before["median_steps"] is None:
            item.update(cut=None, scales=None)
        elif after["median_steps"] is not None:
            cut = before["median_steps"] / after["median_steps"]
            item.update(cut=cut, scales=cut >= needed)
        else:
            bound = before["median_steps"] / after["steps_above"]
            item.update(cut_below=bound, scales=False if bound < needed else None)
        steps.append(item)
    return steps


def critical_batch(cells, target):
    """The critical batch size at `target` (module docstring) from an entry's complete
    cells {batch: cell}: the batch, whether it is a lower bound, and the steps judged;
    with McCandlish et al.'s fit beside it."""
    steps = scaling_steps(cells, target)
    scaling = [step["from"] for step in steps if step["scales"]]
    batch = max(scaling, default=None)
    return {"critical_batch": batch,
            "at_least": bool(steps) and steps[-1]["scales"] is True,
            "below_smallest": bool(steps) and batch is None and steps[0]["scales"] is False,
            "undetermined": [step["from"] for step in steps if step["scales"] is None],
            "steps": steps, "fitted": fitted_critical_batch(cells, target)}


def fitted_critical_batch(cells, target):
    """McCandlish et al.'s S(B) = S_min (1 + B_crit / B) fitted by least squares in 1/B to
    the median steps to `target` of the batches that reached it: the critical batch in
    the units of the noise scale B_simple, which predicts it. None with fewer than two
    such batches, or where the steps do not fall as that curve can (S_min or B_crit not
    positive)."""
    points = [(1 / batch, cell["to_target"][str(target)]["median_steps"])
              for batch, cell in sorted(cells.items())
              if cell["to_target"][str(target)]["median_steps"] is not None]
    if len(points) < 2:
        return None
    slope, min_steps = statistics.linear_regression(*zip(*points))
    if min_steps <= 0 or slope <= 0:
        return None
    return {"min_steps": min_steps, "critical_batch": slope / min_steps,
            "batches": [round(1 / x) for x, _ in points]}


def best_first_order(entries, batch, target):
    """The first-order entry with the fewest median steps to `target` at `batch`, or
    None when none reached it there."""
    reached = {name: result["batches"][batch]["to_target"][str(target)]["median_steps"]
               for name, result in entries.items()
               if name in FIRST_ORDER and batch in result["batches"]
               and result["batches"][batch]["complete"]
               and result["batches"][batch]["to_target"][str(target)]["median_steps"]}
    return min(reached, key=reached.get, default=None)


def over_best_first_order(entries, entry):
    """Per batch and target: `entry`'s median steps over the best first-order entry's
    there, or the bound it is below when no first-order entry reached the target."""
    out = {}
    for batch, result in entries[entry]["batches"].items():
        if not result["complete"]:
            continue
        for target in TARGETS:
            mine = result["to_target"][str(target)]["median_steps"]
            if mine is None:
                continue
            best = best_first_order(entries, batch, target)
            if best is not None:
                theirs = entries[best]["batches"][batch]
                ratio = {"steps": mine / theirs["to_target"][str(target)]["median_steps"],
                         "baseline": best}
                times = [cell.get("retimed", {}).get("time_s_to_target", {}).get(str(target))
                         for cell in (result, theirs)]
                if all(times):
                    ratio["time"] = times[0] / times[1]
            else:
                bounds = [r["batches"][batch]["to_target"][str(target)]["steps_above"]
                          for name, r in entries.items() if name in FIRST_ORDER
                          and batch in r["batches"] and r["batches"][batch]["complete"]]
                if not bounds:
                    continue
                ratio = {"steps_below": mine / min(bounds)}
            out.setdefault(str(batch), {})[str(target)] = ratio
    return out


def report(cells, noise):
    """The JSON document of `cells` {entry: {batch: cell}} and the noise runs `noise`
    {entry: noise_record or None}."""
    entries = {}
    for entry, by_batch in cells.items():
        complete = {batch: c for batch, c in by_batch.items() if c["complete"]}
        entries[entry] = {
            "settings": dict(trials.OPTIMIZERS[ENTRIES[entry]["base"]],
                             **ENTRIES[entry]["extra"]),
            "batch_128_pick": ENTRIES[entry]["pick"],
            "batches": dict(sorted(by_batch.items())),
            "critical_batch": {str(target): critical_batch(complete, target)
                               for target in TARGETS},
            "noise_scale": noise.get(entry)}
    for entry in entries:
        if entry not in FIRST_ORDER:
            entries[entry]["over_best_first_order"] = over_best_first_order(entries, entry)
    for result in entries.values():  # JSON keys are strings
        result["batches"] = {str(batch): c for batch, c in result["batches"].items()}
    return {
        "model": MODEL, "dataset": "fashion_mnist", "targets": list(TARGETS),
        "primary_target": PRIMARY_TARGET, "seeds": list(SEEDS),
        "protocol": {
            "budgets": {str(batch): dict(budget, steps=budget_steps(batch))
                        for batch, budget in BATCHES.items()},
            "schedule": f"linear warm-up over {trials.WARMUP_FRACTION:.0%} of the budget, "
                        "then half a cosine to 0 at its end",
            "weight_decay_per_step": WEIGHT_DECAY,
            "grid": f"{GRID_POINTS} learning rates of the 1-2-5 series, the batch-128 pick "
                    f"x sqrt(B/128) rounded to it and {GRID_BELOW} points below it; a best "
                    f"point at the edge moves the grid out one point (at most "
                    f"{MAX_EDGE_MOVES} times)",
            "kl_clip": "scaled with the learning rate's square from the batch-128 pick",
            "kfac_batch_settings": list(KFAC_BATCH_SETTINGS),
            "selection": f"fewest steps to {PRIMARY_TARGET}; then best accuracy",
            "stop": f"each trial stops at the top target {max(TARGETS)}; tuning trials "
                    "run from the grid's centre outward, each giving up at its first "
                    f"evaluation past the fewest steps to {PRIMARY_TARGET} so far unless "
                    f"it reached it by then, or before any has, below {EARLY_ACCURACY} at "
                    f"{EARLY_FRACTION:.0%} of the budget",
            "critical_batch": f"the largest measured B whose step to the next grid batch rB "
                              f"cuts the median steps by >= {CUT_PER_DOUBLING}^log2(r); "
                              "fitted: S(B) = S_min (1 + B_crit / B) by least squares in "
                              "1/B (McCandlish et al.: B_crit = E_min / S_min)",
            "noise_scale": f"B_simple per epoch of one run at batch {NOISE_BATCH}, the "
                           f"chosen point, seed {SEEDS[0]}, measured every {NOISE_INTERVAL} "
                           "steps from the batch's halves"},
            "retimed": f"per batch size, every complete cell's chosen point trained side by "
                       f"side in one process, compiled with XLA and without, "
                       f"{RETIME_REPEATS} interleaved blocks of timing_block_steps steps "
                       "each from cached batches; time to a target = the first steps' time "
                       "(tracing included) + the rest of the median steps x the median "
                       "block step time, in the compilation that reaches the primary "
                       "target first",
        "entries": entries,
    }


# ---------------------------------------------------------------------- the tables
TABLES_BEGIN = "<!-- batch_scaling tables: bench/batch_scaling.py --collect prints them -->"
TABLES_END = "<!-- end of batch_scaling tables -->"
SUMMARY_BEGIN = "<!-- batch_scaling summary: bench/batch_scaling.py --collect prints it -->"
SUMMARY_END = "<!-- end of batch_scaling summary -->"


def tables(document):
    """The Markdown tables of `document` (`report`'s) that docs/large_batch.md holds
    between TABLES_BEGIN and TABLES_END: per batch size the complete cells' chosen
    learning rates, step times and steps (seconds) to each target, the fewest steps to
    the primary target in bold; K-FAC's ratios to the best first-order entry; per entry
    the critical batch sizes, McCandlish et al.'s fit and the noise scale."""
    entries = document["entries"]
    lines = [TABLES_BEGIN]
    for batch in sorted({int(b) for r in entries.values() for b in r["batches"]}):
        complete = {name: r["batches"][str(batch)] for name, r in entries.items()
                    if r["batches"].get(str(batch), {}).get("complete")}
        if not complete:
            continue
        budget = document["protocol"]["budgets"][str(batch)]["steps"]
        fewest = min((c["to_target"][str(PRIMARY_TARGET)]["median_steps"] or math.inf
                      for c in complete.values()), default=math.inf)
        lines += ["", f"Batch {batch} ({len(complete)} "
                      f"{'entry' if len(complete) == 1 else 'entries'} complete; budget {budget} "
                      "steps): median steps (seconds) to each target", "",
                  "| entry | learning rate | step ms | "
                  + " | ".join(f"{t:.2f}" for t in TARGETS) + " |",
                  "| --- | --- | --- |" + " --- |" * len(TARGETS)]
        for name, found in sorted(complete.items(), key=lambda item: _primary_steps(item[1])):
            timing = found.get("retimed")
            cells = [_reached(found, timing, target, fewest) for target in TARGETS]
            lines.append(f"| {LABELS[name]} | {_learning_rate(found)} | {_step_ms(timing)} | "
                         + " | ".join(cells) + " |")
        for name, r in entries.items():
            ratio = r.get("over_best_first_order", {}).get(str(batch), {}).get(
                str(PRIMARY_TARGET))
            if ratio and "baseline" in ratio:
                time = f" and {ratio['time']:.2f}x its time" if "time" in ratio else ""
                baseline = LABELS[ratio["baseline"]]
                lines += ["", f"{LABELS[name]}: {ratio['steps']:.2f}x {baseline}'s steps "
                              f"to {PRIMARY_TARGET:.2f}{time}."]
            elif ratio:
                lines += ["", f"{LABELS[name]}: < {ratio['steps_below']:.2f}x the steps of "
                              f"every first-order entry to {PRIMARY_TARGET:.2f} (none reached "
                              "it)."]
    lines += ["", "Critical batch size per entry (threshold rule; McCandlish et al.'s fitted "
                  f"B_crit and S_min at {PRIMARY_TARGET:.2f}) and the noise scale B_simple at "
                  f"batch {NOISE_BATCH}, epochs 1 / 2 (preconditioned for K-FAC); ? where "
                  "a budget leaves it undetermined, – before two batches are complete:", "",
              "| entry | critical batch " + " / ".join(f"{t:.2f}" for t in TARGETS)
              + " | fitted B_crit (S_min) | B_simple |", "| --- | --- | --- | --- |"]
    for name, r in entries.items():
        if not any(c["complete"] for c in r["batches"].values()):
            continue
        critical = " / ".join(_critical(r["critical_batch"][str(t)]) for t in TARGETS)
        lines.append(f"| {LABELS[name]} | {critical} | "
                     f"{_fit(r['critical_batch'][str(PRIMARY_TARGET)])} | "
                     f"{_noise(r['noise_scale'])} |")
    return "\n".join(lines + ["", TABLES_END])


def summary(document):
    """The Markdown table of `document` that docs/benchmarks.md holds between
    SUMMARY_BEGIN and SUMMARY_END, the headline of `tables`: per entry the steps to the
    primary target at every batch size (the fewest per batch in bold), its critical batch
    size there, McCandlish et al.'s fit and the noise scale."""
    entries = document["entries"]
    batches = sorted({int(b) for r in entries.values() for b, c in r["batches"].items()
                      if c["complete"]})
    fewest = {batch: min(_primary_steps(r["batches"][str(batch)]) for r in entries.values()
                         if r["batches"].get(str(batch), {}).get("complete"))
              for batch in batches}
    lines = [SUMMARY_BEGIN, "", f"| entry | {' | '.join(f'batch {b}' for b in batches)} | "
             "critical batch | fitted B_crit (S_min) | B_simple |",
             "| --- |" + " --- |" * (len(batches) + 3)]
    for name, r in entries.items():
        steps = []
        for batch in batches:
            found = r["batches"].get(str(batch))
            steps.append(_reached(found, None, PRIMARY_TARGET, fewest[batch])
                         if found and found["complete"] else "–")
        if any(cell != "–" for cell in steps):
            critical = r["critical_batch"][str(PRIMARY_TARGET)]
            lines.append(f"| {LABELS[name]} | {' | '.join(steps)} | {_critical(critical)} | "
                         f"{_fit(critical)} | {_noise(r['noise_scale'])} |")
    return "\n".join(lines + ["", SUMMARY_END])


def _primary_steps(found):
    return found["to_target"][str(PRIMARY_TARGET)]["median_steps"] or math.inf


def _reached(found, timing, target, fewest):
    reached = found["to_target"][str(target)]
    if reached["median_steps"] is None:
        return f"> {reached['steps_above']}"
    text = f"{reached['median_steps']:g}"
    seconds = timing and timing["time_s_to_target"][str(target)]
    if seconds is not None:
        text += f" ({seconds:.1f} s)"
    return f"**{text}**" if target == PRIMARY_TARGET and reached["median_steps"] == fewest \
        else text


def _learning_rate(found):
    """The chosen learning rate, and how often and which way the grid moved."""
    text = f"{found['chosen']['learning_rate']:g}"
    moves = found["edge_moves"]
    if moves:
        down = min(t["learning_rate"] for t in found["trials"]) < min(found["initial_grid"])
        text += (f" (grid moved {'down' if down else 'up'} "
                 f"{'once' if moves == 1 else f'{moves} times'})")
    return text + (" (best at the grid's edge)" if found["best_at_edge"] else "")


def _step_ms(timing):
    if not timing:
        return "–"
    step = {key: value * 1e3 for key, value in timing["step_s"].items()}
    return (f"{step['median']:.1f} [{step['min']:.1f}-{step['max']:.1f}]"
            f"{' XLA' if COMPILATIONS[timing['compilation']] else ''}")


def _critical(critical):
    if critical["critical_batch"] is not None:
        return f"{'≥ ' if critical['at_least'] else ''}{critical['critical_batch']}"
    if critical["below_smallest"]:
        return f"< {SMALLEST_BATCH}"
    return "?" if critical["undetermined"] else "–"


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
    """Steps to each target against batch size, log-log, with each entry's perfect
    scaling (steps ∝ 1/B from its smallest batch) dotted and McCandlish et al.'s fitted
    curve dashed."""
    figure, axes = harness.subplots(1, len(TARGETS), figsize=(6 * len(TARGETS), 5),
                                    squeeze=False)
    for axis, target in zip(axes[0], TARGETS):
        for entry, result in document["entries"].items():
            color = list(ENTRIES).index(entry)  # the same in every run's figure
            points = [(int(batch), c["to_target"][str(target)])
                      for batch, c in result["batches"].items() if c["complete"]]
            reached = [(b, t["median_steps"]) for b, t in points if t["median_steps"]]
            above = [(b, t["steps_above"]) for b, t in points if not t["median_steps"]]
            if reached:
                axis.plot(*zip(*reached), "o-", color=f"C{color}", label=entry)
                first_batch, first_steps = reached[0]
                ends = [first_batch, max(b for b, _ in points)]
                axis.plot(ends, [first_steps * first_batch / b for b in ends], ":",
                          color=f"C{color}", linewidth=0.8)
            fitted = result["critical_batch"][str(target)]["fitted"]
            if fitted:
                low, high = (math.log2(b) for b in (min(fitted["batches"]), ends[1]))
                batches = [2 ** (low + (high - low) * i / 32) for i in range(33)]
                axis.plot(batches, [fitted["min_steps"] * (1 + fitted["critical_batch"] / b)
                                    for b in batches], "--", color=f"C{color}",
                          linewidth=0.8)
            if above:
                axis.plot(*zip(*above), "^", color=f"C{color}", fillstyle="none",
                          label=None if reached else f"{entry} (not reached)")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("batch size")
        axis.set_ylabel(f"steps to test accuracy {target} (median of {len(SEEDS)} seeds)")
        axis.set_title(f"{document['model']} on Fashion-MNIST, target {target}\n"
                       "dotted: perfect scaling; dashed: S_min (1 + B_crit / B) fitted\n"
                       "open triangles: not reached within the budget", fontsize=9)
        if axis.get_legend_handles_labels()[0]:  # none before a cell is complete
            axis.legend(fontsize=8)
    return figure


# ------------------------------------------------------------------------- the run
def collect():
    """Every cell the work dir holds a trial of, complete or not, and every noise run,
    written out."""
    cells = {}
    for entry in ENTRIES:
        for batch in BATCHES:
            # A finished trial reads back whatever step it gave up at.
            found = cell(entry, batch, lambda learning_rate, seed, _: read_trial(
                entry, batch, learning_rate, seed))
            if found["trials"]:
                cells.setdefault(entry, {})[batch] = found
    for batch in BATCHES:
        for entry, timing in (read_retime(batch) or {"entries": {}})["entries"].items():
            found = cells.get(entry, {}).get(batch)
            if found and found["complete"] and found["chosen"] == timing["chosen"]:
                found["retimed"] = retimed(found, timing)
    noise = {entry: noise_scale(entry, cells, run=False) for entry in cells}
    document = report(cells, noise)
    harness.write(document, "batch_scaling", plot)
    if FLAGS.collect:
        print(summary(document), tables(document), sep="\n\n")
    return cells


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
    for batch in sizes:  # every trial's settings, before hours of runs
        for entry in FLAGS.entries:
            trials.check_entry(entry, trial_settings(entry, batch, ENTRIES[entry]["pick"][
                "learning_rate"], SEEDS[0]))
    for batch in sizes:
        for entry in FLAGS.entries:
            result = cell(entry, batch, functools.partial(run_trial, entry, batch))
            steps = {target: reached["median_steps"]
                     for target, reached in result["to_target"].items()}
            print(f"{entry} batch {batch}: chosen {json.dumps(result['chosen'])}, median "
                  f"steps to target {json.dumps(steps)}", flush=True)
            cells = collect()
        if FLAGS.noise_scale and batch == NOISE_BATCH:
            for entry in FLAGS.entries:
                noise_scale(entry, cells, run=True)
            cells = collect()
        if FLAGS.retime:
            retime(batch, cells)
            collect()


if __name__ == "__main__":
    harness.run(main)
