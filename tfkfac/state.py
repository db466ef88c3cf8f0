"""K-FAC's state: per-block factors and decompositions, the step counters, and how the
optimizer's variables are saved.

A .keras file (`KFAC.save_own_variables`) holds every saved variable under a key its
owner names, "<owner>:<parts>" (`key`: a nested layer's path "mha/query" is written
"mha.query"; a key repeated is suffixed "#2", "#3", ...):
- "inner:<i>": the inner optimizer's variables, in its order (Keras's layout for it);
- "counters:<counter>": the step counters (`Counters.NAMES`);
- "block:<layer>:factor:<A|G|F>": a block's running factors (`Block.factor_names`);
- "method:<method>:<layer>:decomposition:<factor>:<k>": under "replicated", tensor k of
  a full factor's decomposition (`Method.decomposition_parts`; <method> the `method`
  setting's name, or the class name of a method object);
- "method:<method>:<layer>:<state><k>": the method's state of a block (`EigenAdam`'s
  "moment0", ...);
- "adaptive_staleness:<name>": the per-block schedule of adaptive stale statistics;
- "grafting:adam_v:<layer>.<variable>": grafting's Adam v of a model variable (of a
  variable no layer holds: "#<i>", its position among the model's variables);
- under "owner", the state a resumed owner rebuilds from: "block:<layer>:decomposed:<factor>",
  the method's state under its key above, "curvature:decomposed_damping",
  "adaptive_staleness:decomposed_dampings";
- "momentum_coupling:peak_learning_rate";
- "self_tuning:<name>" (λ, γ and the logged α, μ, M(δ), h(θ), ρ) and
  "self_tuning:previous_update:<variable path>" (δ₀): self-tuning's (docs/design.md §14);
- "<name>:<parts>": a transform of the `transforms` setting's, under its `name`.
Each transform of the update chain (tfkfac/chain.py) names its own.
A load matches keys, not positions: a key the model lacks or a missing one (another
architecture, method, placement or setting) is a ValueError naming them.

Saves from before the keys (.keras files with keys "0", "1", ...) and every
`tf.train.Checkpoint` (`keras_integration.checkpoint_children`; one that also holds
`KFAC.state_by_key()`, as the trainer's do, restores K-FAC's variables by key) hold the
variables in `KFAC.variables` order, which is therefore kept: the inner optimizer's, the counters,
per block its factors and, under "replicated", its decompositions and the method's
state, grafting's moments, then under "owner" the rebuild state (per block the decomposed
factors and the method's state, then the damping), then the momentum coupling's: each
transform's in chain order but the rebuild state, which comes after the transforms of
the gradients so that saves written before it existed still line up
(`chain.UpdateChain.saved_variables`; tests/test_saved_state_compat.py and
tests/test_resume_matrix.py guard the order).
A checkpoint restored before the optimizer is built fills each variable as it is made,
from its position (`KFAC._take_restored_values`).
"""

import collections
import dataclasses

import tensorflow as tf

from tfkfac import transform


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


