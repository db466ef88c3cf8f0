"""EinsumDense by the letters of its equation `input,kernel->output` (docs/design.md §2).

The first input letter is the batch. Kernel letters also in the input but not in the
output are *contracted* (the A side), kernel letters in the output but not in the input
are the *outputs* (the G side), input letters in the output but not in the kernel are
*positions*, and a letter in all three is *shared*: the kernel is then block-diagonal,
one Kronecker pair per index of the shared letters, kept as a batch (q, n, n).

So the layer is a Dense product at every position: transposing the input to
(shared..., batch, positions..., contracted...) and the output gradient to
(shared..., batch, positions..., outputs...) gives the rows of the Kronecker rule, and
the kernel transposed to (shared..., contracted..., outputs...) is the (q, a, o) weight
matrix. Contracted, outputs and shared letters are flattened in kernel order. A bias
over exactly the kernel's letters in the output (outputs and shared) is the ones-row of
A. `EinsumDense("abc,cde->abde")` is then `Dense(d·e)` on (N, T, c), and
MultiHeadAttention's projections (inputs of any rank) all have this form.
"""

import math
import re

import tensorflow as tf

from tfkfac.blocks.base import Unsupported
from tfkfac.blocks.kronecker import KroneckerBlock

_EQUATION = re.compile(r"([a-zA-Z]+),([a-zA-Z]+)->([a-zA-Z]+)")


class EinsumDenseBlock(KroneckerBlock):
    kind = "einsum_dense"

    def __init__(self, layer, weight_sharing="expand"):
        super().__init__(layer, weight_sharing)
        letters = _letter_classes(layer.equation, layer.bias_axes)
        self.input_spec, self.kernel_spec, self.output_spec = letters["specs"]
        self.shared, self.positions = letters["shared"], letters["positions"]
        self.contracted, self.outputs = letters["contracted"], letters["outputs"]
        self.batch = self.input_spec[0]
        self.output_batch_axis = self.output_spec.index(self.batch)
        self.bias_spec = [c for c in self.output_spec if c in (layer.bias_axes or "")]
        self.sizes = dict(zip(self.kernel_spec, self.kernel_shape))
        self.groups = self._size(self.shared)
        self.in_dim = self._size(self.contracted)
        self.out_dim = self._size(self.outputs)
        self.a_dim = self.in_dim + int(self.has_bias)
        self.bias_shape = tuple(layer.bias.shape) if self.has_bias else None

    def _size(self, letters):
        return math.prod(self.sizes[c] for c in letters)

    def _rows(self, tensor, spec, side, width):
        """`tensor` (letters `spec`) as (q, rows, width) rows, example-major."""
        order = self.shared + [self.batch] + self.positions + side
        rows = tf.transpose(tensor, [spec.index(c) for c in order])
        return tf.reshape(rows, self._batched((-1, width)))

    def input_rows(self, inputs):
        return self._rows(inputs, self.input_spec, self.contracted, self.in_dim)

    def output_rows(self, out_grads):
        return self._rows(out_grads, self.output_spec, self.outputs, self.out_dim)

    def grad_matrix(self, grads):
        matrix = _to_matrix(grads[0], self.kernel_spec, self.shared + self.contracted,
                            self.outputs, self._batched((self.in_dim, self.out_dim)))
        if not self.has_bias:
            return matrix
        bias = tf.reshape(grads[1], [self.sizes[c] for c in self.bias_spec])
        bias = _to_matrix(bias, self.bias_spec, self.shared, self.outputs,
                          self._batched((1, self.out_dim)))
        return tf.concat([matrix, bias], axis=-2)

    def split_matrix(self, matrix):
        kernel = _from_matrix(matrix[..., : self.in_dim, :], self.kernel_spec,
                              self.shared + self.contracted + self.outputs, self.sizes)
        if not self.has_bias:
            return [kernel]
        bias = _from_matrix(matrix[..., self.in_dim:, :], self.bias_spec,
                            self.shared + self.outputs, self.sizes)
        return [kernel, tf.reshape(bias, self.bias_shape)]


def _letter_classes(equation, bias_axes):
    """The letter classes of an EinsumDense equation; `Unsupported` for other layouts."""
    def unsupported(reason):
        return Unsupported(f"EinsumDense equation {equation!r}: {reason}")

    if "..." in equation:
        raise unsupported("ellipsis equations are not supported")
    match = _EQUATION.fullmatch(equation)
    if match is None:
        raise unsupported("not of the form input,kernel->output")
    specs = match.groups()
    if any(len(set(spec)) != len(spec) for spec in specs):
        raise unsupported("a letter repeats within one operand")
    inputs, kernel, output = specs
    batch = inputs[0]
    if batch in kernel or batch not in output:
        raise unsupported(f"the batch letter {batch!r} must be in the output only")
    summed = [c for c in inputs if c not in kernel and c not in output]
    if summed:
        raise unsupported(f"input letters {''.join(summed)!r} are summed outside the kernel")
    letters = {
        "specs": specs,
        "shared": [c for c in kernel if c in inputs and c in output],
        "contracted": [c for c in kernel if c in inputs and c not in output],
        "outputs": [c for c in kernel if c in output and c not in inputs],
        "positions": [c for c in inputs[1:] if c in output and c not in kernel],
    }
    bias_letters = letters["shared"] + letters["outputs"]
    if bias_axes is not None and sorted(bias_axes) != sorted(bias_letters):
        raise unsupported(f"bias over {bias_axes!r}, not over the kernel's output letters "
                          f"{''.join(bias_letters)!r}")
    return letters


def _to_matrix(tensor, spec, rows, columns, shape):
    """`tensor` (letters `spec`) transposed to (rows..., columns...) and reshaped."""
    return tf.reshape(tf.transpose(tensor, [spec.index(c) for c in rows + columns]), shape)


def _from_matrix(matrix, spec, order, sizes):
    """The inverse of `_to_matrix`: `matrix` unflattened to `order`, transposed to `spec`."""
    tensor = tf.reshape(matrix, [sizes[c] for c in order])
    return tf.transpose(tensor, [order.index(c) for c in spec])
