"""The convolution family's blocks (tfkfac/blocks/conv.py) against an explicit numpy im2col.

docs/design.md §2: every convolution is a matrix product s_t = ā_t W (+ b) at the T output
positions of an example. The numpy reference below builds each layer's products in
float64 from loops over output positions and kernel taps, never from the block's code:
- Conv1D/2D/3D (strides, "valid"/"same"/"causal" padding with TensorFlow's padding rule,
  dilation): ā_t is the zero-padded window, flattened in the kernel's (taps..., c_in)
  order;
- grouped convolutions: one product per group on the group's input channels, its kernel
  the group's output channels; DepthwiseConv (kernel (k..., c_in, m)) is the grouped rule
  with its kernel seen as (k..., 1, c_in·m) and q = c_in;
- SeparableConv: the depthwise product on x gives d, then a 1x1 product on d with the bias;
- Conv*DTranspose, from its scatter form: input position i, tap k adds W[k] x_i to output
  position i·s − p + k·d (p TensorFlow's padding of the convolution it transposes, the
  output size Keras's), so ā_t[k] = x_i for the i reaching t through tap k, else 0.
Each reference first reproduces the Keras layer's output (rows @ kernel matrix = layer
output) before it is trusted. From its dL/ds (MSE through a tanh, in numpy) it gives per
group: A, G under the expand and reduce rules, ∇ = Σ ā dL/dsᵀ, and
P = (A ⊗ G + λI)⁻¹ vec(∇) (np.kron solve; eigen method) or the π-corrected factored
inverse (inverse method).

Checked:
- the block's im2col rows equal the numpy rows exactly (also with unknown spatial sizes);
- block level (inputs and dL/ds from a tf.GradientTape around `pre_activation_call`):
  `batch_statistics` gives A, G, and `decompose` + `precondition` give P, for every layer
  case x both methods x both weight-sharing rules, with and without bias;
- one optimizer step per case through `record()` / `minimize` (momentum 0, no KL clip):
  the stored factors and the update -lr·P;
- the docs/design.md §2 equivalences, block level: Conv1D kernel k on (T, c) = Conv2D
  kernel (1, k) on (1, T, c); a grouped Conv2D = q separate Conv2D on the channel slices;
  DepthwiseConv2D = Conv2D with groups = c_in;
- factor layouts (plain Conv2D unbatched for its checkpoints, groups batched, SeparableConv
  four named factors), block kinds, and channels_first falling back with the reason.

Tolerances: rtol 1e-4 with an absolute floor of 1e-5·max|ref| (`assert_close`) for factors
(float32 vs float64); 1e-3 for preconditioned gradients, which go through a float32
eigendecomposition or inverse; rows are compared exactly.
"""

import itertools
import math
import os
import unittest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from tfkfac import methods  # noqa: E402
from kfac_reference import (DAMPING, LR, assert_close,  # noqa: E402
                            factored_inverse_precondition, kron_precondition, loop_step,
                            managed_factors)

N = 4
UPDATE_RTOL = 1e-3
L = keras.layers
MSE = keras.losses.MeanSquaredError()
SEPARABLE = (L.SeparableConv1D, L.SeparableConv2D)
TRANSPOSED = (L.Conv1DTranspose, L.Conv2DTranspose, L.Conv3DTranspose)
DEPTHWISE = (L.DepthwiseConv1D, L.DepthwiseConv2D)


def layer(cls, *args, **kwargs):
    """A factory of the layer with a tanh activation (outside the pre-activation)."""
    return lambda: cls(*args, activation="tanh", bias_initializer="random_normal", **kwargs)


