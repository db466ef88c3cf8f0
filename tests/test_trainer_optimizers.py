"""The trainer's Keras optimizers beyond SGD and Adam: Muon, ScheduleFreeAdamW and Lamb,
each built with the settings it runs best with and trained a few steps through the
trainer on small slices of real Fashion-MNIST; the settings each refuses, naming why."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl.testing import absltest, parameterized  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfkfac  # noqa: E402
from trainers import config as config_lib, lr_schedules, models, runner  # noqa: E402
from tfkfac import schedule_free  # noqa: E402
from trainer_testing import SMALL, STEPS_PER_EPOCH, config_from_argv  # noqa: E402


def trained(test, steps, **settings):
    """A `runner.Trainer` of `settings` on the small slices after `steps` steps."""
    config = config_lib.TrainConfig(
        model_dir=os.path.join(test.create_tempdir().full_path, "run"), steps=steps,
        **dict(SMALL, **settings))
    trainer = runner.Trainer(config)
    trainer.train()
    return trainer


def evaluation_data(trainer):
    return trainer.engine.distribute(trainer.data.evaluation(), trainer.config.batch_size)


def loss_at(trainer, weights):
    """The eval loss with the model's trainable variables set to `weights`; they are put
    back afterwards."""
    variables = trainer.model.trainable_variables
    kept = [variable.numpy() for variable in variables]
    for variable, value in zip(variables, weights):
        variable.assign(value)
    loss = trainer.model.evaluate(evaluation_data(trainer), verbose=0, return_dict=True)["loss"]
    for variable, value in zip(variables, kept):
        variable.assign(value)
    return loss


def on_the_schedule(test, optimizer, keras_class, **settings):
    """A 3-step run of `optimizer` on the trainer's warm-up + cosine: its optimizer is
    `keras_class` at the schedule's learning rate each step. Returns the Trainer."""
    trainer = trained(test, 3, model="mlp", optimizer=optimizer, lr_schedule="cosine",
                      warmup_epochs=0.1, **settings)
    update = trainer.optimizer
    test.assertIs(type(update), keras_class)
    test.assertEqual(int(update.iterations.numpy()), 3)
    schedule = lr_schedules.build_learning_rate(trainer.config, STEPS_PER_EPOCH, 3)
    for step in range(4):
        test.assertAlmostEqual(float(update._learning_rate(step)), float(schedule(step)))
    return trainer


def orthogonalized(model):
    """Paths of the variables the trainer's Muon gives its orthogonalized step."""
    muon = keras.optimizers.Muon(exclude_layers=runner.muon_exclusions(model.output_names[0]))
    return {v.path for v in model.trainable_variables if not muon._should_use_adamw(v)}


class MuonTest(parameterized.TestCase):

    def test_trains_orthogonalizing_hidden_kernels_with_adamw_settings(self):
        trainer = on_the_schedule(self, "muon", keras.optimizers.Muon, learning_rate=2e-3,
                                  weight_decay=0.01)
        muon = trainer.optimizer
        # The output layer (and biases) take its AdamW step; the hidden kernels Muon's.
        on_muon = {v.path for v in trainer.model.trainable_variables
                   if not muon._should_use_adamw(v)}
        hidden = [layer for layer in trainer.model.layers
                  if isinstance(layer, keras.layers.Dense) and layer.name != "logits"]
        self.assertLen(hidden, 2)
        self.assertEqual(on_muon, {layer.kernel.path for layer in hidden})
        self.assertEqual((muon.weight_decay, muon.adam_weight_decay), (0.01, 0.01))
        self.assertEqual((muon.momentum, muon.rms_rate), (0.95, 0.2))  # its own defaults

    def test_models_it_trains_as_adamw_are_the_named_ones(self):
        for name in models.MODEL_NAMES:
            model = models.build_model(name, (28, 28, 1), 10)
            on_muon = orthogonalized(model)
            self.assertEqual(not on_muon, name in config_lib.MODELS_WITHOUT_MUON_WEIGHTS, name)
            output = model.output_names[0]
            self.assertFalse([p for p in on_muon if p.startswith(output + "/")
                              or p.endswith("/bias") or "embedding" in p], name)
        vit = orthogonalized(models.build_model("vit", (28, 28, 1), 10))
        self.assertEqual(vit, {f"block{b}_mlp_{part}/kernel" for b in range(models.VIT_DEPTH)
                               for part in ("hidden", "output")})

    def test_said_where_it_trains_as_adamw(self):
        config, given = config_from_argv("--optimizer=muon", "--model=resnet20")
        config.validate(given)
        with self.assertLogs(level="WARNING") as logs:
            runner._options("muon", config, steps_per_epoch=10, output_layer="logits")
        self.assertRegex(logs.output[0], "orthogonalizes no weight of model=resnet20 .*every "
                         "weight takes Muon's AdamW step")

    def test_kfac_in_front_of_it_is_refused_saying_why(self):
        config, given = config_from_argv("--kfac_inner_optimizer=muon")
        with self.assertRaisesRegex(ValueError, "kfac_inner_optimizer=muon is refused: .*polar "
                                    "factor.*singular values.*one of sgd, adam, adamw, "
                                    "schedule_free_adamw, lamb"):
            config.validate(given)


