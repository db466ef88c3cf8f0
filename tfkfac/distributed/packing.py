"""Symmetric packing: the upper triangles of many symmetric matrices in one flat buffer.

Kronecker factors are symmetric, so only n(n+1)/2 of their n^2 entries need to cross the
wire (Osawa et al. 2019, Ueno et al. 2020). Packing every factor into one buffer also lets
one collective carry them all. The buffer may be cast to a narrower wire dtype; unpacking
returns float32 (float64 from a float64 buffer). Index maps are built in numpy at trace time, so the ops are
plain gathers: usable inside `tf.function`, XLA-compilable, and with static shapes.
float16 keeps 11 significant bits but overflows above 65504; bfloat16 keeps the float32
range with 8 significant bits. Each entry is rounded once, to within 2^-11 (float16) or
2^-8 (bfloat16) of its value. A float21 wire (float21.py: 13 significant bits, float32's
range) is packed in float32, and the communicator encodes it, three values per 64-bit word.
"""

import numpy as np
import tensorflow as tf

from tfkfac.distributed import float21

WIRE_DTYPES = {
    "float64": tf.float64,
    "float32": tf.float32,
    "float16": tf.float16,
    "bfloat16": tf.bfloat16,
    "float21": tf.float32,  # packed in float32; the communicator encodes it (float21.py)
}
FLOAT21 = "float21"


def wire_dtype(name):
    """The `tf.DType` a buffer for the wire `name` (a key of `WIRE_DTYPES`) is packed in:
    the wire's own, float32 for float21."""
    if isinstance(name, tf.dtypes.DType):
        name = name.name
    if name not in WIRE_DTYPES:
        raise ValueError(
            f"wire_dtype must be one of {sorted(WIRE_DTYPES)}, got {name!r}")
    return WIRE_DTYPES[name]


def wire_bytes(name, count):
    """Bytes that `count` values take on the wire `name`: float21 three to a 64-bit word,
    the others their dtype's size each."""
    if name == FLOAT21:
        return float21.WORD_BYTES * float21.words(count)
    return wire_dtype(name).size * count


def packed_size(dims):
    """Number of buffer elements for symmetric matrices of sizes `dims`: sum n(n+1)/2.

    An entry of `dims` is a size n, or the shape (..., n, n) of a batch of matrices.
    """
    return sum(_count(shape) * _triangle_size(shape[-1]) for shape in _check_dims(dims))


def pack_upper_triangles(matrices, dtype="float32"):
    """Concatenate the row-major upper triangles of square `matrices` into one 1-D tensor.

    A matrix may be a batch (..., n, n): each of its matrices is packed in turn. The
    result has `packed_size(shapes)` elements of wire dtype `dtype`. Only the upper
    triangle is read; the caller guarantees symmetry.
    """
    target = wire_dtype(dtype)
    pieces = []
    for matrix in matrices:
        matrix = tf.convert_to_tensor(matrix)
        n = _square_dim(matrix)
        rows, cols = np.triu_indices(n)
        flat_index = tf.constant(rows * n + cols, dtype=tf.int32)
        pieces.append(tf.reshape(
            tf.gather(tf.reshape(matrix, [-1, n * n]), flat_index, axis=1), [-1]))
    if not pieces:
        return tf.zeros([0], dtype=target)
    return tf.cast(tf.concat(pieces, axis=0), target)


def unpack_upper_triangles(buffer, dims):
    """Inverse of `pack_upper_triangles`: full symmetric matrices of `dims`, float32
    (float64 from a float64 buffer).

    An entry of `dims` is a size n (an (n, n) matrix) or a batch shape (..., n, n).
    """
    shapes = _check_dims(dims)
    buffer = tf.convert_to_tensor(buffer)
    buffer = tf.cast(buffer, tf.float64 if buffer.dtype == tf.float64 else tf.float32)
    expected = packed_size(dims)
    if buffer.shape.rank != 1 or (buffer.shape[0] is not None and buffer.shape[0] != expected):
        raise ValueError(
            f"buffer must be 1-D with packed_size(dims)={expected} elements, "
            f"got shape {buffer.shape}")
    sizes = [_count(shape) * _triangle_size(shape[-1]) for shape in shapes]
    segments = tf.split(buffer, sizes) if shapes else []
    return [tf.reshape(tf.gather(tf.reshape(segment, [-1, _triangle_size(shape[-1])]),
                                 _symmetric_index_map(shape[-1]), axis=1), shape)
            for segment, shape in zip(segments, shapes)]


def _symmetric_index_map(n):
    """(n, n) constant: entry (i, j) is the position of (min(i,j), max(i,j)) in the triangle."""
    position = np.zeros((n, n), dtype=np.int32)
    position[np.triu_indices(n)] = np.arange(_triangle_size(n), dtype=np.int32)
    return tf.constant(np.where(np.triu(np.ones((n, n), dtype=bool)), position, position.T))


def _triangle_size(n):
    return n * (n + 1) // 2


def _square_dim(matrix):
    shape = matrix.shape
    if (shape.rank is None or shape.rank < 2 or not shape.is_fully_defined()
            or shape[-1] != shape[-2]):
        raise ValueError(f"matrices must be square with static shape, got shape {shape}")
    return int(shape[-1])


def _count(shape):
    """How many matrices a shape (..., n, n) holds."""
    return int(np.prod(shape[:-2], dtype=np.int64))


def _check_dims(dims):
    """Each entry as a full shape (..., n, n) of positive sizes."""
    shapes = [(int(d), int(d)) if np.ndim(d) == 0 else tuple(int(n) for n in d) for d in dims]
    if any(len(s) < 2 or s[-1] != s[-2] or min(s) < 1 for s in shapes):
        raise ValueError(f"dims must be positive sizes or shapes (..., n, n), got {list(dims)}")
    return shapes
