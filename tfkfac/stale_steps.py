"""Stale steps: a train function of their own, chosen before each step of `model.fit`.

With factors every f steps, f - 1 steps in f are stale: neither factors nor
decompositions are due, and the step preconditions with the stored decompositions. The
factor step (`Attachment.train_step`) finds that out inside the graph (`tf.cond` on the
counters), so it records every managed layer's call and asks the tape for every output
gradient on every step. `fit` therefore gets a second traced train function for stale
steps (`Attachment.train_step(..., stale=True)`: Keras's own forward pass, the weight
gradients only, the same averaging over ranks, preconditioning, the inner update), and
before each step the counters, read outside the graph, say which of the two runs. Every
rank holds the same counters, so every rank runs the same function and issues the same
collectives. With no LAPACK call and, in one process, no collective, the stale step
compiles with XLA under `model.compile(jit_compile=True)`. With adaptive stale statistics
(docs/design.md §12) the next factor step is the earliest step any block is due at.

Every step runs the factor step where the choice cannot be made per step:
`steps_per_execution` > 1 (several steps in one graph call), `factor_examples="fresh"`
(due also needs a fresh example in the batch, known inside the graph) and custom loops
(`record()` and `minimize`); so does the first step after an owner's restore, which
rebuilds its decompositions.
"""

import functools
import sys
import weakref

from tfkfac import keras_integration
from tfkfac.keras_integration import read_scalar

SKIPPED_WARNING = "KFAC warning: non-finite gradients; step skipped, weights unchanged"


class StaleSteps:
    """The choice between the factor and the stale train function of `optimizer`, a KFAC
    whose `Attachment` is `attachment`."""

    def __init__(self, optimizer, attachment):
        self._optimizer = weakref.ref(optimizer)
        # The stale step's `step_with_tape(forward, fresh)` (see `install_train_step`).
        self.step_with_tape = functools.partial(attachment.train_step, stale=True)
        # (update count, next factor step, next decomposition step): read before a step,
        # kept while only stale steps (which change neither "next") run, with the update
        # count after the last of them.
        self._schedule = None

    def unavailable(self, model):
        """Why every step of `model.fit` must run the factor step, or None."""
        if model.steps_per_execution > 1:
            return (f"steps_per_execution={model.steps_per_execution} runs several steps in "
                    "one graph call, which cannot choose per step")
        if self._optimizer().config.factor_examples == "fresh":
            return ("with factor_examples='fresh' whether factors are due depends on the "
                    "batch's fresh flags, known inside the graph")
        return None

    def not_compilable(self):
        """Why the stale step cannot compile with XLA, or None."""
        optimizer = self._optimizer()
        ranks = optimizer.communicator.size
        if ranks > 1:
            return (f"its gradient average over {ranks} ranks is a collective, which XLA "
                    "cannot compile")
        if optimizer.config.phase_clocks:
            return "phase_clocks=True times it with timestamps, which XLA cannot compile"
        return None

    def forget(self):
        """Read the counters again before the next step (they may have been restored)."""
        self._schedule = None

    def choosing(self, model, factor_function, stale_function):
        """A train function that runs `stale_function` on stale steps and `factor_function`
        on the others. A stale step skipped for non-finite gradients is reported here
        (XLA cannot print), unless a wrapping optimizer (Keras's LossScaleOptimizer)
        skipped it, silently as it skips the factor step's."""
        optimizer = self._optimizer()
        wrapped = model.optimizer is not optimizer

        def train_function(iterator):
            count = keras_integration.update_count(optimizer.inner_optimizer)
            if not self._is_stale(optimizer, count):
                self._schedule = None  # a factor step may change the schedule
                return factor_function(iterator)
            logs = stale_function(iterator)
            after = keras_integration.update_count(optimizer.inner_optimizer)
            if after == count and not wrapped:
                print(SKIPPED_WARNING, file=sys.stderr)
            self._schedule = (after,) + self._schedule[1:]
            return logs

        return train_function

    def _is_stale(self, optimizer, count):
        """Whether the step at update `count` is stale: neither factors nor decompositions
        due, and no decompositions to rebuild."""
        counters = optimizer.state.counters
        if counters is None:  # the state is made in the first (factor) step
            return False
        if self._schedule is None or self._schedule[0] != count:  # else nothing else ran
            self._schedule = (count, read_scalar(counters.next_factor_step, int),
                              read_scalar(counters.next_decomposition_step, int))
        accumulation = optimizer.inner_optimizer.gradient_accumulation_steps
        step = count // accumulation if accumulation else count
        if step >= min(self._schedule[1:]):
            return False
        curvature = optimizer.curvature
        return (curvature.placement.saves_decompositions
                or read_scalar(curvature.decompositions_current, bool))
