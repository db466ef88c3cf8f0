"""float21, the 21-bit float of Ueno et al. (KDD'20, §3.3.3, Fig. 6-7), three to a 64-bit word.

A float21 is the top 21 bits of a float32: the sign, the 8-bit exponent (bias 127) and
the first 12 of the 23 fraction bits, taken by truncation (`bits >> 11`), so 13
significant bits over float32's whole range. Decoding appends the middle of the 11
dropped bits, `(f21 << 11) | (1 << 10)`: the midpoint of the float32 values that share
the pattern, so the error is at most half the pattern's spacing, 2^-13 of the value
(unit roundoff u = 2^-13, against float16's 2^-11 and bfloat16's 2^-8).
What that makes of the special values:
- ±0 comes back as ±2^-139 (the midpoint of zero's range, a subnormal), a subnormal x
  as the midpoint of its multiple of 2^-138 (|error| <= 2^-139);
- truncation never overflows: float32's largest comes back as (2 - 2^-13) · 2^127;
- ±inf comes back as NaN (the midpoint bit is a fraction bit), sign kept; a NaN stays a
  NaN with its sign (its payload truncated).
Words are int64, which Horovod's collectives and TensorFlow's collective ops carry:
value 3k + i is bits 21i to 21i + 20 of word k, the top bit is 0, and the last word is
filled with zeros. Pure TensorFlow bit operations: usable in `tf.function`, XLA-compilable.
"""

import tensorflow as tf

BITS = 21
VALUES_PER_WORD = 3
WORD_BYTES = 8
_DROPPED = 32 - BITS  # float32 fraction bits a float21 drops
_MIDPOINT = 1 << (_DROPPED - 1)  # the middle of the dropped bits' range, set on decoding
_FIELD = (1 << BITS) - 1
_SHIFTS = tuple(BITS * i for i in range(VALUES_PER_WORD))


def words(count):
    """Number of 64-bit words that carry `count` float21 values."""
    return -(-count // VALUES_PER_WORD)


def encode(values):
    """`values` (any shape, float32 or narrower; float64 is rounded to float32 first)
    flattened, truncated to float21 and packed three to an int64 word."""
    values = tf.cast(tf.reshape(values, [-1]), tf.float32)
    fields = tf.bitwise.right_shift(tf.cast(tf.bitcast(values, tf.uint32), tf.int64), _DROPPED)
    padding = (-tf.size(fields)) % VALUES_PER_WORD
    fields = tf.reshape(tf.pad(fields, [[0, padding]]), [-1, VALUES_PER_WORD])
    shifted = tf.bitwise.left_shift(fields, tf.constant(_SHIFTS, tf.int64))
    return tf.reduce_sum(shifted, axis=1)  # disjoint bit fields: the sum is their OR


def decode(packed, count):
    """The first `count` float21 values of the int64 words `packed` (1-D), as float32,
    each at the midpoint of its pattern's range."""
    fields = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(tf.reshape(packed, [-1, 1]), tf.constant(_SHIFTS, tf.int64)),
        _FIELD)
    bits = tf.bitwise.bitwise_or(tf.bitwise.left_shift(fields, _DROPPED), _MIDPOINT)
    return tf.bitcast(tf.cast(tf.reshape(bits, [-1])[:count], tf.uint32), tf.float32)
