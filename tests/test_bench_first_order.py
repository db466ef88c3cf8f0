"""bench/time_to_accuracy.py's entries of Keras's Muon, ScheduleFreeAdamW and Lamb: an
8-trial grid on every model each runs, the protocol's weight decay and schedule (none for
ScheduleFreeAdamW), runs of the trainer from the protocol's settings, and ratios of K-FAC
against the best first-order entry among all of them."""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/ as its scripts see it (they import their neighbours by name).
sys.path.insert(0, os.path.join(ROOT, "bench"))

from absl.testing import absltest, flagsaver, parameterized  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from bench import trials  # noqa: E402
import time_to_accuracy  # noqa: E402
from tfkfac import distributed  # noqa: E402
from trainers import config as config_lib, runner  # noqa: E402

NEW_ENTRIES = ("muon", "schedule_free_adamw", "lamb")
STEPS_PER_EPOCH, EPOCHS, WEIGHT_DECAY = 20, 2, 5e-5


class EntriesTest(parameterized.TestCase):

    def test_every_model_tunes_each_on_eight_points_the_trainer_runs(self):
        for model, grids in trials.GRIDS.items():
            for entry in NEW_ENTRIES:
                if entry == "muon" and model in config_lib.MODELS_WITHOUT_MUON_WEIGHTS:
                    self.assertNotIn(entry, grids)
                    continue
                self.assertLen({trials.slug(point) for point in grids[entry]},
                               trials.TUNING_TRIALS, f"{model} {entry}")
                for point in grids[entry]:
                    trials.check_entry(entry, dict(trials.protocol(
                        entry, point, EPOCHS, WEIGHT_DECAY), model=model))
        self.assertEqual(trials.GRIDS["vit"]["muon"], trials.GRIDS["vit"]["adamw"])

    def test_a_model_muon_would_train_as_adamw_is_refused_naming_why(self):
        with flagsaver.flagsaver(models=["resnet20"], optimizers=["muon"]):
            with self.assertRaisesRegex(ValueError, "entry muon: optimizer=muon would train "
                                        "model=resnet20 as adamw"):
                time_to_accuracy.main()

    def test_they_are_first_order_baselines(self):
        self.assertContainsSubset(NEW_ENTRIES, time_to_accuracy.FIRST_ORDER)

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


def measured(seconds_to_target):
    """An entry's result, one seed reaching 0.9 after `seconds_to_target` (None: it never
    did, within a run of 50 s)."""
    curve = [[50.0, 500, 0.85]] if seconds_to_target is None else [
        [seconds_to_target, int(10 * seconds_to_target), 0.9]]
    return {"to_target": {"0.9": trials.to_target([{"curve": curve}], 0.9)}}


class BestFirstOrderTest(absltest.TestCase):

    def test_kfac_is_compared_with_the_fastest_first_order_entry(self):
        results = {"sgd": measured(40.0), "adamw": measured(30.0), "muon": measured(20.0),
                   "lamb": measured(None), "kfac_eigen_adam": measured(10.0)}
        ratio = time_to_accuracy.ratios_over_best(results, "kfac_eigen_adam")["0.9"]
        self.assertEqual(ratio["baseline"], "muon")
        self.assertAlmostEqual(ratio["time"], 0.5)

    def test_where_none_reached_it_the_bound_holds_against_each(self):
        results = {"muon": measured(None), "schedule_free_adamw": measured(None),
                   "kfac_eigen_adam": measured(10.0)}
        results["schedule_free_adamw"]["to_target"]["0.9"]["median_above"]["time_s"] = 40.0
        ratio = time_to_accuracy.ratios_over_best(results, "kfac_eigen_adam")["0.9"]
        self.assertEqual(ratio["baseline"], "schedule_free_adamw")
        self.assertAlmostEqual(ratio["time_below"], 10.0 / 40.0)


if __name__ == "__main__":
    absltest.main()
