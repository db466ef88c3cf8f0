"""bench/trials.py: the time-to-accuracy protocol gives every entry the same decoupled
weight decay and the same tuning budget, and refuses entries the trainer cannot run;
bench/time_to_accuracy.py keeps, of a model it measures, the entries a run does not run.

The weight decay is checked on the optimizers the trainer builds from the protocol's
settings: with zero gradients a step of AdamW or of SGD with momentum only decays, so
w_{t+1} / w_t = 1 - λ s(t), s(t) the warm-up + cosine multiplier, whatever the learning
rate (Loshchilov & Hutter's decoupling; Keras's `weight_decay` is multiplied by it).
"""

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

from bench import trials  # noqa: E402
import time_to_accuracy  # noqa: E402
from tfkfac import distributed  # noqa: E402
from trainers import config as config_lib, runner  # noqa: E402

STEPS_PER_EPOCH, EPOCHS, WEIGHT_DECAY = 20, 2, 5e-5


def multiplier(step, total=STEPS_PER_EPOCH * EPOCHS):
    """The cosine schedule's s(t) with a 5% warm-up, written out."""
    warmup = round(trials.WARMUP_FRACTION * total)
    progress = min(1.0, max(0.0, (step - warmup) / (total - warmup)))
    return min(1.0, (step + 1) / warmup) * (1 + np.cos(np.pi * progress)) / 2


class WeightDecayTest(parameterized.TestCase):

    @parameterized.parameters(("adamw", 1e-4), ("adamw", 2e-2), ("sgd", 5e-4), ("sgd", 0.1))
    def test_weights_shrink_by_lambda_times_the_schedule(self, entry, learning_rate):
        settings = trials.protocol(entry, {"learning_rate": learning_rate}, EPOCHS,
                                   WEIGHT_DECAY)
        optimizer = runner._build_optimizer(
            config_lib.TrainConfig(**settings), STEPS_PER_EPOCH, STEPS_PER_EPOCH * EPOCHS,
            distributed.get_communicator())
        weight = keras.Variable(np.ones(3, "float32"))
        optimizer.build([weight])
        for step in range(STEPS_PER_EPOCH * EPOCHS):
            before = weight.numpy().copy()
            optimizer.apply([np.zeros(3, "float32")], [weight])
            np.testing.assert_allclose(weight.numpy() / before,
                                       1 - WEIGHT_DECAY * multiplier(step), rtol=1e-6,
                                       err_msg=f"step {step}")

    def test_schedule_free_runs_without_a_schedule_alone_and_inside_kfac(self):
        for entry in ("schedule_free_adamw", "kfac_schedule_free_adamw",
                      "kfac_schedule_free_adamw_adaptive"):
            point = trials.GRIDS["cnn"][entry][0]
            settings = trials.protocol(entry, point, EPOCHS, WEIGHT_DECAY)
            self.assertEqual(settings["lr_schedule"], "constant", entry)
            self.assertEqual(settings["warmup_epochs"], trials.WARMUP_FRACTION * EPOCHS)
            self.assertAlmostEqual(settings["weight_decay"],
                                   WEIGHT_DECAY / point["learning_rate"])
            optimizer = runner._build_optimizer(
                config_lib.TrainConfig(**settings), STEPS_PER_EPOCH,
                STEPS_PER_EPOCH * EPOCHS, distributed.get_communicator())
            rule = getattr(optimizer, "inner_optimizer", optimizer)
            self.assertIsInstance(rule, keras.optimizers.ScheduleFreeAdamW, entry)
            self.assertEqual(rule.warmup_steps,
                             round(trials.WARMUP_FRACTION * STEPS_PER_EPOCH * EPOCHS))

    def test_the_constant_rate_reference_keeps_its_old_settings(self):
        settings = trials.protocol("kfac_constant", {"damping": 0.1}, EPOCHS, WEIGHT_DECAY)
        self.assertEqual(settings["learning_rate"], 0.05)
        self.assertNotIn("weight_decay", settings)
        self.assertNotIn("lr_schedule", settings)


