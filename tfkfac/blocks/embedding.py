"""Embedding: a bias-free Dense layer on one-hot inputs, with a diagonal A.

With c_v the count of token v among the batch's N·T positions, A = diag(c_v / N), kept
as a length-V vector (never V x V), and G is the Dense G over T positions (always the
expand rule: reduce would make A dense). Eigen method:
P[v, :] = ((∇[v, :] Q_G) / (a_v v_G + λ)) Q_Gᵀ, exactly (A ⊗ G + λI)⁻¹ vec(∇); inverse
method: (A + π√λ)⁻¹ ∇ (G + (√λ/π) I)⁻¹ with tr(A)/dim A = Σ_v a_v / V (docs/design.md).
"""

import tensorflow as tf

from tfkfac import linalg
from tfkfac.blocks.base import Block, as_float, eigenbasis, per_row


class EmbeddingBlock(Block):
    kind = "embedding"

    def __init__(self, layer):
        super().__init__(layer, [layer.embeddings])
        self.vocabulary, self.width = (int(d) for d in layer.embeddings.shape)

    def factor_shapes(self):
        return [(self.vocabulary,), (self.width, self.width)]

    def batch_statistics(self, calls, batch_size, weights=None):
        tokens = tf.concat([tf.reshape(tf.cast(x, tf.int32), (-1,)) for x, _ in calls], 0)
        g_rows = tf.concat([tf.reshape(as_float(g), (-1, self.width)) for _, g in calls], 0)
        n = tf.cast(batch_size, g_rows.dtype)
        if weights is None:
            token_weights, weighted_rows = tf.ones_like(tokens, g_rows.dtype), g_rows
        else:  # each call's tokens and rows are example-major
            token_weights = tf.concat([per_row(weights, tf.reshape(g, (-1, self.width)))
                                       for _, g in calls], 0)
            weighted_rows = g_rows * token_weights[:, None]
        counts = tf.math.unsorted_segment_sum(token_weights, tokens, self.vocabulary)
        positions = tf.cast(tf.shape(g_rows)[0], g_rows.dtype) / n
        # G = (1/(N T)) Σ (N dL/ds)(N dL/ds)ᵀ
        g = linalg.matmul(weighted_rows, g_rows, self.product_dtype,
                          transpose_a=True) * (n / positions)
        return [counts / n, g]

    def decomposition_shapes(self, method):
        if eigenbasis(method):
            return [[(self.width, self.width), (self.width,)]]
        return [[(self.width, self.width)]]

    def moment_shapes(self):
        return [(self.vocabulary, self.width)]

    def _pi(self, factors):
        a, g = factors
        return linalg.pi_from_mean_traces(tf.reduce_mean(a), linalg.mean_trace(g))

    def decompose(self, index, factors, method, damping):
        if eigenbasis(method):
            values, vectors = linalg.symmetric_eigh(factors[index])
            return [vectors, values]
        return [linalg.damped_inverse(factors[index], tf.sqrt(damping) / self._pi(factors))]

    def precondition(self, grads, factors, decomposition, method, damping, adam=None):
        grad, a = as_float(grads[0]), factors[0]
        if method == "eigen_adam":  # A is diagonal: its eigenbasis is the identity
            ((q_g, _),) = decomposition
            rotated = linalg.matmul(grad, q_g, self.product_dtype)
            return [linalg.matmul(adam.scale(rotated), q_g, self.product_dtype,
                                  transpose_b=True)]
        if method == "eigen":
            ((q_g, v_g),) = decomposition
            rotated = linalg.matmul(grad, q_g, self.product_dtype)
            scaled = rotated / (a[:, None] * v_g[None, :] + damping)
            return [linalg.matmul(scaled, q_g, self.product_dtype, transpose_b=True)]
        ((g_inv,),) = decomposition
        a_shift = self._pi(factors) * tf.sqrt(damping)
        return [linalg.matmul(grad / (a[:, None] + a_shift), g_inv, self.product_dtype)]
