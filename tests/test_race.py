"""bench/race.py: the race's order of runs, its targets, the crossing of a target with
its quantization, and the per-round ratio with its bootstrap interval, against values
worked out by hand and a resampling written out in plain Python."""

import math
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

from absl.testing import absltest  # noqa: E402

import race  # noqa: E402


def run(seed, points):
    """A run whose curve is `points` of (time_s, steps, accuracy)."""
    return {"seed": seed, "curve": [list(point) for point in points]}


class RaceTest(absltest.TestCase):

    def test_rounds_alternate_and_give_headline_entries_more_seeds(self):
        counts = race.seed_counts(["kfac", "sgd", "adamw"], headline=("kfac", "adamw"))
        self.assertEqual(counts, {"kfac": 5, "sgd": 3, "adamw": 5})
        order = race.rounds(counts)
        self.assertEqual(order[:6], [(1, "kfac"), (1, "sgd"), (1, "adamw"),
                                     (2, "adamw"), (2, "sgd"), (2, "kfac")])
        self.assertEqual(order[9:], [(4, "adamw"), (4, "kfac"), (5, "kfac"), (5, "adamw")])
        self.assertLen(order, 13)

    def test_final_target_is_the_best_first_order_median_end(self):
        runs = {"sgd": [run(s, [(1, 10, 0.5), (2, 20, a)]) for s, a in
                        ((1, 0.91), (2, 0.93), (3, 0.92))],
                "adamw": [run(s, [(1, 10, 0.6), (2, 20, a)]) for s, a in
                          ((1, 0.90), (2, 0.95), (3, 0.90))],
                "kfac": [run(1, [(1, 10, 0.99)])]}
        self.assertEqual(race.final_target(runs, ("sgd", "adamw")), (0.92, "sgd"))
        self.assertEqual(race.targets(0.92), [0.9, 0.91, 0.92])

    def test_crossing_and_its_quantization(self):
        curve = run(1, [(10.0, 100, 0.80), (12.0, 120, 0.90), (15.0, 150, 0.89)])
        self.assertEqual(race.crossing(curve, 0.85),
                         {"time_s": 12.0, "steps": 120, "quantization": 2.0 / 12.0})
        self.assertIsNone(race.crossing(curve, 0.95))
        self.assertEqual(race.per_seed([curve], 0.95, "time_s"), {1: math.inf})
        self.assertIsNone(race.median_or_none([1.0, math.inf, math.inf]))
        self.assertEqual(race.median_or_none([1.0, 2.0, math.inf]), 2.0)

    def test_ratio_median_and_interval_against_a_plain_resampling(self):
        mine = {1: 6.0, 2: 9.0, 3: 10.0, 4: 7.0, 5: 20.0}
        theirs = {1: 10.0, 2: 10.0, 3: 10.0, 4: 10.0, 5: 10.0, 6: 4.0}
        result = race.ratio(mine, theirs)
        values = [0.6, 0.9, 1.0, 0.7, 2.0]
        self.assertEqual(result["seeds"], [1, 2, 3, 4, 5])
        self.assertEqual(result["per_seed"], values)
        self.assertAlmostEqual(result["median"], 0.9)
        # The same bootstrap, resampled with Python's own generator: the interval ends
        # agree to the resampling's noise.
        rng = random.Random(1)
        medians = sorted(statistics.median(rng.choices(values, k=5)) for _ in range(20000))
        self.assertAlmostEqual(result["low"], medians[int(0.05 * 20000)], delta=0.051)
        self.assertAlmostEqual(result["high"], medians[int(0.95 * 20000)], delta=0.051)
        self.assertFalse(result["faster"])  # the interval holds 1: a tie

    def test_a_ratio_is_faster_only_when_its_interval_is_below_one(self):
        result = race.ratio({1: 5.0, 2: 6.0, 3: 7.0}, {1: 10.0, 2: 10.0, 3: 10.0})
        self.assertTrue(result["faster"])
        self.assertLess(result["high"], 1)

    def test_unreached_seeds(self):
        result = race.ratio({1: math.inf, 2: 5.0, 3: math.inf},
                            {1: 10.0, 2: math.inf, 3: math.inf})
        self.assertEqual(result["per_seed"][:2], [math.inf, 0.0])
        self.assertTrue(math.isnan(result["per_seed"][2]))
        self.assertEqual(race.ratio({1: math.inf}, {1: math.inf})["median"], None)


if __name__ == "__main__":
    absltest.main()
