"""bench/time_to_accuracy.py's protocol (docs/benchmarks.md, "Protocol: the default against
Keras's optimizers") without training: every entry gets the same decoupled weight decay
and the same tuning budget (SGD's 8 points 4 effective rates x 2 momenta); recorded tuning
trials are read back from `--tuning_from` instead of run, unless the protocol changed;
the race runs its rounds (bench/race.py) with fresh seeds, 5 for the default and the
best-tuned first-order entry; `summarize` gives the targets, crossings and ratios of
hand-made runs; `save` writes the JSON and PNG with the models a run did not measure.

The weight decay is checked on the optimizers the trainer builds from the protocol's
settings: with zero gradients a step of AdamW or of SGD with Nesterov momentum only
decays, so w_{t+1} / w_t = 1 - λ s(t), s(t) the warm-up + cosine multiplier, whatever the
learning rate (Loshchilov & Hutter's decoupling; Keras's `weight_decay` is multiplied by
it). The race's statistics themselves are tests/test_race.py's.
"""

import copy
import json
import os
import sys
import tempfile
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# bench/ as its scripts see it (they import their neighbours by name).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

from absl.testing import absltest, flagsaver, parameterized  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import race  # noqa: E402
import time_to_accuracy  # noqa: E402
import trials  # noqa: E402
from tfkfac import distributed  # noqa: E402
from trainers import config as config_lib, errors, runner  # noqa: E402

STEPS_PER_EPOCH, EPOCHS, WEIGHT_DECAY = 20, 2, 5e-5
SCHEDULE_FREE_ENTRIES = ("kfac", "schedule_free_adamw", "kfac_schedule_free_adamw",
                         "kfac_schedule_free_adamw_adaptive")


def multiplier(step, total=STEPS_PER_EPOCH * EPOCHS):
    """The cosine schedule's s(t) with a 5% warm-up, written out."""
    warmup = round(trials.WARMUP_FRACTION * total)
    progress = min(1.0, max(0.0, (step - warmup) / (total - warmup)))
    return min(1.0, (step + 1) / warmup) * (1 + np.cos(np.pi * progress)) / 2


def build(settings):
    """The optimizer the trainer builds from trainer `settings`."""
    return runner._build_optimizer(
        config_lib.TrainConfig(**settings), STEPS_PER_EPOCH, STEPS_PER_EPOCH * EPOCHS,
        distributed.get_communicator())


def tempdir():
    return tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())


class WeightDecayTest(parameterized.TestCase):

    @parameterized.parameters(("adamw", {"learning_rate": 1e-4}),
                              ("adamw", {"learning_rate": 2e-2}),
                              ("sgd", {"learning_rate": 5e-4, "momentum": 0.9}),
                              ("sgd", {"learning_rate": 0.1, "momentum": 0.97}))
    def test_weights_shrink_by_lambda_times_the_schedule(self, entry, setting):
        optimizer = build(trials.protocol(entry, setting, EPOCHS, WEIGHT_DECAY))
        if entry == "sgd":
            self.assertTrue(optimizer.nesterov)
            self.assertAlmostEqual(optimizer.momentum, setting["momentum"])
        weight = keras.Variable(np.ones(3, "float32"))
        optimizer.build([weight])
        for step in range(STEPS_PER_EPOCH * EPOCHS):
            before = weight.numpy().copy()
            optimizer.apply([np.zeros(3, "float32")], [weight])
            np.testing.assert_allclose(weight.numpy() / before,
                                       1 - WEIGHT_DECAY * multiplier(step), rtol=1e-6,
                                       err_msg=f"step {step}")

    @parameterized.parameters(*SCHEDULE_FREE_ENTRIES)
    def test_schedule_free_runs_without_a_schedule_alone_and_inside_kfac(self, entry):
        point = trials.GRIDS["cnn"][entry][0]
        settings = trials.protocol(entry, point, EPOCHS, WEIGHT_DECAY)
        self.assertEqual(settings["lr_schedule"], "constant")
        self.assertEqual(settings["warmup_epochs"], trials.WARMUP_FRACTION * EPOCHS)
        self.assertAlmostEqual(settings["weight_decay"], WEIGHT_DECAY / point["learning_rate"])
        optimizer = build(settings)
        rule = getattr(optimizer, "inner_optimizer", optimizer)
        self.assertIsInstance(rule, keras.optimizers.ScheduleFreeAdamW)
        self.assertEqual(rule.warmup_steps,
                         round(trials.WARMUP_FRACTION * STEPS_PER_EPOCH * EPOCHS))

    def test_the_default_is_the_inverse_method_into_schedule_free_adamw(self):
        settings = trials.protocol("kfac", trials.GRIDS["vit"]["kfac"][0], EPOCHS,
                                   WEIGHT_DECAY)
        self.assertEqual({key: settings[key] for key in (
            "optimizer", "kfac_method", "kfac_inner_optimizer", "damping", "kl_clip")},
            {"optimizer": "kfac", "kfac_method": "inverse",
             "kfac_inner_optimizer": "schedule_free_adamw", "damping": 0.03, "kl_clip": None})

    def test_the_constant_rate_reference_keeps_its_old_settings(self):
        settings = trials.protocol("kfac_constant", {"damping": 0.1}, EPOCHS, WEIGHT_DECAY)
        self.assertEqual(settings["learning_rate"], 0.05)
        self.assertNotIn("weight_decay", settings)
        self.assertNotIn("lr_schedule", settings)


