"""bench/time_to_accuracy.py's first-order entries, Keras's Muon, ScheduleFreeAdamW and Lamb
beside SGD and AdamW: an 8-trial grid on every model each runs, the protocol's weight
decay and schedule (none for ScheduleFreeAdamW), runs of the trainer from the protocol's
settings, the refusal before any trial of a race the trainer cannot run or that has no
first-order entry, and the race's baselines: the best-tuned first-order entry runs the
default's seed count, the best-ending one sets the targets, and the default is compared
with every one of them."""

import os
import subprocess
import sys
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/ as its scripts see it (they import their neighbours by name).
sys.path.insert(0, os.path.join(ROOT, "bench"))

from absl.testing import absltest, flagsaver, parameterized  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import time_to_accuracy  # noqa: E402
import trials  # noqa: E402
from tfkfac import distributed  # noqa: E402
from trainers import config as config_lib, runner  # noqa: E402

NEW_ENTRIES = ("muon", "schedule_free_adamw", "lamb")
STEPS_PER_EPOCH, EPOCHS, WEIGHT_DECAY = 20, 2, 5e-5


class EntriesTest(parameterized.TestCase):

    def test_every_model_tunes_each_on_eight_points_the_trainer_runs(self):
        for model, grids in trials.GRIDS.items():
            for entry in NEW_ENTRIES:
                settings = time_to_accuracy.run_settings(
                    model, entry, trials.GRIDS["vit"][entry][0], EPOCHS)
                if entry not in grids:  # only where the trainer refuses it
                    with self.assertRaises(ValueError, msg=f"{model} {entry}"):
                        trials.check_entry(entry, settings)
                    continue
                self.assertLen({trials.slug(point) for point in grids[entry]},
                               trials.TUNING_TRIALS, f"{model} {entry}")
                for point in grids[entry]:
                    trials.check_entry(entry, dict(trials.protocol(
                        entry, point, EPOCHS, WEIGHT_DECAY), model=model))
        self.assertEqual(trials.GRIDS["vit"]["muon"], trials.GRIDS["vit"]["adamw"])

    def test_an_entry_the_trainer_cannot_run_is_refused_before_any_trial(self):
        # Lamb given a setting of a feature this trainer does not have (yet).
        with mock.patch.dict(trials.OPTIMIZERS["lamb"], no_such_setting=1), \
                flagsaver.flagsaver(models=["cnn"], optimizers=["kfac", "lamb"]), \
                mock.patch.object(trials, "run", side_effect=AssertionError("ran a trial")):
            with self.assertRaisesRegex(ValueError, r"entry lamb needs the trainer setting\(s\) "
                                        "no_such_setting"):
                time_to_accuracy.main()

    def test_an_entry_without_a_grid_for_the_model_is_refused_naming_the_model(self):
        with mock.patch.dict(trials.GRIDS["resnet20"]), \
                flagsaver.flagsaver(models=["resnet20"], optimizers=["kfac", "adamw", "muon"]), \
                mock.patch.object(trials, "run", side_effect=AssertionError("ran a trial")):
            trials.GRIDS["resnet20"].pop("muon", None)
            with self.assertRaisesRegex(ValueError, r"resnet20 has no tuning grid for \['muon'\]"):
                time_to_accuracy.main()

    def test_a_race_without_a_first_order_entry_is_refused(self):
        with flagsaver.flagsaver(models=["cnn"], optimizers=["kfac", "kfac_eigen"]), \
                mock.patch.object(trials, "run", side_effect=AssertionError("ran a trial")):
            with self.assertRaisesRegex(ValueError, "must hold a first-order entry"):
                time_to_accuracy.main()

    def test_they_are_first_order_baselines_of_the_default(self):
        self.assertContainsSubset(NEW_ENTRIES + ("sgd", "adamw"), time_to_accuracy.FIRST_ORDER)
        self.assertEqual(time_to_accuracy.DEFAULT_ENTRY, "kfac")
        self.assertNotIn("kfac", time_to_accuracy.FIRST_ORDER)
        self.assertEqual(time_to_accuracy.FLAGS["optimizers"].default,
                         ["kfac", *time_to_accuracy.FIRST_ORDER])

    def test_help_lists_them(self):
        help_text = subprocess.run(
            [sys.executable, os.path.join(ROOT, "bench", "time_to_accuracy.py"), "--helpshort"],
            capture_output=True, text=True, timeout=300, cwd=ROOT,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")).stdout
        for entry in NEW_ENTRIES:
            self.assertIn(entry, help_text)


class ProtocolTest(parameterized.TestCase):

    def build(self, entry, learning_rate):
        settings = trials.protocol(entry, {"learning_rate": learning_rate}, EPOCHS,
                                   WEIGHT_DECAY)
        return settings, runner._build_optimizer(
            config_lib.TrainConfig(**settings), STEPS_PER_EPOCH, STEPS_PER_EPOCH * EPOCHS,
            distributed.get_communicator(), output_layer="logits")

    @parameterized.parameters(("muon", 1e-4), ("muon", 2e-2), ("lamb", 2e-4), ("lamb", 5e-2))
    def test_weights_shrink_by_lambda_times_the_schedule(self, entry, learning_rate):
        _, optimizer = self.build(entry, learning_rate)
        weight = keras.Variable(np.ones((3, 2), "float32"))  # a 2-D kernel: Muon's own step
        optimizer.build([weight])
        total = STEPS_PER_EPOCH * EPOCHS
        warmup = round(trials.WARMUP_FRACTION * total)
        for step in range(total):
            progress = min(1.0, max(0.0, (step - warmup) / (total - warmup)))
            multiplier = min(1.0, (step + 1) / warmup) * (1 + np.cos(np.pi * progress)) / 2
            before = weight.numpy().copy()
            optimizer.apply([np.zeros((3, 2), "float32")], [weight])
            np.testing.assert_allclose(weight.numpy() / before, 1 - WEIGHT_DECAY * multiplier,
                                       rtol=1e-6, err_msg=f"step {step}")

    def test_schedule_free_takes_the_warmup_as_its_own_and_no_schedule(self):
        settings, optimizer = self.build("schedule_free_adamw", 5e-3)
        self.assertEqual(settings["lr_schedule"], "constant")
        self.assertEqual(optimizer.warmup_steps,
                         round(trials.WARMUP_FRACTION * STEPS_PER_EPOCH * EPOCHS))
        self.assertEqual(optimizer.learning_rate.numpy(), np.float32(5e-3))
        self.assertAlmostEqual(optimizer.weight_decay, WEIGHT_DECAY / 5e-3)

    def test_a_trial_of_each_runs_through_the_trainer(self):
        work_dir = self.create_tempdir().full_path
        for entry in NEW_ENTRIES:
            settings = dict(time_to_accuracy.run_settings(
                "cnn", entry, trials.GRIDS["cnn"][entry][0], 1),
                train_split="train[:128]", eval_split="test[:64]", batch_size=32)
            summary = trials.run(work_dir, f"cnn-{entry}", **settings)
            self.assertEqual(summary["steps"], 4, entry)
            self.assertEqual(summary["config"]["optimizer"], entry)


def tuned(accuracy):
    return {"best": {"learning_rate": 1e-3}, "best_validation_accuracy": accuracy}


def ending_at(seeds, final_accuracy):
    """Timed runs of `seeds`, each 0.05 below `final_accuracy` at 10 s and at it at 20 s."""
    return [{"seed": seed, "curve": [[10.0, 100, final_accuracy - 0.05],
                                     [20.0, 200, final_accuracy]]} for seed in seeds]


class BestFirstOrderTest(absltest.TestCase):

    def test_the_best_tuned_first_order_entry_runs_the_defaults_seeds(self):
        tunings = {"kfac": tuned(0.95), "kfac_eigen_adam": tuned(0.94), "sgd": tuned(0.90),
                   "adamw": tuned(0.91), "muon": tuned(0.92), "lamb": tuned(0.89)}
        self.assertEqual(time_to_accuracy.best_first_order(tunings), "muon")

    def test_kfac_is_compared_with_every_first_order_entry(self):
        # Lamb tuned worst but ends best: its median final accuracy is the final target.
        runs = {"kfac": ending_at(range(1, 6), 0.93), "muon": ending_at(range(1, 6), 0.90),
                "schedule_free_adamw": ending_at((1, 2, 3), 0.89),
                "lamb": ending_at((1, 2, 3), 0.92)}
        result = time_to_accuracy.summarize(runs)
        self.assertEqual(result["final_target"], {"accuracy": 0.92, "entry": "lamb"})
        self.assertEqual(set(result["ratios"]), {"kfac"})
        self.assertEqual(set(result["ratios"]["kfac"]),
                         {"muon", "schedule_free_adamw", "lamb"})
        # At 0.9: K-FAC and Lamb at 20 s, Muon at 20 s, ScheduleFreeAdamW never.
        at_90 = {baseline: by_target["0.9"]["time_s"]["median"]
                 for baseline, by_target in result["ratios"]["kfac"].items()}
        self.assertEqual(at_90, {"muon": 1.0, "schedule_free_adamw": 0.0, "lamb": 1.0})


if __name__ == "__main__":
    absltest.main()