# name, input shape (without batch), layer factory
CASES = [
    ("conv1d_stride2_same", (7, 2), layer(L.Conv1D, 3, 3, strides=2, padding="same")),
    ("conv1d_causal_dilated_nobias", (6, 2),
     layer(L.Conv1D, 3, 2, padding="causal", dilation_rate=2, use_bias=False)),
    ("conv2d_asymmetric_same", (5, 6, 2), layer(L.Conv2D, 3, (3, 2), strides=2, padding="same")),
    ("conv2d_dilated_valid", (6, 6, 2), layer(L.Conv2D, 2, 2, dilation_rate=2)),
    ("conv3d", (3, 4, 3, 2), layer(L.Conv3D, 2, (2, 2, 1), strides=(1, 2, 1), padding="same")),
    ("grouped_conv2d", (5, 5, 4), layer(L.Conv2D, 6, 3, groups=2, padding="same")),
    ("grouped_conv1d_nobias", (6, 6), layer(L.Conv1D, 3, 2, groups=3, use_bias=False)),
    ("depthwise_conv2d", (5, 5, 3),
     layer(L.DepthwiseConv2D, 3, depth_multiplier=2, strides=2, padding="same")),
    ("depthwise_conv1d_nobias", (6, 2), layer(L.DepthwiseConv1D, 3, use_bias=False)),
    ("separable_conv2d", (5, 5, 2), layer(L.SeparableConv2D, 3, 3, depth_multiplier=2,
                                          padding="same")),
    ("separable_conv1d_nobias", (7, 3), layer(L.SeparableConv1D, 2, 3, strides=2,
                                              use_bias=False)),
    ("conv1d_transpose_same_output_padding", (4, 2),
     layer(L.Conv1DTranspose, 3, 3, strides=2, padding="same", output_padding=1)),
    ("conv1d_transpose_kernel_below_stride", (4, 2), layer(L.Conv1DTranspose, 2, 2, strides=3)),
    ("conv2d_transpose_valid", (3, 4, 2), layer(L.Conv2DTranspose, 2, (3, 2), strides=(2, 3))),
    ("conv2d_transpose_dilated_nobias", (4, 4, 2),
     layer(L.Conv2DTranspose, 2, 2, dilation_rate=2, padding="same", use_bias=False)),
    ("conv3d_transpose", (2, 3, 2, 2), layer(L.Conv3DTranspose, 2, 2, strides=2, padding="same")),
]
CASE = {name: (shape, make) for name, shape, make in CASES}


# ----------------------------------------------------------------- numpy reference
def tf_output_and_pad(size, kernel, stride, dilation, padding):
    """Output length and zeros before of a TensorFlow/Keras convolution."""
    span = (kernel - 1) * dilation + 1
    if padding == "valid":
        return (size - span) // stride + 1, 0
    if padding == "causal":  # Keras pads (k-1)·d zeros on the left, then "valid"
        return (size - 1) // stride + 1, span - 1
    out = math.ceil(size / stride)
    return out, max((out - 1) * stride + span - size, 0) // 2


def taps(kernel_size):
    return list(itertools.product(*[range(k) for k in kernel_size]))


def conv_rows(x, kernel_size, strides, dilation, padding):
    """(N, T, taps·c) im2col by loops over output positions and taps."""
    spatial = x.shape[1:-1]
    geometry = [tf_output_and_pad(*args, padding)
                for args in zip(spatial, kernel_size, strides, dilation)]
    out = tuple(o for o, _ in geometry)
    rows = np.zeros((len(x),) + out + (len(taps(kernel_size)), x.shape[-1]))
    for position in itertools.product(*[range(o) for o in out]):
        for t, tap in enumerate(taps(kernel_size)):
            source = [p * s - before + k * d for p, s, (_, before), k, d
                      in zip(position, strides, geometry, tap, dilation)]
            if all(0 <= i < n for i, n in zip(source, spatial)):
                rows[(slice(None),) + position + (t,)] = x[(slice(None),) + tuple(source)]
    return rows.reshape(len(x), -1, rows.shape[-2] * rows.shape[-1])


def transpose_rows(x, kernel_size, strides, dilation, padding, out):
    """(N, T, taps·c) of a transposed convolution with output spatial shape `out`.

    Scatter form: input position i and tap k reach output i·s − p + k·d, with p the
    padding TensorFlow gives the convolution from `out` back to the input size.
    """
    spatial = x.shape[1:-1]
    pads = [0 if padding == "valid" else max((i - 1) * s + (k - 1) * d + 1 - o, 0) // 2
            for i, s, k, d, o in zip(spatial, strides, kernel_size, dilation, out)]
    rows = np.zeros((len(x),) + tuple(out) + (len(taps(kernel_size)), x.shape[-1]))
    for source in itertools.product(*[range(n) for n in spatial]):
        for t, tap in enumerate(taps(kernel_size)):
            target = tuple(i * s - p + k * d for i, s, p, k, d
                           in zip(source, strides, pads, tap, dilation))
            if all(0 <= o < n for o, n in zip(target, out)):
                rows[(slice(None),) + target + (t,)] += x[(slice(None),) + source]
    return rows.reshape(len(x), -1, rows.shape[-2] * rows.shape[-1])


