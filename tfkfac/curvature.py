"""The curvature of all managed layers: factors, decompositions, preconditioning.

`Curvature` runs the three K-FAC phases of a step on its blocks' state (docs/design.md):
running averages of the factor statistics (one grouped reduction over ranks), damped
decompositions spread over ranks by the placement, and the preconditioning of gradients.
Factors and decompositions are updated when their interval schedule says they are due,
or, with adaptive stale statistics (`tfkfac.adaptive_staleness`), each block's factors
on its own schedule and its decompositions only after its factors were refreshed.
It is the first transform of the update chain (tfkfac/chain.py), and `scheduled` runs a
step's phases around the chain's gradient stage. It holds no Keras optimizer logic.
"""

import dataclasses
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfkfac import adaptive_staleness, distributed, methods, schedules, state as state_lib
from tfkfac import transform
from tfkfac.blocks.base import batch_size
from tfkfac.runtime_warnings import warn_if


# `Curvature.decomposed_damping` before the first decomposition (dampings are > 0).
NOT_DECOMPOSED = -1.0


@dataclasses.dataclass
class Preconditioned:
    """One step's gradients after preconditioning, for the transforms that follow
    (tfkfac/chain.py).

    `raw`: the gradients as given, aligned with `variables`; `slots`: per block the
    indices of its variables there (None: a frozen block); `blocks`: per block its
    preconditioned gradients and `block_grads` its raw ones, both in the state dtype
    (a missing raw gradient as zeros).
    """

    raw: list
    variables: list
    slots: list
    blocks: list
    block_grads: list

    def grads(self, blocks=None):
        """`raw` with every managed variable's gradient replaced by its block's entry of
        `blocks` (default the preconditioned ones), cast to the variable's dtype."""
        grads = list(self.raw)
        for block_slots, values in zip(self.slots, self.blocks if blocks is None else blocks):
            for i, value in zip(block_slots or [], values):
                grads[i] = tf.cast(value, self.variables[i].dtype)
        return grads


