"""tfkfac.KFAC over several steps: KL clip, running averages, update frequencies, schedules.

References (docs/design.md), all computed independently of the optimizer (here and in
kfac_reference.py):
- KL clip (Pauloski eq. 18): ν = min(1, sqrt(κ / (η² Σ_layers |<P, ∇>|))), <P, ∇> the
  inner product of a layer's whole [W; b] matrices; P from a run with kl_clip=None,
  ∇ from a plain tf.GradientTape. The clipped run's update must be ν times the unclipped.
- Running average: F₂ = ξ F₁ + (1-ξ) F_batch₂, with F₁ and F_batch₂ from a float64 numpy
  forward/backward at the weights of each step; the second update must be
  -lr (A₂ ⊗ G₂ + λ₂ I)⁻¹ vec(∇₂) (np.kron) with the averaged factors.
- Frequencies: with factor_update_freq=2, decomposition_update_freq=4, factors change
  only on steps 0, 2, 4, ... and decompositions only on 0, 4, 8, ...; the stored
  eigenbasis reconstructs the factors of the last decomposition step; counters match.
- WarmupDamping against the Python recursion γ ← (1-α)γ + α γ_target,
  α = 2 log10(γ0/γ_target)/t_warmup (Osawa eq. 13-14); OsawaInterval against
  min(20, 5 floor(e/5) + 1) (eq. 20).

Tolerances: rtol 1e-4 with an absolute floor of 1e-5 * max|ref| for float32 TF against
float64 numpy (N = 8, λ ≈ 1e-2); schedules rtol 1e-5 (float32 evaluation).
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import (DAMPING, LR, N, assert_close, dense_layers,  # noqa: E402
                            kron_precondition, loop_step, managed_factors, mlp_reference,
                            sgd_kfac)


def warmup_recursion(gamma0, target, warmup, steps):
    alpha = 2.0 * math.log10(gamma0 / target) / warmup
    values, gamma = [], gamma0
    for _ in range(steps):
        values.append(gamma)
        gamma = (1.0 - alpha) * gamma + alpha * target
    return values


# ------------------------------------------------------------------------ models
def eigen_kfac(model, **intervals):
    """`sgd_kfac` with the eigen method at `intervals`, attached to `model`."""
    return sgd_kfac(damping=DAMPING, method="eigen", xla=False, **intervals).attach(model)


def make_model(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(4, activation="tanh", bias_initializer="random_normal"),
        keras.layers.Dense(3, bias_initializer="random_normal"),
    ])


def batch(seed):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(N, 5)).astype(np.float32),
            rng.normal(size=(N, 3)).astype(np.float32))


MSE = keras.losses.MeanSquaredError()


def snapshot(opt):
    # Decompositions are private: no public API returns them.
    decomps = [v.numpy().copy() for s in opt.curvature.states
               for d in s.decompositions for v in d]
    return managed_factors(opt), decomps


class KLClipTest(parameterized.TestCase):

    # Seed 6 has a layer whose bias part <P_b, ∇_b> is negative while its whole-layer
    # <P, ∇> is positive: the sum must be over layers, not over variables.
    @parameterized.named_parameters(("seed0", 0), ("seed6_mixed_signs", 6))
    def test_clipped_update_is_nu_times_unclipped(self, seed):
        x, y = batch(seed + 100)
        model = make_model(seed)
        with tf.GradientTape() as tape:
            loss = MSE(y, model(x, training=True))
        grads = [g.numpy().astype(np.float64)
                 for g in tape.gradient(loss, model.trainable_variables)]
        unclipped = loop_step(
            model, tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING,
                               kl_clip=None, xla=False, model=model), MSE, x, y)
        p = [-d.astype(np.float64) / LR for d in unclipped]
        per_variable = [float(np.sum(pv * gv)) for pv, gv in zip(p, grads)]
        # variables are (kernel, bias) per layer
        per_layer = [per_variable[0] + per_variable[1], per_variable[2] + per_variable[3]]
        vg_sum = sum(abs(v) for v in per_layer)
        if seed == 6:
            self.assertTrue(any(v < 0 for v in per_variable), per_variable)

        for target_nu in (0.5, None):  # None: κ large, so ν = 1
            kappa = (0.25 if target_nu else 10.0) * LR ** 2 * vg_sum
            nu = min(1.0, math.sqrt(kappa / (LR ** 2 * vg_sum)))
            self.assertAlmostEqual(nu, target_nu or 1.0)
            model = make_model(seed)
            clipped = loop_step(
                model, tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING,
                                   kl_clip=kappa, xla=False, model=model), MSE, x, y)
            for got, want in zip(clipped, unclipped):
                assert_close(got, nu * want.astype(np.float64), msg=f"nu={nu}")


class RunningAverageTest(parameterized.TestCase):

    @parameterized.named_parameters(("constant_damping", False), ("warmup_damping", True))
    def test_two_steps(self, warmup):
        xi = 0.8
        if warmup:
            damping = tfkfac.WarmupDamping(0.1, 1e-3, warmup_steps=20)
            dampings = warmup_recursion(0.1, 1e-3, 20, 2)
        else:
            damping, dampings = DAMPING, [DAMPING, DAMPING]
        model = make_model(1)
        opt = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=damping, kl_clip=None,
                          factor_decay=xi, method="eigen", factor_update_freq=1,
                          decomposition_update_freq=1, xla=False)
        opt.attach(model)
        (x1, y1), (x2, y2) = batch(201), batch(202)

        ref1 = mlp_reference(dense_layers(model), x1, y1, "mse")
        deltas1 = loop_step(model, opt, MSE, x1, y1)
        self.assertAlmostEqual(opt.current_damping(), dampings[1], places=6)
        # at the weights after step 1
        ref2 = mlp_reference(dense_layers(model), x2, y2, "mse")
        deltas2 = loop_step(model, opt, MSE, x2, y2)

        expected1, expected2 = [], []
        for k, layer in enumerate(model.layers):
            a1, g1 = ref1[k]["A"], ref1[k]["G"]
            a2 = xi * a1 + (1 - xi) * ref2[k]["A"]
            g2 = xi * g1 + (1 - xi) * ref2[k]["G"]
            factors = opt.factors(layer)
            assert_close(factors["A"].numpy(), a2, msg="A after two steps")
            assert_close(factors["G"].numpy(), g2, msg="G after two steps")
            p1 = kron_precondition(a1, g1, ref1[k]["grad"], dampings[0])
            p2 = kron_precondition(a2, g2, ref2[k]["grad"], dampings[1])
            expected1 += [-LR * p1[:-1], -LR * p1[-1]]
            expected2 += [-LR * p2[:-1], -LR * p2[-1]]
        for got, want in zip(deltas1, expected1):
            assert_close(got, want, msg="step 1")
        for got, want in zip(deltas2, expected2):
            assert_close(got, want, msg="step 2")


class FrequencyTest(parameterized.TestCase):

    def check_schedule(self, history, factor_steps, decomposition_steps):
        """history[k] = (factors, decompositions, counters) after step k."""
        previous = history[0]
        for step, (factors, decomps, counters) in enumerate(history):
            if step > 0:
                factors_changed = [not np.array_equal(a, b)
                                   for a, b in zip(factors, previous[0])]
                decomps_changed = [not np.array_equal(a, b)
                                   for a, b in zip(decomps, previous[1])]
                if step in factor_steps:
                    self.assertTrue(all(factors_changed), f"step {step}: factors")
                else:
                    self.assertFalse(any(factors_changed), f"step {step}: factors")
                if step in decomposition_steps:
                    self.assertTrue(any(decomps_changed), f"step {step}: decompositions")
                else:
                    self.assertFalse(any(decomps_changed), f"step {step}: decompositions")
            self.assertEqual(counters["steps"], step + 1)
            self.assertEqual(counters["factor_updates"],
                             sum(1 for s in factor_steps if s <= step))
            self.assertEqual(counters["decomposition_updates"],
                             sum(1 for s in decomposition_steps if s <= step))
            previous = (factors, decomps)
            # The eigenbasis reconstructs the factors of the last inverse step.
            last_inverse = max(s for s in decomposition_steps if s <= step)
            factors_then = history[last_inverse][0]
            for i, factor in enumerate(factors_then):
                q, v = decomps[2 * i], decomps[2 * i + 1]
                assert_close(q @ np.diag(v) @ q.T, factor, rtol=1e-4,
                             msg=f"step {step}: decomposition {i}")

    def test_freq_2_and_4_custom_loop(self):
        model = make_model(2)
        opt = eigen_kfac(model, factor_update_freq=2, decomposition_update_freq=4)
        history = []
        for step in range(9):
            loop_step(model, opt, MSE, *batch(300 + step))
            history.append(snapshot(opt) + (opt.summary()["counters"],))
        self.check_schedule(history, {0, 2, 4, 6, 8}, {0, 4, 8})

    def test_freq_2_and_4_fit(self):
        # Inside model.fit the step is a tf.function: the frequency logic runs in graph.
        model = make_model(3)
        opt = eigen_kfac(model, factor_update_freq=2, decomposition_update_freq=4)
        model.compile(optimizer=opt, loss=MSE)
        history = []
        callback = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda b, logs: history.append(
                snapshot(opt) + (opt.summary()["counters"],)))
        xs, ys = zip(*[batch(400 + k) for k in range(9)])
        model.fit(np.concatenate(xs), np.concatenate(ys), batch_size=N, epochs=1,
                  shuffle=False, verbose=0, callbacks=[callback])
        self.assertLen(history, 9)
        self.check_schedule(history, {0, 2, 4, 6, 8}, {0, 4, 8})

    def test_osawa_interval_as_frequency(self):
        # steps_per_epoch=1: interval(step) = 1 for steps 0-4, 6 at step 5, 11 at 10-14.
        # An update at step s schedules the next one interval(s) steps later:
        # 0, 1, 2, 3, 4, 5, 11, (22).
        interval = tfkfac.OsawaInterval(1)
        model = make_model(4)
        opt = eigen_kfac(model, factor_update_freq=interval,
                         decomposition_update_freq=interval)
        expected, next_step = set(), 0
        for step in range(13):
            if step >= next_step:
                expected.add(step)
                next_step = step + min(20, 5 * (step // 5) + 1)
        self.assertEqual(expected, {0, 1, 2, 3, 4, 5, 11})
        history = []
        for step in range(13):
            loop_step(model, opt, MSE, *batch(500 + step))
            history.append(snapshot(opt) + (opt.summary()["counters"],))
        self.check_schedule(history, expected, expected)


class ScheduleTest(parameterized.TestCase):

    @parameterized.named_parameters(("osawa_like", 2.5e-2, 1e-3, 50), ("fast", 1.0, 0.1, 8))
    def test_warmup_damping_equals_recursion(self, gamma0, target, warmup):
        schedule = tfkfac.WarmupDamping(gamma0, target, warmup)
        expected = warmup_recursion(gamma0, target, warmup, 3 * warmup)
        got = [float(schedule(tf.constant(t, tf.int64))) for t in range(3 * warmup)]
        np.testing.assert_allclose(got, expected, rtol=1e-5)
        np.testing.assert_allclose(got[0], gamma0, rtol=1e-6)  # γ(0) = γ0

    @parameterized.named_parameters(
        ("initial_zero", dict(initial_damping=0.0), "initial_damping"),
        ("target_nan", dict(target_damping=float("nan")), "target_damping"),
        ("warmup_inf", dict(warmup_steps=float("inf")), "warmup_steps"),
        ("warmup_fraction", dict(warmup_steps=2.5), "warmup_steps"),
        ("warmup_zero", dict(warmup_steps=0), "warmup_steps"))
    def test_warmup_damping_names_the_bad_argument(self, bad, argument):
        arguments = dict(initial_damping=1.0, target_damping=0.1, warmup_steps=100) | bad
        with self.assertRaisesRegex(ValueError, f"^`{argument}` must be .*; received "):
            tfkfac.WarmupDamping(**arguments)

    def test_osawa_interval(self):
        for steps_per_epoch in (1, 7):
            schedule = tfkfac.OsawaInterval(steps_per_epoch)
            for step in range(0, 30 * steps_per_epoch, max(1, steps_per_epoch // 3)):
                epoch = step // steps_per_epoch
                self.assertEqual(int(schedule(tf.constant(step, tf.int64))),
                                 min(20, 5 * (epoch // 5) + 1), f"step {step}")


if __name__ == "__main__":
    absltest.main()
