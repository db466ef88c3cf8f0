"""KFAC inside real Keras training: precision policies, state, inner optimizers, loops."""

import copy
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest, parameterized

import tfkfac
from kfac_reference import managed_factors

RNG = np.random.default_rng(0)
X = RNG.random((64, 6, 6, 1), dtype=np.float32)
Y = RNG.integers(0, 4, 64)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def small_cnn(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 1)),
        keras.layers.Conv2D(3, 3, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Flatten(),
        keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(4, dtype="float32"),
    ])


def kfac(**kfac_args):
    """The tests' KFAC: their settings unless given (not the library's defaults): momentum
    SGD at 0.05 under a KL clip of 1e-3, damping 1e-2, factors every step."""
    if "inner_optimizer" not in kfac_args:
        kfac_args["inner_optimizer"] = keras.optimizers.SGD(
            kfac_args.pop("learning_rate", 0.05), momentum=kfac_args.pop("momentum", 0.9))
    kfac_args.setdefault("kl_clip", 1e-3)
    kfac_args.setdefault("damping", 1e-2)
    kfac_args.setdefault("factor_update_freq", 1)
    return tfkfac.KFAC(**kfac_args)


def compiled(model, **kfac_args):
    optimizer = kfac(**kfac_args).attach(model)
    model.compile(optimizer=optimizer, loss=LOSS)
    return model, optimizer


def fit(model, steps, batch_size=16):
    model.fit(X[: steps * batch_size], Y[: steps * batch_size], batch_size=batch_size,
              epochs=1, shuffle=False, verbose=0)


def max_difference(weights_a, weights_b):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights_a, weights_b))


class PrecisionTest(parameterized.TestCase):

    def tearDown(self):
        keras.mixed_precision.set_global_policy("float32")

    @parameterized.parameters("mixed_float16", "mixed_bfloat16")
    def test_mixed_policy_trains_with_float32_state(self, policy):
        keras.mixed_precision.set_global_policy(policy)
        model, optimizer = compiled(small_cnn())
        fit(model, steps=4)
        for weight in model.get_weights():
            self.assertTrue(np.all(np.isfinite(weight)))
        for factor in managed_factors(optimizer):
            self.assertEqual(factor.dtype, np.float32)
            self.assertTrue(np.all(np.isfinite(factor)))
        self.assertEqual(optimizer.summary()["counters"]["factor_updates"], 4)

    def test_mixed_float16_unscales_output_gradients(self):
        # The same step in float32 and under loss scaling must give nearly the same G.
        float32_model, float32_opt = compiled(small_cnn())
        fit(float32_model, steps=1)
        keras.mixed_precision.set_global_policy("mixed_float16")
        mixed_model, mixed_opt = compiled(small_cnn())
        self.assertIsInstance(mixed_model.optimizer, keras.optimizers.LossScaleOptimizer)
        fit(mixed_model, steps=1)
        for reference, mixed in zip(managed_factors(float32_opt), managed_factors(mixed_opt)):
            scale = np.max(np.abs(reference))
            np.testing.assert_allclose(mixed, reference, atol=2e-2 * scale)

    def test_non_finite_step_is_skipped_and_factors_untouched(self):
        keras.mixed_precision.set_global_policy("mixed_float16")
        model, optimizer = compiled(small_cnn())
        fit(model, steps=1)
        weights, factors = model.get_weights(), managed_factors(optimizer)
        huge = np.full_like(X[:16], 6e4)  # overflows float16 activations
        model.fit(huge, Y[:16], batch_size=16, epochs=1, verbose=0)
        trainable_after = [w.numpy() for w in model.trainable_weights]
        trainable_before = [w for w, v in zip(weights, model.weights) if v.trainable]
        self.assertEqual(max_difference(trainable_before, trainable_after), 0.0)
        self.assertEqual(max_difference(factors, managed_factors(optimizer)), 0.0)
        self.assertEqual(optimizer.summary()["counters"]["factor_updates"], 1)