class TuningBudgetTest(absltest.TestCase):

    def test_every_entry_has_eight_distinct_points_per_model(self):
        for model, grids in trials.GRIDS.items():
            self.assertContainsSubset(grids, trials.OPTIMIZERS, model)
            for entry in set(trials.OPTIMIZERS) - set(grids):  # only those it cannot run
                with self.assertRaises(ValueError, msg=f"{model} {entry}"):
                    trials.check_entry(entry, time_to_accuracy.run_settings(
                        model, entry, trials.GRIDS["vit"][entry][0], EPOCHS))
            for entry, points in grids.items():
                self.assertLen({trials.slug(point) for point in points},
                               trials.TUNING_TRIALS, f"{model} {entry}")

    def test_sgd_tries_four_effective_rates_at_each_of_two_momenta(self):
        self.assertTrue(trials.OPTIMIZERS["sgd"]["nesterov"])
        for model, grids in trials.GRIDS.items():
            effective = {}
            for point in grids["sgd"]:
                effective.setdefault(point["momentum"], []).append(
                    point["learning_rate"] / (1 - point["momentum"]))
            self.assertEqual(set(effective), set(trials.SGD_MOMENTA), model)
            first, second = (sorted(rates) for rates in effective.values())
            self.assertLen(first, 4, model)
            np.testing.assert_allclose(first, second, rtol=1e-5, err_msg=model)
            # Four consecutive values of the 1-2-5 series.
            np.testing.assert_allclose(first, trials.series(
                trials.series_value(trials.series_index(first[0])), 4), rtol=1e-5)

    def test_the_default_tunes_its_learning_rate_on_schedule_free_adamws_series(self):
        for model, grids in trials.GRIDS.items():
            self.assertEqual(grids["kfac"], grids["schedule_free_adamw"], model)

    def test_series(self):
        self.assertEqual(trials.series(5e-4, 4), (5e-4, 1e-3, 2e-3, 5e-3))


class CheckEntryTest(absltest.TestCase):

    def test_runnable_entries_pass(self):
        for entry in ("kfac", "adamw", "sgd", "kfac_inverse", "kfac_eigen", "kfac_constant",
                      "schedule_free_adamw", "kfac_schedule_free_adamw",
                      "kfac_schedule_free_adamw_adaptive"):
            point = trials.GRIDS["vit"][entry][0]
            trials.check_entry(entry, time_to_accuracy.run_settings("vit", entry, point,
                                                                    EPOCHS))

    def test_an_unknown_setting_is_named(self):
        settings = dict(trials.OPTIMIZERS["sgd"], no_such_setting=1)
        with self.assertRaisesRegex(ValueError, "entry sgd needs the trainer setting"
                                    r"\(s\) no_such_setting"):
            trials.check_entry("sgd", settings)


def scores(model, entry, first=0.8):
    """Tuning trials of `entry` on `model`, the last point best."""
    return [{"setting": setting, "validation_accuracy": first + 0.01 * index}
            for index, setting in enumerate(trials.GRIDS[model][entry])]


