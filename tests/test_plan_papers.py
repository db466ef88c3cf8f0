"""The planner's validation against the papers is its own output: a row's command, as
bench/results/plan_validation.json records it, run as a user runs it, prints the figure
that JSON and docs/benchmarks.md show (bench/plan_validation.py)."""

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
ROW = "+ float21 factors"  # Ueno et al. Table 1, 128 V100s


class PapersTableTest(absltest.TestCase):

    def test_a_row_is_what_its_command_prints(self):
        with open(RESULTS) as f:
            row = next(r for r in json.load(f)["papers"] if r["row"] == ROW)
        spec = next(r for r in plan_validation.rows() if r["row"] == ROW)
        self.assertEqual(row["command"], " ".join(plan_validation.command(spec["flags"])))
        python, module_flag, module, *args = row["command"].split()
        self.assertEqual((python, module_flag, module), ("python", "-m", "trainers.plan"))
        text, _ = plan_validation.run_plan(args)
        figure = plan_validation.printed(text, tuple(row["figure"]))
        self.assertEqual(figure, row["predicted"])
        self.assertIn(f"{figure:.2f}", text)
        with open(BENCHMARKS) as f:
            lines = [line for line in f if line.startswith("| Ueno") and ROW in line]
        self.assertLen(lines, 1)
        self.assertIn(f"| {figure:.2f} |", lines[0])
        self.assertIn(f"{row['error']:+.0%}", lines[0])


if __name__ == "__main__":
    absltest.main()
