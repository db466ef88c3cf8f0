"""The planner's measured steps to target (`--steps_from`, trainers/planning/
measured_steps.py): log-log interpolation between measured global batches against a hand
computation, the refusal to extrapolate, and the recommendation made from them; from a
synthetic batch-scaling JSON in the layout bench/batch_scaling.py writes
(tests/test_batch_scaling.py reads the one it writes back with `measured_steps.load`). A
field of it that is not what that script writes (steps not > 0 or NaN, a missing or
mistyped field) is one line naming the file and the field."""

import json
import math
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl.testing import absltest  # noqa: E402

from trainers.planning import measured_steps, report  # noqa: E402
from plan_testing import run_plan, temporary_path  # noqa: E402

# Median steps to 0.9 (None: not reached within the budget) per entry and batch.
STEPS = {"sgd_nesterov": {128: 2000, 512: 800, 2048: 600, 8192: 500},
         "kfac_inverse": {128: 1000, 512: 300, 2048: 100, 8192: None}}


def document(steps=STEPS, model="cnn"):
    """A batch-scaling JSON with `steps` to 0.9 (0.89 and 0.91 unreached), every cell
    finished."""
    def cell(median):
        reached = {"median_steps": median, "median_time_s": median and median / 10}
        missed = {"median_steps": None, "median_time_s": None, "steps_above": 10_000}
        return {"complete": True, "to_target": {"0.89": missed, "0.9": reached,
                                                "0.91": missed}}

    return {"model": model, "targets": [0.89, 0.9, 0.91], "primary_target": 0.9,
            "entries": {entry: {"batches": {str(batch): cell(median)
                                            for batch, median in by_batch.items()}}
                        for entry, by_batch in steps.items()}}


def written(data):
    path = os.path.join(tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir()),
                        "batch_scaling.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return path


class InterpolationTest(absltest.TestCase):

    def test_between_measured_batches_a_power_law(self):
        sgd = STEPS["sgd_nesterov"]
        # 1024 is halfway between 512 and 2048 in log: the geometric mean of their steps.
        self.assertAlmostEqual(measured_steps.at_batch(sgd, 1024, "sgd", 0.9),
                               math.sqrt(800 * 600))
        # 256 is halfway between 128 and 512 in log.
        self.assertAlmostEqual(measured_steps.at_batch(sgd, 256, "sgd", 0.9),
                               math.sqrt(2000 * 800))
        # 4096 = 2048 x 2 of the 4x to 8192: steps 600 x (500/600)^(1/2).
        self.assertAlmostEqual(measured_steps.at_batch(sgd, 4096, "sgd", 0.9),
                               600 * (500 / 600) ** 0.5)
        self.assertEqual(measured_steps.at_batch(sgd, 512, "sgd", 0.9), 800)

    def test_no_extrapolation(self):
        for batch in (64, 16384):
            with self.subTest(batch), self.assertRaisesRegex(
                    ValueError, f"global batch {batch} is outside the batches measured for "
                    "sgd \\(128 to 8192\\): steps to target are not extrapolated"):
                measured_steps.at_batch(STEPS["sgd_nesterov"], batch, "sgd", 0.9)

    def test_an_unreached_neighbour_is_refused(self):
        with self.assertRaisesRegex(ValueError, "kfac did not reach 0.9 at batch 8192"):
            measured_steps.at_batch(STEPS["kfac_inverse"], 4096, "kfac", 0.9)
        self.assertAlmostEqual(measured_steps.at_batch(STEPS["kfac_inverse"], 1024, "kfac",
                                                       0.9), math.sqrt(300 * 100))

    def test_load_reads_the_finished_cells_of_the_target(self):
        path = written(document())
        target, steps = measured_steps.load(path, "cnn", None, ("sgd_nesterov",))
        self.assertEqual((target, steps), (0.9, {"sgd_nesterov": STEPS["sgd_nesterov"]}))
        data = document()
        data["entries"]["sgd_nesterov"]["batches"]["8192"]["complete"] = False
        _, steps = measured_steps.load(written(data), "cnn", 0.9, ("sgd_nesterov",))
        self.assertNotIn(8192, steps["sgd_nesterov"])