class StateTest(absltest.TestCase):

    def test_save_load_then_one_more_step_matches_uninterrupted(self):
        model, optimizer = compiled(small_cnn(), decomposition_update_freq=2)
        fit(model, steps=3)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        self.assertIsInstance(loaded.optimizer, tfkfac.KFAC)
        loaded.optimizer.attach(loaded)
        self.assertEqual(max_difference(managed_factors(loaded.optimizer),
                                        managed_factors(optimizer)), 0.0)
        fit(model, steps=1)
        fit(loaded, steps=1)
        self.assertLess(max_difference(model.get_weights(), loaded.get_weights()), 1e-6)

    def test_tf_train_checkpoint_restores_kfac_state(self):
        model, optimizer = compiled(small_cnn())
        fit(model, steps=2)
        directory = tempfile.mkdtemp()
        path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(
            os.path.join(directory, "ckpt"))
        fit(model, steps=1)
        restored, restored_opt = compiled(small_cnn(seed=7))
        fit(restored, steps=1)  # builds the state, with different values
        tf.train.Checkpoint(model=restored, optimizer=restored_opt).restore(path)
        fit(restored, steps=1)
        self.assertLess(max_difference(model.get_weights(), restored.get_weights()), 1e-6)

    def test_owner_placement_saves_no_decompositions_and_rebuilds_them(self):
        # The eigen method: its decompositions are (eigenvectors, eigenvalues) pairs.
        replicated_model, replicated = compiled(small_cnn(), method="eigen",
                                                decomposition_update_freq=4)
        replicated.build(replicated_model.trainable_variables)
        model, optimizer = compiled(small_cnn(), method="eigen", placement="owner",
                                    decomposition_update_freq=4)
        fit(model, steps=3)  # decomposed at step 0; the next at step 4
        # Private: no public API tells the decompositions a rank holds.
        held = [v for s in optimizer.curvature.states for d in s.decompositions for v in d]
        # One process owns every layer: it holds all decompositions, but saves none; it
        # saves the factors they came from instead (and their damping, one float32).
        decomposed = [v for s in optimizer.curvature.states for v in s.decomposed or []]
        self.assertEqual(optimizer.summary()["state_bytes"],
                         replicated.summary()["state_bytes"] + 4 + sum(
                             4 * int(np.prod(v.shape)) for v in decomposed))
        self.assertLen(replicated.variables,
                       len(optimizer.variables) + len(held) - len(decomposed) - 1)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        loaded.optimizer.attach(loaded)
        # Private: the next due step is schedule state that `counters()` does not report.
        counters = lambda opt: (opt.counters()["decomposition_updates"],
                                int(opt.state.counters.next_decomposition_step.numpy()))
        self.assertEqual(counters(loaded.optimizer), (1, 4))
        fit(loaded, steps=1)  # step 3: rebuilt from the saved factors of step 0...
        self.assertEqual(counters(loaded.optimizer), (1, 4))  # ...counting nothing
        # Private: decompositions have no public API. (BatchNorm has no decomposition.)
        # The uninterrupted run still holds those of step 0: the rebuild gives the same.
        for state, kept in zip(loaded.optimizer.curvature.states,
                               optimizer.curvature.states):
            for decomposition, kept_decomposition in zip(state.decompositions,
                                                         kept.decompositions):
                for variable, kept_variable in zip(decomposition, kept_decomposition):
                    np.testing.assert_array_equal(variable.numpy(), kept_variable.numpy())
        fit(loaded, steps=1)  # step 4: the scheduled decomposition
        self.assertEqual(counters(loaded.optimizer), (2, 8))

    def test_get_config_round_trip_with_schedules_and_inner_optimizer(self):
        decay = lambda: keras.optimizers.schedules.ExponentialDecay(0.1, 100, 0.5)
        settings = dict(damping=tfkfac.WarmupDamping(1e-1, 1e-3, warmup_steps=100),
                        factor_update_freq=tfkfac.OsawaInterval(steps_per_epoch=50),
                        decomposition_update_freq=tfkfac.OsawaInterval(steps_per_epoch=50),
                        method="inverse", kl_clip=None, skip_layers=["logits"])
        for inner_class, optimizer in (
                (keras.optimizers.Adam, tfkfac.KFAC(
                    inner_optimizer=keras.optimizers.Adam(decay()), **settings)),
                (tfkfac.ScheduleFreeAdamW, tfkfac.KFAC(learning_rate=decay(), **settings))):
            config = optimizer.get_config()
            saved = copy.deepcopy(config)
            rebuilt = tfkfac.KFAC.from_config(config)
            self.assertEqual(config, saved)  # from_config leaves its argument as it was
            self.assertEqual(rebuilt.get_config(), saved)
            self.assertEqual(rebuilt.config.to_config(), optimizer.config.to_config())
            self.assertIsInstance(rebuilt.damping, tfkfac.WarmupDamping)
            self.assertIsInstance(rebuilt.inner_optimizer, inner_class)
            # The schedule survives inside the inner optimizer's config (compared above).


