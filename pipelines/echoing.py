"""Data echoing (Choi et al., "Faster Neural Network Training with Data Echoing"):
repeat each element of a tf.data pipeline so that a slow upstream (reading, decoding,
augmenting) feeds `factor` downstream training steps per unit of upstream work.

Where the stage is inserted picks the paper's variant: on unbatched examples before
augmentation (repeats are augmented differently), after augmentation (repeats are
identical), or on batches (batch echoing).
"""

import math

import tensorflow as tf

from pipelines import counters, seeds
from pipelines.limits import MAX_ECHO_FACTOR, MAX_SHUFFLE_BUFFER
from tfkfac import validation

# Small elements (single examples) are echoed in chunks of consecutive elements: one
# `batch`, one vectorized repeat per chunk and one `unbatch`, same output order. Per
# element that costs about what `batch` plus `unbatch` cost, under a microsecond (a
# dataset per element would cost tens); integer factors need neither positions nor
# draws (the repeat is a tile), fractional ones number chunks, not elements. Larger
# elements (batches) are echoed one at a time without copying them.
# A chunk holds at most _MAX_CHUNK elements and _CHUNK_BYTES bytes (longer chunks saved
# no CPU time), in whole blocks of _DRAW_BLOCK elements: a fractional factor's counts
# are drawn per block of _DRAW_BLOCK consecutive elements, keyed by the block's first
# position, so they do not depend on the chunk size.
_SMALL_ELEMENT_BYTES = 64 << 10
_DRAW_BLOCK = 64
_MAX_CHUNK = 256
_CHUNK_BYTES = 1 << 20
_COUNT_SALT, _SHUFFLE_SALT = 0, 1


def echo(factor, shuffle_buffer=0, seed=None):
    """Returns a `tf.data.Dataset.apply` transformation repeating each element.

    Args:
      factor: echo factor e in [1, 100]. An integer repeats every element exactly e
        times; a fraction repeats each element floor(e) or ceil(e) times, ceil with
        probability e - floor(e), so the mean is e. The draw is a pure function of `seed` and the
        element's position.
      shuffle_buffer: if > 0, shuffle the echoed stream with a buffer of this many
        elements, so repeats are spread apart.
      seed: int (or int scalar tensor) for the fractional draw and the shuffle. None
        draws one from TensorFlow's global generator (reproducible after
        `tf.random.set_seed`).

    Dict elements with a `fresh` entry (see `pipelines.counters`) keep it on the first
    copy and get 0 on the repeats, so fresh-example counts stay exact.

    Example:
      >>> ds = tf.data.Dataset.range(3).apply(echo(2))
      >>> [int(x) for x in ds]
      [0, 0, 1, 1, 2, 2]
    """
    factor = _check_factor(factor)
    validation.integer("shuffle_buffer", shuffle_buffer, 0, MAX_SHUFFLE_BUFFER)
    whole = math.floor(factor)
    fraction = factor - whole

    def apply(dataset):
        key = seeds.derive(_seed_or_draw(seed))
        count_key = seeds.derive(key, _COUNT_SALT)

        def draw_counts(start, num, blocks):
            """floor(e), plus 1 with probability e - floor(e), for the `num` elements
            from position `start` on (a multiple of _DRAW_BLOCK), drawn per block."""
            draws = tf.concat([
                tf.random.stateless_uniform([_DRAW_BLOCK], seeds.derive(count_key, start + b * _DRAW_BLOCK))
                for b in range(blocks)], axis=0)[:num]
            return whole + tf.cast(draws < fraction, tf.int32)

        if _is_small(dataset.element_spec):
            chunk = _chunk_size(dataset.element_spec)
            chunks = dataset.batch(chunk)
            if fraction:
                blocks = chunk // _DRAW_BLOCK
                echoed = chunks.enumerate().map(
                    lambda index, rows: _repeat_rows(
                        rows, draw_counts(index * chunk, _num_rows(rows), blocks)),
                    num_parallel_calls=tf.data.AUTOTUNE)
            else:
                structure = chunks.element_spec  # `map` would unpack a tuple into arguments
                echoed = chunks.map(
                    lambda *parts: _tile_rows(
                        tf.nest.pack_sequence_as(structure, tf.nest.flatten(parts)), whole),
                    num_parallel_calls=tf.data.AUTOTUNE)
            echoed = echoed.unbatch()
        else:
            def count(index):
                """floor(e), plus 1 with probability e - floor(e), keyed by position."""
                if not fraction:
                    return tf.constant(whole)
                draw = tf.random.stateless_uniform([1], seeds.derive(count_key, index))[0]
                return whole + tf.cast(draw < fraction, tf.int32)

            echoed = dataset.enumerate().flat_map(
                lambda index, element: _repeat_element(element, count(index)))
        if shuffle_buffer:
            echoed = echoed.shuffle(shuffle_buffer, seed=seeds.op_seed(seeds.derive(key, _SHUFFLE_SALT)))
        return echoed

    return apply


