"""float21, the 21-bit float of Ueno et al. (KDD'20, Fig. 6-7), three to a 64-bit word.

A float21 is the top 21 bits of a float32: the sign, the 8-bit exponent (bias 127) and
the first 12 of the 23 fraction bits, so 13 significant bits (unit roundoff 2^-13,
against float16's 2^-11 and bfloat16's 2^-8) over float32's whole range. Rounding is
to nearest, ties to even, on the 12-bit fraction (Ueno et al. truncate instead):
- a subnormal float32 rounds like any other value, to a multiple of 2^-138 (the format
  keeps float32's gradual underflow, with 12 fraction bits);
- a value at or beyond (2 - 2^-13) · 2^127 (halfway past the largest float21,
  (2 - 2^-12) · 2^127) rounds to ±inf; ±inf stay ±inf;
- NaN stays NaN, quiet, with its sign and the first 11 bits of its payload;
- −0 stays −0.
Words are int64, which Horovod's collectives and TensorFlow's collective ops carry:
value 3k + i is bits 21i to 21i + 20 of word k, the top bit is 0, and the last word is
filled with zeros. Pure TensorFlow bit operations: usable in `tf.function`, XLA-compilable.
"""

import tensorflow as tf

BITS = 21
VALUES_PER_WORD = 3
WORD_BYTES = 8
_DROPPED = 32 - BITS  # float32 fraction bits a float21 drops
_FIELD = (1 << BITS) - 1
_QUIET_NAN = 1 << (22 - _DROPPED)  # float32's quiet-NaN bit, where a float21 holds it
_SHIFTS = tuple(BITS * i for i in range(VALUES_PER_WORD))


def words(count):
    """Number of 64-bit words that carry `count` float21 values."""
    return -(-count // VALUES_PER_WORD)


def encode(values):
    """`values` (any shape, float32 or narrower; float64 is rounded to float32 first)
    flattened, rounded to float21 and packed three to an int64 word."""
    values = tf.cast(tf.reshape(values, [-1]), tf.float32)
    bits = tf.cast(tf.bitcast(values, tf.uint32), tf.int64)
    kept = tf.bitwise.right_shift(bits, _DROPPED)
    # Round half to even: add just under half a unit, plus one when the kept part is odd.
    rounded = tf.bitwise.right_shift(
        bits + ((1 << (_DROPPED - 1)) - 1) + tf.bitwise.bitwise_and(kept, 1), _DROPPED)
    fields = tf.where(tf.math.is_nan(values), tf.bitwise.bitwise_or(kept, _QUIET_NAN),
                      rounded)
    padding = (-tf.size(fields)) % VALUES_PER_WORD
    fields = tf.reshape(tf.pad(fields, [[0, padding]]), [-1, VALUES_PER_WORD])
    shifted = tf.bitwise.left_shift(fields, tf.constant(_SHIFTS, tf.int64))
    return tf.reduce_sum(shifted, axis=1)  # disjoint bit fields: the sum is their OR


def decode(packed, count):
    """The first `count` float21 values of the int64 words `packed` (1-D), as float32."""
    fields = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(tf.reshape(packed, [-1, 1]), tf.constant(_SHIFTS, tf.int64)),
        _FIELD)
    bits = tf.reshape(tf.bitwise.left_shift(fields, _DROPPED), [-1])[:count]
    return tf.bitcast(tf.cast(bits, tf.uint32), tf.float32)