class UpdateRuleTest(absltest.TestCase):

    def test_kfac_level_arguments_build_the_inner_schedule_free_adamw(self):
        default = small_cnn()
        optimizer = tfkfac.KFAC(learning_rate=0.02, momentum=0.5, damping=1e-2,
                                factor_update_freq=1).attach(default)
        default.compile(optimizer=optimizer, loss=LOSS)
        self.assertIs(type(optimizer.inner_optimizer), tfkfac.ScheduleFreeAdamW)
        self.assertEqual(optimizer.inner_optimizer.beta_1, 0.5)
        inner, _ = compiled(small_cnn(), kl_clip=None,
                            inner_optimizer=tfkfac.ScheduleFreeAdamW(0.02, beta_1=0.5))
        fit(default, steps=3)
        fit(inner, steps=3)
        self.assertEqual(max_difference(default.get_weights(), inner.get_weights()), 0.0)

    def test_inner_adam_gets_preconditioned_gradients(self):
        model, optimizer = compiled(small_cnn(), inner_optimizer=keras.optimizers.Adam(1e-3))
        before = model.get_weights()
        fit(model, steps=2)
        self.assertEqual(int(optimizer.inner_optimizer.iterations.numpy()), 2)
        self.assertEqual(int(optimizer.iterations.numpy()), 2)
        self.assertGreater(max_difference(before, model.get_weights()), 0.0)

    def test_custom_training_loop_matches_fit(self):
        fitted, _ = compiled(small_cnn())
        fit(fitted, steps=2)
        looped = small_cnn()
        optimizer = kfac().attach(looped)

        @tf.function
        def train_step(x, y):
            with optimizer.record() as tape:
                loss = LOSS(y, looped(x, training=True))
            optimizer.minimize(loss, tape=tape)
            return loss

        for step in range(2):
            batch = slice(16 * step, 16 * (step + 1))
            train_step(X[batch], Y[batch])
        self.assertLess(max_difference(fitted.get_weights(), looped.get_weights()), 1e-5)

    def test_stale_steps_do_no_factor_or_decomposition_work(self):
        model, optimizer = compiled(small_cnn(), factor_update_freq=2,
                                    decomposition_update_freq=4)
        fit(model, steps=4)
        counters = optimizer.summary()["counters"]
        self.assertEqual(counters["steps"], 4)
        self.assertEqual(counters["factor_updates"], 2)       # steps 0 and 2
        self.assertEqual(counters["decomposition_updates"], 1)  # step 0
        factors = managed_factors(optimizer)
        fit(model, steps=1)  # step 4: factors and decompositions
        fit(model, steps=1)  # step 5: stale
        after_stale = managed_factors(optimizer)
        fit(model, steps=1)  # step 6: factors only
        self.assertGreater(max_difference(factors, after_stale), 0.0)
        self.assertEqual(optimizer.summary()["counters"]["factor_updates"], 4)
        self.assertEqual(optimizer.summary()["counters"]["decomposition_updates"], 2)

    def test_nan_batch_skips_the_step_and_leaves_weights_and_factors(self):
        # Trainable weights only: BatchNorm's moving statistics are updated by the
        # forward pass itself, before any optimizer sees the batch.
        model, optimizer = compiled(small_cnn())
        fit(model, steps=1)
        trainable = lambda: [w.numpy().copy() for w in model.trainable_weights]
        weights, factors = trainable(), managed_factors(optimizer)
        poisoned = X[:16].copy()
        poisoned[3, 2, 2, 0] = np.nan
        model.fit(poisoned, Y[:16], batch_size=16, epochs=1, verbose=0)
        self.assertEqual(max_difference(weights, trainable()), 0.0)
        self.assertEqual(max_difference(factors, managed_factors(optimizer)), 0.0)
        counters = optimizer.summary()["counters"]
        self.assertEqual((counters["steps"], counters["skipped_steps"]), (1, 1))
        fit(model, steps=1)  # training goes on with clean data
        self.assertEqual(optimizer.summary()["counters"]["steps"], 2)

    def test_failed_decomposition_keeps_the_previous_one(self):
        model, optimizer = compiled(small_cnn(), factor_update_freq=2,
                                    decomposition_update_freq=2)
        fit(model, steps=1)
        # Private, white-box: poisons a stored factor, forces the schedule and reads the
        # decompositions, for which there is no public API.
        state = optimizer.curvature.states[-1]
        previous = [v.numpy().copy() for v in state.decompositions[0]]
        # Corrupt a stored factor directly (the finite check on new statistics is
        # bypassed) so the next eigendecomposition returns non-finite values.
        poisoned = state.factors[0].numpy()
        poisoned[0, 0] = np.inf
        state.factors[0].assign(poisoned)
        model.fit(X[16:32], Y[16:32], batch_size=16, epochs=1, verbose=0)  # stale step 1
        optimizer.state.counters.next_decomposition_step.assign(2)
        optimizer.state.counters.next_factor_step.assign(10)  # step 2: decomposition only
        fit(model, steps=1)
        counters = optimizer.summary()["counters"]
        self.assertEqual(counters["decomposition_updates"], 2)
        self.assertGreaterEqual(counters["failed_decompositions"], 1)
        for before, variable in zip(previous, state.decompositions[0]):
            np.testing.assert_array_equal(before, variable.numpy())
        for weight in model.get_weights():
            self.assertTrue(np.all(np.isfinite(weight)))

    def test_optimizer_not_attached_to_the_unbuilt_compiled_model_says_how(self):
        model = keras.Sequential(small_cnn().layers)  # no Input: not built at compile
        model.compile(optimizer=tfkfac.KFAC(), loss=LOSS)
        with self.assertRaisesRegex(RuntimeError, r"optimizer\.attach\(model\)"):
            fit(model, steps=1)


if __name__ == "__main__":
    absltest.main()