def conv_matrix(kernel, bias, groups):
    """Kernel (k..., c_in/q, q·o) and bias as q matrices (q, taps·c_in/q [+1], o)."""
    o = kernel.shape[-1] // groups
    matrix = np.stack([kernel[..., j * o:(j + 1) * o].reshape(-1, o) for j in range(groups)])
    if bias is None:
        return matrix
    return np.concatenate([matrix, bias.reshape(groups, 1, o)], axis=1)


def depthwise_matrix(kernel, bias):
    """Kernel (k..., c_in, m): the grouped kernel (k..., 1, c_in·m) with q = c_in."""
    c_in, m = kernel.shape[-2:]
    return conv_matrix(kernel.reshape(kernel.shape[:-2] + (1, c_in * m)), bias, c_in)


def transpose_matrix(kernel, bias):
    """Kernel (k..., c_out, c_in) as the convolution (k..., c_in, c_out) of its patches."""
    return conv_matrix(np.swapaxes(kernel, -1, -2), bias, 1)


def group_major(t, groups):
    """(N, T, q·o) -> (q, N, T, o)."""
    n, positions, channels = t.shape
    return t.reshape(n, positions, groups, channels // groups).transpose(2, 0, 1, 3)


class Product:
    """One weight product of a layer: rows (q, N, T, a) against matrices (q, a [+1], o)."""

    def __init__(self, x, rows_of, matrix, out_shape):
        self.groups = len(matrix)
        c = x.shape[-1] // self.groups
        rows = np.stack([rows_of(x[..., j * c:(j + 1) * c]) for j in range(self.groups)])
        if matrix.shape[1] > rows.shape[-1]:  # the bias row
            rows = np.concatenate([rows, np.ones(rows.shape[:-1] + (1,))], axis=-1)
        self.rows, self.matrix = rows, matrix
        s = rows @ matrix[:, None]  # (q, N, T, o)
        self.s = s.transpose(1, 2, 0, 3).reshape((len(x),) + tuple(out_shape) + (-1,))

    def reference(self, ds, weight_sharing, method):
        """A, G, ∇ and P of docs/design.md §2 from dL/ds (N, out..., q·o)."""
        ds = group_major(ds.reshape(len(ds), -1, ds.shape[-1]), self.groups)
        n, t = ds.shape[1:3]
        g = n * ds
        if weight_sharing == "expand":
            a_rows, g_rows, g_scale = self.rows, g, n * t
        else:
            a_rows, g_rows, g_scale = self.rows.mean(axis=2), g.sum(axis=2), n
        a_rows = a_rows.reshape(self.groups, -1, a_rows.shape[-1])
        g_rows = g_rows.reshape(self.groups, -1, g_rows.shape[-1])
        a = a_rows.transpose(0, 2, 1) @ a_rows / n
        big_g = g_rows.transpose(0, 2, 1) @ g_rows / g_scale
        rows = self.rows.reshape(self.groups, -1, self.rows.shape[-1])
        grad = rows.transpose(0, 2, 1) @ ds.reshape(self.groups, -1, ds.shape[-1])
        p = np.stack([precondition(*args, method) for args in zip(a, big_g, grad)])
        return {"A": a, "G": big_g, "grad": grad, "P": p}


def precondition(a, g, grad, method):
    if method == "eigen":
        return kron_precondition(a, g, grad, DAMPING)
    return factored_inverse_precondition(a, g, grad, DAMPING)


def weights_of(layer):
    """The layer's weights in float64, aligned with its block's variables (bias last)."""
    return [w.numpy().astype(np.float64) for w in layer.trainable_weights]


class Reference:
    """A layer in numpy: its products, pre-activation s, and dL/ds of the MSE of tanh(s)."""

    def __init__(self, layer, x):
        self.layer, x = layer, x.astype(np.float64)
        geometry = (layer.kernel_size, layer.strides, layer.dilation_rate, layer.padding)
        out = tuple(layer.compute_output_shape(x.shape)[1:-1])
        first, *pointwise = self.matrices(weights_of(layer))
        if isinstance(layer, TRANSPOSED):
            self.products = [Product(x, lambda c: transpose_rows(c, *geometry, out), first, out)]
        else:
            self.products = [Product(x, lambda c: conv_rows(c, *geometry), first, out)]
        if pointwise:  # SeparableConv: the 1x1 product on d, the depthwise output
            ones = (1,) * len(layer.kernel_size)
            self.products.append(Product(
                self.products[0].s, lambda d: conv_rows(d, ones, ones, ones, "valid"),
                pointwise[0], out))
        self.s = self.products[-1].s

    def matrices(self, weights):
        """Per product, the (q, a [+1], o) matrices of `weights` (aligned with variables)."""
        layer = self.layer
        if isinstance(layer, SEPARABLE):
            bias = weights[2] if layer.use_bias else None
            return [depthwise_matrix(weights[0], None), conv_matrix(weights[1], bias, 1)]
        bias = weights[1] if layer.use_bias else None
        if isinstance(layer, TRANSPOSED):
            return [transpose_matrix(weights[0], bias)]
        if isinstance(layer, DEPTHWISE):
            return [depthwise_matrix(weights[0], bias)]
        return [conv_matrix(weights[0], bias, layer.groups)]

    def pre_activation_grads(self, y):
        """dL/ds per product for L = mean((tanh(s) - y)²) (Keras MSE, sum_over_batch_size)."""
        out = np.tanh(self.s)
        ds = 2.0 * (out - y) / out.size * (1.0 - out ** 2)
        grads = [ds]
        if len(self.products) == 2:  # separable: d feeds the 1x1 product
            pointwise = self.products[1].matrix[0]
            grads.insert(0, ds @ pointwise[: self.products[0].s.shape[-1]].T)
        return grads

    def results(self, y, weight_sharing, method):
        return [product.reference(ds, weight_sharing, method)
                for product, ds in zip(self.products, self.pre_activation_grads(y))]


# ------------------------------------------------------------------------ helpers
def built(name, seed=0):
    """(layer, x, y, reference) of a case; the reference reproduces the layer's output."""
    shape, make = CASE[name]
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N,) + shape).astype(np.float32)
    conv = make()
    try:
        output = conv(x).numpy()
    except tf.errors.InvalidArgumentError as error:
        # TensorFlow's CPU kernels without oneDNN (the default on CPUs without AVX-512)
        # have no dilated transposed convolution: Keras itself cannot run the layer.
        if "do not yet support dilation rates" not in str(error):
            raise
        raise unittest.SkipTest(f"TensorFlow cannot run {name} on this CPU: "
                                f"{error.message.splitlines()[0][:120]}") from None
    ref = Reference(conv, x)
    assert_close(output, np.tanh(ref.s), msg=f"numpy {name} vs Keras")
    y = rng.normal(size=output.shape).astype(np.float32)
    return conv, x, y, ref


