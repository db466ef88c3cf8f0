"""KFAC's public view of its curvature: factors, preconditioning, exact curvature products,
counters, summary.

For checking tfkfac against another K-FAC, or custom updates (docs/guide.md §2). A mixin of
`tfkfac.KFAC`, kept apart from the optimizer's training logic.
"""

import tensorflow as tf

from tfkfac import ggn, keras_integration, state as state_lib
from tfkfac.attachment import NOT_ATTACHED


NO_DECOMPOSITIONS = ("it needs decompositions: train at least one step first (factors and "
                     "decompositions are computed in the training step).")
STALE = ("this rank's decompositions are not current: placement \"owner\" does not save "
         "them, and the first training step after a restore rebuilds them from the saved "
         "factors. Train one step first.")


class CurvatureAPI:
    """Reads KFAC's public parts: `curvature`, `state`, `communicator`, `skipped_layers`,
    `attached_model`, `damping_at` and `iterations`."""

    def factors(self, layer):
        """The running curvature factors of `layer` (a Keras layer, its path or its name).

        A dict of float32 tensors named as in docs/design.md: {"A": ..., "G": ...} for
        Kronecker blocks (a batch of pairs, e.g. per group, has a leading axis; an
        Embedding's A is the diagonal as a vector), {"F": ...} for diagonal blocks.
        """
        if self.curvature is None:
            raise RuntimeError(f"KFAC.factors: {NOT_ATTACHED}")
        if self.state.counters is None:
            raise RuntimeError("KFAC.factors: the optimizer has no state yet; it is made "
                               "at the first training step (or `optimizer.build(variables)`)")
        return self.curvature.factors(layer)

    def precondition(self, gradients, variables):
        """`gradients` of `variables` preconditioned with the current decompositions.

        What the update receives, before the KL clip: managed variables' gradients become
        (curvature + λI)⁻¹ ∇ per docs/design.md; the others come back unchanged. Usable
        eagerly or in a `tf.function` (under a tf.distribute strategy, inside
        `strategy.run`), after a training step has computed decompositions, and after a
        restore under placement "owner" once a training step has rebuilt this rank's;
        before, it raises (in a `tf.function`, when it runs). In a multi-process job
        every rank calls it (placement "owner" gathers).
        """
        if self.state.counters is None:
            raise RuntimeError(f"KFAC.precondition: {NO_DECOMPOSITIONS}")
        damping = self.damping_at(self.iterations)
        precondition = lambda: self.curvature.precondition(
            list(gradients), list(variables), damping, step=self.iterations,
            update_state=False).grads()
        updates = self.state.counters.decomposition_updates
        current = self.curvature.decompositions_current
        if not tf.executing_eagerly():
            with tf.control_dependencies([
                    tf.debugging.Assert(updates > 0, [f"KFAC.precondition: {NO_DECOMPOSITIONS}"]),
                    tf.debugging.Assert(current, [f"KFAC.precondition: {STALE}"])]):
                return precondition()
        # `.numpy()`: in cross-replica context a strategy's variable reads as its first
        # replica's.
        if not updates.numpy():
            raise RuntimeError(f"KFAC.precondition: {NO_DECOMPOSITIONS}")
        if not current.numpy():
            raise RuntimeError(f"KFAC.precondition: {STALE}")
        return precondition()

    def exact_curvature_products(self, x, vectors, sample_weight=None, training=True):
        """[F v for v in `vectors`]: products with the exact Fisher/GGN F = Jᵀ H_L J of the
        model's compiled loss on the batch `x`, averaged over the batch and over ranks as
        the gradient is (docs/design.md §14); each a list of tensors aligned with the
        model's trainable variables, as each vector is.

        Why: K-FAC's Kronecker factors approximate F, and the exact products are what
        measures a direction with the true curvature: self-tuning's quadratic model
        (`self_tuning=True`) is built from them, and a check of how far vᵀ(F̆ + λI)v is
        from vᵀ F v needs them. J v comes from forward mode, Jᵀ u from reverse mode.
        `sample_weight`: the loss's weights of the examples; `training`: run the forward
        pass in training mode (BatchNorm's batch statistics, dropout), after which the
        model's non-trainable variables are put back. In a multi-process job every rank
        calls it on its own batch (under tf.distribute, inside `strategy.run`).
        """
        model = self.attached_model()
        return ggn.products(lambda: model(x, training=training), model.trainable_variables,
                            vectors, ggn.output_curvature(model.loss), sample_weight,
                            self.communicator, state=model.non_trainable_variables)

    def summary(self):
        """Managed and skipped layers, factor shapes, state size, counters, timings."""
        return {"managed": [], "state_bytes": 0,
                **(self.curvature.summary() if self.curvature else {}),
                "skipped": self.skipped_layers, "counters": self.counters(),
                "phase_seconds": self.curvature.clocks.values() if self.curvature else {}}

    def rebuild_state(self):
        """Under placement "owner", the saved variables a restored owner rebuilds its
        decompositions from, the last of `variables` (docs/design.md §6); none otherwise.
        Saves of tfkfac 0.2.0 lack them: restored without them, the owner rebuilds from
        the restored factors at its first step, with a warning."""
        if self.state.counters is None:
            return []
        return self.curvature.rebuild_variables()

    def saved_keys(self):
        """[(key, shape)] of the variables a save of this optimizer holds, in `variables`
        order: a .keras file's keys (tfkfac/state.py). A checkpoint holding them by
        position (`tf.train.Checkpoint`) can record these to check a restore by name
        (`check_saved_keys`)."""
        return [(key, list(variable.shape)) for key, variable in
                self.state.saved_variables(self.inner_optimizer.variables)]

    def state_by_key(self):
        """K-FAC's saved variables (`saved_keys` but the inner optimizer's) in a trackable
        dict by key, for a `tf.train.Checkpoint` that saves and restores them by name
        rather than by their position in `variables` (trainers/checkpoints.py), under a
        child name sorted before the optimizer's: a `tf.train.Checkpoint` orders its
        children by name and binds each variable by the first child that holds it. Call it once the
        optimizer is built: the same dict, grown with the variables made since."""
        by_key = self.__dict__.get("_state_by_key")
        if by_key is None:
            by_key = tf.__internal__.tracking.wrap({})
            keras_integration.set_untracked(self, "_state_by_key", by_key)
        for key, variable in self.state.saved_variables():
            if key not in by_key:
                by_key[key] = variable
        return by_key

    def check_saved_keys(self, saved):
        """ValueError unless `saved` (another optimizer's `saved_keys`) names the variables
        this one has, with their shapes, in the same order: each key missing on either
        side or with another shape is named, as a .keras load names them."""
        here = self.saved_keys()
        state_lib.check_keys({key: tuple(shape) for key, shape in saved},
                             {key: tuple(shape) for key, shape in here})
        order = [key for key, _ in saved]
        if order != [key for key, _ in here]:
            position = next(i for i, (a, (b, _)) in enumerate(zip(order, here)) if a != b)
            raise ValueError(
                "The saved optimizer state holds this KFAC's variables in another order "
                f"(position {position}: saved {order[position]}, here {here[position][0]}): "
                "a save by position would load them into the wrong variables. Load it into "
                "the architecture it was saved with.")

    def counters(self):
        """{name: int} of the steps taken and K-FAC's work so far (factor updates,
        decompositions, skipped and failed ones); empty before the state exists."""
        if self.state.counters is None:
            return {}
        counters = self.state.counters.values()
        return {"steps": int(self.iterations.numpy()),
                **{name: counters[name] for name in state_lib.Counters.NAMES
                   if not name.startswith("next_")}}
