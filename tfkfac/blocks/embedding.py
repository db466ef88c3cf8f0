"""Embedding: a bias-free Dense layer on one-hot inputs, with a diagonal A.

With c_v the count of token v among the batch's N·T positions, A = diag(c_v / N), kept
as a length-V vector (never V x V), and G is the Dense G over T positions (always the
expand rule: reduce would make A dense). Its one piece is the pair (diag(a), G), whose
gradient matrix is the embeddings' gradient (docs/design.md §2 gives what the methods
make of a diagonal A).
"""

import math

import tensorflow as tf

from tfkfac import costs, linalg
from tfkfac.blocks.base import Block, as_float, per_row


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

    def cost(self, calls, batch_size):
        """One row of G's Gram per token of every call."""
        return costs.EmbeddingCost(**self.cost_layout(), vocabulary=self.vocabulary,
                                   width=self.width,
                                   rows=sum(math.prod(tokens.shape) for tokens, _ in calls))

    def gradient_matrices(self, grads):
        return [as_float(grads[0])]

    def split_matrices(self, matrices):
        return list(matrices)
