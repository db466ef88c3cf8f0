"""Stateless random keys, so every random choice in a pipeline is a pure function of
(seed, epoch, position) and stays the same under parallel maps and resumed runs."""

import tensorflow as tf


def derive(seed, *salts):
    """Returns a shape-[2] int64 key for stateless random ops, folded from `seed` and
    each salt in turn (ints or int scalar tensors; `seed` may itself be such a key)."""
    seed = tf.convert_to_tensor(seed, dtype=tf.int64)
    key = seed if seed.shape.rank == 1 else tf.stack([seed, tf.zeros_like(seed)])
    for salt in salts:
        key = tf.random.experimental.stateless_fold_in(key, tf.cast(salt, tf.int64))
    return tf.cast(key, tf.int64)


def split(key, num):
    """Returns `num` independent keys, shape [num, 2], from one key."""
    return tf.random.experimental.stateless_split(key, num)


def op_seed(key):
    """Returns a seed for ops that take a plain one (`Dataset.shuffle`): a Python int
    when the key is known eagerly, else an int64 scalar tensor."""
    static = tf.get_static_value(key[0])
    return key[0] if static is None else int(static)