def published_schedule_free_adamw(start, gradients, learning_rate, warmup_steps,
                                  beta_1=0.9, beta_2=0.999, epsilon=1e-8):
    """(y, x) after Defazio et al.'s schedule-free AdamW (their Algorithm 1 with Adam's
    second moments, c_t = 1/t, no weight decay) on `gradients`, in float64."""
    y, z, x, v = (np.array(start, "float64"), np.array(start, "float64"),
                  np.array(start, "float64"), 0.0)
    for t, gradient in enumerate(gradients, 1):
        v = beta_2 * v + (1 - beta_2) * gradient ** 2
        rate = learning_rate * min(1.0, t / warmup_steps)
        z = z - rate * gradient / (np.sqrt(v / (1 - beta_2 ** t)) + epsilon)
        x = (1 - 1 / t) * x + z / t
        y = (1 - beta_1) * z + beta_1 * x
    return y, x


class ScheduleFreeTest(parameterized.TestCase):

    @parameterized.parameters(False, True)
    def test_steps_and_averaged_weights_are_the_published_ones(self, compiled):
        start = np.array([1.0, -2.0, 3.0], "float32")
        gradients = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
        optimizer = schedule_free.ScheduleFreeAdamW(learning_rate=0.1, warmup_steps=3)
        variable = keras.Variable(start)
        optimizer.build([variable])
        apply = lambda gradient: optimizer.apply([gradient], [variable])  # noqa: E731
        for gradient in gradients:
            (tf.function(apply) if compiled else apply)(tf.constant(gradient))
        want_y, want_x = published_schedule_free_adamw(start, gradients, 0.1, 3)
        np.testing.assert_allclose(variable.numpy(), want_y, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(schedule_free.averaged_weights(optimizer, [variable])[0],
                                   want_x, rtol=1e-5, atol=1e-6)

    def test_own_warmup_no_schedule_evaluated_at_averaged_weights(self):
        trainer = trained(self, STEPS_PER_EPOCH, model="mlp", optimizer="schedule_free_adamw",
                          learning_rate=5e-3, warmup_epochs=0.5, eval_every_steps=10)
        optimizer = trainer.optimizer
        self.assertIs(type(optimizer), schedule_free.ScheduleFreeAdamW)
        self.assertEqual(optimizer.warmup_steps, STEPS_PER_EPOCH // 2)
        self.assertNotIsInstance(optimizer._learning_rate,
                                 keras.optimizers.schedules.LearningRateSchedule)
        self.assertAlmostEqual(float(optimizer.learning_rate.numpy()), 5e-3)
        variables = trainer.model.trainable_variables
        training_point = [variable.numpy() for variable in variables]
        averaged = schedule_free.averaged_weights(optimizer, variables)
        at_x, at_y = loss_at(trainer, averaged), loss_at(trainer, training_point)
        self.assertGreater(abs(at_x - at_y), 1e-3)  # the two points differ
        # fit's evaluation (the epoch's end) and the mid-epoch one run at x.
        self.assertAlmostEqual(trainer.counters.history[-1]["val_loss"], at_x, places=5)
        mid_epoch = trainer._evaluate_mid_epoch(evaluation_data(trainer))
        self.assertAlmostEqual(mid_epoch["val_loss"], at_x, places=5)
        # Training goes on from y, and y is what the checkpoint holds.
        for variable, value in zip(variables, training_point):
            np.testing.assert_array_equal(variable.numpy(), value)
        restored = models.build_model("mlp", trainer.data.input_shape, trainer.data.num_classes)
        tf.train.Checkpoint(model=restored).restore(os.path.join(
            trainer.model_dir, "checkpoints", f"step-{STEPS_PER_EPOCH}",
            "variables")).expect_partial()
        for variable, value in zip(restored.trainable_variables, training_point):
            np.testing.assert_array_equal(variable.numpy(), value)

    def test_batch_normalization_takes_its_statistics_at_averaged_weights(self):
        trainer = trained(self, 4, model="resnet20", optimizer="schedule_free_adamw",
                          learning_rate=5e-3)
        model, (callback,) = trainer.model, trainer._evaluation_callbacks
        layers = [layer for layer in model.layers
                  if isinstance(layer, keras.layers.BatchNormalization)]
        kept = model.trainable_variables + [v for layer in layers
                                            for v in (layer.moving_mean, layer.moving_variance)]
        training_state = [variable.numpy() for variable in kept]
        averaged = schedule_free.averaged_weights(trainer.optimizer, model.trainable_variables)
        # Each layer's input at x, in training mode, on the first training batches.
        for variable, value in zip(model.trainable_variables, averaged):
            variable.assign(value)
        inputs = keras.Model(model.inputs, [layer.input for layer in layers])
        batches = [batch[0] for batch in
                   trainer.data.train(0).take(schedule_free.STATISTICS_BATCHES)]
        seen = [[np.asarray(x) for x in inputs(images, training=True)] for images in batches]
        for variable, value in zip(kept, training_state):
            variable.assign(value)

        callback.on_test_begin()
        for variable, value in zip(model.trainable_variables, averaged):
            np.testing.assert_array_equal(variable.numpy(), value)
        for index, layer in enumerate(layers):
            per_batch = [batch[index] for batch in seen]
            np.testing.assert_allclose(
                layer.moving_mean.numpy(), np.mean([x.mean((0, 1, 2)) for x in per_batch], 0),
                rtol=1e-4, atol=1e-6, err_msg=layer.name)
            np.testing.assert_allclose(
                layer.moving_variance.numpy(),
                np.mean([x.var((0, 1, 2)) for x in per_batch], 0), rtol=1e-3, atol=1e-6,
                err_msg=layer.name)
        at_x = model.evaluate(evaluation_data(trainer), verbose=0, return_dict=True)["loss"]
        callback.on_test_end()
        self.assertAlmostEqual(trainer.counters.history[-1]["val_loss"], at_x, places=5)
        for variable, value in zip(kept, training_state):
            np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)

    def test_evaluations_leave_training_unchanged(self):
        settings = dict(model="mlp", optimizer="schedule_free_adamw", learning_rate=5e-3)
        evaluated = trained(self, 12, eval_every_steps=4, **settings)
        plain = trained(self, 12, **settings)
        self.assertLen(evaluated.counters.evaluations, 3)
        for a, b in zip(evaluated.model.variables + evaluated.optimizer.variables,
                        plain.model.variables + plain.optimizer.variables):
            np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)

    def test_under_kfac_evaluated_at_its_averaged_weights(self):
        trainer = trained(self, 4, model="mlp", optimizer="kfac", learning_rate=1e-3,
                          kfac_inner_optimizer="schedule_free_adamw", kl_clip=None)
        inner = trainer.optimizer.inner_optimizer
        self.assertIsInstance(trainer.optimizer, tfkfac.KFAC)
        self.assertIs(type(inner), schedule_free.ScheduleFreeAdamW)
        self.assertIs(schedule_free.update_rule(trainer.optimizer), inner)
        averaged = schedule_free.averaged_weights(inner, trainer.model.trainable_variables)
        self.assertAlmostEqual(trainer.counters.history[-1]["val_loss"],
                               loss_at(trainer, averaged), places=5)

    @parameterized.product(schedule=["cosine", "step", "polynomial"],
                           rule=[["--optimizer=schedule_free_adamw"],
                                 ["--kfac_inner_optimizer=schedule_free_adamw"]])
    def test_an_external_schedule_is_refused(self, schedule, rule):
        config, given = config_from_argv(f"--lr_schedule={schedule}", "--lr_decay_epochs=1"
                                         if schedule == "step" else "--warmup_epochs=0", *rule)
        with self.assertRaisesRegex(ValueError, f"lr_schedule={schedule} would put a schedule "
                                    "on .*schedule_free_adamw.*use lr_schedule=constant or "
                                    "warmup, with warmup_epochs for its own warm-up"):
            config.validate(given)