class TuningBudgetTest(absltest.TestCase):

    def test_every_entry_has_eight_distinct_points_per_model(self):
        for model, grids in trials.GRIDS.items():
            refused = {"muon"} if model in config_lib.MODELS_WITHOUT_MUON_WEIGHTS else set()
            self.assertEqual(set(grids), set(trials.OPTIMIZERS) - refused, model)
            for entry, points in grids.items():
                self.assertLen({trials.slug(point) for point in points},
                               trials.TUNING_TRIALS, f"{model} {entry}")

    def test_series(self):
        self.assertEqual(trials.series(5e-4, 4), (5e-4, 1e-3, 2e-3, 5e-3))


class CheckEntryTest(absltest.TestCase):

    def test_runnable_entries_pass(self):
        for entry in ("adamw", "sgd", "kfac_inverse", "kfac_eigen", "kfac_constant",
                      "schedule_free_adamw", "kfac_schedule_free_adamw",
                      "kfac_schedule_free_adamw_adaptive"):
            point = trials.GRIDS["vit"][entry][0]
            trials.check_entry(entry, dict(
                trials.protocol(entry, point, EPOCHS, WEIGHT_DECAY), model="vit"))

    def test_an_unknown_setting_is_named(self):
        settings = dict(trials.OPTIMIZERS["sgd"], no_such_setting=1)
        with self.assertRaisesRegex(ValueError, "entry sgd needs the trainer setting"
                                    r"\(s\) no_such_setting"):
            trials.check_entry("sgd", settings)


def tuning(entry, accuracy):
    """A tuned entry's record as the benchmark writes it."""
    return {"trials": [{"setting": trials.GRIDS["vit"][entry][0],
                        "validation_accuracy": accuracy}],
            "best": trials.GRIDS["vit"][entry][0]}


class CarryOverTest(absltest.TestCase):
    """A run that tunes one ViT arm keeps the ViT entries an earlier run wrote, each with
    the commit it was measured at, and replaces the arm it ran again."""

    def test_a_run_keeps_the_entries_it_does_not_run(self):
        adamw = {"setting": {"learning_rate": 2e-3}, "to_target": {"0.86": {}},
                 "tuning": tuning("adamw", 0.8473)["trials"]}
        previous = {
            "library_commit": "old", "budgets": {"vit": {}}, "target_accuracies": {},
            "tuning": {"grids": {"vit": {o: trials.GRIDS["vit"][o]
                                         for o in ("adamw", "sgd", "kfac_eigen")}}},
            "protocol": {"entries": {o: trials.OPTIMIZERS[o]
                                     for o in ("adamw", "sgd", "kfac_eigen")}},
            "models": {"vit": {"optimizers": {"adamw": adamw},
                               "tuned_only": {"sgd": tuning("sgd", 0.80),
                                              "kfac_eigen": tuning("kfac_eigen", 0.70)},
                               "measured_at_commit": "old"},
                       # A model with tuned entries only, none measured yet.
                       "cnn": {"optimizers": {}, "tuned_only": {"sgd": tuning("sgd", 0.9)},
                               "measured_at_commit": "older"}}}
        previous["budgets"]["cnn"] = {"tune_epochs": 2}
        previous["target_accuracies"]["cnn"] = [0.88, 0.9]
        path = os.path.join(tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir()),
                            "time_to_accuracy.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(previous, f)
        report = {
            "budgets": {"vit": {}}, "target_accuracies": {"vit": [0.86]},
            "tuning": {"grids": {"vit": {"kfac_eigen": trials.GRIDS["vit"]["kfac_eigen"]}}},
            "protocol": {"entries": {"kfac_eigen": trials.OPTIMIZERS["kfac_eigen"]}},
            "models": {"vit": {"optimizers": {},
                               "tuned_only": {"kfac_eigen": tuning("kfac_eigen", 0.86)},
                               "measured_at_commit": "new"}}}
        with flagsaver.flagsaver(output_dir=os.path.dirname(path)):
            time_to_accuracy.carry_over(report)
        vit = report["models"]["vit"]
        self.assertEqual(vit["optimizers"], {"adamw": dict(adamw, measured_at_commit="old")})
        self.assertEqual(vit["tuned_only"]["sgd"]["measured_at_commit"], "old")
        self.assertEqual(vit["tuned_only"]["kfac_eigen"], tuning("kfac_eigen", 0.86))
        self.assertEqual(set(report["tuning"]["grids"]["vit"]), {"adamw", "sgd", "kfac_eigen"})
        self.assertEqual(set(report["protocol"]["entries"]), {"adamw", "sgd", "kfac_eigen"})
        self.assertEqual(time_to_accuracy.best_tuning(vit),
                         {"adamw": 0.8473, "sgd": 0.80, "kfac_eigen": 0.86})
        self.assertEqual(report["models"]["cnn"]["measured_at_commit"], "older")
        self.assertEqual(report["target_accuracies"]["cnn"], [0.88, 0.9])