def tuning(model, entry, accuracy, best=0):
    """An entry's tuning as `tune` returns it, its `best`-th point scoring `accuracy`."""
    setting = trials.GRIDS[model][entry][best]
    return {"trials": [{"setting": setting, "validation_accuracy": accuracy}],
            "best": setting, "best_validation_accuracy": accuracy}


def recorded_report(model, entries, layout="tuning", budget=None):
    """A report that ran `entries` ({entry: trials}) on `model`, in this script's layout
    ("tuning") or the earlier one's ("optimizers": a raced entry, "tuned_only")."""
    result = {"tuning": {}, "optimizers": {}, "tuned_only": {}}
    for entry, entry_trials in entries.items():
        result[layout][entry] = ({"tuning": entry_trials} if layout == "optimizers"
                                 else {"trials": entry_trials})
    protocol = {"warmup_fraction": trials.WARMUP_FRACTION,
                "entries": {entry: trials.OPTIMIZERS[entry] for entry in entries}}
    if layout == "tuning":
        protocol["race"] = {"first_seed": race.FIRST_SEED}
    return {"budgets": {model: dict(time_to_accuracy.BUDGETS[model] if budget is None
                                    else budget)},
            "protocol": protocol,
            "models": {model: {key: value for key, value in result.items() if value}}}


