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
from pipelines.validation import check_number

# Small elements (single examples) are echoed in chunks of consecutive elements with
# one vectorized `tf.repeat` (same output order; a few microseconds per element instead
# of tens); larger ones (batches) one at a time without copying them.
_SMALL_ELEMENT_BYTES = 64 << 10
_CHUNK = 64
_COUNT_SALT, _SHUFFLE_SALT = 0, 1


def echo(factor, shuffle_buffer=0, seed=None):
    """Returns a `tf.data.Dataset.apply` transformation repeating each element.

    Args:
      factor: echo factor e >= 1. An integer repeats every element exactly e times; a
        fraction repeats each element floor(e) or ceil(e) times, ceil with probability
        e - floor(e), so the mean is e. The draw is a pure function of `seed` and the
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
    if not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
        raise ValueError(f"shuffle_buffer must be an int >= 0, got {shuffle_buffer!r}")
    whole = math.floor(factor)
    fraction = factor - whole

    def apply(dataset):
        key = seeds.derive(_seed_or_draw(seed))
        count_key = seeds.derive(key, _COUNT_SALT)

        def counts(indices):
            """floor(e), plus 1 with probability e - floor(e), per element."""
            fixed = tf.fill(tf.shape(indices), whole)
            if not fraction:
                return fixed
            draws = tf.random.stateless_uniform(tf.shape(indices), seeds.derive(count_key, indices[0]))
            return fixed + tf.cast(draws < fraction, tf.int32)

        if _is_small(dataset.element_spec):
            echoed = (dataset.enumerate().batch(_CHUNK)
                      .map(lambda indices, chunk: _repeat_chunk(chunk, counts(indices)),
                           num_parallel_calls=tf.data.AUTOTUNE)
                      .unbatch())
        else:
            echoed = dataset.enumerate().flat_map(
                lambda index, element: _repeat_element(element, counts(index[None])[0]))
        if shuffle_buffer:
            echoed = echoed.shuffle(shuffle_buffer, seed=seeds.op_seed(seeds.derive(key, _SHUFFLE_SALT)))
        return echoed

    return apply


def _check_factor(factor):
    try:
        factor = float(factor)
    except (TypeError, ValueError):
        raise ValueError(f"`echo_factor` must be a finite number >= 1; received {factor!r}") from None
    return check_number("echo_factor", factor, low=1)


def _seed_or_draw(seed):
    if seed is not None:
        return seed
    return tf.random.uniform([], maxval=tf.int64.max, dtype=tf.int64)


def _has_fresh_flag(element):
    return isinstance(element, dict) and counters.FRESH_KEY in element


def _repeat_chunk(chunk, counts):
    """Repeats row i of every tensor in `chunk` counts[i] times; only first copies keep
    their fresh flag."""
    repeated = tf.nest.map_structure(lambda t: tf.repeat(t, counts, axis=0), chunk)
    if _has_fresh_flag(chunk):
        owner = tf.repeat(tf.range(tf.size(counts)), counts)
        starts = tf.cumsum(counts, exclusive=True)
        first = tf.equal(tf.range(tf.size(owner)), tf.gather(starts, owner))
        flags = repeated[counters.FRESH_KEY]  # (rows,) for examples, (rows, B) for batches
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


def _is_small(element_spec):
    """Whether elements have static shapes and are small enough to echo in chunks."""
    size = 0
    for spec in tf.nest.flatten(element_spec):
        elements = spec.shape.num_elements() if isinstance(spec, tf.TensorSpec) else None
        if elements is None or spec.dtype == tf.string:
            return False
        size += elements * spec.dtype.size
    return size <= _SMALL_ELEMENT_BYTES
