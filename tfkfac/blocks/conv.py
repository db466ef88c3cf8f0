"""Convolutions over 1, 2 or 3 spatial axes (KFC, Grosse & Martens 2016).

Every convolution is a matrix product at T output positions per example
(docs/design.md §2): the input row of position t is the im2col patch, taken as the
strided slices of the padded input, one per kernel offset, flattened in the kernel's
(spatial..., c_in) order — one implementation for every spatial rank, measured 1.1-1.2x
faster than `tf.image.extract_patches` for 2-D (`bench/linalg_benchmark.py`).

- Conv1D/2D/3D: the layer's strides, padding ("valid", "same", Conv1D's "causal" = a
  left pad of (k-1)·dilation) and dilation.
- Grouped (`groups = q`): block-diagonal, group j's input channels' patch against group
  j's output channels, one Kronecker pair per group, kept as a batch (q, n, n).
- DepthwiseConv1D/2D (kernel (k..., c_in, m)): the grouped rule with q = c_in groups of
  m outputs; output channel c·m + j belongs to group c.
- SeparableConv1D/2D: two weight products in one layer, d = depthwise(x) and
  s = pointwise(d) + b. One block of two parts: the depthwise rule (no bias) on (x, d)
  and a 1x1 convolution with the layer's bias on (d, s).
- Conv1D/2D/3DTranspose, kernel W (k..., c_out, c_in), K taps per axis. TensorFlow
  computes it as the input gradient of the convolution from the output size O (fixed by
  Keras from padding and output_padding) to the input size I; with p that convolution's
  padding before, input position i and kernel tap k (W[k] a (c_out, c_in) matrix)
  reach output o = i·s − p + k·d. Let z be the input with s − 1 zeros inserted after
  every position (z[i·s] = x[i]) and z_pad = z with L = (K−1)·d − p zeros before,
  z_pad[j] = z[j − L]. Then, per spatial axis,

      s_o = Σ_k W[k] z[o + p − k·d] + b = Σ_k W[k] z_pad[o + (K−1−k)·d] + b,

  a stride-1 convolution (dilation d) of z_pad with the spatially flipped kernel. So
  ā_t is the patch of z_pad at output position t, its taps read in reverse order to line
  up with the unflipped kernel (transposed to (k..., c_in, c_out)), plus 1 for the bias;
  G is over c_out; T is the number of output positions.

A stride-1, ungrouped Conv1D/2D/3D with more than one tap and 8 input channels or more,
under the "expand" rule, gets A from correlations of its input (`conv_correlation`: the same sum, about 3x fewer
multiply-adds than the im2col Gram for 3x3), when its spatial sizes are static.
"""

import dataclasses
import itertools
import math
import types

import keras
import tensorflow as tf

from tfkfac import costs
from tfkfac.blocks import conv_correlation
from tfkfac.blocks.base import Block, Unsupported, as_float, layer_input, per_row
from tfkfac.blocks.kronecker import KroneckerBlock