def _check_factor(factor):
    try:
        number = float(factor)
    except (TypeError, ValueError):
        number = factor  # not a number: refused below, naming the value received
    return validation.finite_number("echo_factor", number, 1, MAX_ECHO_FACTOR)


def _seed_or_draw(seed):
    if seed is not None:
        return seed
    return tf.random.uniform([], maxval=tf.int64.max, dtype=tf.int64)


def _has_fresh_flag(element):
    return isinstance(element, dict) and counters.FRESH_KEY in element


def _num_rows(rows):
    return tf.shape(tf.nest.flatten(rows)[0])[0]


def _tile_rows(rows, times):
    """Repeats every row of every tensor in `rows` `times` (a Python int) times, copies
    adjacent; only first copies keep their fresh flag."""
    repeated = tf.nest.map_structure(lambda t: tf.repeat(t, times, axis=0), rows)
    if _has_fresh_flag(rows):
        flags = rows[counters.FRESH_KEY]  # (rows,) for examples, (rows, B) for batches
        first = tf.constant([1] + [0] * (times - 1), flags.dtype, shape=[1, times] + [1] * (flags.shape.rank - 1))
        repeated[counters.FRESH_KEY] = tf.reshape(
            tf.expand_dims(flags, 1) * first, tf.concat([[-1], tf.shape(flags)[1:]], axis=0))
    return repeated


def _repeat_rows(rows, counts):
    """Repeats row i of every tensor in `rows` counts[i] times; only first copies keep
    their fresh flag."""
    source = tf.repeat(tf.range(tf.size(counts)), counts)  # the row each output row copies
    repeated = tf.nest.map_structure(lambda t: tf.gather(t, source), rows)
    if _has_fresh_flag(rows):
        first = tf.concat([[True], tf.not_equal(source[1:], source[:-1])], axis=0)
        flags = repeated[counters.FRESH_KEY]
        first = tf.reshape(tf.cast(first, flags.dtype), [-1] + [1] * (flags.shape.rank - 1))
        repeated[counters.FRESH_KEY] = flags * first
    return repeated


def _repeat_element(element, count):
    """A dataset of `count` copies of `element`; repeats get a zero fresh flag."""
    first = tf.data.Dataset.from_tensors(element)
    if _has_fresh_flag(element):
        repeat = {**element, counters.FRESH_KEY: tf.zeros_like(element[counters.FRESH_KEY])}
    else:
        repeat = element
    return first.concatenate(tf.data.Dataset.from_tensors(repeat).repeat(tf.cast(count, tf.int64) - 1))


def _element_bytes(element_spec):
    """Bytes per element, or None unless every component is a tensor of static shape
    and fixed-size dtype."""
    size = 0
    for spec in tf.nest.flatten(element_spec):
        elements = spec.shape.num_elements() if isinstance(spec, tf.TensorSpec) else None
        if elements is None or spec.dtype == tf.string:
            return None
        size += elements * spec.dtype.size
    return size


def _is_small(element_spec):
    """Whether elements have static shapes and are small enough to echo in chunks."""
    size = _element_bytes(element_spec)
    return size is not None and size <= _SMALL_ELEMENT_BYTES


def _chunk_size(element_spec):
    """Elements per chunk: whole draw blocks, at most _MAX_CHUNK and _CHUNK_BYTES (at
    least one block: 64 elements of at most 64 KiB)."""
    blocks = _CHUNK_BYTES // (max(_element_bytes(element_spec), 1) * _DRAW_BLOCK)
    return _DRAW_BLOCK * max(1, min(blocks, _MAX_CHUNK // _DRAW_BLOCK))
