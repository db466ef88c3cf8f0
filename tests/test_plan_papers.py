"""The planner against the papers (bench/plan_validation.py): every row's command, run as
a user runs it (`python -m trainers.plan`, its own process), prints a figure within the row's
tolerance of the paper's where bench/results/plan_validation.json records the row as
within it, and no further than DRIFT from the recorded error for every row; the docs'
table shows each recorded error and verdict."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/ as its scripts see it (they import their neighbours by name).
sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))

from absl.testing import absltest  # noqa: E402

import plan_validation  # noqa: E402

RESULTS = os.path.join(REPO_ROOT, "bench", "results", "plan_validation.json")
BENCHMARKS = os.path.join(REPO_ROOT, "docs", "benchmarks.md")


class PapersTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        with open(RESULTS) as f:
            cls.recorded = {(r["paper"], r["row"]): r for r in json.load(f)["papers"]}
        cls.specs = plan_validation.rows()
        cls.outputs = plan_validation.outputs(cls.specs)

    def test_every_row_within_its_tolerance_or_recorded_as_a_miss(self):
        self.assertLen(self.recorded, len(self.specs))
        for spec in self.specs:
            with self.subTest(f"{spec['paper']}, {spec['row']}"):
                row = self.recorded[spec["paper"], spec["row"]]
                self.assertEqual(row["command"],
                                 " ".join(plan_validation.command(spec["flags"])))
                text, plan = self.outputs[spec["flags"]]
                figure = plan_validation.printed(text, plan, spec["figure"])
                error = (figure - spec["value"]) / spec["value"]
                self.assertEqual(row["tolerance"], spec["tolerance"])
                self.assertEqual(row["within"], abs(row["error"]) <= row["tolerance"])
                if row["within"]:
                    self.assertLessEqual(abs(error), spec["tolerance"],
                                         f"printed {figure:.4g}, paper {spec['value']:.4g}")
                self.assertLessEqual(abs(error - row["error"]), plan_validation.DRIFT,
                                     f"printed {figure:.4g}: error {error:+.1%}, recorded "
                                     f"{row['error']:+.1%}; rerun bench/plan_validation.py")

    def test_the_docs_show_every_recorded_error(self):
        with open(BENCHMARKS) as f:
            lines = [line for line in f if line.startswith("| ")]
        for row in self.recorded.values():
            with self.subTest(f"{row['paper']}, {row['row']}"):
                (line,) = [l for l in lines if l.startswith(f"| {row['paper']} | {row['row']} |")]
                verdict = "yes" if row["within"] else "no"
                self.assertIn(f"| {row['error']:+.0%} | {verdict} ({row['tolerance']:.0%}) |",
                              line)


if __name__ == "__main__":
    absltest.main()
