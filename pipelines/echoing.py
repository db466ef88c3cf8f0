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

# Consecutive elements are echoed together with one vectorized `tf.repeat` (same output
# order as echoing one by one, a few microseconds per element instead of tens); the
# chunk is kept under this many bytes so echoing large batches adds no latency.
_CHUNK_BYTES = 1 << 20
_MAX_CHUNK = 64
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

        def repeat_chunk(indices, elements):
            size = tf.shape(indices)[0]
            counts = tf.fill([size], whole)
            if fraction > 0:
                draws = tf.random.stateless_uniform([size], seeds.derive(count_key, indices[0]))
                counts += tf.cast(draws < fraction, tf.int32)
            repeated = tf.nest.map_structure(lambda t: tf.repeat(t, counts, axis=0), elements)
            if isinstance(elements, dict) and counters.FRESH_KEY in elements:
                repeated[counters.FRESH_KEY] *= _first_copy_mask(counts, repeated[counters.FRESH_KEY])
            return repeated

        echoed = (dataset.enumerate()
                  .batch(_chunk_size(dataset.element_spec))
                  .map(repeat_chunk, num_parallel_calls=tf.data.AUTOTUNE)
                  .unbatch())
        if shuffle_buffer:
            echoed = echoed.shuffle(shuffle_buffer, seed=seeds.op_seed(seeds.derive(key, _SHUFFLE_SALT)))
        return echoed

    return apply


def _check_factor(factor):
    try:
        factor = float(factor)
    except (TypeError, ValueError):
        raise ValueError(f"echo factor must be a number >= 1, got {factor!r}") from None
    if not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"echo factor must be a finite number >= 1, got {factor!r}")
    return factor


def _seed_or_draw(seed):
    if seed is not None:
        return seed
    return tf.random.uniform([], maxval=tf.int64.max, dtype=tf.int64)


def _first_copy_mask(counts, flags):
    """1 where a repeated row is the first copy of its element, else 0, shaped to
    broadcast against `flags` (rank 1 for examples, rank 2 for batches)."""
    owner = tf.repeat(tf.range(tf.size(counts)), counts)
    starts = tf.cumsum(counts, exclusive=True)
    first = tf.equal(tf.range(tf.size(owner)), tf.gather(starts, owner))
    return tf.reshape(tf.cast(first, flags.dtype), [-1] + [1] * (flags.shape.rank - 1))


def _chunk_size(element_spec):
    sizes = []
    for spec in tf.nest.flatten(element_spec):
        elements = spec.shape.num_elements() if isinstance(spec, tf.TensorSpec) else None
        if elements is None or spec.dtype == tf.string:
            return 1
        sizes.append(elements * spec.dtype.size)
    return int(max(1, min(_MAX_CHUNK, _CHUNK_BYTES // max(1, sum(sizes)))))
