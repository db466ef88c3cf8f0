"""BatchNormalization with the diagonal Fisher of Osawa et al. (2019).

Per-example gradients of γ and β come from the normalized input x̂ and the output
gradient: dl_i/dγ = Σ_pos (N dL/dy_i) x̂_i, dl_i/dβ = Σ_pos N dL/dy_i; then
F = (1/N) Σ_i (dl_i/dθ)², and the gradient is preconditioned as ∇ / (F + ρ_BN λ).
As for g_i = N dL/ds_i in the Kronecker blocks, N dL/dy_i holds the batch statistics of
later BatchNorm layers fixed: the exact per-example gradient would need N backward passes.
"""

import tensorflow as tf

from tfkfac.blocks.base import Block, as_float32


class BatchNormBlock(Block):
    kind = "batchnorm"

    def __init__(self, layer, damping_multiplier):
        variables = [v for v in (layer.gamma, layer.beta) if v is not None]
        super().__init__(layer, variables)
        self.channels = int(variables[0].shape[0])
        self.damping_multiplier = damping_multiplier

    def factor_shapes(self):
        return [(self.channels * len(self.variables),)]

    def _normalized(self, inputs):
        axes = [i for i in range(len(inputs.shape)) if i != self.layer.axis % len(inputs.shape)]
        mean, variance = tf.nn.moments(inputs, axes=axes, keepdims=True)
        return (inputs - mean) * tf.math.rsqrt(variance + self.layer.epsilon)

    def _per_example_grads(self, x, out_grad, batch_size):
        x = as_float32(x)
        scaled = as_float32(out_grad) * tf.cast(batch_size, tf.float32)
        rank = len(x.shape)
        channel_axis = self.layer.axis % rank
        perm = [0] + [i for i in range(1, rank) if i != channel_axis] + [channel_axis]
        to_rows = lambda t: tf.reshape(tf.transpose(t, perm), (tf.shape(t)[0], -1, self.channels))
        grads = []
        if self.layer.gamma is not None:
            grads.append(tf.reduce_sum(to_rows(scaled * self._normalized(x)), axis=1))
        if self.layer.beta is not None:
            grads.append(tf.reduce_sum(to_rows(scaled), axis=1))
        return tf.concat(grads, axis=1)

    def batch_statistics(self, calls, batch_size):
        # The per-example gradient of a layer used several times sums over its uses.
        per_example = tf.add_n([self._per_example_grads(x, g, batch_size) for x, g in calls])
        return [tf.reduce_mean(tf.square(per_example), axis=0)]

    def decomposition_shapes(self, method):
        return []

    def precondition(self, grads, factors, decomposition, method, damping):
        (fisher,) = factors
        flat = tf.concat([tf.reshape(as_float32(g), (-1,)) for g in grads], axis=0)
        scaled = flat / (fisher + self.damping_multiplier * damping)
        return tf.split(scaled, len(grads))
