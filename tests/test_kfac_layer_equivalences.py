"""The blocks of modern layers checked by the equivalences of docs/design.md §2.

Each case builds the layer and its reference formulation with the same weights and data
and compares factors (`KFAC.factors`) and the preconditioned update of one custom-loop
step (momentum 0, no KL clip), for both methods:
- Conv1D with kernel k on (T, c) equals Conv2D with kernel (1, k) on (1, T, c); the
  causal Conv1D's A also against an explicit numpy im2col of the left-padded input.
- Conv3D with depth-1 kernel on a depth-1 input equals Conv2D.
- a grouped Conv2D (q groups) equals q separate Conv2D on the channel slices: its A_j,
  G_j are the separate layers' A, G;
- DepthwiseConv2D (c_in, m) equals Conv2D(groups=c_in, filters=c_in·m) with the same
  kernel, and DepthwiseConv1D the same in 1-D;
- Embedding equals a bias-free Dense on one-hot inputs (its A a dense diagonal matrix),
  and with a 50,000-token vocabulary its state is O(V + d²): A is the token counts / N;
- weight_sharing="reduce" on a Dense over sequences: A = (1/N) Σ_i ā_i ā_iᵀ with ā_i the
  per-example mean over positions, G = (1/N) Σ_i ĝ_i ĝ_iᵀ with ĝ_i the per-example sum of
  g = N dL/ds — against numpy from the tape's dL/ds.
The Conv2D and Dense blocks themselves are checked against numpy im2col / np.kron in
test_kfac_conv.py and test_kfac_dense.py.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import assert_close, loop_step  # noqa: E402

N, LR, DAMPING = 6, 0.1, 1e-2
MSE = keras.losses.MeanSquaredError()
RNG = np.random.default_rng(0)


def kfac(model, method="eigen", **kwargs):
    return tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING, kl_clip=None,
                       method=method, xla=False, **kwargs).attach(model)


def single_layer(input_shape, layer, dtype="float32"):
    inputs = keras.Input(input_shape, dtype=dtype)
    return keras.Model(inputs, layer(inputs))


def step(model, opt, x):
    y = RNG.normal(size=(N,) + tuple(model.output.shape[1:])).astype(np.float32)
    return loop_step(model, opt, MSE, x, y), y


class LayerEquivalenceTest(parameterized.TestCase):

    def compare(self, layer, reference, input_shape, to_reference, x, method, dtype="float32"):
        """`layer` on x and `reference` on to_reference(x): factors and updates agree."""
        keras.utils.set_random_seed(1)
        model = single_layer(input_shape, layer, dtype)
        ref_model = single_layer(to_reference.shape, reference)
        ref_model.set_weights(to_reference.weights(model.get_weights()))
        opt, ref_opt = kfac(model, method), kfac(ref_model, method)
        y = RNG.normal(size=(N,) + tuple(model.output.shape[1:])).astype(np.float32)
        deltas = loop_step(model, opt, MSE, x, y)
        ref_deltas = loop_step(ref_model, ref_opt, MSE, to_reference.inputs(x),
                               y.reshape((N,) + tuple(ref_model.output.shape[1:])))
        for got, want in zip(deltas, to_reference.weights(ref_deltas, back=True)):
            assert_close(got, want, rtol=1e-3, msg=f"{layer.name} update ({method})")
        self.assertGreater(np.max(np.abs(deltas[0])), 1e-4)
        return opt.factors(layer), ref_opt.factors(reference)

    @parameterized.parameters("eigen", "inverse")
    def test_conv1d_equals_conv2d_with_a_1_by_k_kernel(self, method):
        x = RNG.normal(size=(N, 7, 3)).astype(np.float32)
        factors, ref = self.compare(
            keras.layers.Conv1D(4, 3, strides=2), keras.layers.Conv2D(4, (1, 3), strides=(1, 2)),
            (7, 3), Reshaped((1, 7, 3), [(1, 3, 3, 4), (4,)], [(3, 3, 4), (4,)]), x, method)
        for name in ("A", "G"):
            assert_close(factors[name], ref[name], msg=name)

    def test_causal_conv1d_a_is_the_explicit_im2col(self):
        x = RNG.normal(size=(N, 5, 2)).astype(np.float32)
        keras.utils.set_random_seed(2)
        layer = keras.layers.Conv1D(3, 3, padding="causal", dilation_rate=2)
        model = single_layer((5, 2), layer)
        opt = kfac(model)
        step(model, opt, x)
        padded = np.concatenate([np.zeros((N, 4, 2)), x], axis=1)  # (k-1)·d on the left
        rows = np.stack([padded[:, t:t + 5:2].reshape(N, 6) for t in range(5)], axis=1)
        rows = np.concatenate([rows.reshape(-1, 6), np.ones((N * 5, 1))], axis=1)
        assert_close(opt.factors(layer)["A"], rows.T @ rows / N)

    def test_conv3d_with_depth_one_equals_conv2d(self):
        x = RNG.normal(size=(N, 1, 5, 5, 2)).astype(np.float32)
        factors, ref = self.compare(
            keras.layers.Conv3D(3, (1, 2, 2)), keras.layers.Conv2D(3, 2), (1, 5, 5, 2),
            Reshaped((5, 5, 2), [(2, 2, 2, 3), (3,)], [(1, 2, 2, 2, 3), (3,)]), x, "eigen")
        for name in ("A", "G"):
            assert_close(factors[name], ref[name], msg=name)

    @parameterized.parameters("eigen", "inverse")
    def test_grouped_conv_pairs_are_the_separate_convolutions(self, method):
        keras.utils.set_random_seed(3)
        x = RNG.normal(size=(N, 5, 5, 4)).astype(np.float32)
        grouped = keras.layers.Conv2D(6, 3, groups=2, padding="same")
        model = single_layer((5, 5, 4), grouped)
        opt = kfac(model, method)
        kernel, bias = model.get_weights()
        deltas, y = step(model, opt, x)
        factors = opt.factors(grouped)
        self.assertEqual(factors["A"].shape, (2, 19, 19))
        self.assertEqual(factors["G"].shape, (2, 3, 3))
        for j in range(2):
            part = keras.layers.Conv2D(3, 3, padding="same")
            part_model = single_layer((5, 5, 2), part)
            part_model.set_weights([kernel[..., 3 * j:3 * j + 3], bias[3 * j:3 * j + 3]])
            part_opt = kfac(part_model, method)
            # The grouped output's loss splits into the two groups' (MSE over 6 channels).
            part_deltas = loop_step(part_model, part_opt,
                                    lambda t, p: MSE(t, p) / 2, x[..., 2 * j:2 * j + 2],
                                    y[..., 3 * j:3 * j + 3])
            part_factors = part_opt.factors(part)
            assert_close(factors["A"][j], part_factors["A"], msg=f"A_{j}")
            assert_close(factors["G"][j], part_factors["G"], msg=f"G_{j}")
            assert_close(deltas[0][..., 3 * j:3 * j + 3], part_deltas[0], rtol=1e-3)
            assert_close(deltas[1][3 * j:3 * j + 3], part_deltas[1], rtol=1e-3)

    @parameterized.parameters("eigen", "inverse")
    def test_depthwise_conv2d_equals_conv2d_grouped_by_channel(self, method):
        x = RNG.normal(size=(N, 5, 5, 3)).astype(np.float32)
        factors, ref = self.compare(
            keras.layers.DepthwiseConv2D(3, depth_multiplier=2),
            keras.layers.Conv2D(6, 3, groups=3), (5, 5, 3),
            Reshaped((5, 5, 3), [(3, 3, 1, 6), (6,)], [(3, 3, 3, 2), (6,)]), x, method)
        self.assertEqual(factors["A"].shape, (3, 10, 10))
        for name in ("A", "G"):
            assert_close(factors[name], ref[name], msg=name)

    def test_depthwise_conv1d_equals_grouped_conv1d(self):
        x = RNG.normal(size=(N, 6, 2)).astype(np.float32)
        factors, ref = self.compare(
            keras.layers.DepthwiseConv1D(3, use_bias=False), keras.layers.Conv1D(
                2, 3, groups=2, use_bias=False), (6, 2),
            Reshaped((6, 2), [(3, 1, 2)], [(3, 2, 1)]), x, "eigen")
        for name in ("A", "G"):
            assert_close(factors[name], ref[name], msg=name)

    @parameterized.parameters("eigen", "inverse")
    def test_embedding_equals_bias_free_dense_on_one_hot(self, method):
        tokens = RNG.integers(0, 7, size=(N, 4)).astype(np.int32)
        factors, ref = self.compare(
            keras.layers.Embedding(7, 3), keras.layers.Dense(3, use_bias=False), (4,),
            OneHot(7), tokens, method, dtype="int32")
        self.assertEqual(factors["A"].shape, (7,))
        assert_close(np.diag(factors["A"].numpy()), ref["A"], msg="A")
        assert_close(factors["G"], ref["G"], msg="G")

    def test_embedding_state_is_linear_in_the_vocabulary(self):
        vocabulary, width = 50_000, 8
        layer = keras.layers.Embedding(vocabulary, width)
        model = single_layer((5,), layer, dtype="int32")
        opt = kfac(model)
        tokens = RNG.integers(0, vocabulary, size=(N, 5)).astype(np.int32)
        step(model, opt, tokens)
        self.assertEqual(opt.summary()["managed"][0]["factor_shapes"],
                         [[vocabulary], [width, width]])
        # Factors, eigenbasis and eigenvalues: O(V + d²) floats, no V x V anywhere.
        self.assertEqual(opt.summary()["state_bytes"],
                         4 * (vocabulary + 2 * width * width + width))
        counts = opt.factors(layer)["A"].numpy() * N
        np.testing.assert_array_equal(counts, np.bincount(tokens.ravel(), minlength=vocabulary))

    def test_reduce_rule_on_a_dense_layer_over_positions(self):
        keras.utils.set_random_seed(4)
        x = RNG.normal(size=(N, 5, 3)).astype(np.float32)
        layer = keras.layers.Dense(2)
        model = single_layer((5, 3), layer)
        opt = kfac(model, weight_sharing="reduce")
        y = RNG.normal(size=(N, 5, 2)).astype(np.float32)
        s = tf.constant(x) @ layer.kernel + layer.bias
        with tf.GradientTape() as tape:
            tape.watch(s)
            loss = MSE(y, s)
        g = N * tape.gradient(loss, s).numpy().astype(np.float64)
        loop_step(model, opt, MSE, x, y)
        a_bar = np.concatenate([x.mean(axis=1), np.ones((N, 1))], axis=1)
        g_hat = g.sum(axis=1)
        factors = opt.factors(layer)
        assert_close(factors["A"], a_bar.T @ a_bar / N, msg="A")
        assert_close(factors["G"], g_hat.T @ g_hat / N, msg="G")


class Reshaped:
    """The reference layer sees x reshaped to `shape`; weights are reshaped both ways."""

    def __init__(self, shape, ref_shapes, shapes):
        self.shape, self.ref_shapes, self.shapes = shape, ref_shapes, shapes

    def inputs(self, x):
        return x.reshape((len(x),) + self.shape)

    def weights(self, weights, back=False):
        shapes = self.shapes if back else self.ref_shapes
        return [np.reshape(w, s) for w, s in zip(weights, shapes)]


class OneHot:
    """The reference Dense sees one-hot tokens; its kernel is the embedding matrix."""

    def __init__(self, vocabulary, positions=4):
        self.shape, self.vocabulary = (positions, vocabulary), vocabulary

    def inputs(self, tokens):
        return np.eye(self.vocabulary, dtype=np.float32)[tokens]

    def weights(self, weights, back=False):
        return list(weights)


if __name__ == "__main__":
    absltest.main()