def write_report(report, directory=None):
    """Writes `report` as time_to_accuracy.json to `directory` (a new one by default)."""
    path = os.path.join(directory or tempdir(), "time_to_accuracy.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f)
    return path


def no_trial():
    return mock.patch.object(time_to_accuracy.trials, "run",
                             side_effect=AssertionError("ran a trial"))


class RecordedTuningTest(parameterized.TestCase):
    """A machine whose work dir is gone takes an entry's tuning from a report of
    `--tuning_from`, if that report ran it on today's grid and protocol, instead of running
    the trials again."""

    @parameterized.parameters("tuning", "optimizers", "tuned_only")
    def test_recorded_trials_are_read_back_not_run(self, layout):
        recorded = scores("vit", "sgd")
        path = write_report(recorded_report("vit", {"sgd": recorded}, layout))
        missing = os.path.join(tempdir(), "time_to_accuracy.json")
        with flagsaver.flagsaver(tuning_from=[missing, path], work_dir=tempdir()), no_trial():
            tuned = time_to_accuracy.tune("vit", "sgd")
        self.assertEqual(tuned, {"trials": recorded, "best": trials.GRIDS["vit"]["sgd"][-1],
                                 "best_validation_accuracy": recorded[-1]["validation_accuracy"]})

    def test_the_first_report_that_ran_todays_trials_is_used(self):
        voided = write_report(recorded_report(
            "vit", {"sgd": scores("vit", "sgd", first=0.5)},
            budget=dict(time_to_accuracy.BUDGETS["vit"], tune_epochs=1)))
        first = write_report(recorded_report("vit", {"sgd": scores("vit", "sgd", first=0.6)}))
        second = write_report(recorded_report("vit", {"sgd": scores("vit", "sgd", first=0.7)}))
        with flagsaver.flagsaver(tuning_from=[voided, first, second]):
            self.assertEqual(time_to_accuracy.recorded_tuning("vit", "sgd"),
                             scores("vit", "sgd", first=0.6))

    def test_trials_in_the_work_dir_are_run_not_taken_from_a_report(self):
        path = write_report(recorded_report("cnn", {"adamw": scores("cnn", "adamw")}))
        work_dir = tempdir()
        grid = trials.GRIDS["cnn"]["adamw"]
        os.makedirs(os.path.join(work_dir, f"cnn-adamw-tune-{trials.slug(grid[0])}"))
        asked = []

        def run(run_work_dir, name, **settings):
            asked.append((run_work_dir, name, settings))
            # Best at the second point, unlike the report.
            return {"final_eval_accuracy": 0.9 if settings["learning_rate"] == grid[1][
                "learning_rate"] else 0.5}

        with flagsaver.flagsaver(tuning_from=[path], work_dir=work_dir), \
                mock.patch.object(time_to_accuracy.trials, "run", side_effect=run):
            tuned = time_to_accuracy.tune("cnn", "adamw")
        self.assertEqual((tuned["best"], tuned["best_validation_accuracy"]), (grid[1], 0.9))
        self.assertEqual([name for _, name, _ in asked],
                         [f"cnn-adamw-tune-{trials.slug(point)}" for point in grid])
        for (run_work_dir, _, settings), point in zip(asked, grid):
            self.assertEqual(run_work_dir, work_dir)
            self.assertEqual(settings, dict(
                time_to_accuracy.run_settings("cnn", "adamw", point,
                                              time_to_accuracy.BUDGETS["cnn"]["tune_epochs"]),
                batch_size=time_to_accuracy.FLAGS.batch_size,
                train_split=trials.TUNE_SPLIT, eval_split=trials.VALIDATION_SPLIT))

    def test_a_diverged_trial_ranks_last_and_is_not_run_again(self):
        work_dir = tempdir()
        grid = trials.GRIDS["cnn"]["sgd"]
        runs = []

        def run(run_work_dir, name, **settings):
            runs.append(name)
            if settings["learning_rate"] == grid[-1]["learning_rate"]:
                raise errors.RunError("training diverged: after step 3 the model's weights "
                                      "are not finite")
            return {"final_eval_accuracy": 0.5}

        with flagsaver.flagsaver(tuning_from=[], work_dir=work_dir), \
                mock.patch.object(time_to_accuracy.trials, "run", side_effect=run):
            tuned = time_to_accuracy.tune("cnn", "sgd")
            self.assertLen(runs, 8)
            self.assertIsNone(tuned["trials"][-1]["validation_accuracy"])
            self.assertEqual(tuned["best"], grid[0])
            again = time_to_accuracy.tune("cnn", "sgd")  # the marker stands for the run
        self.assertLen(runs, 15)
        self.assertEqual(again["trials"], tuned["trials"])

    def test_what_only_the_timed_runs_read_does_not_void_a_tuning(self):
        budget = dict(time_to_accuracy.BUDGETS["vit"], target_accuracies=[0.84, 0.86])
        budget["kfac_xla"] = not budget["kfac_xla"]
        budget["first_order_xla"] = not budget["first_order_xla"]
        budget["eval_every_steps"] *= 4
        budget["max_epochs"] += 1
        recorded = scores("vit", "sgd")
        report = recorded_report("vit", {"sgd": recorded}, budget=budget)
        report["protocol"]["race"] = {"first_seed": 7, "eval_spacing": 0.1}
        with flagsaver.flagsaver(tuning_from=[write_report(report)]):
            self.assertEqual(time_to_accuracy.recorded_tuning("vit", "sgd"), recorded)

    @parameterized.named_parameters(
        ("tune_epochs", lambda report: report["budgets"]["vit"].update(tune_epochs=1)),
        ("weight_decay", lambda report: report["budgets"]["vit"].update(weight_decay=5e-4)),
        ("warmup", lambda report: report["protocol"].update(warmup_fraction=0.1)),
        # The earlier protocol's SGD: heavy-ball momentum 0.9, not Nesterov.
        ("entry", lambda report: report["protocol"]["entries"].update(
            sgd={"optimizer": "sgd"})),
        ("grid", lambda report: report["models"]["vit"]["tuning"]["sgd"]["trials"].pop()))
    def test_trials_of_another_protocol_are_not_used(self, change):
        report = recorded_report("vit", {"sgd": scores("vit", "sgd")})
        change(report)
        with flagsaver.flagsaver(tuning_from=[write_report(report)]):
            self.assertIsNone(time_to_accuracy.recorded_tuning("vit", "sgd"))
            self.assertIsNone(time_to_accuracy.recorded_tuning("vit", "adamw"))
            self.assertIsNone(time_to_accuracy.recorded_tuning("cnn", "sgd"))

    def test_a_floor_option_runs_at_its_base_entrys_tuned_point(self):
        base = "kfac_schedule_free_adamw"
        recorded = scores("vit", base)
        path = write_report(recorded_report("vit", {base: recorded}))
        for suffix, option in trials.FLOOR_OPTIONS.items():
            entry = f"{base}_{suffix}"
            self.assertEqual(trials.TUNED_AS[entry], base)
            self.assertEqual(trials.OPTIMIZERS[entry], dict(trials.OPTIMIZERS[base], **option))
            with flagsaver.flagsaver(tuning_from=[path], work_dir=tempdir()), no_trial():
                tuned = time_to_accuracy.tune("vit", entry)
            self.assertEqual(tuned["trials"], recorded)
            self.assertEqual(tuned["best"], trials.GRIDS["vit"][base][-1])


def curve_run(seed, seconds_per_eval, accuracies):
    """A timed run of `seed` evaluated every 100 steps (`seconds_per_eval` apart) at
    `accuracies`."""
    return {"seed": seed, "curve": [[seconds_per_eval * i, 100 * i, accuracy]
                                    for i, accuracy in enumerate(accuracies, 1)]}


def hand_made_runs():
    """Runs whose targets, crossings and ratios are worked out in `SummarizeTest`: SGD
    ends at 0.91 (median over 5 seeds), AdamW at 0.89, K-FAC at 0.92 (a K-FAC entry does
    not set the target) and 1.5x slower per evaluation."""
    def entry(seconds, accuracies):
        return [curve_run(seed, seconds, points) for seed, points in
                enumerate(accuracies, race.FIRST_SEED)]

    return {
        "kfac": entry(15.0, [(0.90, 0.92, 0.93), (0.89, 0.91, 0.92), (0.91, 0.92, 0.92),
                             (0.88, 0.90, 0.91), (0.90, 0.91, 0.93)]),
        "sgd": entry(10.0, [(0.85, 0.89, 0.90), (0.88, 0.91, 0.92), (0.86, 0.90, 0.91),
                            (0.89, 0.92, 0.93), (0.87, 0.90, 0.91)]),
        "adamw": entry(10.0, [(0.85, 0.88, 0.89), (0.86, 0.89, 0.90), (0.84, 0.87, 0.88)]),
    }


class SummarizeTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        self.runs = hand_made_runs()
        self.result = time_to_accuracy.summarize(copy.deepcopy(self.runs))

    def test_targets_are_the_best_first_order_median_end_and_two_below(self):
        self.assertEqual(self.result["final_target"], {"accuracy": 0.91, "entry": "sgd"})
        self.assertEqual(self.result["targets"], [0.89, 0.9, 0.91])
        self.assertEqual(self.result["runs"], self.runs)

    def test_crossings_per_seed_and_their_medians(self):
        times = {entry: {target: {seed: crossing and crossing["time_s"]
                                  for seed, crossing in result["per_seed"].items()}
                         for target, result in by_target.items()}
                 for entry, by_target in self.result["to_target"].items()}
        self.assertEqual(times["sgd"], {"0.89": {1: 20, 2: 20, 3: 20, 4: 10, 5: 20},
                                        "0.9": {1: 30, 2: 20, 3: 20, 4: 20, 5: 20},
                                        "0.91": {1: None, 2: 20, 3: 30, 4: 20, 5: 30}})
        self.assertEqual(times["kfac"]["0.91"], {1: 30, 2: 30, 3: 15, 4: 45, 5: 30})
        self.assertEqual(times["adamw"]["0.9"], {1: None, 2: 30, 3: None})
        self.assertEqual(self.result["to_target"]["sgd"]["0.91"]["per_seed"][3],
                         {"time_s": 30.0, "steps": 300, "quantization": 10.0 / 30.0})
        summary = {entry: {target: (result["reached"], result["median_time_s"],
                                    result["median_steps"])
                           for target, result in by_target.items()}
                   for entry, by_target in self.result["to_target"].items()}
        self.assertEqual(summary, {
            "kfac": {"0.89": (5, 15, 100), "0.9": (5, 15, 100), "0.91": (5, 30, 200)},
            "sgd": {"0.89": (5, 20, 200), "0.9": (5, 20, 200), "0.91": (4, 30, 300)},
            # Over half the seeds never reached it: no median.
            "adamw": {"0.89": (2, 30, 300), "0.9": (1, None, None), "0.91": (0, None, None)}})

    def test_kfac_over_each_first_order_entry_per_round(self):
        ratios = self.result["ratios"]
        self.assertEqual({entry: set(by_baseline) for entry, by_baseline in ratios.items()},
                         {"kfac": {"sgd", "adamw"}})
        to_sgd = ratios["kfac"]["sgd"]["0.91"]
        # Seed 1: SGD never reached it (0); the others 30/20, 15/30, 45/20, 30/30.
        self.assertEqual(to_sgd["time_s"]["per_seed"], [0.0, 1.5, 0.5, 2.25, 1.0])
        self.assertEqual(to_sgd["time_s"]["median"], 1.0)
        np.testing.assert_allclose(to_sgd["steps"]["per_seed"],
                                   [0.0, 1.0, 1 / 3, 1.5, 2 / 3])
        # AdamW ran seeds 1-3 only: the common rounds.
        to_adamw = ratios["kfac"]["adamw"]["0.9"]["time_s"]
        self.assertEqual((to_adamw["seeds"], to_adamw["per_seed"], to_adamw["median"]),
                         ([1, 2, 3], [0.0, 1.0, 0.0], 0.0))
        # AdamW never reached the final target: 0 every round.
        never = ratios["kfac"]["adamw"]["0.91"]["time_s"]
        self.assertEqual((never["per_seed"], never["median"]), ([0.0, 0.0, 0.0], 0.0))


def timed_summary(entry, seed):
    """A trainer summary of a timed run: three evaluations, the accuracy growing with
    the seed, K-FAC's highest."""
    accuracy = 0.85 + 0.005 * seed + (0.02 if entry == "kfac" else 0.0)
    return {"mean_step_time_s": {"all": 0.1},
            "evaluations": [{"train_time_s": 10.0 * i, "steps": 100 * i,
                             "val_accuracy": round(accuracy - 0.01 * (3 - i), 4)}
                            for i in (1, 2, 3)]}


# What trials.run records of the machine around a run (trials.machine_record).
MACHINE = {"load_average_before": [1.0, 0.5, 0.25], "load_average_after": [1.5, 0.5, 0.25],
           "resumed": False}


class RaceModelTest(absltest.TestCase):

    def test_rounds_seeds_and_settings_of_the_timed_runs(self):
        model, entries = "vit", ["kfac", "sgd", "adamw", "lamb"]
        # AdamW tuned best among the first-order entries (K-FAC's higher accuracy does not
        # count), so it runs 5 seeds beside the default.
        tunings = {"kfac": tuning(model, "kfac", 0.95, best=3),
                   "sgd": tuning(model, "sgd", 0.90, best=5),
                   "adamw": tuning(model, "adamw", 0.92, best=2),
                   "lamb": tuning(model, "lamb", 0.91, best=4)}
        budget = time_to_accuracy.BUDGETS[model]
        asked = []

        def run(work_dir, name, **settings):
            del work_dir
            entry = name.split("-")[1]
            asked.append((settings["seed"], entry, name, settings))
            return dict(timed_summary(entry, settings["seed"]), machine=dict(
                MACHINE, cpu_time_s=settings["seed"]))

        with flagsaver.flagsaver(work_dir=tempdir()), \
                mock.patch.object(time_to_accuracy.trials, "run", side_effect=run):
            result = time_to_accuracy.race_model(model, entries, tunings)
        counts = {"kfac": race.HEADLINE_SEEDS, "sgd": race.OTHER_SEEDS,
                  "adamw": race.HEADLINE_SEEDS, "lamb": race.OTHER_SEEDS}
        self.assertEqual([(seed, entry) for seed, entry, _, _ in asked], race.rounds(counts))
        self.assertEqual([(seed, entry) for seed, entry, _, _ in asked[:8]],
                         [(1, "kfac"), (1, "sgd"), (1, "adamw"), (1, "lamb"),
                          (2, "lamb"), (2, "adamw"), (2, "sgd"), (2, "kfac")])
        for seed, entry, name, settings in asked:
            xla = budget["first_order_xla" if entry in time_to_accuracy.FIRST_ORDER
                         else "kfac_xla"]
            expected = dict(time_to_accuracy.run_settings(
                model, entry, tunings[entry]["best"], budget["max_epochs"]),
                batch_size=time_to_accuracy.FLAGS.batch_size, seed=seed,
                eval_every_steps=budget["eval_every_steps"],
                eval_spacing=time_to_accuracy.EVAL_SPACING, xla=xla, timed=True)
            self.assertEqual(settings, expected, name)  # the full train and test splits
            self.assertIn(f"seed{seed}", name)
        self.assertEqual({entry: [run["seed"] for run in runs]
                          for entry, runs in result["runs"].items()},
                         {"kfac": [1, 2, 3, 4, 5], "sgd": [1, 2, 3], "adamw": [1, 2, 3, 4, 5],
                          "lamb": [1, 2, 3]})
        first = result["runs"]["adamw"][0]
        self.assertEqual(first["curve"], [(10.0, 100, 0.835), (20.0, 200, 0.845),
                                          (30.0, 300, 0.855)])
        self.assertEqual((first["final_accuracy"], first["best_accuracy"],
                          first["mean_step_time_s"]), (0.855, 0.855, 0.1))
        self.assertEqual(first["machine"], dict(MACHINE, cpu_time_s=1))  # trials.run's record
        # SGD and Lamb's median ends (seeds 1-3) are AdamW's over 5 seeds: AdamW's is
        # the highest first-order one.
        self.assertEqual(result["final_target"], {"accuracy": 0.865, "entry": "adamw"})
        self.assertEqual(time_to_accuracy.best_first_order(tunings), "adamw")


class CutShortTest(parameterized.TestCase):
    """A run cut short: a tuning trial resumes from its checkpoint; a timed run starts
    again, since its clock would hold a second start-up."""

    @parameterized.parameters(False, True)
    def test_a_timed_run_starts_again_and_a_tuning_trial_resumes(self, timed):
        work_dir = tempdir()
        model_dir = os.path.join(work_dir, "cnn-adamw-seed1")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "left_by_the_cut"), "w", encoding="utf-8"):
            pass
        found = []

        def run(config):
            found.append(os.listdir(config.model_dir) if os.path.isdir(config.model_dir)
                         else None)
            os.makedirs(config.model_dir, exist_ok=True)
            return {"final_eval_accuracy": 0.9}

        with mock.patch.object(trials.runner, "run", side_effect=run):
            trials.run(work_dir, "cnn-adamw-seed1", timed=timed, model="cnn", epochs=1)
        self.assertEqual(found, [None] if timed else [["left_by_the_cut"]])