def capture(block, x, y):
    """(inputs, dL/ds, weight grads) of one call, from a tape around the block's call."""
    with tf.GradientTape() as tape:
        (inputs, pre), output = block.pre_activation_call(block.layer.call,
                                                          (tf.constant(x),), {})
        loss = MSE(y, output)
    out_grads, grads = tape.gradient(loss, (pre, block.variables))
    return inputs, out_grads, grads


def block_results(block, inputs, out_grads, grads, method):
    """(factors, preconditioned gradients) of the block on one call."""
    factors = block.batch_statistics([(inputs, out_grads)], N)
    method = tfkfac.KFACConfig(method=method).preconditioning_method()
    decomposition = [methods.decompose_factor(method, block, j, factors, DAMPING)
                     for j in block.symmetric_factors()]
    preconditioned, _ = methods.precondition_block(method, block, grads, factors,
                                                   decomposition, DAMPING)
    return factors, preconditioned


def check_against_reference(ref, factors, updates, results, scale, msg):
    """Factors (A_1, G_1, ...) and `updates` (aligned with variables) = scale·P."""
    for k, (result, matrices) in enumerate(zip(results, ref.matrices(updates))):
        a, g = (np.asarray(f) for f in factors[2 * k: 2 * k + 2])
        assert_close(a.reshape(result["A"].shape), result["A"], msg=f"{msg} A{k}")
        assert_close(g.reshape(result["G"].shape), result["G"], msg=f"{msg} G{k}")
        assert_close(matrices, scale * result["P"], rtol=UPDATE_RTOL, msg=f"{msg} P{k}")


def kfac(model, method, weight_sharing="expand"):
    return tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING, kl_clip=None,
                       method=method, weight_sharing=weight_sharing, xla=False).attach(model)


def settings(index):
    """Spread the methods and weight-sharing rules over the cases of a slower test."""
    return ("inverse" if index % 2 else "eigen"), ("reduce" if index % 3 == 0 else "expand")


