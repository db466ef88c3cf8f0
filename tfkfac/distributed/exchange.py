"""The two K-FAC exchanges, written against any `Communicator`.

- `allreduce_symmetric`: average symmetric factors over ranks with one collective:
  Kronecker factors (single or batched) as packed upper triangles, diagonal factors as
  they are.
- `gather_from_owners`: every item (an eigenbasis, a preconditioned gradient, an
  eigenbasis moment) is computed by one owner rank; one allgather gives every rank all
  of them.

Both return what crossed the wire on every rank, owners included, so all ranks hold
bit-identical results even with a lossy wire dtype and their weights cannot drift apart.
With one process nothing is sent and the inputs come back unchanged.
"""

import tensorflow as tf

from tfkfac.distributed import packing


def allreduce_symmetric(comm, factors, wire_dtype="float32", category="factors"):
    """Mean over ranks of each symmetric factor, in its own dtype, in one grouped collective.

    A matrix, or a batch of matrices (..., n, n), travels as packed upper triangles, a 1-D
    factor (a diagonal) as it is; both in the wire dtype.
    """
    factors = [tf.convert_to_tensor(f) for f in factors]
    wire = packing.wire_dtype(wire_dtype)  # Reject a bad name even when nothing is sent.
    if comm.size == 1 or not factors:
        return factors
    matrices = [f for f in factors if f.shape.rank >= 2]
    vectors = [f for f in factors if f.shape.rank == 1]
    buffers = []
    if matrices:
        buffers.append(packing.pack_upper_triangles(matrices, dtype=wire_dtype))
    if vectors:
        buffers.append(tf.cast(tf.concat(vectors, axis=0), wire))
    reduced = iter(comm.grouped_allreduce_mean(buffers, category=category))
    unpacked = iter(packing.unpack_upper_triangles(
        next(reduced), [m.shape.as_list() for m in matrices]) if matrices else [])
    diagonals = iter(tf.split(next(reduced),
                              [int(v.shape[0]) for v in vectors]) if vectors else [])
    return [tf.cast(next(unpacked) if f.shape.rank >= 2 else next(diagonals), f.dtype)
            for f in factors]


def gather_from_owners(comm, local_values, shapes, owners, wire_dtype="float32",
                       category="decompositions", dtype="float32", exact=None):
    """Every item's value as computed by its owner rank, as `dtype`, on every rank.

    `local_values[i]` is read only where `owners[i] == comm.rank` (pass None elsewhere);
    `shapes[i]` is item i's static shape, known to all ranks. Each rank sends the
    concatenation of its own items in item order, so a rank owning nothing sends nothing.
    Items where `exact[i]` is true (state that accumulates, as Adam's moments) arrive
    bit-exactly as `dtype`: a narrower wire carries each value's bits in several words.
    """
    exact = [False] * len(owners) if exact is None else list(exact)
    if not len(local_values) == len(shapes) == len(owners) == len(exact):
        raise ValueError("local_values, shapes, owners and exact must have one entry per "
                         f"item, got {len(local_values)}, {len(shapes)}, {len(owners)} and "
                         f"{len(exact)}")
    if any(not 0 <= owner < comm.size for owner in owners):
        raise ValueError(f"owners must be ranks in [0, {comm.size}), got {owners}")
    shapes = [tf.TensorShape(shape) for shape in shapes]
    if not all(shape.is_fully_defined() for shape in shapes):
        raise ValueError(f"shapes must be fully defined, got {shapes}")
    wire = packing.wire_dtype(wire_dtype)
    if comm.size == 1 or not owners:
        return list(local_values)
    dtype = tf.as_dtype(dtype)
    words = max(1, dtype.size // wire.size)  # wire words per bit-exact value
    sizes = [shape.num_elements() * (words if e else 1) for shape, e in zip(shapes, exact)]
    mine = [_to_wire(local_values[i], wire, dtype, exact[i])
            for i, owner in enumerate(owners) if owner == comm.rank]
    gathered = comm.allgather(tf.concat(mine, axis=0) if mine else tf.zeros([0], wire),
                              category=category)
    # The gathered buffer holds rank 0's items in item order, then rank 1's, and so on.
    order = sorted(range(len(owners)), key=lambda i: (owners[i], i))
    pieces = tf.split(gathered, [sizes[i] for i in order])
    values = [None] * len(owners)
    for item, piece in zip(order, pieces):
        values[item] = tf.reshape(_from_wire(piece, dtype, exact[item], words), shapes[item])
    return values


def _to_wire(value, wire, dtype, exact):
    """`value` flat in the wire dtype: rounded, or (`exact`) its bits as `dtype` in
    `wire` words when the wire is narrower (a wider or equal float wire holds it)."""
    value = tf.reshape(value, [-1])
    if exact and dtype.size > wire.size:
        return tf.reshape(tf.bitcast(tf.cast(value, dtype), wire), [-1])
    return tf.cast(value, wire)


def _from_wire(piece, dtype, exact, words):
    if exact and words > 1:
        return tf.bitcast(tf.reshape(piece, [-1, words]), dtype)
    return tf.cast(piece, dtype)