class LambTest(absltest.TestCase):

    def test_trains_on_the_trainers_schedule(self):
        trainer = on_the_schedule(self, "lamb", keras.optimizers.Lamb, learning_rate=1e-2,
                                  weight_decay=0.02)
        self.assertEqual(trainer.optimizer.weight_decay, 0.02)

    def test_under_kfac(self):
        trainer = trained(self, 2, model="mlp", optimizer="kfac", kfac_inner_optimizer="lamb",
                          learning_rate=1e-2, kl_clip=None)
        self.assertIs(type(trainer.optimizer.inner_optimizer), keras.optimizers.Lamb)
        self.assertEqual(int(trainer.optimizer.iterations.numpy()), 2)


class MomentumTest(absltest.TestCase):

    def test_only_sgd_takes_it(self):
        for rule in ("--optimizer=sgd", "--kfac_inner_optimizer=sgd"):  # K-FAC's inner SGD
            config, given = config_from_argv(rule, "--momentum=0.5")
            config.validate(given)
            self.assertEqual(config.momentum, 0.5)
        for rule in ("--optimizer=muon", "--optimizer=schedule_free_adamw", "--optimizer=lamb",
                     "--optimizer=adamw", "--kfac_inner_optimizer=adam",
                     "--optimizer=kfac"):  # K-FAC's default inner ScheduleFreeAdamW
            config, given = config_from_argv(rule, "--momentum=0.5")
            with self.subTest(rule), self.assertRaisesRegex(
                    ValueError, "momentum applies to optimizer=sgd and to "
                    "kfac_inner_optimizer=sgd, not to .*which keeps its own"):
                config.validate(given)


