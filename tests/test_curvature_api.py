"""The public curvature API: `KFAC.factors(layer)` and `KFAC.precondition(grads, vars)`.

Against the independent numpy reference of tests/kfac_reference.py (float64 forward and
backward of a small MLP): after one step with factor_decay's first update F = F_batch,
`factors` returns A = (1/N) Σ ā āᵀ and G = (1/N) Σ g gᵀ of each Dense layer, and
`precondition` returns (A ⊗ G + λI)⁻¹ vec(∇) per layer (explicit np.kron solve) for new
gradients, leaving unmanaged variables' gradients untouched. BatchNorm's factor is
named "F". Bad arguments name what is allowed.

`state_dtype="float64"` on a float64 model agrees with the same reference to 1e-9 for the
factors and 1e-7 for the preconditioned gradients (float32 state: 1e-4), and
`step_phase` names exactly the work each step did (the
counters), also for callable intervals. Inside `model.fit`, `summary()["phase_seconds"]`
charges each phase's work to its own clock (an update made slow on purpose shows in
"update" only).
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import DAMPING, N, assert_close, kron_precondition  # noqa: E402

RNG = np.random.default_rng(0)


def mlp(dtype=None):
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((4,), dtype=dtype),
        keras.layers.Dense(5, activation="tanh", name="hidden", dtype=dtype),
        keras.layers.Dense(3, name="head", dtype=dtype),
    ])


def numpy_curvature(model, x, y):
    """Per layer (A, G, ∇) of the MSE loss, float64, from an explicit forward/backward."""
    (w1, b1), (w2, b2) = [(l.kernel.numpy().astype(np.float64), l.bias.numpy().astype(np.float64))
                          for l in model.layers]
    s1 = x @ w1 + b1
    h = np.tanh(s1)
    s2 = h @ w2 + b2
    ds2 = 2.0 * (s2 - y) / s2.size
    ds1 = (ds2 @ w2.T) * (1 - h ** 2)
    result = []
    for a, ds in ((x, ds1), (h, ds2)):
        a_bar = np.concatenate([a, np.ones((len(a), 1))], 1)
        g = N * ds
        result.append((a_bar.T @ a_bar / N, g.T @ g / N, a_bar.T @ ds))
    return result


class CurvatureApiTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        self.model = mlp()
        self.optimizer = tfkfac.KFAC(learning_rate=0.1, damping=DAMPING, kl_clip=None,
                                     momentum=0.0, xla=False).attach(self.model)
        self.loss = keras.losses.MeanSquaredError()

    def step(self, x, y):
        with self.optimizer.record() as tape:
            loss = self.loss(y, self.model(x, training=True))
        self.optimizer.minimize(loss, tape=tape)

    def check_against_numpy(self, dtype, rtol, atol_scale=1e-5, precondition=None):
        """`precondition`: (rtol, atol_scale) of the preconditioned gradients, if not those."""
        precondition_rtol, precondition_atol = precondition or (rtol, atol_scale)
        x = RNG.normal(size=(N, 4)).astype(dtype)
        y = RNG.normal(size=(N, 3)).astype(dtype)
        expected = numpy_curvature(self.model, x, y)
        self.step(x, y)
        for layer, (a, g, _) in zip(self.model.layers, expected):
            factors = self.optimizer.factors(layer)
            self.assertEqual(set(factors), {"A", "G"})
            self.assertEqual(factors["A"].dtype, self.optimizer.state_dtype)
            assert_close(factors["A"], a, rtol=rtol, msg=layer.name, atol_scale=atol_scale)
            assert_close(self.optimizer.factors(layer.name)["G"], g, rtol=rtol, msg=layer.name,
                         atol_scale=atol_scale)
        # New gradients, preconditioned with the decompositions of those factors.
        x2 = RNG.normal(size=(N, 4)).astype(dtype)
        y2 = RNG.normal(size=(N, 3)).astype(dtype)
        with tf.GradientTape() as tape:
            loss = self.loss(y2, self.model(x2))
        variables = self.model.trainable_variables
        grads = tape.gradient(loss, variables)
        got = self.optimizer.precondition(grads, variables)
        for k, (a, g, _) in enumerate(expected):
            grad = np.concatenate([grads[2 * k].numpy(), grads[2 * k + 1].numpy()[None]], 0)
            p = kron_precondition(a, g, grad.astype(np.float64), DAMPING)
            assert_close(got[2 * k], p[:-1], rtol=precondition_rtol, msg=f"layer {k} kernel",
                         atol_scale=precondition_atol)
            assert_close(got[2 * k + 1], p[-1], rtol=precondition_rtol, msg=f"layer {k} bias",
                         atol_scale=precondition_atol)

    def test_factors_and_precondition_match_numpy(self):
        self.check_against_numpy(np.float32, rtol=1e-4)

    def test_float64_state_matches_numpy_to_float64_rounding(self):
        self.model = mlp(dtype="float64")
        self.optimizer = tfkfac.KFAC(learning_rate=0.1, damping=DAMPING, kl_clip=None,
                                     momentum=0.0, xla=False, state_dtype="float64")
        self.optimizer.attach(self.model)
        self.loss = keras.losses.MeanSquaredError(dtype="float64")  # default: floatx
        # Factors to 1e-9; the preconditioned gradients measured 1.6e-8 x max|P| off the
        # explicit np.kron solve (eigenbasis route vs dense solve): 1e4 x closer than float32.
        self.check_against_numpy(np.float64, rtol=1e-9, atol_scale=1e-12,
                                 precondition=(1e-7, 1e-7))
        self.assertEqual(tfkfac.KFAC.from_config(self.optimizer.get_config()).state_dtype,
                         "float64")

    def test_float64_state_trains_a_float32_model(self):
        model = mlp()
        optimizer = tfkfac.KFAC(state_dtype="float64", xla=False).attach(model)
        model.compile(optimizer=optimizer, loss="mse")
        x = RNG.normal(size=(4 * N, 4)).astype(np.float32)
        history = model.fit(x, x[:, :3], batch_size=N, epochs=1, verbose=0)
        self.assertTrue(np.isfinite(history.history["loss"][-1]))
        self.assertEqual(optimizer.factors("head")["G"].dtype, tf.float64)
        self.assertEqual(model.layers[0].kernel.dtype, "float32")

    def test_step_phase_names_the_work_each_step_did(self):
        for factor_freq, inv_freq in ((2, 4), (lambda s: 1 + s // 3, lambda s: 2 + s // 2)):
            model = mlp()
            optimizer = tfkfac.KFAC(factor_update_freq=factor_freq, inv_update_freq=inv_freq,
                                    xla=False).attach(model)
            x = RNG.normal(size=(N, 4)).astype(np.float32)
            done = []
            for step in range(14):
                before = optimizer.summary()["counters"] if step else {
                    "factor_updates": 0, "decomposition_updates": 0}
                with optimizer.record() as tape:
                    loss = tf.reduce_mean(model(x, training=True) ** 2)
                optimizer.minimize(loss, tape=tape)
                after = optimizer.summary()["counters"]
                factors, decompositions = (
                    after[name] > before[name]
                    for name in ("factor_updates", "decomposition_updates"))
                done.append({(True, True): "factors_and_decompositions",
                             (False, True): "decompositions", (True, False): "factors",
                             (False, False): "stale"}[factors, decompositions])
            self.assertEqual([optimizer.step_phase(s) for s in range(14)], done)
            self.assertIn("stale", done)

    def test_phase_clocks_charge_each_phase_its_own_work(self):
        # The clocks are tf.timestamp ops, stateful like the variable writes, and a
        # tf.function runs stateful ops in program order: a phase's end stamp waits for
        # its writes even though the update returns no tensor that depends on them.
        sleep_seconds, steps = 0.05, 3

        class SleepingSGD(keras.optimizers.SGD):
            """SGD whose every variable update waits `sleep_seconds` before writing."""

            def update_step(self, gradient, variable, learning_rate):
                slept = tf.py_function(lambda: (time.sleep(sleep_seconds), 0.0)[1], [],
                                       gradient.dtype)
                super().update_step(gradient + slept, variable, learning_rate)

        model = mlp()
        optimizer = tfkfac.KFAC(inner_optimizer=SleepingSGD(0.1), xla=False,
                                phase_clocks=True).attach(model)
        model.compile(optimizer=optimizer, loss="mse")
        x = RNG.normal(size=(steps * N, 4)).astype(np.float32)
        model.fit(x, x[:, :3], batch_size=N, epochs=1, verbose=0)
        seconds = optimizer.summary()["phase_seconds"]
        slept = steps * len(model.trainable_variables) * sleep_seconds
        self.assertGreaterEqual(seconds["update"], slept, seconds)
        for phase in ("factors", "decomposition", "precondition"):
            self.assertLess(seconds[phase], slept, (phase, seconds))

    def test_phase_clocks_are_off_unless_asked_for(self):
        model = mlp()
        optimizer = tfkfac.KFAC(xla=False).attach(model)
        model.compile(optimizer=optimizer, loss="mse")
        x = RNG.normal(size=(2 * N, 4)).astype(np.float32)
        model.fit(x, x[:, :3], batch_size=N, epochs=1, verbose=0)
        self.assertEqual(optimizer.summary()["phase_seconds"], {})
        self.assertEqual(optimizer.summary()["counters"]["factor_updates"], 2)
        with self.assertRaisesRegex(ValueError, "`phase_clocks` must be True or False"):
            tfkfac.KFAC(phase_clocks="yes")

    def test_unmanaged_variables_keep_their_gradient(self):
        optimizer = tfkfac.KFAC(skip_layers=["hidden"], xla=False)
        model = mlp()
        optimizer.attach(model)
        x = RNG.normal(size=(N, 4)).astype(np.float32)
        with optimizer.record() as tape:
            loss = tf.reduce_mean(model(x, training=True) ** 2)
        optimizer.minimize(loss, tape=tape)
        grads = [tf.ones_like(v) for v in model.trainable_variables]
        got = optimizer.precondition(grads, model.trainable_variables)
        for k in (0, 1):  # hidden: skipped
            np.testing.assert_array_equal(got[k].numpy(), grads[k].numpy())
        self.assertFalse(np.allclose(got[2].numpy(), 1.0))

    def test_batchnorm_factor_is_named_f(self):
        model = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(name="bn"),
                                  keras.layers.Dense(2)])
        optimizer = tfkfac.KFAC(xla=False).attach(model)
        with optimizer.record() as tape:
            loss = tf.reduce_mean(model(np.ones((4, 3), np.float32), training=True))
        optimizer.minimize(loss, tape=tape)
        factors = optimizer.factors("bn")
        self.assertEqual(set(factors), {"F"})
        self.assertEqual(factors["F"].shape, (6,))

    def test_bad_arguments_say_what_is_allowed(self):
        with self.assertRaisesRegex(ValueError, r"`layer`.*hidden.*head"):
            self.optimizer.factors("nope")
        with self.assertRaisesRegex(ValueError, r"`state_dtype` must be one of.*float64"):
            tfkfac.KFAC(state_dtype="float16")
        with self.assertRaisesRegex(ValueError, r"`skip_layers` must be a list"):
            tfkfac.KFAC(skip_layers="hidden")
        with self.assertRaisesRegex(RuntimeError, "train at least one step"):
            self.optimizer.precondition([], [])
        x = np.zeros((N, 4), np.float32)
        self.step(x, np.zeros((N, 3), np.float32))
        with self.assertRaisesRegex(ValueError, "`variables` must hold every"):
            self.optimizer.precondition([tf.zeros((4, 5))],
                                        [self.model.trainable_variables[0]])


if __name__ == "__main__":
    absltest.main()
