"""bench/race.py: the race's order of runs, its targets, the crossing of a target with
its quantization, and the per-round ratio with its bootstrap interval, against values
worked out by hand and a resampling written out in plain Python; bench/race_tables.py:
docs/benchmarks.md's race tables are what it writes from the JSON, and what it writes
for a race."""

import math
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

from absl.testing import absltest  # noqa: E402

import race  # noqa: E402
import race_tables  # noqa: E402


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


class RaceTablesTest(absltest.TestCase):

    def test_the_pages_quote_what_the_json_holds(self):
        report = race_tables.read_report()
        for path, headline in ((race_tables.PAGE, False), (race_tables.README, True)):
            with open(path, encoding="utf-8") as f:
                page = f.read()
            self.assertEqual(race_tables.block(page), race_tables.tables(report, headline),
                             msg=f"{path}'s race tables are stale: run "
                                 ".venv/bin/python bench/race_tables.py")

    def test_a_race_gives_each_ratio_its_interval_and_verdict(self):
        # 0.90: K-FAC at 10 s in every round, Muon at 20 s (0.5x, faster); 0.92: K-FAC at
        # 35, 40 and 30 s, Muon at 30 s (1.17x, interval [1.00, 1.33] holds 1: a tie);
        # 0.93: K-FAC never.
        kfac = [dict(run(s, [(10, 100, 0.90), (30 + 5 * (s % 3), 300, 0.92)]),
                     final_accuracy=0.92) for s in (1, 2, 3)]
        muon = [dict(run(s, [(20, 200, 0.90), (30, 300, 0.93)]), final_accuracy=0.93)
                for s in (1, 2, 3)]
        runs = {"kfac": kfac, "muon": muon}
        targets = [0.9, 0.92, 0.93]
        ratios = {"muon": {str(t): {key: race.ratio(race.per_seed(kfac, t, key),
                                                   race.per_seed(muon, t, key))
                                    for key in ("time_s", "steps")} for t in targets}}
        to_target = {entry: {str(t): {
            "reached": sum(race.crossing(r, t) is not None for r in entry_runs),
            "median_time_s": race.median_or_none(race.per_seed(entry_runs, t, "time_s")
                                                 .values()),
            "median_steps": race.median_or_none(race.per_seed(entry_runs, t, "steps")
                                                .values())} for t in targets}
            for entry, entry_runs in runs.items()}
        result = {"final_target": {"accuracy": 0.93, "entry": "muon"}, "targets": targets,
                  "runs": runs, "to_target": to_target, "ratios": {"kfac": ratios},
                  "measured_at_commit": "abc1234"}
        text = race_tables.tables({"models": {"cnn": result}})
        self.assertIn("final target 0.9300 (Muon's median final accuracy)", text)
        self.assertIn("| Muon (3 rounds) | 0.50x [0.50, 0.50], faster | "
                      "1.17x [1.00, 1.33], tie | ∞x [∞, ∞], slower |", text)
        self.assertIn(race_tables.RATIO_LEGEND, text)
        headline = race_tables.tables({"models": {"cnn": result}}, headline=True)
        self.assertTrue(text.startswith(headline))
        self.assertNotIn("| entry |", headline)
        self.assertEqual([race_tables.ratio_number(x) for x in (0.0, 0.456, float("inf"))],
                         ["0", "0.46", "∞"])
        self.assertIn("| K-FAC (default) | 10.0 s, 100 steps (3/3) | 35.0 s, 300 steps "
                      "(3/3) | not reached (0/3) | 0.9200 |", text)
        self.assertNotIn("abc1234", text)  # user docs name no commit; the JSON holds it
        self.assertEqual(race_tables.tables(None), race_tables.NOT_RACED)

    def test_the_page_is_rewritten_between_its_markers_only(self):
        path = os.path.join(absltest.get_default_test_tmpdir(), "page.md")
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"before\n{race_tables.BEGIN}\nold\n{race_tables.END}\nafter\n")
        race_tables.write(path, report={})
        with open(path, encoding="utf-8") as f:
            self.assertEqual(f.read(), f"before\n{race_tables.BEGIN}\n"
                                       f"{race_tables.NOT_RACED}\n{race_tables.END}\nafter\n")
        with open(path, "w", encoding="utf-8") as f:
            f.write("no markers\n")
        with self.assertRaisesRegex(ValueError, "race tables"):
            race_tables.write(path, report={})


if __name__ == "__main__":
    absltest.main()
