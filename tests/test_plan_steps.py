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

from trainers import plan  # noqa: E402
from trainers.planning import (hardware, measured_steps, report, step_model,  # noqa: E402
                               workloads)
from plan_testing import run_plan, temporary_path  # noqa: E402

# Median steps to 0.9 (None: not reached within the budget) per entry and batch.
STEPS = {"sgd_nesterov": {128: 2000, 512: 800, 2048: 600, 8192: 500},
         "kfac_inverse": {128: 1000, 512: 300, 2048: 100, 8192: None}}
# The retimed median step (s) per entry and batch, on the machine of the local profile.
STEP_S = {"sgd_nesterov": {128: 0.02, 512: 0.07, 2048: 0.28, 8192: 1.0},
          "kfac_inverse": {128: 0.03, 512: 0.12, 2048: 0.6, 8192: 1.5}}
# K-FAC's settings per batch, as bench/batch_scaling.py's protocol and picks give them.
BUDGETS = {128: (10, 100, 1.0), 512: (2, 20, 1.0), 2048: (1, 5, 1.0), 8192: (1, 2, 0.25)}
KL_CLIPS = {128: 0.001, 512: 0.004, 2048: 0.016, 8192: 0.016}
PER_BATCH = ("factor_update_freq", "decomposition_update_freq", "factor_batch_fraction")


def document(steps=STEPS, model="cnn"):
    """A batch-scaling JSON with `steps` to 0.9 (0.89 and 0.91 unreached), every cell
    finished and retimed, measured on this machine's CPUs."""
    def cell(entry, batch, median):
        reached = {"median_steps": median, "median_time_s": median and median / 10}
        missed = {"median_steps": None, "median_time_s": None, "steps_above": 10_000}
        chosen = {"learning_rate": 0.1}
        if entry.startswith("kfac"):
            chosen.update(damping=0.1, kl_clip=KL_CLIPS[batch])
        return {"complete": True, "chosen": chosen,
                "retimed": {"step_s": {"median": STEP_S[entry][batch]}},
                "to_target": {"0.89": missed, "0.9": reached, "0.91": missed}}

    settings = {"sgd_nesterov": {"optimizer": "sgd", "nesterov": True},
                "kfac_inverse": {"optimizer": "kfac", "factor_update_freq": 10,
                                 "decomposition_update_freq": 100, "kfac_method": "inverse"}}
    return {"model": model, "targets": [0.89, 0.9, 0.91], "primary_target": 0.9,
            "machine": {"cpus": hardware.device("local").cores},
            "protocol": {"budgets": {str(b): dict(zip(PER_BATCH, v))
                                     for b, v in BUDGETS.items()},
                         "kfac_batch_settings": list(PER_BATCH)},
            "entries": {entry: {"settings": settings[entry],
                                "batches": {str(batch): cell(entry, batch, median)
                                            for batch, median in by_batch.items()}}
                        for entry, by_batch in steps.items()}}


def kfac_at(batch):
    """The K-FAC configuration kfac_inverse ran at `batch`."""
    factor, decomposition, fraction = BUDGETS[batch]
    return step_model.Configuration(factor_interval=factor,
                                    decomposition_interval=decomposition, method="inverse",
                                    kl_clip=KL_CLIPS[batch], factor_batch_fraction=fraction)


