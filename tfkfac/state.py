"""K-FAC's state: per-block factors and decompositions, and the step counters.

Checkpoints save optimizer variables by creation order, so the order here is part of the
save format: counters first (in `Counters.NAMES` order), then per block its factors and,
when saved ("replicated"), its decompositions and the method's state (`EigenAdam`'s
eigenbasis moments), then grafting's moments, then under "owner" the state a resumed
owner rebuilds from (per block the decomposed factors and the method's state, then the
damping of the decompositions).
That last group comes last so that saves written before it existed still line up
(tests/test_saved_state_compat.py and tests/test_resume_matrix.py guard the order).
"""

import dataclasses

import tensorflow as tf


@dataclasses.dataclass
class BlockState:
    """One block's running factors and, where this rank holds them, its decompositions.

    `factors` follow `Block.factor_shapes()`; `decompositions` hold one list of variables
    per symmetric factor (`Block.symmetric_factors()` order), or None; `method_state`,
    the method's state of the block (`tfkfac.methods.state_shapes`, on every rank;
    `EigenAdam`'s moments); `decomposed`, under
    placement "owner" for a block with decompositions, a copy of `factors` as they were
    when the decompositions were last computed (on every rank, in host memory).
    """

    factors: list
    decompositions: list = None
    method_state: list = None
    decomposed: list = None

    def factor_values(self):
        return [v.value for v in self.factors]

    def decomposition_values(self):
        return [[v.value for v in d] for d in self.decompositions]

    def method_state_values(self):
        return [v.value for v in self.method_state or []]

    def variables(self, decompositions=True, method_state=True):
        """Factors, then the held decompositions and the method's state (each if asked)."""
        held = self.decompositions if decompositions and self.decompositions else []
        state = self.method_state if method_state and self.method_state else []
        return list(self.factors) + [v for d in held for v in d] + list(state)

    def rebuild_variables(self):
        """The decomposed factors and the method's state ("owner": saved after everything
        else)."""
        return list(self.decomposed or []) + list(self.method_state or [])


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


class PhaseClocks:
    """Seconds spent in each phase of the K-FAC steps so far (not saved: per process).

    Only when `enabled`: the timestamps order the phases and cost 0.2-0.6 ms per step
    (docs/benchmarks.md). A phase's clock starts once `after` (the previous phase's
    results) and its `inputs` exist, and its function sees its `inputs` only through that
    start, so none of its work runs before its clock and no earlier work (forward,
    backward, the previous phase) falls on it; it stops once its results exist (a
    cond's results wait for the cond's writes). The phases of a step do not overlap:
    the step minus their sum is the forward/backward, the gradient reduction and
    Keras's step around them.
    """

    PHASES = ("factors", "decomposition", "precondition", "update")

    def __init__(self, enabled):
        self.seconds = ({phase: tf.Variable(0.0, dtype=tf.float64, trainable=False)
                         for phase in self.PHASES} if enabled else {})

    def timed(self, phase, function, inputs=(), after=()):
        """`function(*inputs)`, its wall time (from when `after` and `inputs` exist until
        its outputs exist) added to `phase`."""
        if not self.seconds:
            return function(*inputs)
        with tf.control_dependencies(_tensors(after) + _tensors(inputs)):
            start = tf.timestamp()
        with tf.control_dependencies([start]):
            # A tf.function called inside (preconditioning) would otherwise start on its
            # inputs alone, whatever the control dependencies of its call.
            inputs = tf.nest.map_structure(lambda t: None if t is None else tf.identity(t),
                                           inputs)
            result = function(*inputs)
        with tf.control_dependencies(_tensors(result)):
            self.seconds[phase].assign_add(tf.timestamp() - start)
        return result

    def values(self):
        return {phase: float(v.numpy()) for phase, v in self.seconds.items()}


def _tensors(structure):
    return [t for t in tf.nest.flatten(structure, expand_composites=True) if t is not None]


class KFACState:
    """K-FAC's variables inside its optimizer, in the save format's order: the counters,
    then the update chain's pieces (`chain.UpdateChain.variables`). Values loaded before
    the state exists (a save loaded before `attach`) wait here until it is created."""

    def __init__(self):
        self.counters, self._chain, self._waiting = None, None, None

    def create(self, add_variable, chain, model_variables):
        """`add_variable(shape, initializer, name, dtype)` makes an optimizer variable."""
        self.counters = Counters(lambda shape, initializer, dtype, name: add_variable(
            shape, initializer, name, dtype))
        self._chain = chain
        chain.create_state(self.counters, add_variable, model_variables)
        if self._waiting is not None:
            self.load(self._waiting)

    def variables(self):
        if self.counters is None:
            return []
        return self.counters.variables() + self._chain.variables()

    def load(self, values):
        """Assign saved `values`, or keep them until `create`. A save without an owner's
        rebuild state (written before tfkfac saved it) loads the rest; the owner then
        recomputes its decompositions from the restored factors (`Curvature.restored`)."""
        if self.counters is None:
            self._waiting = list(values) or None
            return
        self._waiting = None
        variables = self.variables()
        rebuild = len(self._chain.curvature.rebuild_variables())
        complete = not rebuild or len(values) != len(variables) - rebuild
        restore(variables if complete else variables[:-rebuild], values)
        self._chain.curvature.restored(complete)


def restore(variables, values):
    """Assign saved `values` (in creation order) to the K-FAC `variables`, each cast to its
    variable's dtype (decompositions saved with another `product_dtype`)."""
    if len(values) != len(variables):
        raise ValueError(
            f"The restored K-FAC state has {len(values)} variables but the attached model "
            f"needs {len(variables)}: attach the optimizer to the same architecture it was "
            "saved with.")
    for variable, value in zip(variables, values):
        variable.assign(tf.cast(value, variable.dtype))


def identities(shape, dtype=None):
    """Initializer: identity matrices, also for a batch of them (..., n, n)."""
    return tf.eye(shape[-1], batch_shape=shape[:-2], dtype=dtype or "float32")
