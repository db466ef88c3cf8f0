"""The public curvature API: `KFAC.factors(layer)` and `KFAC.precondition(grads, vars)`.

Against the independent numpy reference of tests/kfac_reference.py (float64 forward and
backward of a small MLP): after one step with factor_decay's first update F = F_batch,
`factors` returns A = (1/N) Σ ā āᵀ and G = (1/N) Σ g gᵀ of each Dense layer, and
`precondition` returns (A ⊗ G + λI)⁻¹ vec(∇) per layer (explicit np.kron solve) for new
gradients, leaving unmanaged variables' gradients untouched. BatchNorm's factor is
named "F". Bad arguments name what is allowed.

`state_dtype="float64"` on a float64 model agrees with the same reference to 1e-12, with
the damping given as a number or by a schedule (float32 state: 1e-4). The trainer's
per-step phase (`trainers.runner.phase_fn`, read from `KFAC.counters()` after each step of
`model.fit`) names exactly the work each step did — factors, decompositions, both, or
stale — for factor and decomposition intervals that differ, fixed and callable: it
matches the documented schedule (step 0, then s + interval(s) after each due step s)
and what the step observably changed (the factors `factors()` returns; the result of
`precondition()` on fixed gradients, which only new decompositions change), also when
it is created mid-run as on a resumed run. Inside `model.fit`,
`summary()["phase_seconds"]` charges each phase's work to its own clock (an update made
slow on purpose shows in "update" only; sleeps in the forward pass, the decompositions and
the preconditioning show on their own clocks only: the clocks time the phases one after
another).
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import (DAMPING, N, assert_close, kron_precondition,  # noqa: E402
                             sgd_kfac)
from trainers import runner  # noqa: E402

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


PHASE_NAMES = {(True, True): "factors_and_decompositions", (True, False): "factors",
               (False, True): "decompositions", (False, False): "stale"}


def due_steps(interval, steps):
    """The steps below `steps` an interval schedule fires at, by its documented rule
    (docs/design.md): step 0, then s + interval(s) after each due step s."""
    due, next_due = set(), 0
    for step in range(steps):
        if step >= next_due:
            due.add(step)
            next_due = step + (interval(step) if callable(interval) else interval)
    return due


class PhaseObserver(keras.callbacks.Callback):
    """After each step: the name `phase()` gives it (`trainers.runner.phase_fn`, as
    `reporting.StepTimer` calls it), whether the factors of every layer changed, and
    whether `precondition` of fixed gradients changed (only new decompositions do)."""

    def __init__(self, model, optimizer):
        super().__init__()
        self.kfac, self.phase = optimizer, None
        self.layers = model.layers
        self.variables = model.trainable_variables
        self.gradients = [tf.constant(RNG.normal(size=v.shape), v.dtype) for v in self.variables]
        self.names, self.factors_changed, self.preconditioning_changed = [], [], []
        self.last_factors = self.last_preconditioned = None

    def on_train_batch_end(self, batch, logs=None):
        self.names.append(self.phase())
        factors = [f.numpy() for layer in self.layers
                   for f in self.kfac.factors(layer).values()]
        preconditioned = [p.numpy() for p in self.kfac.precondition(self.gradients,
                                                                    self.variables)]
        self.factors_changed.append(changed(self.last_factors, factors))
        self.preconditioning_changed.append(changed(self.last_preconditioned, preconditioned))
        self.last_factors, self.last_preconditioned = factors, preconditioned


def changed(before, after):
    return before is None or any(not np.array_equal(b, a) for b, a in zip(before, after))


class CurvatureApiTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        self.model = mlp()
        self.optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.1), damping=DAMPING,
                                     kl_clip=None,
                                     method="eigen",
                                     xla=False).attach(self.model)
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
        """λ = 1e-2 given as a Python float, or by a schedule as one, reaches the float64
        state as that float64 (through float32 it was 1e-2 (1 - 2.2e-8), which moved the
        preconditioned gradients by 8e-8 relative)."""
        for damping in (DAMPING, lambda step: DAMPING):
            self.model = mlp(dtype="float64")
            self.optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.1),
                                         damping=damping, kl_clip=None,
                                         method="eigen", xla=False,
                                         state_dtype="float64")
            self.optimizer.attach(self.model)
            self.loss = keras.losses.MeanSquaredError(dtype="float64")  # default: floatx
            self.check_against_numpy(np.float64, rtol=1e-12, atol_scale=1e-12)
            if not callable(damping):
                self.assertEqual(tfkfac.KFAC.from_config(
                    self.optimizer.get_config()).state_dtype, "float64")

    def test_float64_state_trains_a_float32_model(self):
        model = mlp()
        optimizer = tfkfac.KFAC(state_dtype="float64", xla=False).attach(model)
        model.compile(optimizer=optimizer, loss="mse")
        x = RNG.normal(size=(4 * N, 4)).astype(np.float32)
        history = model.fit(x, x[:, :3], batch_size=N, epochs=1, verbose=0)
        self.assertTrue(np.isfinite(history.history["loss"][-1]))
        self.assertEqual(optimizer.factors("head")["G"].dtype, tf.float64)
        self.assertEqual(model.layers[0].kernel.dtype, "float32")

    def test_trainer_phases_name_the_work_each_step_did(self):
        schedules = {
            # (factor interval, decomposition interval, steps): every kind of step occurs.
            "fixed": (2, 6, 14),
            "callable": (lambda s: 1 + s // 4, lambda s: 3 + s // 5, 16),
        }
        named = set()
        for schedule, (factor_freq, decomposition_freq, steps) in schedules.items():
            with self.subTest(schedule):
                factor_steps = due_steps(factor_freq, steps)
                decomposition_steps = due_steps(decomposition_freq, steps)
                expected = [PHASE_NAMES[s in factor_steps, s in decomposition_steps]
                            for s in range(steps)]
                named |= set(expected)
                model = mlp()
                optimizer = tfkfac.KFAC(factor_update_freq=factor_freq,
                                        decomposition_update_freq=decomposition_freq,
                                        xla=False).attach(model)
                model.compile(optimizer=optimizer, loss="mse")
                observer = PhaseObserver(model, optimizer)
                x = RNG.normal(size=(steps * N, 4)).astype(np.float32)
                y = RNG.normal(size=(steps * N, 3)).astype(np.float32)
                half = steps // 2 * N
                # Two fits, each with a phase function made before it as the trainer's
                # `train()` does: the second one starts from non-zero counters, as after
                # a restore.
                for part in (slice(0, half), slice(half, None)):
                    observer.phase = runner.phase_fn(optimizer)
                    model.fit(x[part], y[part], batch_size=N, epochs=1, shuffle=False,
                              verbose=0, callbacks=[observer])
                self.assertEqual(observer.names, expected)
                self.assertEqual(optimizer.counters()["steps"], steps)
                self.assertEqual(optimizer.counters()["factor_updates"], len(factor_steps))
                self.assertEqual(optimizer.counters()["decomposition_updates"],
                                 len(decomposition_steps))
                # What each step observably changed agrees with its name.
                self.assertEqual(observer.factors_changed,
                                 [s in factor_steps for s in range(steps)])
                self.assertEqual(observer.preconditioning_changed,
                                 [s in decomposition_steps for s in range(steps)])
        # Fixed intervals are multiples, so only a callable one has decomposition-only steps.
        self.assertEqual(named, set(PHASE_NAMES.values()))
        self.assertEqual(runner.phase_fn(keras.optimizers.SGD(0.1))(), "step")

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

    def test_phase_clocks_time_the_phases_one_after_another(self):
        # Sleeps the scheduler cannot see as state (stateless numpy functions on the data)
        # in the forward pass, the decompositions and the preconditioning: each sleep
        # falls on its own clock, none on another's. Without a start stamp that waits for
        # the phase's inputs, "update"'s clock ran from the step's start (forward and
        # backward included) and the preconditioning, a tf.function called on inputs
        # that already existed, could run before its clock started (with one inter-op
        # thread, under the decompositions' clock).
        sleep_seconds, steps = 0.1, 3

        def slow(tensor):
            slept = tf.numpy_function(lambda t: (time.sleep(sleep_seconds), np.float32(0))[1],
                                      [tensor], tf.float32, stateful=False)
            return tensor + tf.cast(tf.reshape(slept, []), tensor.dtype)

        class SlowForward(keras.layers.Layer):
            def call(self, x):
                return slow(x)

        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), SlowForward(),
                                  keras.layers.Dense(5, activation="tanh"),
                                  keras.layers.Dense(3)])
        optimizer = sgd_kfac(xla=False, phase_clocks=True, factor_update_freq=1,
                             decomposition_update_freq=1).attach(model)
        curvature = optimizer.curvature
        decompose, precondition = curvature._decompose, curvature._precondition

        def slow_decompose(items, factors, damping):
            return decompose(items, [[slow(f) for f in factors[0]]] + factors[1:], damping)

        def slow_precondition(indices, grads, *rest):
            return precondition(indices, [[slow(g) for g in grads[0]]] + grads[1:], *rest)

        curvature._decompose_fn = tf.function(slow_decompose)
        curvature._precondition_fn = tf.function(slow_precondition)
        model.compile(optimizer=optimizer, loss="mse")
        x = RNG.normal(size=(steps * N, 4)).astype(np.float32)
        model.fit(x, x[:, :3], batch_size=N, epochs=1, verbose=0)
        seconds = optimizer.summary()["phase_seconds"]
        # Every step: one sleep in the forward pass, the decompositions' (one factor made
        # slow) and the preconditioning's (one block's kernel gradient made slow).
        slept = steps * sleep_seconds
        self.assertGreaterEqual(seconds["decomposition"], slept, seconds)
        self.assertGreaterEqual(seconds["precondition"], slept, seconds)
        self.assertLess(seconds["decomposition"], 1.5 * slept, seconds)
        for phase in ("factors", "update"):
            self.assertLess(seconds[phase], slept / 2, (phase, seconds))

    def test_phase_clocks_are_off_unless_asked_for(self):
        model = mlp()
        optimizer = tfkfac.KFAC(factor_update_freq=1, xla=False).attach(model)
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
        with self.assertRaisesRegex(RuntimeError, r"KFAC.factors: .*not attached.*attach\("):
            tfkfac.KFAC(xla=False).factors("hidden")
        with self.assertRaisesRegex(RuntimeError, "KFAC.factors: .*no state yet.*first "
                                                  "training step"):
            self.optimizer.factors("hidden")
        with self.assertRaisesRegex(ValueError, r"`state_dtype` must be one of.*float64"):
            tfkfac.KFAC(state_dtype="float16")
        with self.assertRaisesRegex(ValueError, r"`skip_layers` must be a list"):
            tfkfac.KFAC(skip_layers="hidden")
        with self.assertRaisesRegex(RuntimeError, "train at least one step"):
            self.optimizer.precondition([], [])
        x = np.zeros((N, 4), np.float32)
        self.step(x, np.zeros((N, 3), np.float32))
        with self.assertRaisesRegex(ValueError, r"`layer`.*hidden.*head.*received 'nope'"):
            self.optimizer.factors("nope")
        with self.assertRaisesRegex(ValueError, r"`variables` must hold all or none of "
                                    r"layer 'hidden''s weights; missing \['.*/hidden/bias'\]"):
            self.optimizer.precondition([tf.zeros((4, 5))],
                                        [self.model.trainable_variables[0]])


if __name__ == "__main__":
    absltest.main()
