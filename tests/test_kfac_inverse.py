"""tfkfac.KFAC(method="inverse"): factored Tikhonov damping with the π correction.

docs/design.md: π = sqrt((tr A / dim A) / (tr G / dim G)),
P = (A + π√λ I)⁻¹ ∇ (G + (√λ/π) I)⁻¹. The reference runs the tiny network's forward and
backward in float64 numpy (kfac_reference.py) and inverts the damped factors with
np.linalg.inv. One step with momentum=0, kl_clip=None must change each kernel/bias by
-lr * P; the stored decompositions must be the two damped inverses.

Tolerances: rtol 1e-4 with an absolute floor of 1e-5 * max|ref| (float32 TF against
float64 numpy on N = 8, λ = 1e-2, well conditioned). Dropping π (π = 1) changes the
update by several percent, far outside it (checked in the test).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import (LR, N, assert_close, dense_layers,  # noqa: E402
                            factored_inverses as pi_inverses, mlp_reference)


def make_model(use_bias, seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(4, activation="tanh", use_bias=use_bias,
                           bias_initializer="random_normal"),
        keras.layers.Dense(3, use_bias=use_bias, bias_initializer="random_normal"),
    ])


class InverseMethodTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("bias_xla", True, True, 1e-2),
        ("nobias_noxla", False, False, 1e-2),
        ("bias_noxla_small_damping", True, False, 1e-3),
    )
    def test_one_step_equals_pi_corrected_reference(self, use_bias, xla, damping):
        model = make_model(use_bias, seed=11)
        rng = np.random.default_rng(12)
        x = rng.normal(size=(N, 5)).astype(np.float32)
        labels = rng.integers(0, 3, size=N)
        reference = mlp_reference(dense_layers(model), x, labels, "ce")

        opt = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=damping, kl_clip=None,
                          method="inverse", xla=xla)
        opt.attach(model)
        model.compile(optimizer=opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        before = [v.numpy().copy() for v in model.trainable_variables]
        model.fit(x, labels, batch_size=N, epochs=1, shuffle=False, verbose=0)
        deltas = [v.numpy() - b for v, b in zip(model.trainable_variables, before)]

        expected = []
        # Private: no public API returns the stored decompositions.
        stored = [state.decompositions for state in opt.curvature.states]
        self.assertLen(stored, len(reference))
        for ref, decompositions in zip(reference, stored):
            a_inv, g_inv = pi_inverses(ref["A"], ref["G"], damping)
            # The stored decompositions are the two damped inverses.
            self.assertLen(decompositions, 2)
            assert_close(decompositions[0][0].numpy(), a_inv, msg="A inverse")
            assert_close(decompositions[1][0].numpy(), g_inv, msg="G inverse")
            p = a_inv @ ref["grad"] @ g_inv
            # The π correction matters here: without it the update differs clearly.
            a1, g1 = pi_inverses(ref["A"], ref["G"], damping, use_pi=False)
            p_no_pi = a1 @ ref["grad"] @ g1
            self.assertGreater(np.max(np.abs(p_no_pi - p)), 0.02 * np.max(np.abs(p)))
            expected += [-LR * p[:-1], -LR * p[-1]] if use_bias else [-LR * p]
        self.assertLen(deltas, len(expected))
        for var, got, want in zip(model.trainable_variables, deltas, expected):
            assert_close(got, want, msg=var.path)


if __name__ == "__main__":
    absltest.main()
