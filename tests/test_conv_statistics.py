"""A convolution's factor statistics from input correlations against an explicit im2col.

tfkfac.blocks.conv_correlation computes a stride-1 convolution's A = (1/N) Σ_i w_i Σ_t
ā_it ā_itᵀ without forming the patch rows. The reference here builds every patch with
Python loops over output positions and kernel taps (TensorFlow's zero padding: 'same'
pads max((O − 1)·s + (K − 1)·d + 1 − S, 0), the smaller half before; 'causal' pads
(K − 1)·d before), appends 1 for the bias, and sums the outer products in float64 numpy.
The blocks run in float64 too, so the two agree to float64 rounding (rtol 1e-10). G is
checked as well: G = (1/(N T)) Σ_i w_i Σ_t g_it g_itᵀ with g = N dL/ds.

Layers the correlation does not cover (strides, groups, depthwise, transposed, 1x1,
fewer than 8 input channels, the reduce rule) keep the im2col path; an end-to-end step of a small conv net gives the
same factors either way (float32 rounding).
"""

import itertools
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from tfkfac.blocks import conv_correlation  # noqa: E402
from kfac_reference import managed_factors  # noqa: E402

N = 3
L = keras.layers
RTOL = 1e-10


# ----------------------------------------------------------------- numpy reference
def window(size, kernel, stride, dilation, padding):
    """(output positions, zeros before) along one axis, as TensorFlow pads."""
    span = (kernel - 1) * dilation + 1
    if padding == "valid":
        return (size - span) // stride + 1, 0
    if padding == "causal":
        return size, span - 1
    out = math.ceil(size / stride)
    return out, max((out - 1) * stride + span - size, 0) // 2


def patches(x, kernel, strides, dilation, padding, use_bias):
    """(N, T, P·C [+1]) im2col rows, one loop iteration per output position and tap."""
    n, *sizes, c = x.shape
    geometry = [window(*args, padding) for args in zip(sizes, kernel, strides, dilation)]
    rows = []
    for out in itertools.product(*[range(o) for o, _ in geometry]):
        row = []
        for tap in itertools.product(*[range(k) for k in kernel]):
            where = [o * s - b + t * d for o, s, (_, b), t, d
                     in zip(out, strides, geometry, tap, dilation)]
            inside = all(0 <= w < s for w, s in zip(where, sizes))
            row.append(x[(slice(None),) + tuple(where)] if inside else np.zeros((n, c)))
        if use_bias:
            row.append(np.ones((n, 1)))
        rows.append(np.concatenate(row, axis=1))
    return np.stack(rows, axis=1)


def reference_factors(calls, layer, weights=None):
    """(A, G) of `calls` [(x, dL/ds)] by the im2col rule, numpy float64."""
    n = calls[0][0].shape[0]
    w = np.ones(n) if weights is None else weights
    a = 0.0
    g_sum, positions = 0.0, 0
    for x, out_grads in calls:
        rows = patches(x, layer.kernel_size, layer.strides, layer.dilation_rate, layer.padding,
                       layer.use_bias)
        a = a + np.einsum("n,nti,ntj->ij", w, rows, rows)
        g = (n * out_grads).reshape(n, -1, out_grads.shape[-1])
        g_sum = g_sum + np.einsum("n,nti,ntj->ij", w, g, g)
        positions += g.shape[1]
    return a / n, g_sum / (n * positions)


# ----------------------------------------------------------------- helpers
def built(layer, input_shape):
    layer.build((None,) + tuple(input_shape))
    return layer


def block_of(layer, **config):
    block, reason = tfkfac.blocks.block_for(layer, tfkfac.KFACConfig(**config))
    assert block is not None, reason
    return block