class RecordedTuningTest(absltest.TestCase):
    """A machine whose work dir is gone takes an entry's tuning from the JSON, if the JSON
    ran it on today's grid and protocol, instead of running the trials again."""

    def write(self, budget):
        output_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        scores = [{"setting": setting, "validation_accuracy": 0.8 + 0.01 * i}
                  for i, setting in enumerate(trials.GRIDS["vit"]["sgd"])]
        with open(os.path.join(output_dir, "time_to_accuracy.json"), "w",
                  encoding="utf-8") as f:
            json.dump({"budgets": {"vit": budget},
                       "protocol": {"warmup_fraction": trials.WARMUP_FRACTION,
                                    "entries": {"sgd": trials.OPTIMIZERS["sgd"]}},
                       "models": {"vit": {"optimizers": {},
                                          "tuned_only": {"sgd": {"trials": scores}}}}}, f)
        return output_dir, scores

    def test_recorded_trials_are_read_back_not_run(self):
        output_dir, scores = self.write(time_to_accuracy.BUDGETS["vit"])
        empty_work_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        with flagsaver.flagsaver(output_dir=output_dir, work_dir=empty_work_dir), \
                mock.patch.object(time_to_accuracy.trials, "run",
                                  side_effect=AssertionError("ran a trial")):
            tuned = time_to_accuracy.tune("vit", "sgd")
        self.assertEqual(tuned, {"trials": scores, "best": trials.GRIDS["vit"]["sgd"][-1]})

    def test_what_only_the_timed_runs_read_does_not_void_a_tuning(self):
        budget = dict(time_to_accuracy.BUDGETS["vit"])
        budget["kfac_xla"] = not budget["kfac_xla"]
        budget["eval_every_steps"] *= 4
        budget["max_epochs"] += 1
        output_dir, scores = self.write(budget)
        with flagsaver.flagsaver(output_dir=output_dir):
            self.assertEqual(time_to_accuracy.recorded_tuning("vit", "sgd"), scores)

    def test_a_floor_option_runs_at_its_base_entrys_tuned_point(self):
        output_dir, scores = self.write(time_to_accuracy.BUDGETS["vit"])
        with open(os.path.join(output_dir, "time_to_accuracy.json"), encoding="utf-8") as f:
            report = json.load(f)
        base = "kfac_eigen_adam"
        grid = trials.GRIDS["vit"][base]
        base_scores = [dict(score, setting=setting) for score, setting in zip(scores, grid)]
        report["protocol"]["entries"][base] = trials.OPTIMIZERS[base]
        report["models"]["vit"]["tuned_only"][base] = {"trials": base_scores}
        with open(os.path.join(output_dir, "time_to_accuracy.json"), "w",
                  encoding="utf-8") as f:
            json.dump(report, f)
        empty_work_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        with flagsaver.flagsaver(output_dir=output_dir, work_dir=empty_work_dir), \
                mock.patch.object(time_to_accuracy.trials, "run",
                                  side_effect=AssertionError("ran a trial")):
            tuned = time_to_accuracy.tune("vit", f"{base}_bf16")
        self.assertEqual(tuned, {"trials": base_scores, "best": grid[-1]})
        self.assertEqual(trials.OPTIMIZERS[f"{base}_bf16"],
                         dict(trials.OPTIMIZERS[base], product_dtype="bfloat16"))

    def test_trials_of_another_protocol_are_not_used(self):
        output_dir, _ = self.write(dict(time_to_accuracy.BUDGETS["vit"], tune_epochs=1))
        with flagsaver.flagsaver(output_dir=output_dir):
            self.assertIsNone(time_to_accuracy.recorded_tuning("vit", "sgd"))
            self.assertIsNone(time_to_accuracy.recorded_tuning("vit", "adamw"))