class Curvature(transform.Transform):
    """Blocks, their state (`state.BlockState` each) and the phases that update it.

    `config` (a `tfkfac.KFACConfig`) gives the method (`tfkfac.methods`: what a
    decomposition holds, how pieces are preconditioned, the state it keeps per block),
    the factors' decay, the wire
    dtypes, the share of each batch the factors use and the state dtype (float32, or
    float64 for checks against a float64 reference) that factors, decompositions and
    preconditioning run in. `config.xla` (True, False or "auto": when a GPU is visible)
    compiles the factor statistics and the preconditioning. Decompositions never use
    XLA: XLA:CPU lowers eigh to a Jacobi solver (docs/benchmarks.md), and on CPU they run
    in LAPACK (`tfkfac.linalg`). `clocks` (a `state.PhaseClocks`) times the phases.
    """

    name = "curvature"

    def __init__(self, blocks, placement, comm, config, clocks):
        self.blocks, self.placement, self.comm, self.clocks = blocks, placement, comm, clocks
        self.method = config.preconditioning_method()
        self.factor_decay = config.factor_decay
        self.factor_wire_dtype = config.factor_wire_dtype
        self.decomposition_wire_dtype = config.decomposition_wire_dtype
        self.dtype = tf.as_dtype(config.state_dtype)
        self.factor_batch_fraction = config.factor_batch_fraction
        self.states = None
        self.counters = None
        self.decomposed_damping = None
        self.adaptive = (None if config.stale_threshold is None else
                         adaptive_staleness.AdaptiveStaleness(config.stale_threshold,
                                                              config.max_factor_interval))
        self._frozen = set()
        self.factor_interval = schedules.interval("factor_update_freq",
                                                  config.factor_update_freq)
        self.decomposition_interval = schedules.interval("decomposition_update_freq",
                                                         config.decomposition_update_freq)
        self.overlap_reduction = config.overlap_reduction
        # Per block, whether its preconditioning reads its factors (then it waits for the
        # factor update; with `overlap_reduction` the others run while it is reduced).
        self.reads_factors = [any(self.method.reads_factors(p) for p in block.pieces())
                              for block in blocks]
        if config.overlap_reduction:
            _check_overlap(self.method, blocks, self.reads_factors, comm)
        xla = config.xla
        jit = bool(tf.config.list_physical_devices("GPU")) if xla == "auto" else xla
        # Not converted by AutoGraph: their Python loops run over shapes and blocks, never
        # over tensors, and converting them took most of the first step's tracing.
        self._statistics_fn = tf.function(self._batch_statistics, jit_compile=jit,
                                          autograph=False)
        self._decompose_fn = tf.function(self._decompose, autograph=False)
        self._precondition_fn = tf.function(self._precondition, jit_compile=jit,
                                            autograph=False)

    # ----------------------------------------------------------------- state
    def create_state(self, context):
        """Create every block's factors, held decompositions and, under "replicated", the
        method's state (the eigenbasis moments of `EigenAdam`), in a stable order, then
        the adaptive schedule's state (with adaptive stale statistics only), with
        `context.add_variable` (a `transform.StateContext`, whose counters this curvature
        keeps). An owner's decompositions are rank-specific and not saved; it saves the
        state it rebuilds them from after a restore instead (`_create_rebuild_state`).
        """
        add_variable = context.add_variable
        self.counters = context.counters
        self.states = []
        for b, block in enumerate(self.blocks):
            factors = [add_variable(shape, f"{block.name}_factor{i}", self.dtype)
                       for i, shape in enumerate(block.factor_shapes())]
            decompositions = None
            if self.placement.holds_decompositions(b):
                decompositions = [
                    [self._decomposition_variable(add_variable, part,
                                                  f"{block.name}_decomp{j}_{k}", block)
                     for k, part in enumerate(self.method.decomposition_parts(shape))]
                    for j, shape in enumerate(methods.full_factor_shapes(block))]
            method_state = None
            if self.placement.saves_decompositions:
                method_state = self._method_state_variables(add_variable, block)
            self.states.append(state_lib.BlockState(factors, decompositions, method_state))
        if self.adaptive is not None:
            self.adaptive.create_state(add_variable, len(self.blocks))
        with tf.init_scope():
            self.decompositions_current = tf.Variable(
                self.placement.saves_decompositions, trainable=False,
                name="decompositions_current")
        self._create_rebuild_state(add_variable)

    def _create_rebuild_state(self, add_variable):
        """Under "owner", on every rank, all a resumed owner needs to go on as the
        uninterrupted run, whichever rank wrote the checkpoint: per block with
        decompositions a copy of the factors they were last computed from (in host
        memory), the method's state of every block (`EigenAdam`'s moments), and the
        damping of the decompositions (`NOT_DECOMPOSED` until the first; with adaptive
        stale statistics also per block)."""
        self.decomposed_damping = None
        if self.placement.saves_decompositions:
            return
        for block, state in zip(self.blocks, self.states):
            if block.symmetric_factors():
                with tf.device("/CPU:0"):
                    state.decomposed = [
                        add_variable(shape, f"{block.name}_decomposed{i}", self.dtype)
                        for i, shape in enumerate(block.factor_shapes())]
            state.method_state = self._method_state_variables(add_variable, block)
        self.decomposed_damping = add_variable(
            (), "decomposed_damping", self.dtype, keras.initializers.Constant(NOT_DECOMPOSED))
        if self.adaptive is not None:
            self.adaptive.create_rebuild_state(add_variable, len(self.blocks), self.dtype)

    def _method_state_variables(self, add_variable, block):
        """The method's state of `block` (none for a method without), from zero."""
        return [add_variable(shape, f"{block.name}_{self.method.state_name}{k}", self.dtype)
                for k, shape in enumerate(methods.state_shapes(self.method, block))]

    def _decomposition_variable(self, add_variable, part, name, block):
        """A variable for `part` (a `methods.Part`) of a decomposition of `block`, held
        where the placement holds decompositions: saved if they are. A matrix part is
        stored in the block's `product_dtype` when set (docs/design.md §9): cast once
        when computed rather than at every preconditioning product."""
        shape = part.shape
        dtype = block.product_dtype if part.matrix and block.product_dtype else self.dtype
        initializer = state_lib.identities if part.matrix else "zeros"  # until step 0
        if self.placement.saves_decompositions:
            return add_variable(shape, name, dtype, initializer)
        # Not an optimizer variable: outside `variables`, so checkpoints skip it.
        with tf.init_scope():
            return keras.Variable(keras.initializers.get(initializer)(shape, dtype),
                                  trainable=False, name=name)

    def saved_variables(self):
        """(key, variable) of the saved state (keys: tfkfac/state.py): per block its
        factors, then under "replicated" its decompositions and the method's state; then
        the adaptive schedule's state, if any; then an owner's rebuild state
        (`rebuild_variables`)."""
        saved = []
        for block, state in zip(self.blocks, self.states):
            saved += self._named_factors(block, "factor", state.factors)
            if self.placement.saves_decompositions:
                full = [block.factor_names()[j] for j in block.symmetric_factors()]
                saved += [(self._method_key(block, "decomposition", name, k), variable)
                          for name, parts in zip(full, state.decompositions or [])
                          for k, variable in enumerate(parts)]
                saved += self._named_method_state(block, state)
        return (saved + (self.adaptive.saved_variables() if self.adaptive is not None else [])
                + self._saved_rebuild_variables())

    def _saved_rebuild_variables(self):
        """(key, variable) of `_create_rebuild_state`'s variables (none under
        "replicated")."""
        if self.decomposed_damping is None:
            return []
        saved = []
        for block, state in zip(self.blocks, self.states):
            saved += (self._named_factors(block, "decomposed", state.decomposed or [])
                      + self._named_method_state(block, state))
        return saved + [(state_lib.key("curvature", "decomposed_damping"),
                         self.decomposed_damping)] + (
            self.adaptive.saved_rebuild_variables() if self.adaptive is not None else [])

    def rebuild_variables(self):
        return [variable for _, variable in self._saved_rebuild_variables()]

    @staticmethod
    def _named_factors(block, kind, variables):
        return [(state_lib.key("block", block.path, kind, name), variable)
                for name, variable in zip(block.factor_names(), variables)]

    def _named_method_state(self, block, state):
        return [(self._method_key(block, f"{self.method.state_name}{k}"), variable)
                for k, variable in enumerate(state.method_state or [])]

    def _method_key(self, block, *parts):
        """The key of the method's variable `parts` of `block`: under the method's name."""
        return state_lib.key("method", self.method.name or type(self.method).__name__,
                             block.path, *parts)

    def restored(self, complete):
        """After a save was loaded into the state: an owner's decompositions are stale
        until rebuilt (the next training step). Without the rebuild state (`complete`
        False: a save written before tfkfac saved it) the owner rebuilds from the
        restored factors instead, with a warning, and the method's state starts from
        zero."""
        self.decompositions_current.assign(self.placement.saves_decompositions)
        if not complete:
            self.decomposed_damping.assign(NOT_DECOMPOSED)
            for state in self.states:
                for variable in state.method_state or []:
                    variable.assign(tf.zeros_like(variable))

    def block_of(self, layer):
        """The block managing `layer`: a Keras layer, its path ("mha/query") or its name."""
        if isinstance(layer, str):
            found = ([b for b in self.blocks if b.path == layer]
                     or [b for b in self.blocks if b.name == layer])
        else:
            found = [b for b in self.blocks if b.layer is layer]
        if len(found) == 1:
            return found[0]
        if found:
            raise ValueError(f"`layer` {layer!r} names {len(found)} managed layers; pass the "
                             f"layer or its path, one of {[b.path for b in found]}")
        raise ValueError(f"`layer` must be a K-FAC-managed layer, its path or its name, one "
                         f"of {[b.path for b in self.blocks]}; received {layer!r}")

    def factors(self, layer):
        block = self.block_of(layer)
        state = self.states[self.blocks.index(block)]
        return {name: tf.convert_to_tensor(v)
                for name, v in zip(block.factor_names(), state.factors)}

    # --------------------------------------------------------------- factors
    def _batch_statistics(self, calls, weights, keep, due=None):
        """Per block its factor statistics of this batch; with `due` (per block, adaptive
        stale statistics) zeros for a block not due, whose statistics are not computed."""
        batch = None if keep is None else batch_size(calls[0])
        calls = tf.nest.map_structure(
            lambda t: tf.cast(t, self.dtype) if t.dtype.is_floating else t, calls)
        if weights is not None:
            weights = tf.cast(weights, self.dtype)
        statistics = []
        for b, (block, block_calls) in enumerate(zip(self.blocks, calls)):
            def block_statistics(block=block, block_calls=block_calls):
                block_weights = weights
                if keep is not None:
                    block_calls, block_weights = block.take_examples(block_calls, weights,
                                                                     keep, batch)
                return [tf.cast(s, self.dtype) for s in block.batch_statistics(
                    block_calls, batch_size(block_calls), block_weights)]

            if due is None:
                statistics.append(block_statistics())
            else:
                statistics.append(tf.cond(due[b], block_statistics, lambda block=block: [
                    tf.zeros(shape, self.dtype) for shape in block.factor_shapes()]))
        return statistics

    def update_factors(self, calls, weights=None, step=0, due=None):
        """Fold this batch's statistics into the running factors of every block, or of
        the blocks `due` says (adaptive stale statistics; the others keep theirs).
        Returns (whether the statistics were finite, with `due` per block the relative
        change of its factors, `adaptive_staleness.relative_change`, else None).

        `weights` (N,): per-example weights of the statistics, mean 1 over the examples
        of all ranks (docs/design.md §7); None counts every example once. With a
        `factor_batch_fraction` below 1 the statistics come from the examples
        `kept_examples` draws for `step` (docs/design.md §8).
        """
        keep = None
        if self.factor_batch_fraction < 1 and calls:
            keep = kept_examples(batch_size(calls[0]), self.factor_batch_fraction, step,
                                 self.comm.rank)
        statistics = (self._statistics_fn(calls, weights, keep) if due is None
                      else self._statistics_fn(calls, weights, keep, due))
        flat = iter(distributed.allreduce_symmetric(
            self.comm, [s for block_stats in statistics for s in block_stats],
            self.factor_wire_dtype, "factors"))
        batch_values = [[next(flat) for _ in state.factors] for state in self.states]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(s))
                                for values in batch_values for s in values])
        decay = tf.cast(tf.where(tf.equal(self.counters.factor_updates, 0), 0.0,
                                 self.factor_decay), self.dtype)
        changes = []
        for b, (state, values) in enumerate(zip(self.states, batch_values)):
            fold = finite if due is None else tf.logical_and(finite, due[b])
            old = [tf.convert_to_tensor(v) for v in state.factors]  # read before the update
            new = [tf.where(fold, decay * before + (1.0 - decay) * batch_value, before)
                   for before, batch_value in zip(old, values)]
            for variable, value in zip(state.factors, new):
                variable.assign(value)
            if due is not None:
                changes.append(adaptive_staleness.relative_change(old, new))
        self.counters.factor_updates.assign_add(tf.cast(finite, tf.int64))
        self.counters.skipped_factor_updates.assign_add(1 - tf.cast(finite, tf.int64))
        warn_if(tf.logical_not(finite),
                "KFAC warning: non-finite factor statistics; factor update skipped")
        if due is None:
            return finite, None
        return finite, (tf.stack(changes) if changes else tf.zeros([0], tf.float64))

    def update_factors_if_due(self, step, calls, interval, weights=None, ready=True):
        """`update_factors(calls(), weights)` at a due step (`interval(step)` steps after
        the last one); with adaptive stale statistics, of the blocks due at `step`, at a
        step where any is (docs/design.md §12). `calls` is a function, called in the due
        branch only: whatever makes the calls (the output gradients' unscaling) runs on
        factor steps alone. The counters' `next_factor_step` is the next step with
        factors due, which the stale steps (`tfkfac.stale_steps`) are chosen from.

        A step that is not `ready` (no fresh example on any rank, docs/design.md §7)
        updates nothing; due work waits for the next ready step.
        """
        if self.adaptive is None:
            def update():
                updated, _ = self.update_factors(calls(), weights, step)
                self.counters.next_factor_step.assign(step + interval(step))
                return updated

            due = tf.logical_and(step >= self.counters.next_factor_step, ready)
            return tf.cond(due, update, lambda: tf.constant(False))

        blocks_due = tf.logical_and(self.adaptive.due(step), ready)

        def update_due_blocks():
            updated, changes = self.update_factors(calls(), weights, step, blocks_due)
            self.counters.next_factor_step.assign(self.adaptive.refreshed(
                step, blocks_due, updated, changes, interval(step)))
            return updated

        return tf.cond(tf.reduce_any(blocks_due), update_due_blocks,
                       lambda: tf.constant(False))

    # -------------------------------------------------------- decompositions
    def _decompose(self, items, factors, damping, pending=None):
        """{item: its decomposition of `factors` with `damping`, a scalar or one per
        block}; with `pending` (per block, adaptive stale statistics), zeros in place of
        the decomposition of a block not pending, which is not computed."""
        def decomposition(b, j):
            block_damping = damping if damping.shape.rank == 0 else damping[b]
            return methods.decompose_factor(self.method, self.blocks[b], j, factors[b],
                                            block_damping)

        def if_pending(b, j):
            shapes = self.placement.decomposition_shapes((b, j))
            if not shapes:  # a method may keep no decomposition
                return decomposition(b, j)
            return tf.cond(pending[b],
                           lambda: [tf.cast(r, self.dtype) for r in decomposition(b, j)],
                           lambda: [tf.zeros(shape, self.dtype) for shape in shapes])

        return {(b, j): decomposition(b, j) if pending is None else if_pending(b, j)
                for b, j in items}

    def update_decompositions(self, damping):
        """Recompute the decompositions this rank holds (with adaptive stale statistics,
        of the blocks whose factors were refreshed since their last one); returns how
        many failed. Under "owner" every rank also keeps the factors and damping they
        came from."""
        pending = None if self.adaptive is None else self.adaptive.pending()
        factors = [s.factor_values() for s in self.states]
        failed = self._hold_decompositions(
            factors, damping if pending is None else tf.fill(tf.shape(pending), damping),
            pending)
        for b, (state, values) in enumerate(zip(self.states, factors)):
            for copy, value in zip(state.decomposed or [], values):
                copy.assign(value if pending is None else tf.where(pending[b], value, copy))
        if self.decomposed_damping is not None:
            self.decomposed_damping.assign(damping)
        if self.adaptive is not None:
            self.adaptive.decomposed(pending, damping)
        self.counters.failed_decompositions.assign_add(failed)
        # The steps that decomposed (with adaptive stale statistics, any block: a due step
        # with none refreshed since its last decomposition decomposes nothing).
        self.counters.decomposition_updates.assign_add(
            1 if pending is None else tf.cast(tf.reduce_any(pending), tf.int64))
        return failed

    def rebuild_decompositions(self, damping):
        """An owner's decompositions after a restore, as the run last computed them: from
        the saved decomposed factors and their damping, the inputs of that computation.
        From a save without them (an older tfkfac's), from the restored factors and
        `damping`, with a warning. Counts nothing: the run's computation was counted."""
        saved = self.decomposed_damping >= 0
        warn_if(tf.logical_not(saved), "KFAC warning: the restored state holds no "
                "decomposed factors (saved by an older tfkfac under placement \"owner\"); "
                "decompositions recomputed from the restored factors")
        factors = [[tf.where(saved, copy.value, value) for copy, value in
                    zip(s.decomposed or s.factors, s.factor_values())] for s in self.states]
        if self.adaptive is None:
            return self._hold_decompositions(
                factors, tf.where(saved, self.decomposed_damping.value, damping))
        # Per block, with its damping, through the same graph as `update_decompositions`
        # (another one may round differently); the blocks decomposed are those with a
        # damping (dampings are > 0).
        dampings = self.adaptive.decomposed_dampings
        return self._hold_decompositions(factors, tf.where(saved, dampings.value, damping),
                                         dampings > 0)

    def _hold_decompositions(self, factors, damping, pending=None):
        """This rank's decompositions of `factors` with `damping`, shared as the placement
        says and assigned where finite (and, if given, `pending`: per block whether to
        decompose it); returns how many failed."""
        owned = self.placement.decomposed_items()
        results = {}
        if owned:
            results = (self._decompose_fn(owned, factors, damping) if pending is None
                       else self._decompose_fn(owned, factors, damping, pending))
        results = self.placement.share_decompositions(results, self.decomposition_wire_dtype)
        failures = [tf.constant(False)]
        for (b, j), result in results.items():
            targets = self.states[b].decompositions[self.blocks[b].symmetric_factors().index(j)]
            ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(r)) for r in result]
                               or [True])  # a method may keep no decomposition
            kept = ok if pending is None else tf.logical_and(ok, pending[b])
            for variable, value in zip(targets, result):
                variable.assign(tf.where(kept, tf.cast(value, variable.dtype), variable))
            failures.append(tf.logical_not(ok))
        failed = tf.reduce_sum(tf.cast(failures, tf.int64))
        warn_if(failed > 0, "KFAC warning:", failed,
                "decomposition(s) not finite; keeping the previous ones")
        self.decompositions_current.assign(True)
        return failed

    def decompositions_settled(self, step, ready=True):
        """Whether `update_decompositions_if_due` changes no decomposition at `step`:
        none due, and no owner's to rebuild. Preconditioning then reads what the
        decompositions hold now, so a block's that reads no factors needs nothing of the
        step's factor update (`precondition`'s `during`)."""
        due = tf.logical_and(step >= self.counters.next_decomposition_step, ready)
        settled = tf.logical_not(due)
        if self.decomposed_damping is not None:
            settled = tf.logical_and(settled, tf.logical_or(
                self.decompositions_current, self.counters.decomposition_updates <= 0))
        return settled

    def update_decompositions_if_due(self, step, damping, interval, ready=True):
        """`update_decompositions` at a due and `ready` step (as for factors). Under
        "owner", at another step after a restore, `rebuild_decompositions` (the schedule
        is the saved one); before the first decomposition there is nothing to rebuild.
        With adaptive stale statistics an owner also rebuilds at a due step first: the
        blocks not decomposed there keep what the run computed."""
        def update():
            if self.adaptive is not None and self.decomposed_damping is not None:
                rebuild_if_stale()
            failed = self.update_decompositions(damping)
            self.counters.next_decomposition_step.assign(step + interval(step))
            return failed

        def rebuild_if_stale():
            stale = tf.logical_and(tf.logical_not(self.decompositions_current),
                                   self.counters.decomposition_updates > 0)
            return tf.cond(stale, lambda: self.rebuild_decompositions(damping), none_failed)

        none_failed = lambda: tf.constant(0, tf.int64)
        due = tf.logical_and(step >= self.counters.next_decomposition_step, ready)
        return tf.cond(due, update, none_failed if self.decomposed_damping is None
                       else rebuild_if_stale)

    # ------------------------------------------------------------ the phases
    def scheduled(self, step, captures, gradients, measure_noise=None):
        """`gradients(step)`, the update chain's GRADIENTS stage (which this curvature's
        `apply` begins), on `step` (a `transform.Step`) with the step's phases before it:
        the factor update (from `captures`, the step's `attachment.Captures`) and the
        decompositions when due, then `measure_noise()` if given, which reads them. With
        `overlap_reduction`, at a step whose decompositions are settled, the factor
        update runs inside the preconditioning instead, beside the blocks that do not
        wait for it (docs/design.md §6). A stale step (`tfkfac.stale_steps`) has neither
        phase due. With phase clocks each phase waits for the previous one's results
        (the first for the gradients): the clocks then time them one after another."""
        def update_factors():
            return self.update_factors_if_due(step.step, captures.calls, self.factor_interval,
                                              captures.weights, captures.ready)

        def phases():
            decomposed = step.grads
            if not captures.stale:
                updated = self.clocks.timed("factors", update_factors, after=step.grads)
                decomposed = self.clocks.timed(
                    "decomposition", lambda: self.update_decompositions_if_due(
                        step.step, step.damping, self.decomposition_interval, captures.ready),
                    after=updated)
            if measure_noise is not None:
                measure_noise()
            return self.clocks.timed(
                "precondition", lambda grads: gradients(dataclasses.replace(step, grads=grads)),
                inputs=(step.grads,), after=decomposed)

        def overlapped_phases():
            if measure_noise is not None:  # the plain gradient's: no factors read
                measure_noise()
            return gradients(dataclasses.replace(step, during=update_factors))

        if captures.stale or not self.overlap_reduction:
            return phases()
        return tf.cond(self.decompositions_settled(step.step, captures.ready),
                       overlapped_phases, phases)

    def apply(self, step):
        """The chain's first transform: `step.grads` preconditioned (`precondition`, at
        `step.during`), their `Preconditioned` kept for the transforms after it."""
        preconditioned = self.precondition(step.grads, step.variables, step.damping,
                                           step=step.step, during=step.during)
        return dataclasses.replace(step, grads=preconditioned.grads(),
                                   preconditioned=preconditioned)

    # ------------------------------------------------------- preconditioning
    def _precondition(self, block_indices, block_grads, factors, decompositions, damping,
                      method_state, step):
        """({block: preconditioned gradients}, {block: the method's updated state})."""
        preconditioned, updated = {}, {}
        for b, grads, block_factors, decomposition, state in zip(
                block_indices, block_grads, factors, decompositions, method_state):
            preconditioned[b], updated[b] = methods.precondition_block(
                self.method, self.blocks[b], grads, block_factors, decomposition, damping,
                state, step)
        return preconditioned, updated

    def precondition(self, grads, variables, damping, step=0, update_state=True,
                     during=None):
        """`grads` of `variables` with every managed variable's gradient preconditioned,
        as `Preconditioned`; other gradients pass unchanged.

        A method with state (`EigenAdam`'s moments) updates it with these gradients at
        `step` (0-based) when `update_state` (a training step), else only reads it.
        `during` (the factor update, at a step whose decompositions are settled): called
        after the blocks whose preconditioning reads no factors were preconditioned and
        before the others; nothing links the two, so those blocks' work runs while the
        factor reduction is in flight (`overlap_reduction`, docs/design.md §6).
        """
        if not self.blocks:
            return Preconditioned(list(grads), list(variables), [], [], [])
        slots = self.block_slots(variables)
        # Dense gradients in the state dtype (an Embedding's arrives as IndexedSlices); a
        # frozen block's are zeros (every rank must still take part in "owner"'s gather).
        block_grads = [[tf.zeros(v.shape, self.dtype) for v in block.variables]
                       if block_slots is None else
                       [tf.zeros(variables[i].shape, self.dtype) if grads[i] is None
                        else tf.cast(tf.convert_to_tensor(grads[i]), self.dtype)
                        for i in block_slots] for block, block_slots in zip(self.blocks, slots)]
        indices = self.placement.preconditioned_blocks()
        if during is None:
            local, updated = self._precondition_blocks(indices, block_grads, damping, step)
        else:
            local, updated = self._precondition_blocks(
                [b for b in indices if not self.reads_factors[b]], block_grads, damping, step)
            during()
            late = self._precondition_blocks([b for b in indices if self.reads_factors[b]],
                                             block_grads, damping, step)
            local, updated = {**local, **late[0]}, {**updated, **late[1]}
        # The updated state to store: under "owner" it travels with the preconditioned
        # gradients, so that every rank holds (and saves) every block's.
        updating = update_state and self.placement.method_keeps_state
        preconditioned, updated = self.placement.share_preconditioned(
            local, self.decomposition_wire_dtype, updated if updating else None)
        for b, values in updated.items():
            for variable, value in zip(self.states[b].method_state, values):
                variable.assign(value)
        return Preconditioned(list(grads), list(variables), slots, preconditioned,
                              block_grads)

    def _precondition_blocks(self, indices, block_grads, damping, step):
        """`_precondition` of the blocks `indices` (none: nothing), from their state now."""
        if not indices:
            return {}, {}
        states = [self.states[b] for b in indices]
        return self._precondition_fn(
            tuple(indices), [block_grads[b] for b in indices],
            [s.factor_values() for s in states], [s.decomposition_values() for s in states],
            damping, [s.method_state_values() for s in states], tf.cast(step, self.dtype) + 1)

    def block_slots(self, variables):
        """Per block, the indices of its variables in `variables`; None for a block none
        of whose variables are there (a layer frozen after `attach`: not trained, so not
        preconditioned, with one warning)."""
        index = {id(v): i for i, v in enumerate(variables)}
        slots = []
        for block in self.blocks:
            present = [id(v) in index for v in block.variables]
            if not any(present):
                if block.path not in self._frozen:
                    self._frozen.add(block.path)
                    warnings.warn(f"KFAC: layer {block.path!r} is not being trained (frozen "
                                  "after attach?); its curvature is not used", stacklevel=4)
                slots.append(None)
            elif not all(present):
                missing = [v.path for v, here in zip(block.variables, present) if not here]
                raise ValueError(
                    f"`variables` must hold all or none of layer {block.path!r}'s weights; "
                    f"missing {missing}. Freeze whole layers (`layer.trainable = False`).")
            else:
                slots.append([index[id(v)] for v in block.variables])
        return slots

    def summary(self):
        """Per block its layer, kind and factor shapes (with adaptive stale statistics,
        once the state exists, also its factor interval and next due step); the bytes of
        the state created."""
        managed = [{"layer": b.path, "kind": b.kind,
                    "factor_shapes": [list(s) for s in b.factor_shapes()]}
                   for b in self.blocks]
        if self.adaptive is not None and self.adaptive.intervals is not None:
            intervals, next_steps = [tf.convert_to_tensor(v).numpy() for v in
                                     (self.adaptive.intervals, self.adaptive.next_steps)]
            for entry, interval, due in zip(managed, intervals, next_steps):
                entry.update(factor_interval=int(interval), next_factor_step=int(due))
        state_bytes = 0
        if self.states is not None:
            held = ([] if self.placement.saves_decompositions else  # an owner's, not saved
                    [v for s in self.states for d in s.decompositions or [] for v in d])
            state_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in [
                v for _, v in self.saved_variables()] + held)
        return {"managed": managed, "state_bytes": state_bytes}


