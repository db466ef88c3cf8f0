"""tfkfac.KFAC on LayerNormalization, GroupNormalization and RMSNormalization.

docs/design.md §3: a diagonal Fisher F = (1/N) Σ_i (dl_i/dθ)² over θ = (γ, β), each
flattened in its variable's order and concatenated, and the update ∇ / (F + ρ λ). These
layers normalize every example on its own, so dl_i/dθ is the gradient of example i's
loss with example i run through the model alone: the reference takes N such separate
tapes, independent of the optimizer's capture and x̂. One custom-loop step with
momentum=0, kl_clip=None must store F and change θ by -lr ∇ / (F + ρ λ), ∇ the mean of
the rows.

The blocks recompute x̂ with Keras's ops; `γ ⊙ x̂ + β` must rebuild the layer's own
output (float32, and float16 under mixed_float16 within its rounding).

Tolerances: `assert_close` (rtol 1e-4, floor 1e-5 max|ref|; float32 throughout).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import DAMPING, LR, N, assert_close, loop_step  # noqa: E402
from tfkfac import blocks  # noqa: E402

RHO = 3.0
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RANDOM_AFFINE = {"gamma_initializer": "random_uniform", "beta_initializer": "random_normal"}

# name -> (input shape without the batch, layer factory, block kind)
CASES = {
    "layer_norm": ((3, 4), lambda: keras.layers.LayerNormalization(**RANDOM_AFFINE),
                   "layer_norm"),
    "layer_norm_last_two_axes": ((3, 4), lambda: keras.layers.LayerNormalization(
        axis=[-2, -1], **RANDOM_AFFINE), "layer_norm"),
    "layer_norm_without_center": ((3, 4), lambda: keras.layers.LayerNormalization(
        center=False, gamma_initializer="random_uniform"), "layer_norm"),
    "layer_norm_rms_scaling": ((3, 4), lambda: keras.layers.LayerNormalization(
        rms_scaling=True, gamma_initializer="random_uniform"), "layer_norm"),
    "group_norm": ((3, 3, 4), lambda: keras.layers.GroupNormalization(
        groups=2, **RANDOM_AFFINE), "group_norm"),
    "rms_norm": ((3, 4), keras.layers.RMSNormalization, "rms_norm"),
}


def affine(layer):
    """(γ, β or None) of a normalization layer (RMSNormalization's γ is `scale`)."""
    if isinstance(layer, keras.layers.RMSNormalization):
        return layer.scale, None
    return layer.gamma, layer.beta


def model_around(input_shape, norm):
    """Input -> norm -> tanh -> Flatten -> Dense: every example's loss depends on θ."""
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input(input_shape), norm, keras.layers.Activation("tanh"),
                             keras.layers.Flatten(), keras.layers.Dense(3)])


def per_example_grads(model, variables, x, labels):
    """(N, |θ|) in float64: row i is dl_i/dθ, from a tape of example i alone."""
    rows = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = LOSS(labels[i:i + 1], model(x[i:i + 1], training=True))
        grads = tape.gradient(loss, variables)
        rows.append(np.concatenate([g.numpy().ravel() for g in grads]))
    return np.stack(rows).astype(np.float64)


class NormalizationTest(parameterized.TestCase):

    @parameterized.named_parameters(*[(name, name) for name in CASES])
    def test_one_step_is_diagonal_fisher_update(self, name):
        input_shape, make_layer, kind = CASES[name]
        norm = make_layer()
        model = model_around(input_shape, norm)
        rng = np.random.default_rng(11)
        x = rng.normal(size=(N,) + input_shape).astype(np.float32)
        labels = rng.integers(0, 3, size=N)
        variables = [v for v in affine(norm) if v is not None]
        per_example = per_example_grads(model, variables, x, labels)
        fisher = np.mean(per_example ** 2, axis=0)
        grad = per_example.mean(axis=0)

        opt = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING, kl_clip=None,
                          diagonal_damping_multiplier=RHO, xla=False).attach(model)
        kinds = {m["layer"]: m["kind"] for m in opt.summary()["managed"]}
        self.assertEqual(kinds[norm.name], kind)  # its path in the model
        deltas = loop_step(model, opt, LOSS, x, labels)
        index_of = {id(v): i for i, v in enumerate(model.trainable_variables)}
        delta = np.concatenate([deltas[index_of[id(v)]].ravel() for v in variables])

        assert_close(opt.factors(norm)["F"].numpy(), fisher,
                     msg="diagonal Fisher")
        expected = -LR * grad / (fisher + RHO * DAMPING)
        assert_close(delta, expected, msg="update")
        # ρ matters here: with ρ = 1 the update would be clearly different.
        other = -LR * grad / (fisher + DAMPING)
        self.assertGreater(np.max(np.abs(other - expected)), 0.01 * np.max(np.abs(expected)))

    @parameterized.named_parameters(("float32", "float32", 1e-5),
                                    ("mixed_float16", "mixed_float16", 1e-2))
    def test_normalized_input_rebuilds_layer_output(self, policy, rtol):
        keras.mixed_precision.set_dtype_policy(policy)
        self.addCleanup(keras.mixed_precision.set_dtype_policy, "float32")
        rng = np.random.default_rng(12)
        for name, (input_shape, make_layer, _) in CASES.items():
            norm = make_layer()
            x = tf.constant(rng.normal(size=(N,) + input_shape), norm.compute_dtype)
            output = norm(x).numpy().astype(np.float64)
            block, reason = blocks.block_for(norm)
            self.assertIsNone(reason, name)
            # In these cases γ and β lie along the trailing axes, so they broadcast.
            rebuilt = block.normalized(tf.cast(x, tf.float32)).numpy()
            for weight, term in zip(affine(norm), (np.multiply, np.add)):
                if weight is not None:
                    rebuilt = term(rebuilt, weight.numpy())
            np.testing.assert_allclose(output, rebuilt, rtol=rtol, atol=rtol, err_msg=name)

    def test_weights_along_batch_axis_are_unsupported(self):
        norm = keras.layers.LayerNormalization(axis=[0, -1])
        norm.build((N, 4))
        block, reason = blocks.block_for(norm)
        self.assertIsNone(block)
        self.assertIn("batch axis", reason)


if __name__ == "__main__":
    absltest.main()