class StopAtLastTargetTest(absltest.TestCase):
    """`--stop_at_last_target`: the timed runs ask the trainer to stop at the model's
    highest target, and each run records whether it did; without it, no stop."""

    def test_timed_runs_stop_at_the_highest_target_only_when_asked(self):
        asked = []

        def run(work_dir, name, **settings):
            del work_dir, name
            asked.append(settings)
            stopped = settings.get("stop_at_target", False)
            return {"config": {"stop_at_target": stopped}, "to_target": 900 if stopped else None,
                    "mean_step_time_s": {"all": 0.1},
                    "evaluations": [{"train_time_s": 90.0, "steps": 900,
                                     "val_accuracy": 0.905}]}

        stopped = {}
        for flag in (False, True):
            with flagsaver.flagsaver(stop_at_last_target=flag, seeds=1), \
                    mock.patch.object(time_to_accuracy.trials, "run", side_effect=run):
                result = time_to_accuracy.measure("cnn", "sgd", {"learning_rate": 0.1})
            stopped[flag] = result["runs"][0]["stopped_at_target"]
            self.assertEqual(result["to_target"]["0.9"]["median_steps"], 900)
        self.assertNotIn("stop_at_target", asked[0])
        self.assertEqual((asked[1]["target_accuracy"], asked[1]["stop_at_target"]), (0.9, True))
        self.assertEqual(stopped, {False: False, True: True})


class SaveTest(absltest.TestCase):
    """A measured entry is written with the entries the JSON already held and the ratios
    between them, and the run's own report is left as it was."""

    def test_an_entry_is_saved_beside_the_kept_ones(self):
        def measured(steps):  # one seed reaching 0.86 at `steps` steps, 0.1 s each
            return {"runs": [{"seed": 0, "curve": [[0.1 * steps, steps, 0.86]]}],
                    "to_target": {"0.86": trials.to_target(
                        [{"curve": [[0.1 * steps, steps, 0.86]]}], 0.86)},
                    "tuning": tuning("adamw", 0.8)["trials"]}

        output_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        report = {
            "seeds": 1, "budgets": {"vit": {"tune_epochs": 2}},
            "target_accuracies": {"vit": [0.86]}, "autoencoder": {},
            "library_commit": "new",
            "tuning": {"grids": {"vit": {"kfac_eigen_adam": []}}},
            "protocol": {"entries": {"kfac_eigen_adam": {}}},
            "models": {"vit": {"optimizers": {"kfac_eigen_adam": measured(1600)},
                               "tuned_only": {}, "measured_at_commit": "new"}}}
        previous = dict(report, library_commit="old", models={"vit": {
            "optimizers": {"adamw": measured(2600)}, "measured_at_commit": "old"}})
        previous["tuning"] = {"grids": {"vit": {"adamw": []}}}
        previous["protocol"] = {"entries": {"adamw": {}}}
        with open(os.path.join(output_dir, "time_to_accuracy.json"), "w",
                  encoding="utf-8") as f:
            json.dump(previous, f)
        before = json.dumps(report, sort_keys=True)
        with flagsaver.flagsaver(output_dir=output_dir):
            time_to_accuracy.save(report)
        self.assertEqual(json.dumps(report, sort_keys=True), before)
        with open(os.path.join(output_dir, "time_to_accuracy.json"), encoding="utf-8") as f:
            vit = json.load(f)["models"]["vit"]
        self.assertEqual(list(vit["optimizers"]), ["kfac_eigen_adam", "adamw"])
        self.assertEqual(vit["optimizers"]["adamw"]["measured_at_commit"], "old")
        self.assertAlmostEqual(vit["kfac_eigen_adam_over_adamw"]["0.86"]["steps"], 1600 / 2600)
        self.assertGreater(os.path.getsize(os.path.join(output_dir, "time_to_accuracy.png")),
                           0)


if __name__ == "__main__":
    absltest.main()