def price(entry, measured, ranks, batch=128):
    """The measured step of `entry` at global batch `measured` scaled to `ranks` V100s
    of `batch` examples each: the planner's V100 step over its local one, times it."""
    unit = workloads.named("cnn")
    local, v100 = hardware.device("local", "cnn"), hardware.device("v100")
    if entry == "sgd_nesterov":
        step = lambda work, n, *where: step_model.sgd_step(work, n, *where)
    else:
        step = lambda work, n, *where: step_model.kfac_step(work, kfac_at(measured), n, *where)
    there = step(unit.at_batch(measured), 1, local,
                 step_model.fabric(local, hardware.network("loopback")), "float32")
    planned = step(unit.at_batch(batch), ranks, v100,
                   step_model.fabric(v100, hardware.network("ib-edr")), "mixed")
    return (STEP_S[entry][measured] * step_model.step_seconds(planned)
            / step_model.step_seconds(there))


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
        """Steps read or interpolated at each global batch, each priced at the step the
        benchmark measured there scaled to the V100s (between two measured batches, the
        power law between their prices), K-FAC at the entry's own settings."""
        code, out, err, results = self.plan("--workers=1,2,8,16")
        self.assertIsNone(code, err)
        sgd, kfac = STEPS["sgd_nesterov"], STEPS["kfac_inverse"]
        expected = {1: (sgd[128], kfac[128]), 2: (math.sqrt(2000 * 800), math.sqrt(1000 * 300)),
                    8: (math.sqrt(800 * 600), math.sqrt(300 * 100)), 16: (600, 100)}
        around = {1: (128,), 2: (128, 512), 8: (512, 2048), 16: (2048,)}
        options = []
        for entry in results:
            workers = entry["workers"]
            for name, steps, json_name in zip(("sgd", "kfac"), expected[workers], STEPS):
                prices = [price(json_name, b, workers) for b in around[workers]]
                self.assertAlmostEqual(entry[f"{name}_step_s_to_target"],
                                       math.prod(prices) ** (1 / len(prices)))
                self.assertAlmostEqual(entry[f"{name}_steps_to_target"], steps)
                self.assertAlmostEqual(entry[f"{name}_time_to_target_s"],
                                       steps * entry[f"{name}_step_s_to_target"])
            self.assertEqual(entry["kfac_to_target"],
                             [kfac_at(b).label() for b in around[workers]])
            options.append((entry["sgd_time_to_target_s"], workers, "SGD", ""))
            options.append((entry["kfac_time_to_target_s"], workers, "K-FAC",
                            f" ({' / '.join(entry['kfac_to_target'])})"))
        self.assertLen(results, 4)
        self.assertIn("replicated float32/float32 f=1 d=5 expand inverse kl_clip=0.016", out)
        seconds, workers, name, configuration = min(options)
        self.assertIn(f"fastest to target: {name} on {workers} workers, "
                      f"{report._seconds(seconds)} s{configuration}\n", out)
        self.assertIn("Steps to target: measured to test accuracy 0.9", out)

    def test_a_step_that_cannot_be_priced_is_refused(self):
        """No measured step where one is needed, another machine than the local
        profile's, settings tfkfac refuses, a first-order entry as K-FAC's:
        one line each."""
        kfac_512 = lambda data: data["entries"]["kfac_inverse"]["batches"]["512"]
        for damage, expected in (
                (lambda d: kfac_512(d).pop("retimed"),
                 "has no measured step of kfac_inverse at batch 512"),
                (lambda d: d["machine"].update(cpus=64), "was timed on 64 CPUs"),
                (lambda d: d["entries"]["kfac_inverse"]["settings"].update(
                    kfac_method="cholesky"), "kfac_inverse's settings cannot be priced: `method`"),
                (lambda d: d["entries"]["kfac_inverse"]["settings"].update(optimizer="sgd"),
                 "kfac_inverse is not a K-FAC entry (optimizer sgd)")):
            with self.subTest(expected):
                data = document()
                damage(data)
                code, _, err, _ = self.plan("--workers=2", data=data)
                self.assertEqual(code, 2, err)
                self.assertIn("trainers.plan: error: --steps_from: ", err.splitlines()[-1])
                self.assertIn(expected, err.splitlines()[-1])
        data = document()
        kfac_512(data).pop("retimed")
        code, _, err, _ = self.plan("--workers=16", data=data)  # 2048 reads no 512
        self.assertIsNone(code, err)

    def test_times_to_target_keep_three_digits_below_100_seconds(self):
        # A small model on a GPU reaches its target in a fraction of a second.
        self.assertEqual([report._seconds(s) for s in (0.02134, 12.34, 99.94, 1234.4)],
                         ["0.0213", "12.3", "99.9", "1234"])

    def test_beyond_the_largest_measured_batch_is_one_line_refusal(self):
        code, _, err, _ = self.plan("--workers=1,128")
        self.assertEqual(code, 2)
        self.assertEqual(err.splitlines(), [
            plan.CLI.usage_hint,
            "trainers.plan: error: --steps_from: global batch 16384 is outside the batches "
            "measured for sgd_nesterov (128 to 8192): steps to target are not extrapolated; "
            "choose --batch and --workers whose product lies in that range (--batch=128, "
            "--workers=1,128)"])

    def test_k_fac_unreached_at_the_batches_around_is_refused(self):
        code, _, err, _ = self.plan("--workers=1,64")
        self.assertEqual(code, 2)
        self.assertIn("kfac_inverse did not reach 0.9 at batch 8192", err)
        self.assertLen(err.splitlines(), 2)  # the usage hint, the error

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
                self.assertLen(err.splitlines(), 2, err)
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
                self.assertLen(err.splitlines(), 2, err)
                self.assertRegex(err.splitlines()[-1], "^trainers.plan: error: --steps_from: "
                                 f".*batch_scaling.json: {field}; it is not the "
                                 "batch-scaling JSON bench/batch_scaling.py writes$")
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