def _check_overlap(method, blocks, reads_factors, comm):
    """ValueError when `overlap_reduction` could overlap nothing: one rank (no
    reduction), or no block whose preconditioning reads no factors."""
    if comm.size == 1:
        raise ValueError("`overlap_reduction` overlaps the factor reduction over ranks with "
                         f"preconditioning, and needs several ranks; this job has one "
                         f"({_one_rank()}), where nothing is reduced: set "
                         "overlap_reduction=False")
    if all(reads_factors):
        raise ValueError(
            "`overlap_reduction` preconditions the layers whose preconditioning reads no "
            f"factors while the factors are reduced; under method={method!r} no managed "
            f"layer is one (managed: {[b.path for b in blocks]}): set "
            "overlap_reduction=False")


def _one_rank():
    """What makes this job one rank, in words: the tf.distribute strategy in scope with one
    replica, or one process without one."""
    if tf.distribute.has_strategy():
        strategy = tf.distribute.get_strategy()
        devices = getattr(strategy.extended, "worker_devices", ())
        return (f"{type(strategy).__name__} with {strategy.num_replicas_in_sync} replica, "
                f"on {', '.join(devices) or 'one device'}")
    return "one process, without Horovod or a tf.distribute strategy of several replicas"


def kept_examples(examples, fraction, step, rank):
    """Indices (ascending) of the ceil(fraction · examples) examples of a batch that a
    factor step takes its statistics from (docs/design.md §8): a uniformly random subset,
    drawn from (step, rank) alone, so that a rerun or a resumed run draws the same one
    and each rank its own."""
    count = tf.cast(tf.math.ceil(fraction * tf.cast(examples, tf.float64)), tf.int32)
    seed = tf.stack([tf.cast(step, tf.int64), tf.cast(rank, tf.int64)])
    order = tf.argsort(tf.random.stateless_uniform([examples], seed=seed))
    return tf.sort(order[:tf.maximum(count, 1)])