def model_result(model, runs, commit):
    """What `main` records of a raced model."""
    tunings = {entry: tuning(model, entry, 0.9) for entry in runs}
    return dict(time_to_accuracy.summarize(runs), tuning=tunings,
                best_first_order_by_tuning=time_to_accuracy.best_first_order(tunings),
                measured_at_commit=commit)


def report_of(models, commit, autoencoder=None):
    """A report as `main` builds it, of `models` ({model: runs})."""
    entries = sorted({entry for runs in models.values() for entry in runs})
    return {"batch_size": 128,
            "budgets": {model: dict(time_to_accuracy.BUDGETS[model]) for model in models},
            "protocol": {"warmup_fraction": trials.WARMUP_FRACTION,
                         "entries": {entry: trials.OPTIMIZERS[entry] for entry in entries},
                         "race": {"first_seed": race.FIRST_SEED}},
            "tuning": {"grids": {model: {entry: trials.GRIDS[model][entry] for entry in runs}
                                 for model, runs in models.items()}},
            "models": {model: model_result(model, runs, commit)
                       for model, runs in models.items()},
            "autoencoder": autoencoder or {}, "library_commit": commit}


AUTOENCODER_RESULT = {"setting": {"learning_rate": 0.1}, "final_train_squared_error": 5.0,
                      "curve": [[1.0, 100, 9.0], [2.0, 200, 5.0]]}