def random_call(layer, input_shape, seed):
    """(x, dL/ds) of one call, float64: dL/ds random in the layer's output shape."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N,) + tuple(input_shape))
    out_shape = layer.compute_output_shape((N,) + tuple(input_shape))
    return x, rng.normal(size=out_shape) / N


def block_factors(block, calls, weights=None):
    tensors = [(tf.constant(x), tf.constant(g)) for x, g in calls]
    return [f.numpy() for f in block.batch_statistics(
        tensors, N, None if weights is None else tf.constant(weights))]


def assert_factors(test, got, want, rtol=RTOL):
    for name, g, w in zip(("A", "G"), got, want):
        test.assertEqual(g.shape, w.shape, name)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max(), err_msg=name)


# (name, layer builder, input shape without the batch)
CORRELATION_CASES = [
    ("same_3x3", lambda bias: L.Conv2D(4, 3, padding="same", use_bias=bias), (7, 9, 8)),
    # Large enough that the whole input minus what each window misses is cheaper.
    ("same_3x3_large", lambda bias: L.Conv2D(3, 3, padding="same", use_bias=bias),
     (12, 13, 8)),
    ("valid_3x3", lambda bias: L.Conv2D(3, 3, padding="valid", use_bias=bias), (6, 5, 8)),
    ("same_5x5", lambda bias: L.Conv2D(3, 5, padding="same", use_bias=bias), (8, 7, 8)),
    ("dilation_2_same", lambda bias: L.Conv2D(3, 3, padding="same", dilation_rate=2,
                                              use_bias=bias), (9, 8, 8)),
    ("dilation_2_valid", lambda bias: L.Conv2D(3, 3, padding="valid", dilation_rate=(2, 1),
                                               use_bias=bias), (7, 6, 8)),
    # 'same' with an even kernel pads 1 before and 2 after; a (4, 2) kernel.
    ("even_kernel_same", lambda bias: L.Conv2D(2, (4, 2), padding="same", use_bias=bias),
     (6, 5, 8)),
    # Dilation 3 on 3 positions: some taps' windows lie wholly in the padding.
    ("windows_in_padding", lambda bias: L.Conv2D(2, 3, padding="same", dilation_rate=3,
                                                 use_bias=bias), (3, 4, 8)),
    ("conv1d_causal", lambda bias: L.Conv1D(3, 3, padding="causal", dilation_rate=2,
                                            use_bias=bias), (11, 8)),
    ("conv1d_same", lambda bias: L.Conv1D(3, 4, padding="same", use_bias=bias), (9, 8)),
    ("conv3d_same", lambda bias: L.Conv3D(2, 3, padding="same", use_bias=bias), (4, 5, 3, 8)),
    ("conv3d_valid", lambda bias: L.Conv3D(2, (2, 3, 2), padding="valid", use_bias=bias),
     (4, 5, 3, 8)),
]


class CorrelationTest(parameterized.TestCase):

    def assert_correlation_matches(self, layer, calls, weights):
        block = block_of(layer)
        self.assertTrue(block.correlation_statistics)
        assert_factors(self, block_factors(block, calls, weights),
                       reference_factors(calls, layer, weights))

    @parameterized.named_parameters(
        (f"{name}_{'bias' if bias else 'nobias'}_{'weighted' if weighted else 'plain'}",
         make, shape, bias, weighted)
        for name, make, shape in CORRELATION_CASES for bias in (True, False)
        for weighted in (False, True))
    def test_equals_im2col(self, make, shape, bias, weighted):
        layer = built(make(bias), shape)
        weights = np.array([0.5, 2.0, 1.25]) if weighted else None
        self.assert_correlation_matches(layer, [random_call(layer, shape, seed=1)], weights)

    def test_both_decompositions_occur(self):
        # `same_3x3` cuts the input into the pieces each window covers; `same_3x3_large`
        # takes the whole input minus the pieces each window misses (coefficients −1).
        def signs(sizes):
            chosen = conv_correlation.regions(sizes, (3, 3), (1, 1), (1, 1), sizes)
            return {math.prod(c[k] for (*_, c), k in zip(region, (0, 0))) for region in chosen}

        self.assertNotIn(-1.0, signs((7, 9)))
        self.assertIn(-1.0, signs((12, 13)))

    def test_shared_layer_sums_its_calls(self):
        # One layer called on two inputs of different sizes in one forward pass.
        layer = built(L.Conv2D(3, 3, padding="same"), (6, 7, 8))
        calls = [random_call(layer, (6, 7, 8), seed=2), random_call(layer, (4, 9, 8), seed=3)]
        self.assert_correlation_matches(layer, calls, np.array([1.0, 0.25, 3.0]))

    def test_part_of_the_batch(self):
        # factor_batch_fraction: the blocks' take_examples, then the statistics of n < N.
        layer = built(L.Conv2D(3, 3, padding="same"), (5, 6, 8))
        block = block_of(layer)
        self.assertTrue(block.correlation_statistics)
        x, g = random_call(layer, (5, 6, 8), seed=4)
        keep = tf.constant([0, 2])
        calls, _ = block.take_examples([(tf.constant(x), tf.constant(g))], None, keep, N)
        a, _ = block.batch_statistics(calls, 2)
        rows = patches(x[[0, 2]], (3, 3), (1, 1), (1, 1), "same", True)
        np.testing.assert_allclose(a.numpy(), np.einsum("nti,ntj->ij", rows, rows) / 2,
                                   rtol=RTOL, atol=RTOL * np.abs(a.numpy()).max())

    def test_bfloat16_products(self):
        # product_dtype="bfloat16": operands rounded to 8 bits of mantissa.
        layer = built(L.Conv2D(4, 3, padding="same"), (7, 6, 8))
        block = block_of(layer, product_dtype="bfloat16")
        self.assertTrue(block.correlation_statistics)
        calls = [random_call(layer, (7, 6, 8), seed=5)]
        tensors = [(tf.constant(x, tf.float32), tf.constant(g, tf.float32)) for x, g in calls]
        got = [f.numpy() for f in block.batch_statistics(tensors, N)]
        assert_factors(self, got, reference_factors(calls, layer), rtol=3e-2)

    def test_unknown_spatial_sizes_take_im2col(self):
        layer = built(L.Conv2D(3, 3, padding="same"), (None, None, 8))
        block = block_of(layer)
        self.assertTrue(block.correlation_statistics)  # were the sizes known
        statistics = tf.function(
            lambda x, g: block.batch_statistics([(x, g)], N),
            input_signature=[tf.TensorSpec((None, None, None, 8), tf.float64),
                             tf.TensorSpec((None, None, None, 3), tf.float64)])
        calls = [random_call(layer, (5, 6, 8), seed=6)]
        got = [f.numpy() for f in statistics(*calls[0])]
        assert_factors(self, got, reference_factors(calls, layer))


class FallbackTest(parameterized.TestCase):
    """Layers whose rows the correlation does not describe keep the im2col path."""

    @parameterized.named_parameters(
        ("stride_2", lambda: L.Conv2D(3, 3, strides=2, padding="same"), (7, 7, 2), {}),
        ("stride_1_and_2", lambda: L.Conv2D(3, 3, strides=(1, 2), padding="same"),
         (7, 7, 2), {}),
        ("groups", lambda: L.Conv2D(4, 3, padding="same", groups=2), (6, 6, 2), {}),
        ("depthwise", lambda: L.DepthwiseConv2D(3, padding="same"), (6, 6, 2), {}),
        ("transposed", lambda: L.Conv2DTranspose(3, 3, padding="same"), (5, 5, 2), {}),
        ("one_by_one", lambda: L.Conv2D(3, 1), (5, 5, 8), {}),
        ("few_channels", lambda: L.Conv2D(3, 3, padding="same"), (6, 6, 4), {}),
        ("reduce_rule", lambda: L.Conv2D(3, 3, padding="same"), (6, 6, 8),
         {"weight_sharing": "reduce"}))
    def test_im2col_path(self, make, shape, config):
        block = block_of(built(make(), shape), **config)
        self.assertFalse(block.correlation_statistics)

    def test_strided_factors_still_match(self):
        layer = built(L.Conv2D(3, 3, strides=2, padding="same"), (7, 6, 2))
        calls = [random_call(layer, (7, 6, 2), seed=7)]
        self.assertFalse(block_of(layer).correlation_statistics)
        assert_factors(self, block_factors(block_of(layer), calls),
                       reference_factors(calls, layer))


class EndToEndTest(absltest.TestCase):

    def test_factors_after_a_step_match_the_im2col_path(self):
        rng = np.random.default_rng(8)
        x = rng.normal(size=(8, 9, 9, 8)).astype(np.float32)
        labels = rng.integers(0, 4, size=8)
        results = []
        for correlation in (True, False):
            keras.utils.set_random_seed(9)
            model = keras.Sequential([
                keras.Input((9, 9, 8)),
                L.Conv2D(8, 3, padding="same", activation="relu"),
                L.Conv2D(6, 3, padding="valid", dilation_rate=2, use_bias=False,
                         activation="relu"),
                L.Flatten(), L.Dense(4)])
            opt = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                              damping=1e-2, kl_clip=1e-3, xla=False)
            opt.attach(model)
            conv_blocks = [b for b in opt.curvature.blocks
                           if isinstance(b, tfkfac.blocks.ConvBlock)]
            self.assertLen(conv_blocks, 2)
            self.assertTrue(all(b.correlation_statistics for b in conv_blocks))
            for block in conv_blocks:
                block.correlation_statistics = correlation
            model.compile(optimizer=opt,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(x, labels, batch_size=8, epochs=1, shuffle=False, verbose=0)
            results.append(managed_factors(opt))
        # The first update's A of the 9x9 'same' convolution: its bias corner counts the
        # 81 output positions.
        self.assertAlmostEqual(results[0][0][-1, -1], 81.0, places=3)
        for got, want in zip(*results):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


if __name__ == "__main__":
    absltest.main()
