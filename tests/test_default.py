"""The declared default (docs/guide.md, "The default"): what `tfkfac.KFAC()` and
`python -m trainers.train` give with no arguments — the inverse method, damping 0.03, no
KL clip, factors every 10 steps (decay 0.95) and decompositions every 100, into
`tfkfac.ScheduleFreeAdamW` at learning rate 0.01 (β1 0.9; the trainer warms it up over
5% of the run) — trains, is evaluated at its averaged weights through
`tfkfac.AveragedWeights`, saves and loads; saves of the trainer's ScheduleFreeAdamW and of
0.1 (KFAC was its own momentum SGD) load as they were."""

import dataclasses
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from tfkfac import distributed  # noqa: E402
from trainers import config as config_lib, lr_schedules, runner  # noqa: E402

# The declared default's K-FAC settings; every other KFACConfig field keeps its default.
DECLARED = dict(method="inverse", damping=0.03, kl_clip=None, factor_update_freq=10,
                decomposition_update_freq=100, factor_decay=0.95)
# ScheduleFreeAdamW's hyperparameters in the default: (learning_rate, beta_1, beta_2,
# epsilon, weight_decay).
DECLARED_RULE = (0.01, 0.9, 0.999, 1e-8, None)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def rule_of(optimizer):
    inner = optimizer.inner_optimizer
    return (float(inner.learning_rate), inner.beta_1, inner.beta_2, inner.epsilon,
            inner.weight_decay)


def mlp(normalized=False):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="tanh")]
        + ([keras.layers.BatchNormalization()] if normalized else [])
        + [keras.layers.Dense(3)])


def data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")


class DeclaredDefaultTest(absltest.TestCase):

    def test_kfac_without_arguments_is_the_declared_default(self):
        optimizer = tfkfac.KFAC()
        for name, value in DECLARED.items():
            self.assertEqual(getattr(optimizer.config, name), value, msg=name)
        self.assertEqual(optimizer.config, tfkfac.KFACConfig(**DECLARED))
        self.assertIs(type(optimizer.inner_optimizer), tfkfac.ScheduleFreeAdamW)
        self.assertEqual(rule_of(optimizer), (np.float32(0.01), *DECLARED_RULE[1:]))
        self.assertEqual(optimizer.inner_optimizer.warmup_steps, 0)  # the run's is unknown

    def test_trainer_without_flags_runs_the_declared_default(self):
        config = config_lib.TrainConfig()
        config.validate()
        self.assertEqual((config.optimizer, config.kfac_inner_optimizer, config.learning_rate,
                          config.damping, config.kl_clip, config.kfac_method,
                          config.lr_schedule, config.warmup_epochs),
                         ("kfac", "schedule_free_adamw", 0.01, 0.03, None, "inverse",
                          "constant", None))
        optimizer = runner._build_optimizer(config, 100, 1000, distributed.SingleProcess())
        self.assertIsInstance(optimizer, tfkfac.KFAC)
        # The library's default, with K-FAC's own stages not compiled without --xla.
        self.assertEqual(optimizer.config, dataclasses.replace(tfkfac.KFAC().config,
                                                               xla=False))
        self.assertIs(type(optimizer.inner_optimizer), tfkfac.ScheduleFreeAdamW)
        self.assertEqual(rule_of(optimizer), rule_of(tfkfac.KFAC()))
        self.assertEqual(optimizer.inner_optimizer.warmup_steps, 50)  # 5% of 1000 steps
        # The warm-up is 5% of whatever the run is; a rule with a schedule has none.
        self.assertEqual(lr_schedules.warmup_length(config, 100, 300), 15)
        self.assertEqual(lr_schedules.warmup_length(config, 100, 8), 0)
        sgd = config_lib.TrainConfig(kfac_inner_optimizer="sgd")
        self.assertEqual(lr_schedules.warmup_length(sgd, 100, 1000), 0)

    def test_trainer_learning_rate_default_follows_the_update_rule(self):
        for settings, rate in ((dict(), 0.01), (dict(optimizer="schedule_free_adamw"), 0.01),
                               (dict(optimizer="sgd"), 0.05),
                               (dict(kfac_inner_optimizer="sgd"), 0.05),
                               (dict(optimizer="adamw"), 1e-3),
                               (dict(kfac_inner_optimizer="adam"), 1e-3),
                               (dict(optimizer="sgd", learning_rate=0.2), 0.2)):
            with self.subTest(**settings):
                config = config_lib.TrainConfig(**settings)
                config.validate()
                self.assertEqual(config.learning_rate, rate)

    def test_couple_momentum_to_lr_names_the_default_inner_optimizer(self):
        with self.assertRaisesRegex(ValueError, r"`couple_momentum_to_lr` couples the "
                                    r"momentum of a keras.optimizers.SGD.*the inner optimizer "
                                    r"here is ScheduleFreeAdamW \(KFAC's default\).*Pass "
                                    r"inner_optimizer=keras.optimizers.SGD"):
            tfkfac.KFAC(couple_momentum_to_lr=True)
        with self.assertRaisesRegex(ValueError, "couple_momentum_to_lr couples.*received "
                                    "kfac_inner_optimizer=schedule_free_adamw; pass "
                                    "kfac_inner_optimizer=sgd"):
            config_lib.TrainConfig(couple_momentum_to_lr=True).validate(
                {"couple_momentum_to_lr"})