class CarryOverTest(absltest.TestCase):
    """A run keeps of the report it replaces whole models it did not measure (and
    autoencoder entries it did not run), each with the commit it was measured at."""

    def test_models_it_did_not_measure_are_kept_whole(self):
        runs = hand_made_runs()
        lamb = {"lamb": [curve_run(seed, 10.0, (0.8, 0.85, 0.9)) for seed in (1, 2, 3)]}
        previous = report_of({"vit": dict(runs, **lamb), "resnet20": runs, "cnn": runs},
                             "old", autoencoder={"sgd": dict(AUTOENCODER_RESULT),
                                                 "adam": dict(AUTOENCODER_RESULT)})
        previous["models"]["vit"]["measured_at_commit"] = "older"
        del previous["models"]["resnet20"]["measured_at_commit"]  # the report's commit
        previous["budgets"]["cnn"] = dict(previous["budgets"]["cnn"], tune_epochs=3)
        previous["protocol"]["entries"]["kfac_eigen"] = trials.OPTIMIZERS["kfac_eigen"]
        output_dir = os.path.dirname(write_report(previous))
        report = report_of({"cnn": {"kfac": runs["kfac"], "sgd": runs["sgd"]}}, "new",
                           autoencoder={"adam": dict(AUTOENCODER_RESULT, curve=[])})
        mine = copy.deepcopy(report["models"]["cnn"])
        with flagsaver.flagsaver(output_dir=output_dir):
            time_to_accuracy.carry_over(report)
        self.assertEqual(report["models"]["cnn"], mine)  # no entry of the old one merged
        previous = json.loads(json.dumps(previous))  # as read back: seeds as strings
        self.assertEqual(report["models"]["vit"], previous["models"]["vit"])
        self.assertEqual(report["models"]["resnet20"],
                         dict(previous["models"]["resnet20"], measured_at_commit="old"))
        for model in ("vit", "resnet20"):
            self.assertEqual(report["budgets"][model], previous["budgets"][model])
            self.assertEqual(report["tuning"]["grids"][model],
                             previous["tuning"]["grids"][model])
        self.assertEqual(report["budgets"]["cnn"], time_to_accuracy.BUDGETS["cnn"])
        self.assertEqual(set(report["tuning"]["grids"]["cnn"]), {"kfac", "sgd"})
        # The settings of the kept models' entries are kept with them.
        self.assertEqual(set(report["protocol"]["entries"]), {"kfac", "sgd", "adamw", "lamb"})
        self.assertEqual(report["autoencoder"], {
            "adam": dict(AUTOENCODER_RESULT, curve=[]),
            "sgd": dict(AUTOENCODER_RESULT, measured_at_commit="old")})
        self.assertEqual(time_to_accuracy.best_tuning(report["models"]["vit"]),
                         {"kfac": 0.9, "sgd": 0.9, "adamw": 0.9, "lamb": 0.9})

    def test_a_report_of_the_earlier_protocol_is_not_carried_over(self):
        previous = recorded_report("vit", {"sgd": scores("vit", "sgd")}, "tuned_only")
        previous["models"]["vit"]["optimizers"] = {}
        output_dir = os.path.dirname(write_report(previous))
        report = report_of({"cnn": hand_made_runs()}, "new")
        before = copy.deepcopy(report)
        with flagsaver.flagsaver(output_dir=output_dir):
            time_to_accuracy.carry_over(report)
        self.assertEqual(report, before)


