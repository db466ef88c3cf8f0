"""What every communicator does in front of its transport: one collective per dtype (a
fused call takes one dtype), on the concatenation of that dtype's tensors, and dtypes
the transport refuses sent as dtypes it takes, exactly.
"""

import collections

import tensorflow as tf


def per_dtype(tensors, collective):
    """`collective(group)` once per dtype, `group` being that dtype's tensors in order;
    its results are returned in the order of `tensors`.

    Groups run in the order of their dtype's first tensor, so ranks that pass the same
    dtypes issue the same sequence of collectives.
    """
    positions_by_dtype = collections.defaultdict(list)
    for position, tensor in enumerate(tensors):
        positions_by_dtype[tensor.dtype].append(position)
    results = [None] * len(tensors)
    for positions in positions_by_dtype.values():
        group = [tensors[p] for p in positions]
        for position, result in zip(positions, collective(group)):
            results[position] = result
    return results


def concatenated(group, collective):
    """`collective(flat)` on `group`'s tensors flattened into one 1-D tensor; its result
    is cut back into their shapes."""
    sizes = [tf.size(t) for t in group]
    flat = collective(tf.concat([tf.reshape(t, [-1]) for t in group], axis=0))
    parts = []
    for tensor, part in zip(group, tf.split(flat, sizes)):
        part = tf.reshape(part, tf.shape(tensor))
        part.set_shape(tensor.shape)
        parts.append(part)
    return parts


def to_wire(tensor, taken, bfloat16_bits):
    """`tensor` in one of the dtypes `taken` by the transport: as it is if it can,
    bfloat16 as its bits in the 16-bit dtype `bfloat16_bits` (copied unchanged), bool
    and the small integers widened to int32 (exact)."""
    if tensor.dtype in taken:
        return tensor
    if tensor.dtype == tf.bfloat16:
        return tf.bitcast(tensor, bfloat16_bits)
    return tf.cast(tensor, tf.int32)


def from_wire(tensor, dtype):
    """The `dtype` tensor that `to_wire` sent as `tensor`."""
    if tensor.dtype == dtype:
        return tensor
    if dtype == tf.bfloat16:
        return tf.bitcast(tensor, tf.bfloat16)
    return tf.cast(tensor, dtype)
