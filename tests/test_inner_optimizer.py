"""KFAC is a preconditioner in front of a Keras optimizer (docs/usage.md): the inner
optimizer applies every update, and its learning rate is the one Keras users set —
through KFAC's `learning_rate`, schedules and callbacks."""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


class LearningRateLog(keras.callbacks.Callback):
    """The inner optimizer's learning rate at the start of each epoch's first step (after
    the scheduler), and the weights at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.rates, self.weights = [], []

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.rates.append(float(self.model.optimizer.inner_optimizer.learning_rate))

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([w.copy() for w in self.model.get_weights()])


class InnerOptimizerTest(absltest.TestCase):

    def test_scheduler_callback_drives_the_inner_adamw(self):
        model = mlp()
        inner = keras.optimizers.AdamW(1e-3, weight_decay=0.0)
        optimizer = tfkfac.KFAC(inner_optimizer=inner, damping=1e-2).attach(model)
        model.compile(optimizer=optimizer, loss=LOSS)
        log = LearningRateLog()
        # Epoch 2 at 2.5e-4 as in the report; epoch 3 at 0: the weights must then stay.
        schedule = keras.callbacks.LearningRateScheduler(
            lambda epoch, lr: [1e-3, 2.5e-4, 0.0][epoch])
        x, y = data()
        model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                  callbacks=[schedule, log])
        np.testing.assert_allclose(log.rates, [1e-3, 2.5e-4, 0.0], rtol=1e-6)
        self.assertIs(model.optimizer.inner_optimizer, inner)
        self.assertEqual(float(model.optimizer.learning_rate), 0.0)
        # Epochs 1 and 2 moved the weights, epoch 3 (rate 0, no decay) did not.
        self.assertGreater(np.abs(log.weights[1][0] - log.weights[0][0]).max(), 0)
        for before, after in zip(log.weights[1], log.weights[2]):
            np.testing.assert_array_equal(before, after)
        # One step counter, the inner optimizer's: 4 steps an epoch.
        self.assertIs(optimizer.iterations, inner.iterations)
        self.assertEqual(int(inner.iterations), 12)
        self.assertEqual(optimizer.counters()["steps"], 12)

    def test_default_inner_is_momentum_sgd_from_kfacs_arguments(self):
        optimizer = tfkfac.KFAC(learning_rate=0.2, momentum=0.5, weight_decay=1e-4)
        inner = optimizer.inner_optimizer
        self.assertIsInstance(inner, keras.optimizers.SGD)
        self.assertEqual((float(inner.learning_rate), inner.momentum, inner.weight_decay),
                         (np.float32(0.2), 0.5, 1e-4))
        optimizer.learning_rate = 0.05  # what ReduceLROnPlateau does
        self.assertAlmostEqual(float(inner.learning_rate), 0.05)

    def test_update_is_the_inner_rule_on_the_preconditioned_gradient(self):
        # One step of KFAC over plain SGD (no momentum, no KL clip) moves every weight by
        # -η P, P what `precondition` gives for the step's gradient with the curvature
        # the step computed.
        model = mlp()
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.1), kl_clip=None,
                                damping=1e-2, xla=False).attach(model)
        variables = model.trainable_variables
        x, y = data(16)
        before = [v.numpy().copy() for v in variables]
        with optimizer.record() as tape:
            loss = LOSS(y, model(x, training=True))
        optimizer.minimize(loss, tape=tape)
        after = [v.numpy().copy() for v in variables]
        for variable, value in zip(variables, before):
            variable.assign(value)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        preconditioned = optimizer.precondition(tape.gradient(loss, variables), variables)
        for moved, start, p in zip(after, before, preconditioned):
            np.testing.assert_allclose(moved, start - 0.1 * p.numpy(), rtol=0, atol=1e-6)
        self.assertGreater(max(np.abs(m - s).max() for m, s in zip(after, before)), 1e-4)


class JitCompileTest(absltest.TestCase):

    def test_jit_compile_is_turned_off_with_a_warning_not_silently(self):
        x, y = data(32)
        for jit_compile, warns in ((True, True), (False, False)):
            model = mlp()
            model.compile(optimizer=tfkfac.KFAC(learning_rate=0.05).attach(model), loss=LOSS,
                          jit_compile=jit_compile)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            said = [w for w in caught if "cannot be compiled with XLA" in str(w.message)]
            self.assertLen(said, int(warns))
            self.assertFalse(model.jit_compile)


if __name__ == "__main__":
    absltest.main()