class SaveTest(absltest.TestCase):
    """A raced model is written with the models the JSON already held, as JSON and PNG,
    and the run's own report is left as it was."""

    def test_a_model_is_saved_beside_the_kept_ones(self):
        runs = hand_made_runs()
        output_dir = tempdir()
        write_report(report_of({"vit": runs, "cnn": runs}, "old",
                               autoencoder={"sgd": dict(AUTOENCODER_RESULT)}), output_dir)
        report = report_of({"cnn": runs}, "new")
        before = json.dumps(report, sort_keys=True)
        with flagsaver.flagsaver(output_dir=output_dir):
            time_to_accuracy.save(report)
        self.assertEqual(json.dumps(report, sort_keys=True), before)
        with open(os.path.join(output_dir, "time_to_accuracy.json"), encoding="utf-8") as f:
            saved = json.load(f)
        self.assertEqual({model: result["measured_at_commit"]
                          for model, result in saved["models"].items()},
                         {"cnn": "new", "vit": "old"})
        self.assertEqual(saved["models"]["cnn"]["ratios"]["kfac"]["sgd"]["0.91"]["time_s"][
            "median"], 1.0)
        self.assertEqual(saved["autoencoder"]["sgd"]["measured_at_commit"], "old")
        self.assertGreater(os.path.getsize(os.path.join(output_dir, "time_to_accuracy.png")),
                           0)


if __name__ == "__main__":
    absltest.main()
