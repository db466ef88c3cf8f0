"""The two K-FAC exchanges, written against any `Communicator`.

- `allreduce_symmetric`: average symmetric factors over ranks with one collective:
  Kronecker factors (single or batched) as packed upper triangles, diagonal factors as
  they are.
- `gather_from_owners`: every item (an eigenbasis, a preconditioned gradient, an
  eigenbasis moment) is computed by one owner rank; one allgather gives every rank all
  of them.

Both return what crossed the wire on every rank, owners included, so all ranks hold
bit-identical results even with a lossy wire dtype and their weights cannot drift apart.
On a float21 wire (three values to a 64-bit word, float21.py) the factors' mean is the
communicator's `float21_mean` and the gathered values travel as float21 words.
With one process nothing is sent and the inputs come back unchanged.
"""

import tensorflow as tf

from tfkfac.distributed import float21, packing


def allreduce_symmetric(comm, factors, wire_dtype="float32", category="factors"):
    """Mean over ranks of each symmetric factor, in its own dtype, in one communicator call.

    A matrix, or a batch of matrices (..., n, n), travels as packed upper triangles, a 1-D
    factor (a diagonal) as it is; both in the wire dtype.
    """
    factors = [tf.convert_to_tensor(f) for f in factors]
    packed_in = packing.wire_dtype(wire_dtype)  # Reject a bad name even when nothing is sent.
    if comm.size == 1 or not factors:
        return factors
    matrices = [f for f in factors if f.shape.rank >= 2]
    vectors = [f for f in factors if f.shape.rank == 1]
    buffers = [packing.pack_upper_triangles(matrices, dtype=packed_in)] if matrices else []
    buffer = tf.concat(buffers + [tf.cast(v, packed_in) for v in vectors], axis=0)
    if wire_dtype == packing.FLOAT21:
        reduced = comm.float21_mean(buffer, category=category)
    else:
        (reduced,) = comm.grouped_allreduce_mean([buffer], category=category)
    dims = [m.shape.as_list() for m in matrices]
    packed, diagonal = tf.split(reduced, [packing.packed_size(dims),
                                          sum(int(v.shape[0]) for v in vectors)])
    unpacked = iter(packing.unpack_upper_triangles(packed, dims) if matrices else [])
    diagonals = iter(tf.split(diagonal, [int(v.shape[0]) for v in vectors]) if vectors else [])
    return [tf.cast(next(unpacked) if f.shape.rank >= 2 else next(diagonals), f.dtype)
            for f in factors]


def gather_from_owners(comm, local_values, shapes, owners, wire_dtype="float32",
                       category="decompositions", dtype="float32", exact=None):
    """Every item's value as computed by its owner rank, as `dtype`, on every rank.

    `local_values[i]` is read only where `owners[i] == comm.rank` (pass None elsewhere);
    `shapes[i]` is item i's static shape, known to all ranks. Each rank sends its own
    items' values, rounded to the wire, then the bits of its items where `exact[i]` is
    true (state that accumulates, as Adam's moments), which arrive bit-exactly as
    `dtype` whatever the wire; each part in item order. A rank owning nothing sends
    nothing.
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
    wire = _Wire(wire_dtype, tf.as_dtype(dtype))
    if comm.size == 1 or not owners:
        return list(local_values)
    counts = [shape.num_elements() for shape in shapes]

    def parts(rank):
        """(rank's rounded items, its exact items, and the wire length of each part)."""
        items = [i for i, owner in enumerate(owners) if owner == rank]
        rounded = [i for i in items if not exact[i]]
        bits = [i for i in items if exact[i]]
        return rounded, bits, [wire.rounded_length(sum(counts[i] for i in rounded)),
                               wire.exact_length(sum(counts[i] for i in bits))]

    rounded, bits, _ = parts(comm.rank)
    mine = [wire.to_wire([local_values[i] for i in rounded], exact=False),
            wire.to_wire([local_values[i] for i in bits], exact=True)]
    gathered = comm.allgather(tf.concat(mine, axis=0), category=category)
    # The gathered buffer holds rank 0's parts, then rank 1's, and so on.
    layout = [parts(rank) for rank in range(comm.size)]
    values = [None] * len(owners)
    for (rounded, bits, lengths), segment in zip(
            layout, tf.split(gathered, [sum(lengths) for _, _, lengths in layout])):
        for items, is_exact, part in zip((rounded, bits), (False, True),
                                         tf.split(segment, lengths)):
            if not items:
                continue
            flat = wire.from_wire(part, sum(counts[i] for i in items), is_exact)
            for i, piece in zip(items, tf.split(flat, [counts[i] for i in items])):
                values[i] = tf.reshape(piece, shapes[i])
    return values


def gathered_bytes(wire_dtype, rounded, exact, dtype="float32"):
    """Bytes one rank hands to `gather_from_owners`'s allgather for `rounded` values on
    the wire `wire_dtype` and `exact` values of `dtype` sent bit-exactly (what its
    counters count, and what the planner prices)."""
    wire = _Wire(wire_dtype, tf.as_dtype(dtype))
    return wire.element.size * (wire.rounded_length(rounded) + wire.exact_length(exact))


class _Wire:
    """How values of `dtype` travel on the wire `name` in a gather: rounded (cast to the
    wire dtype, or float21 words) or exactly (their bits, in as many wire elements as
    they take)."""

    def __init__(self, name, dtype):
        self.float21 = name == packing.FLOAT21
        self.dtype = dtype
        if self.float21:  # int64 words: three float21 values, or one or two exact ones
            self.element = tf.int64
            self.exact_per_word = tf.int64.size // dtype.size
        else:
            self.element = packing.wire_dtype(name)
            # Wire elements per exact value (1: a cast to the wire keeps it).
            self.exact_elements = max(1, dtype.size // self.element.size)

    def rounded_length(self, count):
        return float21.words(count) if self.float21 else count

    def exact_length(self, count):
        if self.float21:
            return -(-count // self.exact_per_word)
        return count * self.exact_elements

    def to_wire(self, values, exact):
        """`values` (a list of tensors) flattened and concatenated, on the wire."""
        flat = tf.concat([tf.reshape(tf.cast(v, self.dtype), [-1]) for v in values]
                         + [tf.zeros([0], self.dtype)], axis=0)
        if not exact:
            return float21.encode(flat) if self.float21 else tf.cast(flat, self.element)
        if self.float21:  # the last word padded
            padding = (-tf.size(flat)) % self.exact_per_word
            grouped = tf.reshape(tf.pad(flat, [[0, padding]]), [-1, self.exact_per_word])
            return tf.reshape(tf.bitcast(grouped, tf.int64), [-1])
        if self.exact_elements > 1:
            return tf.reshape(tf.bitcast(flat, self.element), [-1])
        return tf.cast(flat, self.element)

    def from_wire(self, part, count, exact):
        """The `count` values of `dtype` that `to_wire` sent as `part`."""
        if not exact:
            return tf.cast(float21.decode(part, count) if self.float21 else part, self.dtype)
        if self.float21:
            return tf.reshape(tf.bitcast(part, self.dtype), [-1])[:count]
        if self.exact_elements > 1:
            return tf.bitcast(tf.reshape(part, [-1, self.exact_elements]), self.dtype)
        return tf.cast(part, self.dtype)