class ConvBlock(KroneckerBlock):
    """Conv1D/2D/3D, grouped or not; `depthwise` for DepthwiseConv1D/2D."""

    def __init__(self, layer, weight_sharing="expand", depthwise=False):
        _require_supported(layer)
        super().__init__(layer, weight_sharing)
        self.depthwise = depthwise
        self.spatial = len(layer.kernel_size)
        self.positions = math.prod(layer.kernel_size)
        self.groups, self.group_in, self.out_dim = self._channels()
        self.channels_in = self.groups * self.group_in
        self.in_dim = self.positions * self.group_in
        self.a_dim = self.in_dim + int(self.has_bias)
        self.kind = "depthwise_conv" if depthwise else f"conv{self.spatial}d"
        # A from input correlations (module docstring) where that is the same sum and,
        # with 8 input channels or more, faster (bench/conv_statistics.py: 1-4 channels
        # measured slower, 8 and more faster, on 28x28 and 14x14 inputs).
        self.correlation_statistics = (
            weight_sharing == "expand" and not depthwise and self.groups == 1
            and self.positions > 1 and all(s == 1 for s in layer.strides)
            and self.channels_in >= 8)

    def _channels(self):
        """(groups, input channels per group, output channels per group)."""
        kernel_in, kernel_out = self.kernel_shape[-2:]
        if self.depthwise:  # kernel (k..., c_in, m): one group per input channel
            return kernel_in, 1, kernel_out
        return self.layer.groups, kernel_in, kernel_out // self.layer.groups

    def _padded(self, inputs):
        """(padded input, output extents, window strides, window starts per axis)."""
        layer, extents, pads = self.layer, [], []
        for axis in range(self.spatial):
            out, before, after = _window_extents(
                _size(inputs, axis + 1), layer.kernel_size[axis], layer.strides[axis],
                layer.dilation_rate[axis], layer.padding)
            extents.append(out)
            pads.append([before, after])
        starts = [[k * d for k in range(taps)]
                  for taps, d in zip(layer.kernel_size, layer.dilation_rate)]
        return _pad_spatial(inputs, pads), extents, layer.strides, starts

    def patches(self, inputs):
        """(rows, kernel positions, c_in): every output position's input window."""
        padded, extents, strides, starts = self._padded(inputs)
        columns = []
        for offset in itertools.product(*starts):
            index = [slice(None)]
            for start, extent, stride in zip(offset, extents, strides):
                index.append(slice(start, start + (extent - 1) * stride + 1, stride))
            columns.append(padded[tuple(index)])
        return tf.reshape(tf.stack(columns, axis=-2), (-1, self.positions, self.channels_in))

    def batch_statistics(self, calls, batch_size, weights=None):
        if not (self.correlation_statistics
                and all(None not in inputs.shape[1:-1] for inputs, _ in calls)):
            return super().batch_statistics(calls, batch_size, weights)
        grams, g_rows, row_weights = [], [], []
        for inputs, out_grads in calls:
            grams.append(self._patch_gram(as_float(inputs), weights))
            g_rows.append(self.output_rows(as_float(out_grads)))
            if weights is not None:
                row_weights.append(per_row(weights, g_rows[-1]))
        a = tf.add_n(grams) / tf.cast(batch_size, grams[0].dtype)
        g = self.output_factor(tf.concat(g_rows, axis=0), batch_size,
                               tf.concat(row_weights, axis=0) if weights is not None else None)
        return [a, g]

    def _stride_1_geometry(self, input_shape):
        """(spatial sizes, kernel taps, dilation, padding before, output positions) of a
        call on `input_shape` (N, S..., C), static, for `conv_correlation`."""
        layer, sizes = self.layer, [int(s) for s in input_shape[1:-1]]
        windows = [_window_extents(size, taps, 1, dilation, layer.padding)
                   for size, taps, dilation in zip(sizes, layer.kernel_size,
                                                   layer.dilation_rate)]
        return (sizes, layer.kernel_size, layer.dilation_rate, [w[1] for w in windows],
                [w[0] for w in windows])

    def _patch_gram(self, inputs, weights):
        """Σ over one call's im2col rows of ā āᵀ, from input correlations."""
        _, taps, dilation, before, extents = self._stride_1_geometry(inputs.shape)
        return conv_correlation.patch_gram(inputs, taps, dilation, before, extents,
                                           self.has_bias, weights, self.product_dtype)

    def correlation_multiply_adds(self, input_shape):
        """Multiply-adds of A's correlation products for a call on `input_shape`
        (static), or None where A is the im2col Gram (for the floor model)."""
        if not self.correlation_statistics or None in tuple(input_shape[1:-1]):
            return None
        return int(input_shape[0]) * conv_correlation.multiply_adds(
            *self._stride_1_geometry(input_shape), self.channels_in)

    def cost(self, calls, batch_size):
        """The Kronecker rule's, and im2col's reads of the inputs, or A's correlation
        products where every call gets A from them."""
        correlation = [self.correlation_multiply_adds(inputs.shape) for inputs, _ in calls]
        return dataclasses.replace(
            super().cost(calls, batch_size),
            patch_input=sum(math.prod(inputs.shape) for inputs, _ in calls),
            correlation_multiply_adds=sum(correlation) if None not in correlation else 0)

    def input_rows(self, inputs):
        patches = self.patches(inputs)
        if self.groups == 1:
            return tf.reshape(patches, (-1, self.in_dim))
        grouped = tf.reshape(patches, (-1, self.positions, self.groups, self.group_in))
        return tf.reshape(tf.transpose(grouped, (2, 0, 1, 3)), (self.groups, -1, self.in_dim))

    def output_rows(self, out_grads):
        if self.groups == 1:
            return tf.reshape(out_grads, (-1, self.out_dim))
        grouped = tf.reshape(out_grads, (-1, self.groups, self.out_dim))
        return tf.transpose(grouped, (1, 0, 2))

    def grad_matrix(self, grads):
        if self.groups == 1:
            return super().grad_matrix(grads)
        if self.depthwise:  # (P, c_in, m) -> (c_in, P, m)
            kernel = tf.reshape(grads[0], (self.positions, self.groups, self.out_dim))
            kernel = tf.transpose(kernel, (1, 0, 2))
        else:  # (P, c_in/q, q·o) -> (q, P·c_in/q, o)
            kernel = tf.reshape(grads[0], (self.positions, self.group_in, self.groups,
                                           self.out_dim))
            kernel = tf.transpose(kernel, (2, 0, 1, 3))
        matrix = tf.reshape(kernel, (self.groups, self.in_dim, self.out_dim))
        if self.has_bias:
            bias = tf.reshape(grads[1], (self.groups, 1, self.out_dim))
            matrix = tf.concat([matrix, bias], axis=1)
        return matrix

    def split_matrix(self, matrix):
        if self.groups == 1:
            return super().split_matrix(matrix)
        kernel = tf.reshape(matrix[:, : self.in_dim],
                            (self.groups, self.positions, self.group_in, self.out_dim))
        if self.depthwise:  # (c_in, P, 1, m) -> (P, c_in, m)
            kernel = tf.transpose(kernel[:, :, 0], (1, 0, 2))
        else:  # (q, P, c_in/q, o) -> (P, c_in/q, q, o)
            kernel = tf.transpose(kernel, (1, 2, 0, 3))
        kernel = tf.reshape(kernel, self.kernel_shape)
        if self.has_bias:
            return [kernel, tf.reshape(matrix[:, self.in_dim], (-1,))]
        return [kernel]