# -------------------------------------------------------------------------- tests
class RowsTest(parameterized.TestCase):

    @parameterized.named_parameters(*[(name, name) for name, _, _ in CASES])
    def test_im2col_rows_match_numpy(self, name):
        conv, x, _, ref = built(name)
        block, reason = tfkfac.blocks.block_for(conv)
        self.assertIsNone(reason)
        # SeparableConv: the depthwise part's rows (the pointwise part's rows are d itself)
        part = block.parts[0] if hasattr(block, "parts") else block
        product = ref.products[0]
        expected = product.rows[..., : part.in_dim].reshape(product.groups, -1, part.in_dim)
        if product.groups == 1:
            expected = expected[0]
        np.testing.assert_array_equal(part.input_rows(tf.constant(x)).numpy(), expected)
        # Unknown spatial sizes: the geometry is then computed in the graph.
        spec = tf.TensorSpec((None,) * (x.ndim - 1) + x.shape[-1:], tf.float32)
        rows = tf.function(part.input_rows, input_signature=[spec])(x)
        np.testing.assert_array_equal(rows.numpy(), expected)


class BlockMathTest(parameterized.TestCase):

    @parameterized.named_parameters(*[
        (f"{name}_{method}_{sharing}", name, method, sharing) for name, _, _ in CASES
        for method in ("eigen", "inverse") for sharing in ("expand", "reduce")])
    def test_factors_and_preconditioned_gradient(self, name, method, sharing):
        conv, x, y, ref = built(name)
        block, _ = tfkfac.blocks.block_for(conv, tfkfac.KFACConfig(weight_sharing=sharing))
        inputs, out_grads, grads = capture(block, x, y)
        results = ref.results(y, sharing, method)
        for matrix, result in zip(ref.matrices([g.numpy() for g in grads]), results):
            assert_close(matrix, result["grad"], msg="tape gradient vs numpy ∇")
        factors, preconditioned = block_results(block, inputs, out_grads, grads, method)
        check_against_reference(ref, factors, [p.numpy() for p in preconditioned], results,
                                1.0, name)


class OptimizerStepTest(parameterized.TestCase):

    @parameterized.named_parameters(*[
        (name, name, *settings(i)) for i, (name, _, _) in enumerate(CASES)])
    def test_one_step_update_is_minus_lr_p(self, name, method, sharing):
        conv, x, y, ref = built(name, seed=1)
        inputs = keras.Input(x.shape[1:])
        model = keras.Model(inputs, conv(inputs))
        opt = kfac(model, method, sharing)
        deltas = loop_step(model, opt, MSE, x, y)
        self.assertEqual([m["layer"] for m in opt.summary()["managed"]], [conv.name])
        factors = managed_factors(opt)
        check_against_reference(ref, factors, deltas, ref.results(y, sharing, method), -LR,
                                f"{name} ({method}, {sharing})")


