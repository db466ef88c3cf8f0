"""Normalization layers with the diagonal Fisher (docs/design.md §3).

BatchNormalization (Osawa et al. 2019), LayerNormalization, GroupNormalization and
RMSNormalization all compute y = γ ⊙ x̂ + β, with γ and β laid along some axes of the
input. The per-example gradients follow from x̂ and the output gradient, summed over the
other non-batch axes: dl_i/dγ = Σ_pos (N dL/dy_i) ⊙ x̂_i, dl_i/dβ = Σ_pos N dL/dy_i;
then F = (1/N) Σ_i (dl_i/dθ)², one diagonal piece damped with ρλ.

These are the exact per-example gradients for LayerNorm, GroupNorm and RMSNorm, which
normalize each example on its own. A BatchNorm couples the examples: as for
g_i = N dL/ds_i in the Kronecker blocks, N dL/dy_i holds its batch statistics (and those
of later BatchNorm layers) fixed; the exact gradients would need N backward passes.

The forward pass records only the layer input; x̂ is recomputed with Keras's own
normalization ops (in float32, or float64 with state_dtype="float64") when factors are
updated, so steps without a factor update pay nothing for it.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tfkfac import costs
from tfkfac.blocks.base import Block, Unsupported, as_float
from tfkfac.methods import Piece


def _input_axes(layer, axes):
    """`axes` of the layer's input as sorted non-negative indices, none the batch axis."""
    shape = (layer.get_build_config() or {}).get("input_shape")
    if shape is None:
        raise Unsupported(f"{type(layer).__name__} built without a known input shape")
    axes = sorted({a % len(shape) for a in axes})
    if 0 in axes:
        raise Unsupported(f"{type(layer).__name__} with weights along the batch axis "
                          "is not supported")
    return axes


def _standardized(x, axes, epsilon):
    """(x - mean) / sqrt(variance + ε) over `axes`, by Keras's op (no γ, no β)."""
    return keras.ops.layer_normalization(x, axis=axes, epsilon=epsilon)


class NormalizationBlock(Block):
    """y = γ ⊙ x̂ + β; a subclass names γ, β, their input axes, and computes x̂."""

    def __init__(self, layer, damping_multiplier):
        scale, offset, axes = self.parameters(layer)
        super().__init__(layer, [v for v in (scale, offset) if v is not None])
        self.has_scale, self.has_offset = scale is not None, offset is not None
        self.parameter_axes = _input_axes(layer, axes)
        self.size = int(np.prod(self.variables[0].shape))
        self.damping_multiplier = damping_multiplier

    @staticmethod
    def parameters(layer):
        """(γ or None, β or None, the input axes both lie along)."""
        raise NotImplementedError

    def normalized(self, x):
        """x̂ of the layer input `x` (float32 or float64)."""
        raise NotImplementedError

    def factor_shapes(self):
        return [(self.size * len(self.variables),)]

    def _per_example_grads(self, x, out_grad, batch_size):
        """(N, |θ|): row i is dl_i/dθ, γ then β, each flattened in its variable's order.

        Keras lays γ and β over the input in the order of their axes, so summing the
        other axes and flattening gives the variable's own flat order.
        """
        x = as_float(x)
        scaled = as_float(out_grad) * tf.cast(batch_size, x.dtype)
        positions = [a for a in range(1, len(x.shape)) if a not in self.parameter_axes]
        per_example = lambda t: tf.reshape(tf.reduce_sum(t, axis=positions), (-1, self.size))
        grads = []
        if self.has_scale:
            grads.append(per_example(scaled * self.normalized(x)))
        if self.has_offset:
            grads.append(per_example(scaled))
        return tf.concat(grads, axis=1)

    def take_examples(self, calls, weights, keep, batch):
        """The whole batch: the diagonal statistics cost O(N·|θ|) (nothing to save), and
        a BatchNorm's x̂ is computed over the whole batch."""
        return calls, weights

    def batch_statistics(self, calls, batch_size, weights=None):
        # The per-example gradient of a layer used several times sums over its uses.
        per_example = tf.add_n([self._per_example_grads(x, g, batch_size) for x, g in calls])
        squares = tf.square(per_example)
        if weights is not None:
            squares = squares * weights[:, None]
        return [tf.reduce_mean(squares, axis=0)]

    def cost(self, calls, batch_size):
        """x̂ recomputed over every call's input, one per-example gradient per example."""
        (size,) = self.factor_shapes()[0]
        return costs.DiagonalCost(
            **self.cost_layout(), size=size,
            input_elements=sum(math.prod(inputs.shape) for inputs, _ in calls),
            batch_size=batch_size)

    def pieces(self):
        """One diagonal F, damped with ρλ (docs/design.md §3)."""
        return [Piece((0,), (True,), self.damping_multiplier)]

    def gradient_matrices(self, grads):
        return [tf.concat([tf.reshape(as_float(g), (-1,)) for g in grads], axis=0)]

    def split_matrices(self, matrices):
        (flat,) = matrices
        return [tf.reshape(p, v.shape)
                for p, v in zip(tf.split(flat, len(self.variables)), self.variables)]


class BatchNormBlock(NormalizationBlock):
    """x̂ from the batch's moments, as in training mode."""

    kind = "batch_norm"

    @staticmethod
    def parameters(layer):
        if layer.renorm:
            raise Unsupported("BatchNormalization(renorm=True) is not supported")
        return layer.gamma, layer.beta, [layer.axis]

    def normalized(self, x):
        (channels,) = self.parameter_axes
        axes = [a for a in range(len(x.shape)) if a != channels]
        return _standardized(x, axes, self.layer.epsilon)


class LayerNormBlock(NormalizationBlock):
    """x̂ over `axis`, per example; `rms_scaling` divides x by its standard deviation."""

    kind = "layer_norm"

    @staticmethod
    def parameters(layer):
        return layer.gamma, layer.beta, layer.axis

    def normalized(self, x):
        return keras.ops.layer_normalization(x, axis=self.layer.axis,
                                             epsilon=self.layer.epsilon,
                                             rms_scaling=self.layer.rms_scaling)


class GroupNormBlock(NormalizationBlock):
    """x̂ over (positions, channels of the group) per example and group; γ, β per channel."""

    kind = "group_norm"

    @staticmethod
    def parameters(layer):
        return layer.gamma, layer.beta, [layer.axis]

    def normalized(self, x):
        (channels,) = self.parameter_axes
        groups = self.layer.groups
        shape = tf.shape(x)
        # Keras's grouping: the channel axis becomes (group, channel in group).
        grouped = tf.reshape(x, tf.concat(
            [shape[:channels], [groups, x.shape[channels] // groups], shape[channels + 1:]],
            axis=0))
        axes = [a for a in range(1, len(x.shape) + 1) if a != channels]
        return tf.reshape(_standardized(grouped, axes, self.layer.epsilon), shape)


class RMSNormBlock(NormalizationBlock):
    """x̂ = x / sqrt(mean(x²) + ε) over `axis`; only a scale, broadcast on trailing axes."""

    kind = "rms_norm"

    @staticmethod
    def parameters(layer):
        return layer.scale, None, range(-len(layer.scale.shape), 0)

    def normalized(self, x):
        return keras.ops.rms_normalization(x, axis=self.layer.axis, epsilon=self.layer.epsilon)