class ConvTransposeBlock(ConvBlock):
    """Conv1D/2D/3DTranspose: the convolution rule of the module docstring."""

    def __init__(self, layer, weight_sharing="expand"):
        super().__init__(layer, weight_sharing)
        # The kernel as the convolution it is on the stride-dilated input: (k..., c_in, c_out).
        self.kernel_shape = tuple(layer.kernel_size) + (self.group_in, self.out_dim)
        self.kind = "conv_transpose"
        self.correlation_statistics = False  # its input is stride-dilated: the im2col rule

    def _channels(self):
        c_out, c_in = self.kernel_shape[-2:]  # the layer's kernel (k..., c_out, c_in)
        return 1, c_in, c_out

    def _padded(self, inputs):
        layer, sizes, extents, pads = self.layer, [], [], []
        output_padding = layer.output_padding or (None,) * self.spatial
        for axis in range(self.spatial):
            size = _size(inputs, axis + 1)
            out, before, after = _transpose_extents(
                size, layer.kernel_size[axis], layer.strides[axis],
                layer.dilation_rate[axis], layer.padding, output_padding[axis])
            sizes.append(size)
            extents.append(out)
            pads.append([before, after])
        starts = [[(taps - 1 - k) * d for k in range(taps)]
                  for taps, d in zip(layer.kernel_size, layer.dilation_rate)]
        dilated = _insert_zeros(inputs, sizes, layer.strides)
        return _pad_spatial(dilated, pads), extents, (1,) * self.spatial, starts

    def grad_matrix(self, grads):
        return super().grad_matrix([_swap_channels(grads[0])] + list(grads[1:]))

    def split_matrix(self, matrix):
        kernel, *bias = super().split_matrix(matrix)
        return [_swap_channels(kernel)] + bias