class EquivalenceTest(parameterized.TestCase):
    """docs/design.md §2, on the blocks with the same inputs and dL/ds."""

    @parameterized.parameters("eigen", "inverse")
    def test_conv1d_equals_conv2d_with_a_1_by_k_kernel(self, method):
        keras.utils.set_random_seed(2)
        x = np.random.default_rng(2).normal(size=(N, 7, 3)).astype(np.float32)
        conv1d = L.Conv1D(4, 3, strides=2, padding="same", bias_initializer="random_normal")
        conv1d(x)
        block1, _ = tfkfac.blocks.block_for(conv1d)
        inputs, out_grads, grads = capture(block1, x, np.ones((N, 4, 4), np.float32))
        factors1, p1 = block_results(block1, inputs, out_grads, grads, method)

        conv2d = L.Conv2D(4, (1, 3), strides=(1, 2), padding="same")
        conv2d.build((None, 1, 7, 3))
        block2, _ = tfkfac.blocks.block_for(conv2d)
        factors2, p2 = block_results(
            block2, tf.reshape(inputs, (N, 1, 7, 3)), tf.reshape(out_grads, (N, 1, 4, 4)),
            [tf.reshape(grads[0], (1, 3, 3, 4)), grads[1]], method)
        for f1, f2 in zip(factors1, factors2):
            assert_close(f1, f2)
        assert_close(p1[0], tf.reshape(p2[0], (3, 3, 4)), rtol=UPDATE_RTOL)
        assert_close(p1[1], p2[1], rtol=UPDATE_RTOL)

    @parameterized.parameters("eigen", "inverse")
    def test_grouped_conv_is_the_separate_convs_on_channel_slices(self, method):
        grouped, x, y, _ = built("grouped_conv2d")
        block, _ = tfkfac.blocks.block_for(grouped)
        inputs, out_grads, grads = capture(block, x, y)
        (a, g), (kernel, bias) = block_results(block, inputs, out_grads, grads, method)
        self.assertEqual((a.shape, g.shape), ((2, 19, 19), (2, 3, 3)))
        for j in range(2):
            part = L.Conv2D(3, 3, padding="same")
            part.build((None, 5, 5, 2))
            part_block, _ = tfkfac.blocks.block_for(part)
            outputs = slice(3 * j, 3 * j + 3)
            (a_j, g_j), (kernel_j, bias_j) = block_results(
                part_block, inputs[..., 2 * j:2 * j + 2], out_grads[..., outputs],
                [grads[0][..., outputs], grads[1][outputs]], method)
            assert_close(a[j], a_j, msg=f"A_{j}")
            assert_close(g[j], g_j, msg=f"G_{j}")
            assert_close(kernel[..., outputs], kernel_j, rtol=UPDATE_RTOL)
            assert_close(bias[outputs], bias_j, rtol=UPDATE_RTOL)

    @parameterized.parameters("eigen", "inverse")
    def test_depthwise_conv_is_the_grouped_conv_with_one_group_per_channel(self, method):
        depthwise, x, y, _ = built("depthwise_conv2d")
        block, _ = tfkfac.blocks.block_for(depthwise)
        inputs, out_grads, grads = capture(block, x, y)
        factors, (kernel, bias) = block_results(block, inputs, out_grads, grads, method)
        grouped = L.Conv2D(6, 3, strides=2, padding="same", groups=3)
        grouped.build((None, 5, 5, 3))
        grouped_block, _ = tfkfac.blocks.block_for(grouped)
        grouped_factors, (grouped_kernel, grouped_bias) = block_results(
            grouped_block, inputs, out_grads, [tf.reshape(grads[0], (3, 3, 1, 6)), grads[1]],
            method)
        self.assertEqual(factors[0].shape, (3, 10, 10))
        for f, f_grouped in zip(factors, grouped_factors):
            assert_close(f, f_grouped)
        assert_close(kernel, tf.reshape(grouped_kernel, (3, 3, 3, 2)), rtol=UPDATE_RTOL)
        assert_close(bias, grouped_bias, rtol=UPDATE_RTOL)


class LayoutTest(parameterized.TestCase):

    def test_kinds_and_factor_shapes(self):
        expected = {
            # plain Conv2D keeps 2-D factors: checkpoints of tfkfac 0.1.0 depend on it
            "conv2d_asymmetric_same": ("conv2d", [(13, 13), (3, 3)]),
            "conv1d_stride2_same": ("conv1d", [(7, 7), (3, 3)]),
            "conv3d": ("conv3d", [(9, 9), (2, 2)]),
            "grouped_conv2d": ("conv2d", [(2, 19, 19), (2, 3, 3)]),
            "depthwise_conv1d_nobias": ("depthwise_conv", [(2, 3, 3), (2, 1, 1)]),
            "separable_conv2d": ("separable_conv",
                                 [(2, 9, 9), (2, 2, 2), (5, 5), (3, 3)]),
            "conv2d_transpose_valid": ("conv_transpose", [(13, 13), (2, 2)]),
        }
        for name, (kind, shapes) in expected.items():
            conv, _, _, _ = built(name)
            block, _ = tfkfac.blocks.block_for(conv)
            self.assertEqual(block.kind, kind, name)
            self.assertEqual([tuple(s) for s in block.factor_shapes()], shapes, name)
        self.assertEqual(block.factor_names(), ("A", "G"))
        separable, _, _, _ = built("separable_conv2d")
        block, _ = tfkfac.blocks.block_for(separable)
        self.assertEqual(block.factor_names(),
                         ("A_depthwise", "G_depthwise", "A_pointwise", "G_pointwise"))
        self.assertEqual([v.name for v in block.variables],
                         ["depthwise_kernel", "pointwise_kernel", "bias"])

    @parameterized.parameters(
        (L.Conv2D, (2, 3)), (L.DepthwiseConv2D, (3,)), (L.SeparableConv2D, (2, 3)),
        (L.Conv2DTranspose, (2, 3)))
    def test_channels_first_falls_back_with_the_reason(self, cls, args):
        conv = cls(*args, data_format="channels_first")
        conv.build((None, 2, 6, 6))
        block, reason = tfkfac.blocks.block_for(conv)
        self.assertIsNone(block)
        self.assertEqual(reason, f"{cls.__name__} with data_format='channels_first' is not "
                                 "supported")


if __name__ == "__main__":
    absltest.main()
