"""API misuse that used to train wrongly without a sign now stops with a clear error, or
works as it should: a plain tape or one passed as `var_list`, schedules that return bad
values, learning rates whose square overflows the KL clip, layers frozen after `attach`,
two KFACs on one model, an attached model recompiled with another optimizer or a new
KFAC, a wrapping optimizer as inner optimizer, real sample weights where fresh flags
are expected, and steps a LossScaleOptimizer skips."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from tfkfac import linalg  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh",
                                                                   name="d1"),
                             keras.layers.Dense(3, name="d2")])


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


def fit(model, optimizer, epochs=1, **kwargs):
    model.compile(optimizer=optimizer, loss=LOSS)
    x, y = data()
    return model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, shuffle=False, **kwargs)


class MisuseTest(parameterized.TestCase):

    def test_minimize_with_a_wrong_tape_says_how_to_pass_it(self):
        # A plain tape, or the recording tape passed as `var_list`.
        model = mlp()
        optimizer = tfkfac.KFAC().attach(model)
        x, y = data(16)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        with self.assertRaisesRegex(RuntimeError, r"optimizer\.record\(\)"):
            optimizer.minimize(loss, tape=tape)
        with optimizer.record() as tape:
            loss = LOSS(y, model(x, training=True))
        with self.assertRaisesRegex(ValueError, "GradientTape was passed as `var_list`; "
                                    "pass it as `tape=tape`"):
            optimizer.minimize(loss, tape)

    @parameterized.named_parameters(
        ("damping_nan", dict(damping=lambda step: float("nan")), "damping"),
        ("damping_zero", dict(damping=lambda step: 0.0), "damping"),
        ("damping_negative", dict(damping=lambda step: -1.0), "damping"),
        ("learning_rate_nan", dict(learning_rate=lambda step: float("nan")), "learning_rate"),
        ("learning_rate_negative", dict(learning_rate=lambda step: -0.1), "learning_rate"),
        ("interval_zero", dict(factor_update_freq=lambda step: 0), "factor_update_freq"),
        ("interval_fraction", dict(decomposition_update_freq=lambda step: 2.5),
         "decomposition_update_freq"))
    def test_schedule_giving_a_bad_value_stops_training_naming_it(self, settings, name):
        # One line (not TensorFlow's graph trace of the failed check): name, allowed
        # values, step and the value given.
        model = mlp()
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    rf"^KFAC: the schedule of `{name}` must give (a finite "
                                    r"number|an integer) >=? [0-9.]+; at step 0 it gave "
                                    r"[^\n]+$"):
            fit(model, tfkfac.KFAC(**settings).attach(model))

    @parameterized.named_parameters(
        ("damping_string", dict(damping=lambda step: "x"), "damping", "'x'"),
        ("learning_rate_string", dict(learning_rate=lambda step: "1e-3"), "learning_rate",
         "'1e-3'"),
        ("damping_vector", dict(damping=lambda step: tf.fill([2], 1e-3)), "damping",
         r"a float32 tensor of shape \(2,\)"),
        ("interval_bool", dict(factor_update_freq=lambda step: True), "factor_update_freq",
         "True"))
    def test_schedule_giving_no_number_is_refused_naming_it(self, settings, name, received):
        # Found when the step is traced, before any step runs: a Python error, not an
        # op that fails in the graph naming nothing.
        model = mlp()
        before = model.get_weights()
        with self.assertRaisesRegex(ValueError, rf"^KFAC: the schedule of `{name}` must give "
                                    rf"(a finite number|an integer) .*; received {received}$"):
            fit(model, tfkfac.KFAC(**settings).attach(model))
        for old, new in zip(before, model.get_weights()):
            np.testing.assert_array_equal(old, new)

    def test_learning_rate_decayed_to_zero_is_allowed(self):
        model = mlp()
        before = model.get_weights()
        # SGD: at rate 0 nothing moves, bit for bit (ScheduleFreeAdamW's interpolation
        # rounds); the schedule is a callable of the step, as KFAC's `learning_rate` takes.
        sgd = keras.optimizers.SGD(tfkfac.schedules.as_learning_rate(lambda step: 0.0))
        fit(model, tfkfac.KFAC(inner_optimizer=sgd).attach(model))
        for old, new in zip(before, model.get_weights()):
            np.testing.assert_array_equal(old, new)

    def test_kl_clip_has_no_overflow_at_huge_learning_rates(self):
        rng = np.random.default_rng(1)
        p = [[rng.normal(size=(4, 3)).astype("float32")]]
        g = [[rng.normal(size=(4, 3)).astype("float32")]]
        vg = abs(float(np.sum(p[0][0].astype("float64") * g[0][0])))
        for lr in (1e-2, 1e19, 1e30):
            expected = min(1.0, np.sqrt(1e-3 / (lr * lr * vg)))
            nu = float(linalg.kl_clip_scale(p, g, lr, 1e-3))
            self.assertGreater(nu, 0.0)
            np.testing.assert_allclose(nu, expected, rtol=1e-5)
        # A step at η = 1e20 moves the weights by η ν P = sqrt(κ/Σ) P: finite, not ~0.
        model = mlp()
        before = model.get_weights()
        fit(model, tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(1e20),
                               kl_clip=1e-3).attach(model))
        moved = max(np.abs(a - b).max() for a, b in zip(model.get_weights(), before))
        self.assertTrue(np.isfinite(moved))
        self.assertGreater(moved, 1e-4)

    def test_layer_frozen_after_attach_is_skipped_with_one_warning(self):
        model = mlp()
        optimizer = tfkfac.KFAC().attach(model)
        model.get_layer("d1").trainable = False
        frozen = model.get_layer("d1").get_weights()
        with self.assertWarnsRegex(UserWarning, "'d1' is not being trained"):
            fit(model, optimizer, epochs=2)
        for old, new in zip(frozen, model.get_layer("d1").get_weights()):
            np.testing.assert_array_equal(old, new)
        self.assertEqual(optimizer.counters()["steps"], 8)

    def test_second_kfac_on_one_model_is_an_error(self):
        model = mlp()
        tfkfac.KFAC().attach(model)
        with self.assertRaisesRegex(ValueError, "already driven by another KFAC"):
            tfkfac.KFAC().attach(model)

    def test_compiling_an_attached_model_with_another_optimizer_detaches_kfac(self):
        # The model then trains with plain Adam, as one never attached.
        model = mlp()
        optimizer = tfkfac.KFAC().attach(model)
        fit(model, "adam")
        plain = mlp()
        fit(plain, "adam")
        for got, want in zip(model.get_weights(), plain.get_weights()):
            np.testing.assert_array_equal(got, want)
        with self.assertRaisesRegex(RuntimeError, "detached from its model: model "
                                    "'sequential.*' was compiled with another optimizer "
                                    r"\(Adam\)"):
            optimizer.record()

    def test_freeze_fit_unfreeze_and_recompile_with_a_new_kfac(self):
        # Keras asks for a new optimizer when trainable flags change: the new KFAC takes
        # the model over, the old one is detached.
        model = mlp()
        model.get_layer("d1").trainable = False
        old = tfkfac.KFAC().attach(model)
        fit(model, old)
        frozen = model.get_layer("d1").get_weights()
        model.get_layer("d1").trainable = True
        new = tfkfac.KFAC().attach(model)
        fit(model, new)
        self.assertEqual([m["layer"] for m in new.summary()["managed"]], ["d1", "d2"])
        self.assertEqual(new.counters()["steps"], 4)
        self.assertGreater(max(np.abs(a - b).max() for a, b in
                               zip(frozen, model.get_layer("d1").get_weights())), 1e-4)
        with self.assertRaisesRegex(RuntimeError, "detached from its model: KFAC 'kfac' "
                                    "was attached to model 'sequential.*' in its place"):
            old.record()
        with self.assertRaisesRegex(ValueError, "was detached.*make a new KFAC"):
            old.attach(model)

    def test_a_wrapping_optimizer_as_inner_optimizer_is_refused_naming_it(self):
        for wrapper in (tfkfac.KFAC(),
                        keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())):
            with self.assertRaisesRegex(ValueError, "`inner_optimizer` must be the Keras "
                                        f"optimizer that applies the update.*received "
                                        f"{type(wrapper).__name__} around "
                                        f"{type(wrapper.inner_optimizer).__name__}"):
                tfkfac.KFAC(inner_optimizer=wrapper)

    def test_attach_to_something_else_than_a_model_names_it(self):
        with self.assertRaisesRegex(ValueError, "`model` must be a keras.Model; received list"):
            tfkfac.KFAC().attach([])

    def test_fresh_examples_never_read_sample_weights_as_flags(self):
        # A plain tensor in the sample-weight slot is a sample weight: under
        # factor_examples="fresh" the batch then lacks its flags, said before any step.
        model = mlp()
        before = model.get_weights()
        optimizer = tfkfac.KFAC(factor_examples="fresh").attach(model)
        weights = np.full(64, 0.5, "float32")
        with self.assertRaisesRegex(ValueError, r"^KFAC\(factor_examples='fresh'\) takes "
                                    r".*`tfkfac.fresh_flags\(flags\)`.*this batch has a "
                                    "sample weight there"):
            fit(model, optimizer, sample_weight=weights)
        for old, new in zip(before, model.get_weights()):
            np.testing.assert_array_equal(old, new)

    def test_steps_the_loss_scale_skips_are_counted(self):
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            model = mlp()
            optimizer = tfkfac.KFAC().attach(model)
            model.compile(optimizer=optimizer, loss=LOSS)
            self.assertIsInstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
            x, y = data()
            x[16] = np.inf  # the second batch's gradients are not finite
            model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        self.assertEqual(optimizer.counters()["skipped_steps"], 1)
        self.assertEqual(optimizer.counters()["steps"], 3)


if __name__ == "__main__":
    absltest.main()