class SeparableConvBlock(Block):
    """SeparableConv1D/2D: a depthwise part and a pointwise (1x1) part, each a pair.

    Factors [A_dw, G_dw, A_pw, G_pw]: two pieces, each part's own pair (the inverse
    method's π pairs each A with its own G).
    """

    kind = "separable_conv"

    def __init__(self, layer, weight_sharing="expand"):
        _require_supported(layer)
        ones = (1,) * len(layer.kernel_size)
        depthwise = types.SimpleNamespace(
            name=layer.name, kernel=layer.depthwise_kernel, bias=None,
            kernel_size=layer.kernel_size, strides=layer.strides, padding=layer.padding,
            dilation_rate=layer.dilation_rate, data_format=layer.data_format)
        pointwise = types.SimpleNamespace(
            name=layer.name, kernel=layer.pointwise_kernel, bias=layer.bias, groups=1,
            kernel_size=ones, strides=ones, padding="valid", dilation_rate=ones,
            data_format=layer.data_format)
        self.parts = [ConvBlock(depthwise, weight_sharing, depthwise=True),
                      ConvBlock(pointwise, weight_sharing)]
        super().__init__(layer, [v for part in self.parts for v in part.variables])

    def use_product_dtype(self, product_dtype):
        super().use_product_dtype(product_dtype)
        for part in self.parts:
            part.use_product_dtype(product_dtype)

    def factor_shapes(self):
        return [shape for part in self.parts for shape in part.factor_shapes()]

    def factor_names(self):
        return ("A_depthwise", "G_depthwise", "A_pointwise", "G_pointwise")

    def pre_activation_call(self, call, args, kwargs):
        """The layer's own math in its two products; records ((x, d), (d, s))."""
        layer, x = self.layer, layer_input(args, kwargs)
        d = keras.ops.depthwise_conv(x, layer.depthwise_kernel, strides=layer.strides,
                                     padding=layer.padding, data_format=layer.data_format,
                                     dilation_rate=layer.dilation_rate)
        s = keras.ops.conv(d, layer.pointwise_kernel, data_format=layer.data_format)
        if layer.bias is not None:
            s = keras.ops.add(s, layer.bias)
        output = layer.activation(s) if layer.activation is not None else s
        return ((x, d), (d, s)), output

    def batch_statistics(self, calls, batch_size, weights=None):
        return [statistic for i, part in enumerate(self.parts)
                for statistic in part.batch_statistics(
                    [(inputs[i], out_grads[i]) for inputs, out_grads in calls], batch_size,
                    weights)]

    def cost(self, calls, batch_size):
        """Each part's, on its own (input, pre-activation) of every call."""
        return costs.PartsCost(**self.cost_layout(), parts=tuple(
            part.cost([(inputs[i], outputs[i]) for inputs, outputs in calls], batch_size)
            for i, part in enumerate(self.parts)))

    def pieces(self):
        """The two parts' pairs, each part's factor indices shifted past the earlier's."""
        return [dataclasses.replace(piece, factors=tuple(2 * p + i for i in piece.factors))
                for p, part in enumerate(self.parts) for piece in part.pieces()]

    def gradient_matrices(self, grads):
        split = len(self.parts[0].variables)
        return (self.parts[0].gradient_matrices(grads[:split])
                + self.parts[1].gradient_matrices(grads[split:]))

    def split_matrices(self, matrices):
        return [g for part, matrix in zip(self.parts, matrices)
                for g in part.split_matrices([matrix])]


def _require_supported(layer):
    """The blocks read inputs and output gradients channels last."""
    if layer.data_format != "channels_last":
        raise Unsupported(f"{type(layer).__name__} with data_format='channels_first' is "
                          "not supported")


def _size(inputs, axis):
    """Static size of `axis` when known, else the dynamic one."""
    size = inputs.shape[axis]
    return size if size is not None else tf.shape(inputs)[axis]


def _nonnegative(value):
    return max(value, 0) if isinstance(value, int) else tf.maximum(value, 0)


def _pad_spatial(inputs, pads):
    return tf.pad(inputs, [[0, 0]] + pads + [[0, 0]])


def _window_extents(size, kernel, stride, dilation, padding):
    """(output size, padding before, padding after) as Keras/TensorFlow compute them."""
    span = (kernel - 1) * dilation + 1
    if padding == "valid":
        return (size - span) // stride + 1, 0, 0
    if padding == "causal":
        return (size - 1) // stride + 1, span - 1, 0
    out = (size + stride - 1) // stride
    total = _nonnegative((out - 1) * stride + span - size)
    return out, total // 2, total - total // 2


def _transpose_extents(size, kernel, stride, dilation, padding, output_padding):
    """(output size, zeros before, zeros after) around the stride-dilated input.

    The output size is Keras's (`compute_conv_transpose_output_shape`); the padding p of
    the convolution it transposes is TensorFlow's for that convolution from the output
    size back to `size`. The zeros after may exceed what the windows read.
    """
    span = (kernel - 1) * dilation + 1
    if padding == "valid":
        extra = max(span, stride) - span if output_padding is None else output_padding
        out, before = (size - 1) * stride + span + extra, 0
    else:
        out = (size * stride if output_padding is None
               else (size - 1) * stride + span % 2 + output_padding)
        before = _nonnegative((size - 1) * stride + span - out) // 2
    zeros_before = span - 1 - before
    return out, zeros_before, out + span - 1 - zeros_before - (size - 1) * stride - 1


def _insert_zeros(inputs, sizes, strides):
    """`stride - 1` zeros after every input position, one spatial axis at a time.

    (All axes at once would need a rank-8 pad for 3-D; TensorFlow pads up to rank 6.)
    """
    dims = list(sizes)
    for axis, stride in enumerate(strides):
        if stride == 1:
            continue
        spread = tf.expand_dims(inputs, axis + 2)
        zeros = [[0, 0]] * len(spread.shape)
        zeros[axis + 2] = [0, stride - 1]
        dims[axis] = dims[axis] * stride
        inputs = tf.reshape(tf.pad(spread, zeros), [-1] + dims + [inputs.shape[-1]])
    return inputs


def _swap_channels(kernel):
    """(k..., a, b) -> (k..., b, a)."""
    rank = len(kernel.shape)
    return tf.transpose(kernel, list(range(rank - 2)) + [rank - 1, rank - 2])