class NesterovTest(absltest.TestCase):

    def test_sgd_and_kfacs_inner_sgd_run_with_it(self):
        trainer = trained(self, 2, model="mlp", optimizer="sgd", nesterov=True,
                          learning_rate=1e-2)
        self.assertTrue(trainer.optimizer.nesterov)
        trainer = trained(self, 2, model="mlp", optimizer="kfac", kfac_inner_optimizer="sgd",
                          nesterov=True)
        self.assertTrue(trainer.optimizer.inner_optimizer.nesterov)
        self.assertEqual(int(trainer.optimizer.iterations.numpy()), 2)

    def test_refused_where_it_would_change_nothing(self):
        for rule in ("--optimizer=adamw", "--optimizer=lamb", "--kfac_inner_optimizer=adam"):
            config, given = config_from_argv(rule, "--nesterov")
            with self.subTest(rule), self.assertRaisesRegex(
                    ValueError, "nesterov applies to optimizer=sgd and to "
                    "kfac_inner_optimizer=sgd, not to .*which keeps its own momentum"):
                config.validate(given)
        config, given = config_from_argv("--optimizer=sgd", "--nesterov", "--momentum=0")
        with self.assertRaisesRegex(ValueError, "nesterov needs momentum > 0"):
            config.validate(given)


if __name__ == "__main__":
    absltest.main()
