"""trainers.train: flag validation, the files a run writes, checkpoint/resume equality and
target-accuracy bookkeeping, on small slices of real Fashion-MNIST."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags
from absl.testing import absltest, parameterized
import keras
import numpy as np
import tensorflow as tf

import tfkfac
from tfkfac import distributed
from trainers import checkpoints, config as config_lib, lr_schedules, reporting, runner
from trainers import train
from trainer_testing import BATCH, SMALL, config_from_argv, read_csv, read_json, step_tensors

FLAGS = flags.FLAGS
# Checkpoint keys of the optimizer's step counter and K-FAC's factor-update counter.
ITERATIONS_KEY = "optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"
# K-FAC's variables are saved by key (trainers/checkpoints.py, KFAC_STATE).
FACTOR_UPDATES_KEY = "kfac_state/counters:factor_updates/.ATTRIBUTES/VARIABLE_VALUE"


def tensorboard_scalars(directory):
    """{tag: [(step, value)]} from the event files in `directory`."""
    scalars = {}
    for name in sorted(os.listdir(directory)):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(directory, name)):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor))))
    return scalars


class FlagValidationTest(parameterized.TestCase):

    def test_defaults_are_the_make_train_job(self):
        config, explicitly_set = config_from_argv()
        self.assertEqual(explicitly_set, set())
        self.assertEqual((config.model, config.dataset, config.optimizer),
                         ("cnn", "fashion_mnist", "kfac"))
        self.assertEqual(config, config_lib.TrainConfig())

    @parameterized.parameters(
        ("--model=vgg", "mlp|cnn|resnet20|vit|autoencoder"),
        ("--optimizer=rmsprop", "kfac|sgd|adam|adamw"),
        ("--echo_mode=sometimes", "none|example_before_augment"),
        ("--precision=float8", "float32|mixed_float16|mixed_bfloat16"),
        ("--lr_schedule=linear", "constant|warmup|step|polynomial|cosine"),
        ("--weight_sharing=mean", "expand|reduce"),
    )
    def test_unknown_choice_lists_allowed(self, arg, allowed):
        with self.assertRaisesRegex(flags.IllegalFlagValueError, allowed):
            config_from_argv(arg)

    @parameterized.parameters(
        (["--echo_factor=0.5", "--echo_mode=batch"],
         r"`echo_factor` must be a finite number in \[1, 100\]"),
        (["--echo_factor=2"], "echo_factor=2.0 needs an echo_mode"),
        (["--optimizer=sgd", "--damping=0.01", "--kl_clip=0.01"],
         "damping, kl_clip only apply to optimizer=kfac"),
        (["--factor_update_freq=10", "--decomposition_update_freq=15"], "must be a multiple"),
        (["--target_accuracy=1.5"], r"`target_accuracy` must be a finite number in \(0, 1\]"),
        (["--model=autoencoder", "--target_accuracy=0.5"], "applies to classifiers"),
        (["--stop_at_target"], "stop_at_target needs a target_accuracy"),
        (["--give_up_steps=10"], "give_up_steps and give_up_accuracy go together"),
        (["--give_up_steps=0", "--give_up_accuracy=0.5"],
         r"`give_up_steps` must be an integer in \[1, 2\*\*63 - 1\]; received 0"),
        (["--give_up_steps=5", "--give_up_accuracy=0"],
         r"`give_up_accuracy` must be a finite number in \(0, 1\]"),
        (["--model=autoencoder", "--give_up_steps=5", "--give_up_accuracy=0.5"],
         "give_up_accuracy applies to classifiers"),
        (["--lr_schedule=step"], "needs lr_decay_epochs"),
        (["--lr_schedule=step", "--lr_decay_epochs=5,2"], "strictly increasing"),
        (["--optimizer=sgd", "--lr_schedule=warmup"], "needs warmup_epochs > 0"),
        (["--lr_schedule=warmup", "--warmup_epochs=0"], "needs warmup_epochs > 0"),
        (["--lr_decay_epochs=3"], "only applies to lr_schedule=step"),
        (["--optimizer=sgd", "--lr_schedule=cosine", "--warmup_epochs=2", "--epochs=2"],
         "warmup, which must end before the run"),
        (["--batch_size=0"], r"`batch_size` must be an integer in \[1, 2\*\*63 - 1\]; received 0"),
        (["--eval_every_steps=-1"],
         r"`eval_every_steps` must be an integer in \[0, 2\*\*63 - 1\]; received -1"),
        (["--learning_rate=-1"], "learning_rate` must be a finite number > 0"),
        (["--learning_rate=nan"], "learning_rate` must be a finite number > 0"),
        (["--damping=inf"], "damping` must be a finite number > 0"),
        (["--momentum=nan"], r"`momentum` must be a finite number in \[0, 1\); received nan"),
        (["--optimizer=adamw", "--weight_decay=-0.1"],
         "weight_decay` must be a finite number >= 0"),
        (["--optimizer=sgd", "--weight_sharing=reduce"],
         "weight_sharing only applies to optimizer=kfac"),
        (["--running_mixup"], "running_mixup needs mixup_alpha > 0"),
        (["--model=autoencoder", "--mixup_alpha=0.2"], "has none"),
        (["--resume"], "resume needs the model_dir"),
        (["--dataset=no_such_dataset"], "dataset must be one of fashion_mnist, mnist"),
        (["--train_split=validation"], "train_split must be one of test, train.*'validation'"),
        (["--hierarchical_reduction"],
         "this job is one process, with nothing to reduce: set hierarchical_reduction=False"),
        (["--optimizer=sgd", "--hierarchical_reduction"],
         "hierarchical_reduction only applies to optimizer=kfac"),
    )
    def test_inconsistent_settings_raise(self, argv, message):
        config, explicitly_set = config_from_argv(*argv)
        with self.assertRaisesRegex(ValueError, message):
            runner.check(config, explicitly_set)

    @parameterized.parameters(
        (["--optimizer=adamw", "--weight_decay=0.01"], keras.optimizers.AdamW, 0.01),
        (["--optimizer=adamw"], keras.optimizers.AdamW, 0.004),  # Keras's default
        (["--optimizer=sgd"], keras.optimizers.SGD, None),
        # K-FAC: the update rule and its weight decay are the inner optimizer's.
        (["--optimizer=kfac", "--weight_decay=0.001"], tfkfac.ScheduleFreeAdamW, 0.001),
        (["--kfac_inner_optimizer=sgd", "--weight_decay=0.001"], keras.optimizers.SGD, 0.001),
        (["--kfac_inner_optimizer=adamw"], keras.optimizers.AdamW, 0.004),
        (["--kfac_inner_optimizer=adam", "--weight_decay=0.01"], keras.optimizers.Adam, 0.01),
    )
    def test_weight_decay_reaches_the_optimizer(self, argv, update_class, weight_decay):
        config, _ = config_from_argv("--learning_rate=0.002", *argv)
        optimizer = runner._build_optimizer(config, 10, 100, distributed.get_communicator())
        update = optimizer
        if config.optimizer == "kfac":
            self.assertIsInstance(optimizer, tfkfac.KFAC)
            update = optimizer.inner_optimizer
            self.assertIs(type(update), update_class)  # Keras's own (AdamW is an Adam)
        self.assertIsInstance(update, update_class)
        self.assertEqual(update.weight_decay, weight_decay)
        self.assertAlmostEqual(float(optimizer.learning_rate), 0.002)
        self.assertAlmostEqual(float(update.learning_rate), 0.002)
        if update_class is keras.optimizers.SGD:
            self.assertEqual(update.momentum, config.momentum)

    @parameterized.parameters(
        ("inv_update_freq", "decomposition_update_freq", "30", 30),
        ("bn_damping_multiplier", "diagonal_damping_multiplier", "3", 3.0),
        ("eigen_wire_dtype", "decomposition_wire_dtype", "float16", "float16"),
    )
    def test_renamed_flag_still_works_with_a_deprecation_warning(self, old, new, text, value):
        with self.assertLogs("absl", "WARNING") as logs:
            config, explicitly_set = config_from_argv(f"--{old}={text}")
        self.assertIn(f"--{old} is deprecated; use --{new}", "\n".join(logs.output))
        self.assertEqual(getattr(config, new), value)
        self.assertIn(new, explicitly_set)
        self.assertEqual(getattr(runner.check(config, explicitly_set).kfac_config(), new),
                         value)

    def test_non_numeric_decay_epochs(self):
        with self.assertRaisesRegex(ValueError, "lr_decay_epochs must be numbers"):
            config_from_argv("--lr_schedule=step", "--lr_decay_epochs=ten")


class TrainerRunTest(parameterized.TestCase):

    def run_trainer(self, model_dir, **overrides):
        return runner.run(config_lib.TrainConfig(model_dir=model_dir, **dict(SMALL, **overrides)))

    @parameterized.parameters("mlp", "cnn", "resnet20", "autoencoder")
    def test_short_kfac_run_writes_all_outputs(self, model):
        model_dir = self.create_tempdir().full_path
        summary = self.run_trainer(model_dir, model=model, steps=30, learning_rate=0.01,
                                   factor_update_freq=10, decomposition_update_freq=30)
        metric = "squared_error" if model == "autoencoder" else "accuracy"

        rows = read_csv(os.path.join(model_dir, "metrics.csv"))
        self.assertLen(rows, 2)  # 30 steps at 20 per epoch: one full and one partial epoch
        last = rows[-1]
        self.assertEqual(int(last["steps"]), 30)
        self.assertEqual(int(float(last["fresh_examples"])), 30 * BATCH)
        self.assertAlmostEqual(float(last["learning_rate"]), 0.01, places=6)
        self.assertAlmostEqual(float(last["damping"]), config_lib.TrainConfig().damping)
        for column in ("loss", metric, "val_loss", f"val_{metric}", "train_time_s"):
            self.assertTrue(np.isfinite(float(last[column])), column)

        scalars = tensorboard_scalars(os.path.join(model_dir, "tensorboard"))
        self.assertEqual([step for step, _ in scalars["val_loss"]], [1, 2])
        self.assertAlmostEqual(scalars["val_loss"][-1][1], float(last["val_loss"]), places=5)
        self.assertIn("fresh_examples", scalars)

        on_disk = read_json(os.path.join(model_dir, runner.SUMMARY_FILE))
        self.assertEqual(on_disk, json.loads(json.dumps(summary)))
        self.assertEqual((summary["steps"], summary["epochs"]), (30, 2))
        self.assertEqual(summary["fresh_examples"], 30 * BATCH)
        self.assertGreater(summary["mean_step_time_s"]["all"], 0)
        self.assertEqual(summary["final_metrics"]["val_loss"], float(last["val_loss"]))

        state = checkpoints.read_state(model_dir)
        self.assertEqual(state["counters"]["steps"], 30)
        self.assertEqual(sorted(os.listdir(os.path.join(model_dir, "checkpoints"))),
                         ["step-20", "step-30"])
        saved = step_tensors(model_dir, 30)
        # Factors updated at steps 0, 10 and 20; all K-FAC state is saved with them.
        self.assertEqual(saved[FACTOR_UPDATES_KEY], 3)
        self.assertEqual(saved[ITERATIONS_KEY], 30)
        self.assertTrue(all(np.all(np.isfinite(v)) for v in saved.values()
                            if np.issubdtype(v.dtype, np.floating)))

    def test_resume_ends_with_the_weights_of_an_uninterrupted_run(self):
        # Mid-epoch evaluations must leave training untouched, so they run here too. The
        # warm-up is given: by default it is 5% of the budget, which the resume changes.
        # The MLP: K-FAC's saved state of convolutions is compared bit for bit in
        # tests/test_resume_matrix.py; the CNN (a 1601-wide factor) took 1.7x the CPU.
        settings = dict(model="mlp", factor_update_freq=5, decomposition_update_freq=10,
                        learning_rate=0.01, eval_every_steps=7, warmup_epochs=0.1)
        straight = self.create_tempdir().full_path
        resumed = self.create_tempdir().full_path
        expected = self.run_trainer(straight, epochs=2, **settings)
        self.run_trainer(resumed, epochs=1, **settings)
        after_one = step_tensors(resumed, 20)
        got = self.run_trainer(resumed, epochs=2, resume=True, **settings)

        want = step_tensors(straight, 40)
        have = step_tensors(resumed, 40)
        self.assertEqual(sorted(want), sorted(have))
        self.assertEqual(want[FACTOR_UPDATES_KEY], 8)
        for key, value in want.items():
            if "phase_seconds" in key:  # wall-clock totals, not training state
                continue
            np.testing.assert_allclose(have[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
        # The comparison can fail: one epoch less training is far from it.
        self.assertGreater(max(np.max(np.abs(after_one[key] - want[key])) for key in want
                               if np.issubdtype(want[key].dtype, np.floating)
                               and "phase_seconds" not in key), 1e-3)

        for key in ("steps", "epochs", "fresh_examples"):
            self.assertEqual(got[key], expected[key], key)
        self.assertEqual([row["epoch"] for row in got["history"]], [1, 2])
        for mine, theirs in zip(got["history"], expected["history"]):
            self.assertAlmostEqual(mine["val_loss"], theirs["val_loss"], places=4)
        self.assertLen(read_csv(os.path.join(resumed, "metrics.csv")), 2)

    def test_resumed_cosine_run_keeps_the_schedule_end(self):
        # The first start stops at its target after epoch 1 of a 2-epoch budget; resumed
        # without stopping, it must decay to 0 at step 40, as the uninterrupted run does.
        settings = dict(model="mlp", optimizer="sgd", learning_rate=0.05, lr_schedule="cosine",
                        warmup_epochs=0.25, epochs=2, target_accuracy=0.01)
        straight = self.create_tempdir().full_path
        resumed = self.create_tempdir().full_path
        self.run_trainer(straight, **settings)
        first = self.run_trainer(resumed, stop_at_target=True, **settings)
        self.assertEqual(first["steps"], 20)
        got = self.run_trainer(resumed, resume=True, **settings)
        self.assertEqual(got["steps"], 40)
        want, have = step_tensors(straight, 40), step_tensors(resumed, 40)
        for key, value in want.items():
            np.testing.assert_allclose(have[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
        rates = [row["learning_rate"] for row in got["history"]]
        np.testing.assert_allclose(rates, [0.05 * (1 + np.cos(np.pi * 15 / 35)) / 2, 0.0],
                                   atol=1e-7)

    def test_model_dir_guards(self):
        model_dir = self.create_tempdir().full_path
        self.run_trainer(model_dir, optimizer="sgd", steps=5)
        with self.assertRaisesRegex(ValueError, "already holds a checkpoint; pass --resume"):
            runner.check(config_lib.TrainConfig(model_dir=model_dir, optimizer="sgd", **SMALL))
        changed = dict(SMALL, batch_size=16)
        with self.assertRaisesRegex(ValueError, r"changed: batch_size \(32 -> 16\)"):
            runner.check(config_lib.TrainConfig(model_dir=model_dir, optimizer="sgd",
                                                resume=True, **changed))

    def test_target_reached_and_stop(self):
        model_dir = self.create_tempdir().full_path
        summary = self.run_trainer(model_dir, optimizer="sgd", epochs=3, eval_every_steps=10,
                                   target_accuracy=0.2, stop_at_target=True)
        # Well above chance (0.1) after 10 SGD steps: the first evaluation reaches it and
        # training stops there, mid-epoch, then fit evaluates once more.
        first, at_stop = summary["evaluations"]
        self.assertGreaterEqual(first["val_accuracy"], 0.2)
        self.assertEqual((first["steps"], first["epochs"], first["fresh_examples"]),
                         (10, 0.5, 10 * BATCH))
        self.assertEqual(summary["to_target"], {
            "epochs": 0.5, "steps": 10, "fresh_examples": 10 * BATCH,
            "time_s": first["train_time_s"], "accuracy": first["val_accuracy"]})
        self.assertEqual((summary["steps"], summary["epochs"]), (10, 1))
        self.assertEqual(at_stop["steps"], 10)
        self.assertLen(summary["history"], 1)

    def test_a_run_gives_up_past_its_steps_and_stays_given_up_on_resume(self):
        model_dir = self.create_tempdir().full_path
        settings = dict(model="mlp", optimizer="sgd", epochs=3, eval_every_steps=5,
                        give_up_steps=5, give_up_accuracy=1.0)
        summary = self.run_trainer(model_dir, **settings)
        # Evaluations at steps 5 and 10: the one at 10 is past 5 steps and none reached
        # 1.0 by then, so training stops there (fit evaluates once more at the stop).
        self.assertTrue(summary["gave_up"])
        self.assertEqual((summary["steps"], summary["epochs"]), (10, 1))
        self.assertEqual([p["steps"] for p in summary["evaluations"]], [5, 10, 10])
        self.assertTrue(read_json(os.path.join(model_dir, runner.SUMMARY_FILE))["gave_up"])
        resumed = self.run_trainer(model_dir, resume=True, **settings)
        self.assertTrue(resumed["gave_up"])
        self.assertEqual(resumed["steps"], 10)
        # Without the give-up the same run trains its 3 epochs.
        full = self.run_trainer(self.create_tempdir().full_path, model="mlp", optimizer="sgd",
                                epochs=3, eval_every_steps=5)
        self.assertFalse(full["gave_up"])
        self.assertEqual(full["steps"], 60)

    def test_unreached_target_is_null(self):
        model_dir = self.create_tempdir().full_path
        summary = self.run_trainer(model_dir, optimizer="sgd", steps=10, target_accuracy=1.0)
        self.assertIsNone(summary["to_target"])
        self.assertIsNone(read_json(os.path.join(model_dir, runner.SUMMARY_FILE))["to_target"])


class LearningRateScheduleTest(parameterized.TestCase):
    """`--lr_schedule` values at chosen steps against the formulas, written out by hand."""

    STEPS_PER_EPOCH, TOTAL_STEPS = 10, 50

    def schedule_at(self, steps, **settings):
        # SGD: the default schedule-free rule takes no schedule.
        config = config_lib.TrainConfig(optimizer="sgd", learning_rate=0.2, **settings)
        config.validate()
        schedule = lr_schedules.build_learning_rate(config, self.STEPS_PER_EPOCH,
                                                    self.TOTAL_STEPS)
        return [float(schedule(step)) if callable(schedule) else schedule for step in steps]

    def test_constant(self):
        self.assertEqual(self.schedule_at([0, 49]), [0.2, 0.2])

    def test_warmup_ramps_then_holds(self):
        # warmup_epochs=0.5 -> 5 steps: lr * (step + 1) / 5, then lr.
        np.testing.assert_allclose(
            self.schedule_at([0, 2, 4, 5, 30], lr_schedule="warmup", warmup_epochs=0.5),
            [0.04, 0.12, 0.2, 0.2, 0.2], rtol=1e-6)

    def test_step_decays_at_epoch_boundaries(self):
        np.testing.assert_allclose(
            self.schedule_at([0, 9, 10, 19, 20, 49], lr_schedule="step",
                             lr_decay_epochs=(1.0, 2.0), lr_decay_factor=0.5),
            [0.2, 0.2, 0.1, 0.1, 0.05, 0.05], rtol=1e-6)

    def test_cosine_decays_to_zero_after_the_warmup(self):
        # warmup_epochs=0.2 -> W = 2 steps: lr * (t + 1) / W, then
        # lr * (1 + cos(pi (t - W) / (T - W))) / 2, 0 at the end T = 50.
        steps = np.array([0, 1, 2, 3, 10, 26, 40, 49, 50])
        progress = np.clip((steps - 2) / 48, 0, 1)
        expected = 0.2 * np.minimum(1, (steps + 1) / 2) * (1 + np.cos(np.pi * progress)) / 2
        np.testing.assert_allclose(
            self.schedule_at(steps, lr_schedule="cosine", warmup_epochs=0.2), expected,
            rtol=1e-5, atol=1e-9)
        self.assertEqual(self.schedule_at([50], lr_schedule="cosine", warmup_epochs=0.2), [0])

    def test_cosine_without_warmup_starts_at_full_rate(self):
        steps = np.array([0, 25, 50])
        np.testing.assert_allclose(self.schedule_at(steps, lr_schedule="cosine"),
                                   0.2 * (1 + np.cos(np.pi * steps / 50)) / 2, atol=1e-7)

    def test_cosine_round_trips_through_keras_serialization(self):
        config = config_lib.TrainConfig(optimizer="sgd", learning_rate=0.2,
                                        lr_schedule="cosine", warmup_epochs=0.2)
        schedule = lr_schedules.build_learning_rate(config, self.STEPS_PER_EPOCH,
                                                    self.TOTAL_STEPS)
        restored = keras.saving.deserialize_keras_object(
            keras.saving.serialize_keras_object(schedule))
        self.assertEqual(restored.get_config(), schedule.get_config())
        np.testing.assert_allclose([float(restored(t)) for t in (0, 7, 30)],
                                   [float(schedule(t)) for t in (0, 7, 30)])

    def test_polynomial_reaches_zero_with_warmup(self):
        steps = [0, 1, 10, 25, 50]
        expected = [0.2 * (1 - t / 50) ** 2 * min(1.0, (t + 1) / 2) for t in steps]
        np.testing.assert_allclose(
            self.schedule_at(steps, lr_schedule="polynomial", lr_decay_power=2.0,
                             warmup_epochs=0.2), expected, rtol=1e-5, atol=1e-9)


class _FakeModel:
    stop_training = False


class RecorderBookkeepingTest(absltest.TestCase):
    """Drives EpochRecorder through the callbacks Keras calls, without training."""

    def test_giving_up_needs_an_evaluation_past_the_steps_and_none_reaching_by_them(self):
        counters = reporting.RunCounters()
        log = reporting.EvaluationLog(counters, give_up=(10, 0.9))

        def evaluate(steps, accuracy):
            counters.steps = steps
            log.record({"val_accuracy": accuracy}, fresh_examples=0, epochs=0)
            return log.gave_up

        self.assertFalse(evaluate(5, 0.5))
        self.assertFalse(evaluate(10, 0.5))  # not past the steps yet
        self.assertTrue(evaluate(15, 0.95))  # reached, but after the steps
        reached_in_time = reporting.RunCounters()
        log = reporting.EvaluationLog(reached_in_time, give_up=(10, 0.9))
        for steps, accuracy in ((10, 0.9), (15, 0.8)):
            reached_in_time.steps = steps
            log.record({"val_accuracy": accuracy}, fresh_examples=0, epochs=0)
        self.assertFalse(log.gave_up)
        self.assertFalse(reporting.EvaluationLog(counters).gave_up)  # no give_up given

    def test_evaluation_spacing_is_a_share_of_the_steps_done(self):
        due = reporting.EvaluationSchedule(every=0, spacing=0.1)
        steps = [s for s in range(1, 200) if due(s)]
        # Gaps of 5 until 10% of the steps done exceeds 5, then 10% of them (rounded down).
        self.assertEqual(steps[:12], [5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60])
        self.assertEqual(steps[12:16], [66, 72, 79, 86])
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        self.assertTrue(all(gap <= max(5, 0.1 * a) for gap, a in zip(gaps, steps)))
        # A schedule that starts late (a resumed run) evaluates at the same steps.
        resumed = reporting.EvaluationSchedule(every=0, spacing=0.1)
        self.assertEqual([s for s in range(100, 200) if resumed(s)],
                         [s for s in steps if s >= 100])
        capped = reporting.EvaluationSchedule(every=7, spacing=0.1)
        capped_steps = [s for s in range(1, 200) if capped(s)]
        self.assertEqual(max(b - a for a, b in zip(capped_steps, capped_steps[1:])), 7)
        every = reporting.EvaluationSchedule(every=4, spacing=0)
        self.assertEqual([s for s in range(1, 13) if every(s)], [4, 8, 12])
        self.assertFalse(reporting.EvaluationSchedule(every=0, spacing=0)(5))

    def test_first_crossing_is_recorded_with_totals_at_that_point(self):
        counters = reporting.RunCounters()
        fresh_per_epoch = {"count": 0}
        # Mid-epoch evaluations after steps 2, 6 and 10; epoch ends after steps 4, 8, 12.
        mid_epoch = iter([{"val_accuracy": 0.5}, {"val_accuracy": 0.7},
                          {"val_accuracy": 0.2}])
        recorder = reporting.EpochRecorder(
            counters, distributed.SingleProcess(), scalars_fn=lambda: {"learning_rate": 0.1},
            fresh_examples_fn=lambda: fresh_per_epoch["count"],
            phase_fn=lambda: "step", evaluate_fn=lambda: next(mid_epoch),
            eval_every_steps=2, target_accuracy=0.75, stop_at_target=False)
        recorder.set_model(_FakeModel())
        recorder.set_params({"steps": 4})
        for epoch, accuracy in enumerate([0.6, 0.8, 0.9]):
            recorder.on_epoch_begin(epoch)
            fresh_per_epoch["count"] = 0
            for batch in range(4):
                recorder.on_train_batch_begin(batch)
                fresh_per_epoch["count"] += 10
                recorder.on_train_batch_end(batch)
            recorder.on_test_begin()
            recorder.on_epoch_end(epoch, {"loss": 1.0, "val_accuracy": accuracy})
        points = [(p["steps"], p["epochs"], p["fresh_examples"], p["val_accuracy"])
                  for p in counters.evaluations]
        self.assertEqual(points[:5], [(2, 0.5, 20, 0.5), (4, 1, 40, 0.6), (6, 1.5, 60, 0.7),
                                      (8, 2, 80, 0.8), (10, 2.5, 100, 0.2)])
        reached = counters.evaluations[3]
        self.assertEqual(counters.to_target, {
            "epochs": 2, "steps": 8, "fresh_examples": 80,
            "time_s": reached["train_time_s"], "accuracy": 0.8})
        self.assertEqual(counters.history[1]["train_time_s"], reached["train_time_s"])
        self.assertEqual((counters.epochs, counters.steps, counters.fresh_examples),
                         (3, 12, 120))
        # First step of a phase (tracing) is not timed: 11 of 12 steps are.
        self.assertEqual(counters.step_time["step"][0], 11)
        self.assertFalse(recorder.model.stop_training)
        self.assertEqual(reporting.RunCounters.from_dict(counters.to_dict()), counters)


if __name__ == "__main__":
    absltest.main()
