"""Fresh-example accounting for data echoing (Choi et al.): how many distinct source
examples reached training versus how many examples training consumed.

Each example carries a `fresh` flag from the source: 1 on the first copy, 0 on every
echoed repeat. The flags are summed where training takes the batch, not where the
source is read, so the counts do not run ahead of training by the shuffle and prefetch
buffers and do not depend on thread timing.
"""

import keras
import tensorflow as tf

from tfkfac import example_weights

FRESH_KEY = "fresh"


def mark_fresh(example):
    """Adds the fresh flag (1) to a dict example read from the source."""
    return {**example, FRESH_KEY: tf.ones([], tf.int32)}


class EchoCounters:
    """Counts fresh and trained examples in variables (`tf.Variable`) the pipeline updates."""

    def __init__(self):
        self.fresh = tf.Variable(0, dtype=tf.int64, trainable=False, name="fresh_examples")
        self.trained = tf.Variable(0, dtype=tf.int64, trainable=False, name="trained_examples")

    def count(self, dataset, fresh_flags=False):
        """Returns `dataset` of batched dicts as `(image, label)` pairs, adding each
        batch's size and fresh flags to the counters as the batch is taken. Apply it
        after `prefetch`, so it runs when the consumer asks for the batch.

        With `fresh_flags` the elements are `(image, label, tfkfac.fresh_flags(fresh))`:
        the flags in the structure `tfkfac.KFAC(factor_examples="fresh")` reads from the
        batch's third element, where Keras has sample weights (which it tells apart)."""

        def take(batch):
            flags = tf.cast(batch[FRESH_KEY], tf.int64)
            with tf.control_dependencies([
                self.fresh.assign_add(tf.reduce_sum(flags)),
                self.trained.assign_add(tf.size(flags, out_type=tf.int64)),
            ]):
                element = tuple(tf.identity(t) for t in (batch["image"], batch["label"]))
                if fresh_flags:
                    element += (example_weights.fresh_flags(tf.identity(batch[FRESH_KEY])),)
                return element

        # tf.data's autotuner would inject a prefetch after this map, which would run
        # it ahead of the consumer; the counts must follow what training has taken.
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        return dataset.map(take).with_options(options)

    def result(self):
        """Returns the counts as Python ints."""
        return {"fresh_examples": int(self.fresh.numpy()),
                "trained_examples": int(self.trained.numpy())}

    def reset(self):
        self.fresh.assign(0)
        self.trained.assign(0)


class EchoCountersCallback(keras.callbacks.Callback):
    """Adds `fresh_examples` and `trained_examples` to the epoch logs (and so to
    `History`), for reporting fresh examples to reach a target metric."""

    def __init__(self, counters):
        super().__init__()
        self.counters = counters

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self.counters.result())
