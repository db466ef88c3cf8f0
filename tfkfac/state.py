"""K-FAC's state: per-block factors and decompositions, and the step counters.

Checkpoints save optimizer variables by creation order, so the order here is part of the
save format: counters first (in `Counters.NAMES` order), then per block its factors and,
when saved, its decompositions (tests/test_saved_state_compat.py guards it).
"""

import dataclasses

import tensorflow as tf


@dataclasses.dataclass
class BlockState:
    """One block's running factors and, where this rank holds them, its decompositions.

    `factors` follow `Block.factor_shapes()`; `decompositions` hold one list of variables
    per symmetric factor (`Block.symmetric_factors()` order), or None.
    """

    factors: list
    decompositions: list = None

    def factor_values(self):
        return [v.value for v in self.factors]

    def decomposition_values(self):
        return [[v.value for v in d] for d in self.decompositions]

    def variables(self, with_decompositions=True):
        held = self.decompositions if with_decompositions and self.decompositions else []
        return list(self.factors) + [v for d in held for v in d]


class Counters:
    """int64 step counters, each an optimizer variable named as its attribute."""

    NAMES = ("skipped_steps", "factor_updates", "skipped_factor_updates",
             "decomposition_updates", "failed_decompositions", "next_factor_step",
             "next_decomposition_step")

    def __init__(self, add_variable):
        for name in self.NAMES:
            setattr(self, name, add_variable((), initializer="zeros", dtype="int64",
                                             name=name))

    def variables(self):
        return [getattr(self, name) for name in self.NAMES]

    def values(self):
        """The counters as Python ints (eager)."""
        return {name: int(getattr(self, name).numpy()) for name in self.NAMES}


def identities(shape, dtype=None):
    """Initializer: identity matrices, also for a batch of them (..., n, n)."""
    return tf.eye(shape[-1], batch_shape=shape[:-2], dtype=dtype or "float32")