class DefaultTrainsTest(absltest.TestCase):

    def test_default_trains_and_is_evaluated_at_the_averaged_weights(self):
        model = mlp()
        optimizer = tfkfac.KFAC()
        averaged = tfkfac.AveragedWeights(optimizer)
        model.compile(optimizer=optimizer, loss=LOSS)
        x, y = data()
        validation = data(64, seed=1)
        history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
                            validation_data=validation, callbacks=[averaged])
        losses = history.history["loss"]
        self.assertTrue(np.all(np.isfinite(losses)))
        self.assertLess(losses[-1], losses[0])
        self.assertEqual(optimizer.counters()["steps"], 24)
        self.assertGreater(optimizer.counters()["factor_updates"], 0)
        training_point = [v.numpy() for v in model.trainable_variables]
        at_x = tfkfac.schedule_free.averaged_weights(optimizer.inner_optimizer,
                                                     model.trainable_variables)
        self.assertGreater(max(np.abs(a - b).max() for a, b in zip(at_x, training_point)),
                           1e-4)
        # fit's validation ran at x, and the model went back to y, where training goes on.
        for variable, value in zip(model.trainable_variables, at_x):
            variable.assign(value)
        loss_at_x = model.evaluate(*validation, verbose=0)
        for variable, value in zip(model.trainable_variables, training_point):
            variable.assign(value)
        self.assertAlmostEqual(history.history["val_loss"][-1], loss_at_x, places=5)
        self.assertAlmostEqual(model.evaluate(*validation, verbose=0, callbacks=[averaged]),
                               loss_at_x, places=5)
        with averaged.applied():  # e.g. to export the model at x
            for variable, value in zip(model.trainable_variables, at_x):
                np.testing.assert_array_equal(variable.numpy(), value)
        for variable, value in zip(model.trainable_variables, training_point):
            np.testing.assert_array_equal(variable.numpy(), value)

    def test_batch_normalization_needs_training_batches(self):
        model = mlp(normalized=True)
        optimizer = tfkfac.KFAC()
        model.compile(optimizer=optimizer, loss=LOSS)
        x, y = data()
        with self.assertRaisesRegex(ValueError, "AveragedWeights: the model has "
                                    "BatchNormalization layers.*pass `training_batches`"):
            model.fit(x, y, batch_size=32, epochs=1, verbose=0, validation_data=data(64, 1),
                      callbacks=[tfkfac.AveragedWeights(optimizer)])
        batches = [(x[i:i + 32], y[i:i + 32]) for i in range(0, 256, 32)]
        history = model.fit(x, y, batch_size=32, epochs=1, verbose=0,
                            validation_data=data(64, 1),
                            callbacks=[tfkfac.AveragedWeights(optimizer, batches)])
        self.assertTrue(np.isfinite(history.history["val_loss"][-1]))

    def test_averaged_weights_refuses_another_update_rule(self):
        with self.assertRaisesRegex(ValueError, r"AveragedWeights evaluates at a "
                                    r"ScheduleFreeAdamW's averaged weights; `optimizer` "
                                    r"\(KFAC\) applies its updates with SGD"):
            tfkfac.AveragedWeights(tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.1)))


class DefaultSavesTest(absltest.TestCase):

    def test_keras_file_round_trip(self):
        model = mlp()
        model.compile(optimizer=tfkfac.KFAC(), loss=LOSS)
        x, y = data()
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        path = os.path.join(self.create_tempdir().full_path, "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertIs(type(loaded.optimizer.inner_optimizer), tfkfac.ScheduleFreeAdamW)
        self.assertEqual(loaded.optimizer.get_config(), model.optimizer.get_config())
        for saved, restored in zip(model.optimizer.variables, loaded.optimizer.variables):
            np.testing.assert_array_equal(saved.numpy(), restored.numpy())

    def test_trainers_registered_name_still_loads(self):
        config = keras.saving.serialize_keras_object(tfkfac.ScheduleFreeAdamW(0.02))
        self.assertEqual(config["registered_name"], "tfkfac>ScheduleFreeAdamW")
        # As the trainer's own copy (trainers/schedule_free.py, now gone) saved it.
        config.update(module="trainers.schedule_free",
                      registered_name="trainers>ScheduleFreeAdamW")
        loaded = keras.saving.deserialize_keras_object(config)
        self.assertIs(type(loaded), tfkfac.ScheduleFreeAdamW)
        self.assertAlmostEqual(float(loaded.learning_rate), 0.02)

    def test_a_save_without_inner_optimizer_loads_as_momentum_sgd(self):
        # 0.1's KFAC was its own momentum SGD: its config holds the rule's arguments, or
        # leaves them at 0.1's defaults (0.05, 0.9).
        config = tfkfac.KFAC().get_config()
        del config["inner_optimizer"]
        for legacy, expected in ((dict(learning_rate=0.2, momentum=0.5), (0.2, 0.5)),
                                 (dict(), (0.05, 0.9))):
            loaded = tfkfac.KFAC.from_config(dict(config, **legacy))
            inner = loaded.inner_optimizer
            self.assertIs(type(inner), keras.optimizers.SGD)
            self.assertEqual((float(inner.learning_rate), inner.momentum),
                             (np.float32(expected[0]), expected[1]))


if __name__ == "__main__":
    absltest.main()
