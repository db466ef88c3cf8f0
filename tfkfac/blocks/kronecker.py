"""Kronecker-factored blocks: the shared math, and Dense (Martens & Grosse 2015).

Both see a layer as a matrix product applied at T positions per example: a Dense layer
on (N, d_in) input has T = 1 (extra leading axes count as positions), a Conv2D layer has
one position per output pixel, its input rows being the im2col patches. With
`ā` the input row (plus 1 for the bias) and `g = N dL/ds`, the *expand* rule
(docs/design.md) counts every position like an example:

    A = (1/N) Σ_i Σ_t ā_it ā_itᵀ          G = (1/(N T)) Σ_i Σ_t g_it g_itᵀ

and the *reduce* rule (Eschenhagen et al. 2023) first sums over each example's positions,
ā_i = (1/T) Σ_t ā_it, ĝ_i = Σ_t g_it, then A = (1/N) Σ_i ā_i ā_iᵀ, G = (1/N) Σ_i ĝ_i ĝ_iᵀ.

A layer called several times in one forward pass (shared weights) contributes every
call's positions, so T counts positions over all calls; under *reduce* each call is
reduced on its own and then counts as one position.

Rows may carry a leading group axis, (q, rows, d): the block then keeps q Kronecker
pairs (a block-diagonal layer such as a grouped convolution), all computed batched.
"""

import tensorflow as tf

from tfkfac import costs, linalg
from tfkfac.blocks.base import Block, as_float, layer_input, per_row


class KroneckerBlock(Block):
    """Shared math; subclasses say how inputs become rows and kernels become matrices."""

    def __init__(self, layer, weight_sharing="expand"):
        variables = [layer.kernel] + ([layer.bias] if layer.bias is not None else [])
        super().__init__(layer, variables)
        self.weight_sharing = weight_sharing
        self.groups = 1  # block-diagonal layers keep `groups` pairs, batched
        self.has_bias = layer.bias is not None
        kernel_shape = tuple(layer.kernel.shape)
        self.kernel_shape = kernel_shape
        self.out_dim = kernel_shape[-1]
        self.in_dim = 1
        for size in kernel_shape[:-1]:
            self.in_dim *= size
        self.a_dim = self.in_dim + int(self.has_bias)

    def input_rows(self, inputs):
        """(rows, in_dim) matrix of the layer's input, one row per position."""
        raise NotImplementedError

    def _batched(self, shape):
        return shape if self.groups == 1 else (self.groups,) + shape

    def factor_shapes(self):
        return [self._batched((self.a_dim, self.a_dim)),
                self._batched((self.out_dim, self.out_dim))]

    def pre_activation_call(self, call, args, kwargs):
        activation = self.layer.activation
        self.layer.activation = None
        try:
            pre_activation = call(*args, **kwargs)
        finally:
            self.layer.activation = activation
        output = activation(pre_activation) if activation is not None else pre_activation
        return (layer_input(args, kwargs), pre_activation), output

    def output_rows(self, out_grads):
        """(rows, out_dim) matrix of dL/ds, rows aligned with `input_rows`."""
        return tf.reshape(out_grads, (-1, self.out_dim))

    def batch_statistics(self, calls, batch_size, weights=None):
        a_rows, g_rows, row_weights = [], [], []
        for inputs, out_grads in calls:
            a_call = self.input_rows(as_float(inputs))
            g_call = self.output_rows(as_float(out_grads))
            if self.weight_sharing == "reduce":
                a_call = tf.reduce_mean(_per_example(a_call, batch_size), axis=-2)
                g_call = tf.reduce_sum(_per_example(g_call, batch_size), axis=-2)
            a_rows.append(a_call)
            g_rows.append(g_call)
            if weights is not None:  # a call's A and G rows are the same positions
                row_weights.append(per_row(weights, a_call))
        a_rows = tf.concat(a_rows, axis=-2)
        g_rows = tf.concat(g_rows, axis=-2)
        if self.has_bias:
            a_rows = tf.concat([a_rows, tf.ones_like(a_rows[..., :1])], axis=-1)
        row_weights = tf.concat(row_weights, axis=0) if weights is not None else None
        a = _gram(a_rows, row_weights, self.product_dtype) / tf.cast(batch_size, a_rows.dtype)
        return [a, self.output_factor(g_rows, batch_size, row_weights)]

    def output_factor(self, g_rows, batch_size, row_weights=None):
        """G from the (..., N·T, out_dim) rows of dL/ds over all calls."""
        n = tf.cast(batch_size, g_rows.dtype)
        positions = tf.cast(tf.shape(g_rows)[-2], g_rows.dtype) / n
        # G = (1/(N T)) Σ (N dL/ds)(N dL/ds)ᵀ = (N / T) Σ dL/ds dL/dsᵀ
        return _gram(g_rows, row_weights, self.product_dtype) * (n / positions)

    def cost(self, calls, batch_size):
        """The layer's product at its rows over all calls; under "reduce" the Gram
        products have one row per example and call."""
        rows = sum(int(self.output_rows(out).shape[-2]) for _, out in calls)
        return costs.KroneckerCost(
            **self.cost_layout(), groups=self.groups, product_rows=rows,
            statistics_rows=batch_size * len(calls) if self.weight_sharing == "reduce" else rows,
            in_dim=self.in_dim, out_dim=self.out_dim, has_bias=self.has_bias)

    def grad_matrix(self, grads):
        """[dL/dW ; dL/db] as a (a_dim, out_dim) matrix, bias row last."""
        matrix = tf.reshape(grads[0], (self.in_dim, self.out_dim))
        if self.has_bias:
            matrix = tf.concat([matrix, tf.reshape(grads[1], (1, self.out_dim))], axis=0)
        return matrix

    def split_matrix(self, matrix):
        kernel = tf.reshape(matrix[: self.in_dim], self.kernel_shape)
        if self.has_bias:
            return [kernel, matrix[self.in_dim]]
        return [kernel]

    def gradient_matrices(self, grads):
        return [self.grad_matrix([as_float(g) for g in grads])]

    def split_matrices(self, matrices):
        (matrix,) = matrices
        return self.split_matrix(matrix)


class DenseBlock(KroneckerBlock):
    kind = "dense"

    def input_rows(self, inputs):
        return tf.reshape(inputs, (-1, self.in_dim))


def _gram(rows, row_weights, product_dtype):
    """rowsᵀ diag(row_weights) rows (rowsᵀ rows when `row_weights` is None)."""
    weighted = rows if row_weights is None else rows * row_weights[:, None]
    return linalg.matmul(weighted, rows, product_dtype, transpose_a=True)


def _per_example(rows, batch_size):
    """(..., rows, d) as (..., N, positions, d): rows are example-major."""
    shape = tf.shape(rows)
    return tf.reshape(rows, tf.concat([shape[:-2], [batch_size, -1, shape[-1]]], axis=0))
