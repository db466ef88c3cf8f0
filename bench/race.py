"""The timed race of the benchmarks' protocol (docs/benchmarks.md, "Protocol").

Every entry of a model is timed in one window: seed by seed, the entries alternating
(their order reversed every other round, so a drift of the machine within a round does
not favour one side); the seeds are fresh (the tuning trials ran seed 0); the declared
default and the best first-order entry run `HEADLINE_SEEDS` seeds, the others
`OTHER_SEEDS`. The final target is the accuracy the best first-order entry ends its
budget at (the median over its seeds; Pauloski et al.'s criterion), with two earlier
targets below it. A ratio of two entries is the median over the rounds both ran of the
per-round ratio (entries of one round ran side by side), with a bootstrap interval
over those rounds; "faster" only where the interval's upper end is below 1.
"""

import math
import statistics

import numpy as np

# The race's entries (bench/trials.py OPTIMIZERS): the declared default and the
# first-order ones, with the names the tables give them.
DEFAULT_ENTRY = "kfac"
FIRST_ORDER = ("sgd", "adamw", "muon", "schedule_free_adamw", "lamb")
NAMES = {"kfac": "K-FAC (default)", "sgd": "SGD, Nesterov", "adamw": "AdamW",
         "muon": "Muon", "schedule_free_adamw": "ScheduleFreeAdamW", "lamb": "Lamb"}
FIRST_SEED = 1
HEADLINE_SEEDS, OTHER_SEEDS = 5, 3
# The earlier targets, this far below the final one.
EARLIER_TARGET_OFFSETS = (0.02, 0.01)
INTERVAL = 0.90
BOOTSTRAP_SAMPLES = 10_000
BOOTSTRAP_SEED = 0


def seed_counts(entries, headline):
    """{entry: number of timed seeds}: HEADLINE_SEEDS for the entries in `headline`."""
    return {entry: HEADLINE_SEEDS if entry in headline else OTHER_SEEDS for entry in entries}


def rounds(counts):
    """The timed runs in their order, (seed, entry): round k runs seed FIRST_SEED + k of
    every entry that has that many seeds, in `counts`' order, reversed every other
    round."""
    order = []
    for index in range(max(counts.values())):
        entries = [entry for entry, count in counts.items() if count > index]
        order += [(FIRST_SEED + index, entry)
                  for entry in (entries if index % 2 == 0 else entries[::-1])]
    return order


def final_accuracy(run):
    """The accuracy of a run's last evaluation: the end of its budget."""
    return run["curve"][-1][2]


def final_target(runs, first_order):
    """(target, entry): the highest median final accuracy among the `first_order`
    entries of `runs` ({entry: [run, ...]}), and that entry."""
    medians = {entry: statistics.median(final_accuracy(run) for run in runs[entry])
               for entry in first_order if runs.get(entry)}
    entry = max(medians, key=medians.get)
    return medians[entry], entry


def targets(final):
    """The targets of a race whose final target is `final`, ascending."""
    return [round(final - offset, 4) for offset in EARLIER_TARGET_OFFSETS] + [final]


def crossing(run, target):
    """{time_s, steps, quantization} at the first evaluation of `run` at or above
    `target`, or None: `quantization` is the share of that time since the evaluation
    before it, the most by which the crossing can be late."""
    curve = run["curve"]
    for index, (time_s, steps, accuracy) in enumerate(point[:3] for point in curve):
        if accuracy >= target:
            before = curve[index - 1][0] if index else 0.0
            return {"time_s": time_s, "steps": steps,
                    "quantization": (time_s - before) / time_s if time_s else 0.0}
    return None


def per_seed(runs, target, key):
    """{seed: `key` of the crossing of `target`} over `runs`, infinite where a seed never
    reaches it."""
    values = {}
    for run in runs:
        reached = crossing(run, target)
        values[run["seed"]] = math.inf if reached is None else reached[key]
    return values


def median_or_none(values):
    """The median of `values`, None when it is infinite (over half never reached)."""
    median = statistics.median(values)
    return None if math.isinf(median) else median


def ratio(mine, theirs):
    """Per-round ratio of two {seed: value} dicts over their common seeds: the median
    and its bootstrap `INTERVAL` interval (None where undefined), and the per-round
    values. A seed one entry never reached counts as infinite, so a ratio is inf or 0
    there; both unreached is undefined (left out)."""
    seeds = sorted(set(mine) & set(theirs))
    values = [_divide(mine[seed], theirs[seed]) for seed in seeds]
    defined = np.array([value for value in values if not math.isnan(value)])
    result = {"seeds": seeds, "per_seed": values, "median": None, "low": None, "high": None}
    if not len(defined):
        return result
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    draws = rng.choice(defined, size=(BOOTSTRAP_SAMPLES, len(defined)))
    medians = np.median(draws, axis=1)
    tail = (1 - INTERVAL) / 2 * 100
    # The bootstrap medians take few distinct values: the nearest of them, no
    # interpolation (which infinite values would turn into NaN).
    low, high = np.percentile(medians, [tail, 100 - tail], method="nearest")
    result.update(median=float(np.median(defined)), low=float(low), high=float(high))
    result["faster"] = bool(result["high"] < 1)
    return result


def _divide(mine, theirs):
    if math.isinf(mine) and math.isinf(theirs):
        return math.nan
    if math.isinf(theirs):
        return 0.0
    return math.inf if math.isinf(mine) else mine / theirs


def bootstrap_medians(groups, samples=BOOTSTRAP_SAMPLES):
    """{group: `samples` bootstrap medians of its values}, each group of `groups` ({group:
    values, inf where a seed never reached}) resampled with replacement on its own, for
    a statistic of several groups' medians (e.g. the critical batch over batch sizes,
    bench/batch_scaling.py): draw k of every group makes its k-th sample."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    medians = {}
    for group, values in groups.items():
        values = np.asarray(values, dtype=float)
        medians[group] = np.median(rng.choice(values, size=(samples, len(values))), axis=1)
    return medians
