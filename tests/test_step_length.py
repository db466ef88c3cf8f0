"""bench/step_length.py's arithmetic against numpy: per-layer ‖P_ℓ‖, ‖r_ℓ‖, their ratio and
the KL clip's ν (docs/design.md §5, §11).

A two-layer Dense network (5 -> 4 tanh -> 3 logits, biases) trains 3 steps through the
script's own custom-loop step (`step_length.training_step`) with K-FAC's inverse method
(factors and decompositions every step), an inner SGD without momentum under a linear
warm-up (η_t = η (t+1)/3, so a learning rate read at the wrong step shows) and the KL
clip. After each step the script's `AdamDirections`, `record` (P through the public
`KFAC.precondition`), `step_lengths` and `kl_clip_scale` are compared with numpy
(tests/kfac_reference.py): the float64 forward/backward's gradient ∇ = [dL/dW; dL/db],
Adam's r with v from 0 and bias correction, P = (A + π√λ I)⁻¹ ∇ (G + (√λ/π) I)⁻¹ from
the factors `KFAC.factors` reports, norms over kernel and bias together, and
ν = min(1, sqrt(κ / (η_t² Σ_ℓ |<P_ℓ, ∇_ℓ>|))). The script's ν must also be the one the
library applied: the weight change of the managed layers is -η_t ν P.
A KL clip of 1e-6 binds at every step (ν < 0.1), one of 1e3 never (ν = 1).

Tolerance: rtol 1e-4 (float32 TF against float64 numpy, as the other K-FAC tests).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# bench/ as its scripts see it (they import their neighbours by name): beside tests/, in
# the checkout and in Bazel's runfiles (//bench:step_length).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import step_length  # noqa: E402
import tfkfac  # noqa: E402
from kfac_reference import (LR, N, RTOL, adam_scale, dense_layers,  # noqa: E402
                            factored_inverse_precondition, mlp_reference)
from trainers import lr_schedules  # noqa: E402

DAMPING, STEPS, WARMUP = 1e-2, 3, 3


def make_model():
    keras.utils.set_random_seed(21)
    return keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(4, activation="tanh", bias_initializer="random_normal"),
        keras.layers.Dense(3, bias_initializer="random_normal"),
    ])


def norm(arrays):
    return np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64))) for a in arrays))


class StepLengthTest(parameterized.TestCase):

    @parameterized.named_parameters(("clip_binds", 1e-6, True), ("clip_free", 1e3, False))
    def test_ratios_and_nu_match_numpy(self, kl_clip, binds):
        model = make_model()
        optimizer = tfkfac.KFAC(
            inner_optimizer=keras.optimizers.SGD(lr_schedules.LinearWarmup(LR, WARMUP)),
            method="inverse", damping=DAMPING, kl_clip=kl_clip, factor_update_freq=1,
            decomposition_update_freq=1, xla=False).attach(model)
        step = step_length.training_step(
            model, optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        variables = model.trainable_variables
        config = optimizer.get_config()
        beta_2, epsilon = config["adam_beta_2"], config["adam_epsilon"]
        adam = step_length.AdamDirections(beta_2, epsilon)
        moments = [0.0, 0.0]  # numpy's v per layer, [dW; db] together
        rng = np.random.default_rng(22)
        for t in range(STEPS):
            x = rng.normal(size=(N, 5)).astype(np.float32)
            labels = rng.integers(0, 3, size=N).astype(np.int32)
            reference = mlp_reference(dense_layers(model), x, labels, "ce")
            before = [v.numpy().copy() for v in variables]
            _, gradients, learning_rate = step(x, labels)
            deltas = [v.numpy() - b for v, b in zip(variables, before)]
            eta = LR * (t + 1) / WARMUP
            self.assertAlmostEqual(float(learning_rate), eta, delta=1e-7 * eta)

            groups = step_length.managed_groups(optimizer, variables)
            self.assertEqual(groups, [(layer.name, "dense", [2 * k, 2 * k + 1])
                                      for k, layer in enumerate(model.layers)])
            directions = adam.update(gradients)
            got = step_length.record(optimizer, variables, groups, gradients, directions,
                                     float(learning_rate), kl_clip)

            inner_products, preconditioned = 0.0, []
            for k, (layer, ref) in enumerate(zip(model.layers, reference)):
                grad = ref["grad"]  # [dL/dW; dL/db]
                r, moments[k] = adam_scale(grad, moments[k], t + 1, beta_2, epsilon)
                factors = optimizer.factors(layer)
                p = factored_inverse_precondition(factors["A"].numpy().astype(np.float64),
                                                  factors["G"].numpy().astype(np.float64),
                                                  grad, DAMPING)
                preconditioned += [p[:-1], p[-1]]
                inner_products += abs(np.sum(p * grad))
                lengths = got["layers"][layer.name]
                np.testing.assert_allclose(
                    [lengths["p_norm"], lengths["r_norm"], lengths["ratio"]],
                    [norm([p]), norm([r]), norm([p]) / norm([r])], rtol=RTOL,
                    err_msg=f"step {t} {layer.name}")
            nu = min(1.0, np.sqrt(kl_clip / (eta ** 2 * inner_products)))
            self.assertAlmostEqual(got["nu"], nu, delta=RTOL * nu, msg=f"step {t}")
            self.assertEqual(got["binds"], binds)
            if binds:
                self.assertLess(got["nu"], 0.1)
            else:
                self.assertEqual(got["nu"], 1.0)
            # What the library applied: Δw = -η ν P on every managed variable.
            np.testing.assert_allclose(np.concatenate([d.ravel() for d in deltas]),
                                       -eta * nu * np.concatenate(
                                           [p.ravel() for p in preconditioned]),
                                       rtol=RTOL, atol=RTOL * eta * nu * norm(preconditioned),
                                       err_msg=f"step {t}")

    def test_defaults_are_the_middle_of_the_vit_grid(self):
        # kfac_inverse on the ViT tunes learning rate {0.05, 0.2}, damping {3e-2, 0.1} and
        # KL clip {1e-3, 1e-2}: geometric middles 0.1, 0.055, 0.0032.
        self.assertEqual([step_length.grid_middle(name)
                          for name in ("learning_rate", "damping", "kl_clip")],
                         [0.1, 0.055, 0.0032])

    def test_zero_direction_has_no_ratio(self):
        groups = [("a", "dense", [0]), ("b", "dense", [1, 2])]
        lengths = step_length.step_lengths(
            [np.array([3.0, 4.0]), np.array([1.0]), np.array([2.0, 2.0])],
            [np.zeros(2), np.array([0.5]), np.array([1.0, 0.0])], groups)
        self.assertEqual(lengths[0], (5.0, 0.0, None))
        np.testing.assert_allclose(lengths[1], (3.0, np.sqrt(1.25), 3.0 / np.sqrt(1.25)))


if __name__ == "__main__":
    absltest.main()