class Counters:
    """int64 step counters, each an optimizer variable named as its attribute."""

    NAMES = ("skipped_steps", "factor_updates", "skipped_factor_updates",
             "decomposition_updates", "failed_decompositions", "next_factor_step",
             "next_decomposition_step")

    def __init__(self, add_variable):
        for name in self.NAMES:
            setattr(self, name, add_variable((), name, "int64"))

    def variables(self):
        return [getattr(self, name) for name in self.NAMES]

    def saved_variables(self):
        return [(key("counters", name), getattr(self, name)) for name in self.NAMES]

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
    """K-FAC's variables inside its optimizer, named and in `KFAC.variables` order: the
    counters, then the update chain's transforms' (`chain.UpdateChain.saved_variables`).
    Values loaded before the state exists (a save loaded before `attach`) wait here
    until it is created."""

    def __init__(self):
        self.counters, self._chain, self._waiting = None, None, None

    def create(self, add_variable, chain, model_variables, variable_paths):
        """`add_variable(shape, name, dtype, initializer="zeros")` makes an optimizer
        variable; `variable_paths` name `model_variables` in keys (`chain.variable_paths`)."""
        self.counters = Counters(add_variable)
        self._chain = chain
        chain.create_state(transform.StateContext(add_variable, model_variables,
                                                  variable_paths, self.counters))
        if self._waiting is not None:
            self.load(self._waiting)

    def saved_variables(self, inner=()):
        """(key, variable) of `inner` (the inner optimizer's variables) under "inner:<i>",
        then of every variable of K-FAC's, in `variables` order."""
        own = [] if self.counters is None else unique_keys(
            self.counters.saved_variables() + self._chain.saved_variables())
        return [(key(INNER, i), variable) for i, variable in enumerate(inner)] + own

    def variables(self):
        return [variable for _, variable in self.saved_variables()]

    def load(self, values, inner=()):
        """Assign saved `values` to `inner` (the inner optimizer's variables) and to
        K-FAC's: {key: value} by key, each checked before any is assigned
        (`assign_by_key`), or from a save written before the keys a list, `inner`'s then
        K-FAC's in `variables` order. K-FAC's wait until `create` if the state does not
        exist yet. A list without an owner's rebuild state (written before tfkfac saved
        it) loads the rest; the owner then recomputes its decompositions from the
        restored factors (`Curvature.restored`)."""
        if isinstance(values, dict):
            own = {name: v for name, v in values.items() if not name.startswith(INNER + ":")}
            if self.counters is None:
                assign_by_key(self.saved_variables(inner), {
                    name: v for name, v in values.items() if name not in own})
                self._waiting = own or None
                return
            assign_by_key(self.saved_variables(inner), values)
            complete = True
        else:
            for variable, value in zip(inner, values):
                variable.assign(value)
            values = values[len(inner):]
            if self.counters is None:
                self._waiting = values or None
                return
            variables = self.variables()
            rebuild = len(self._chain.curvature.rebuild_variables())
            complete = not rebuild or len(values) != len(variables) - rebuild
            restore(variables if complete else variables[:-rebuild], values)
        self._waiting = None
        self._chain.curvature.restored(complete)


INNER = "inner"  # the owner of the inner optimizer's saved variables


def key(*parts):
    """A saved variable's key: `parts` joined by ":", "/" (of a nested layer's or a
    variable's path) written "." (a key holds no "/": an HDF5 store reads that as groups)."""
    return ":".join(str(part).replace("/", ".") for part in parts)


def unique_keys(saved):
    """(key, variable) pairs `saved` with each repeat of a key suffixed "#<n>", n ≥ 2 its
    occurrence (layer paths "a/b" and "a.b" both read "a.b")."""
    seen = collections.Counter()
    unique = []
    for name, variable in saved:
        seen[name] += 1
        unique.append((name if seen[name] == 1 else f"{name}#{seen[name]}", variable))
    return unique


def indexed(keys):
    """Whether a .keras file's optimizer `keys` are positions ("0", "1", ...: a save
    from before the keys) rather than names."""
    return all(k.isdigit() for k in keys)


def assign_by_key(saved, values):
    """Assign each of `values` ({key: array}) to the variable of `saved` ((key, variable)
    pairs) under its key, cast to its dtype; a ValueError naming the keys that are not in
    both, or whose shapes differ, before anything is assigned."""
    check_keys({name: tuple(value.shape) for name, value in values.items()},
               {name: tuple(variable.shape) for name, variable in saved})
    for name, variable in saved:
        variable.assign(tf.cast(values[name], variable.dtype))


def check_keys(saved, here):
    """A ValueError naming the keys that are not in both `saved` and `here` ({key:
    shape}: a save's and this optimizer's), or whose shapes differ."""
    missing = [name for name in here if name not in saved]
    unexpected = [name for name in saved if name not in here]
    if missing or unexpected:
        raise ValueError(
            "The saved optimizer state does not match this KFAC's: "
            + "; ".join(f"{what} {listed(names)}" for what, names in (
                ("missing from the save:", missing),
                ("in the save but not here:", unexpected)) if names)
            + ". Load it into the architecture and K-FAC settings (method, placement, "
            "grafting, ...) it was saved with.")
    reshaped = [f"{name} (saved {saved[name]}, here {shape})"
                for name, shape in here.items() if saved[name] != shape]
    if reshaped:
        raise ValueError("The saved optimizer state does not match this KFAC's: shapes "
                         f"differ for {listed(reshaped)}. Load it into the architecture "
                         "it was saved with.")


def listed(names, most=20):
    """`names` (keys, positions) joined by commas, the first `most` of them."""
    shown = ", ".join(map(str, names[:most]))
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


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
