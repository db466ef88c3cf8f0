"""Warnings printed while a traced training step runs: a skipped factor update or step,
decompositions kept or rebuilt. Python's `warnings` cannot speak from inside a graph."""

import sys

import tensorflow as tf


def warn_if(condition, *message):
    """Print `message` to stderr when the (graph-time) `condition` holds."""
    def warn():
        tf.print(*message, output_stream=sys.stderr)
        return tf.constant(True)

    tf.cond(condition, warn, lambda: tf.constant(False))