class PlannerTest(absltest.TestCase):
    """`python -m trainers.plan --steps_from=...` as a user runs it."""

    def plan(self, *args, data=None):
        output_dir = temporary_path("plan")
        code, out, err = run_plan("--model=cnn", "--batch=128", f"--output_dir={output_dir}",
                                  f"--steps_from={written(data or document())}", *args)
        results = None
        if code is None:
            with open(os.path.join(output_dir, "plan.json")) as f:
                results = json.load(f)["results"]
        return code, out, err, results

    def test_times_to_target_and_the_recommendation(self):
        code, out, err, results = self.plan("--workers=1,2,8,16")
        self.assertIsNone(code, err)
        sgd, kfac = STEPS["sgd_nesterov"], STEPS["kfac_inverse"]
        expected = {1: (sgd[128], kfac[128]), 2: (math.sqrt(2000 * 800), math.sqrt(1000 * 300)),
                    8: (math.sqrt(800 * 600), math.sqrt(300 * 100)), 16: (600, 100)}
        options = []
        for entry in results:
            sgd_steps, kfac_steps = expected[entry["workers"]]
            self.assertAlmostEqual(entry["sgd_steps_to_target"], sgd_steps)
            self.assertAlmostEqual(entry["sgd_time_to_target_s"],
                                   sgd_steps * entry["sgd_ms"] / 1e3)
            options.append((entry["sgd_time_to_target_s"], entry["workers"], "SGD", ""))
            self.assertAlmostEqual(entry["kfac_steps_to_target"], kfac_steps)
            self.assertAlmostEqual(entry["kfac_time_to_target_s"],
                                   kfac_steps * entry["kfac_ms"][entry["best"]] / 1e3)
            options.append((entry["kfac_time_to_target_s"], entry["workers"], "K-FAC",
                            f" ({entry['best']})"))
        self.assertLen(results, 4)
        seconds, workers, name, configuration = min(options)
        self.assertIn(f"fastest to target: {name} on {workers} workers, "
                      f"{report._seconds(seconds)} s{configuration}\n", out)
        self.assertIn("Steps to target: measured to test accuracy 0.9", out)

    def test_times_to_target_keep_three_digits_below_100_seconds(self):
        # A small model on a GPU reaches its target in a fraction of a second.
        self.assertEqual([report._seconds(s) for s in (0.02134, 12.34, 99.94, 1234.4)],
                         ["0.0213", "12.3", "99.9", "1234"])

    def test_beyond_the_largest_measured_batch_is_one_line_refusal(self):
        code, _, err, _ = self.plan("--workers=1,128")
        self.assertEqual(code, 2)
        self.assertEqual(err.splitlines(), [
            "trainers.plan: error: --steps_from: global batch 16384 is outside the batches "
            "measured for sgd_nesterov (128 to 8192): steps to target are not extrapolated; "
            "choose --batch and --workers whose product lies in that range (--batch=128, "
            "--workers=1,128)"])

    def test_k_fac_unreached_at_the_batches_around_is_refused(self):
        code, _, err, _ = self.plan("--workers=1,64")
        self.assertEqual(code, 2)
        self.assertIn("kfac_inverse did not reach 0.9 at batch 8192", err)
        self.assertLen(err.splitlines(), 1)

    def test_bad_inputs_are_one_line_errors(self):
        for args, data, expected in (
                (["--workers=1"], document(model="resnet20"),
                 "holds steps measured on resnet20, not --model=cnn"),
                (["--workers=1", "--steps_target=0.95"], None,
                 "--steps_target must be one of 0.89, 0.9, 0.91"),
                (["--workers=1", "--kfac_entry=kfac_eigen"], None,
                 "has no entry kfac_eigen; its entries are sgd_nesterov, kfac_inverse"),
                (["--workers=1", "--sgd_steps=10", "--kfac_steps=5"], None,
                 "--steps_from replaces --sgd_steps and --kfac_steps")):
            with self.subTest(expected):
                code, _, err, _ = self.plan(*args, data=data)
                self.assertEqual(code, 2, err)
                self.assertLen(err.splitlines(), 1, err)
                self.assertIn(expected, err)
        code, _, err = run_plan("--model=cnn", "--workers=1", "--steps_target=0.9",
                                f"--output_dir={temporary_path('plan')}")
        self.assertEqual(code, 2)
        self.assertIn("--steps_target only applies with --steps_from", err)

    def test_bad_fields_are_one_line_naming_the_file_and_the_field(self):
        """Steps that are not a positive number (negative, zero, NaN), a missing or
        mistyped field, a primary target not among the targets: one line naming the
        file, the field and what it holds, never a traceback or a flag not given."""
        sgd_512 = lambda data: data["entries"]["sgd_nesterov"]["batches"]["512"]
        median = "entries.sgd_nesterov.batches.512.to_target.0.9.median_steps is "
        not_steps = ", not a number of steps > 0 \\(or null: not reached\\)"
        for damage, field in (
                (lambda d: sgd_512(d)["to_target"]["0.9"].update(median_steps=-800),
                 median + r"-800 \(an integer\)" + not_steps),
                (lambda d: sgd_512(d)["to_target"]["0.9"].update(median_steps=0),
                 median + r"0 \(an integer\)" + not_steps),
                (lambda d: sgd_512(d)["to_target"]["0.9"].update(median_steps=math.nan),
                 median + r"NaN \(a float\)" + not_steps),
                (lambda d: sgd_512(d)["to_target"]["0.9"].update(median_steps="800"),
                 median + r'"800" \(a string\)' + not_steps),
                (lambda d: d.update(primary_target=0.95),
                 r"primary_target is 0.95, not one of its targets \(0.89, 0.9, 0.91\)"),
                (lambda d: d.update(targets="0.9"),
                 r'targets is "0.9" \(a string\), not a list of accuracies'),
                (lambda d: d.pop("entries"), "the document has no field entries"),
                (lambda d: d["entries"]["sgd_nesterov"].pop("batches"),
                 "entries.sgd_nesterov has no field batches"),
                (lambda d: d["entries"]["sgd_nesterov"]["batches"].update(big={}),
                 'entries.sgd_nesterov.batches has the key "big", not a batch size '
                 r"\(an integer > 0\)"),
                (lambda d: sgd_512(d).pop("complete"),
                 "entries.sgd_nesterov.batches.512 has no field complete"),
                (lambda d: sgd_512(d)["to_target"].pop("0.9"),
                 "entries.sgd_nesterov.batches.512.to_target has no field 0.9")):
            with self.subTest(field):
                data = document()
                damage(data)
                path = written(data)
                code, _, err, _ = self.plan("--workers=1", data=data)
                self.assertEqual(code, 2, err)
                self.assertLen(err.splitlines(), 1, err)
                self.assertRegex(err, f"^trainers.plan: error: --steps_from: .*batch_scaling"
                                 f".json: {field}; it is not the batch-scaling JSON "
                                 "bench/batch_scaling.py writes$")
                self.assertNotIn("--steps_target", err)
                with self.assertRaisesRegex(ValueError, f"{path}: {field}"):
                    measured_steps.load(path, "cnn", None, ("sgd_nesterov",))
        data = [STEPS]
        code, _, err, _ = self.plan("--workers=1", data=data)
        self.assertEqual(code, 2, err)
        self.assertRegex(err, r"batch_scaling.json: the document is \[.*\(a list\), not an "
                              "object")


if __name__ == "__main__":
    absltest.main()
