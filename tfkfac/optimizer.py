"""`tfkfac.KFAC`: K-FAC preconditioning in front of a Keras optimizer.

    optimizer = tfkfac.KFAC().attach(model)   # the declared default; tune learning_rate
    model.compile(optimizer=optimizer, loss=..., metrics=[...])
    model.fit(dataset, epochs=..., callbacks=[tfkfac.AveragedWeights(optimizer)])

One step (docs/design.md §1): `attachment` records the managed layers' inputs and output
gradients, and the update chain (`chain`, a list of `tfkfac.Transform` objects) takes them: the
curvature (`curvature`) updates factors and decompositions when due and preconditions the
gradients, the KL clip or grafting follows, then the inner optimizer applies them — any
Keras optimizer; by default `tfkfac.ScheduleFreeAdamW`, whose averaged weights
`tfkfac.AveragedWeights` evaluates and exports. Like Keras's `LossScaleOptimizer`, KFAC
forwards `learning_rate` and `iterations` to the inner optimizer, so schedules and
callbacks act on the update rule.
"""

import warnings

import keras
import tensorflow as tf

from tfkfac import blocks as blocks_lib, chain as chain_lib
from tfkfac import curvature as curvature_lib
from tfkfac import distributed, fisher, inner, keras_integration
from tfkfac import placement as placement_lib, schedules, self_tuning, stale_steps
from tfkfac import state as state_lib, transform
from tfkfac.attachment import ATTACH_HINT, Attachment
from tfkfac.config import KFACConfig, signature_with_settings
from tfkfac.curvature_api import CurvatureAPI
from tfkfac.runtime_warnings import warn_if


@keras.saving.register_keras_serializable(package="tfkfac")
class KFAC(CurvatureAPI, keras.optimizers.Optimizer):
    """K-FAC (Martens & Grosse 2015; Grosse & Martens 2016) in front of `inner_optimizer`.

    Args:
      learning_rate, momentum, weight_decay: of the default inner optimizer,
        `tfkfac.ScheduleFreeAdamW(learning_rate, beta_1=momentum, weight_decay=...)`
        (defaults 0.01, 0.9, None; Keras's decoupled decay): the default rule's momentum
        is ScheduleFreeAdamW's β1. It has no warm-up: a library cannot know the run's
        length, so for one set the inner optimizer's `warmup_steps` to about 5% of the
        run's steps, as the trainer does. The learning rate is the one number to tune:
        start at 0.01, about 1-2x what ScheduleFreeAdamW alone would take. Give these
        three only when `inner_optimizer` is not given.
      inner_optimizer: the Keras optimizer that applies the preconditioned gradients
        (not Muon, whose orthogonalization discards K-FAC's scaling, nor an optimizer
        that wraps or holds others).
      communicator: a `tfkfac.distributed` communicator; default
        `tfkfac.distributed.get_communicator("auto")` (Horovod under horovodrun).
      model: if given, `attach(model)` is called.
      config: a `tfkfac.KFACConfig`, in place of its settings as keyword arguments.
      **settings: the fields of `tfkfac.KFACConfig` (docs/arguments.md lists them).
    """

    def __init__(self, learning_rate=None, momentum=None, weight_decay=None, *,
                 inner_optimizer=None, communicator=None, model=None, config=None,
                 name="kfac", **settings):
        inner.refuse_inner_only(settings)
        if config is not None and settings:
            raise ValueError("Pass either `config` or K-FAC settings as keyword arguments "
                             f"(received both `config` and {sorted(settings)})")
        config = config if config is not None else KFACConfig.from_arguments(**settings)
        if not isinstance(config, KFACConfig):
            raise ValueError(f"`config` must be a tfkfac.KFACConfig; received "
                             f"{type(config).__name__}")
        rule = self_tuning.update_rule if config.self_tuning else inner.inner_optimizer
        inner_optimizer = rule(inner_optimizer, learning_rate, momentum, weight_decay)
        super().__init__(learning_rate=0.0, name=name)
        self.config = config
        self.inner_optimizer = inner_optimizer
        self.loss_scale_factor = inner.take_loss_scale_factor(inner_optimizer)
        # KFAC hands it gradients its communicator has averaged over every rank.
        keras_integration.without_replica_sum(inner_optimizer)
        if communicator is not None and not isinstance(communicator,
                                                       distributed.Communicator):
            raise ValueError("`communicator` must be a tfkfac.distributed communicator (from "
                             "tfkfac.distributed.get_communicator) or None; received "
                             f"{type(communicator).__name__}")
        self._comm = distributed.communicator_for(communicator, config.hierarchical_reduction)
        self._init_kfac_fields()
        if model is not None:
            self.attach(model)

    def __getattr__(self, name):
        # Settings read as attributes (`optimizer.damping`), one source: the config.
        config = self.__dict__.get("config")
        if config is not None and name in KFACConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @keras_integration.no_tracking
    def _init_kfac_fields(self):
        self._curvature = None
        self._chain = None
        self._self_tuning = None
        self._state = state_lib.KFACState()
        self._skipped = []
        self._attachment = None
        self._detached = None  # why this KFAC no longer drives the model it was attached to
        self._clocks = state_lib.PhaseClocks(self.config.phase_clocks)
        if self.config.couple_momentum_to_lr:  # refused here, not at attach
            inner.check_couplable(self.inner_optimizer)

    # ------------------------------------------- forwarded to the inner optimizer
    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def variables(self):
        """The inner optimizer's variables, then K-FAC's (the order of tf.train.Checkpoint
        and of .keras files before the keys of tfkfac/state.py)."""
        return self.inner_optimizer.variables + self._kfac_variables()

    def _kfac_variables(self):
        return self._state.variables()

    # ------------------------------------ K-FAC's parts, read by its other modules
    @property
    def communicator(self):
        """The `tfkfac.distributed` communicator that averages over ranks."""
        return self._comm

    @property
    def curvature(self):
        """The attached model's `tfkfac.curvature.Curvature` (blocks, placement, factors);
        None before `attach`."""
        return self._curvature

    @property
    def state(self):
        """K-FAC's variables by name (a `tfkfac.state.KFACState`); its `counters` is None
        until the optimizer is built."""
        return self._state

    @property
    def skipped_layers(self):
        """The attached model's layers K-FAC does not manage, with the reason for each."""
        return list(self._skipped)

    @property
    def _counters(self):
        return self._state.counters

    def finalize_variable_values(self, var_list):
        """The inner optimizer's end of `fit` (with `use_ema`, its averages replace the
        weights)."""
        self.inner_optimizer.finalize_variable_values(var_list)

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Exclude variables from the weight decay of the inner optimizer, which applies
        it; an error if it applies none (`weight_decay` None)."""
        if self.inner_optimizer.weight_decay is None:
            raise ValueError(
                "KFAC.exclude_from_weight_decay: the inner optimizer "
                f"({type(self.inner_optimizer).__name__}) applies no weight decay "
                "(weight_decay=None), so nothing would be excluded; give it a `weight_decay`.")
        self.inner_optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        return keras_integration.checkpoint_children(
            super()._trackable_children(save_type, **kwargs), self)

    # ------------------------------------------------------------------ attach
    @keras_integration.no_tracking
    def attach(self, model):
        """Manage `model`'s supported layers and install the K-FAC train step on it.

        Only this model instance is changed: its `train_step` records layer inputs and
        pre-activation gradients. Layers without a block get the plain gradient.
        Attaching again to the same model changes nothing. A compiled model another KFAC
        is attached to passes to this one (Keras asks for a new optimizer when a model is
        recompiled, e.g. after freezing layers), and the other is detached.
        """
        if not isinstance(model, keras.Model):
            raise ValueError(f"KFAC.attach(model): `model` must be a keras.Model; received "
                             f"{type(model).__name__}")
        if not model.built:
            raise ValueError(
                "KFAC.attach(model): the model is not built. Build it first (give it "
                "an `Input` shape or call it on a batch) so its layers have weights.")
        if self._attachment is not None:
            if self._attachment.model is model:
                return self
            raise ValueError("This KFAC optimizer is already attached to another model "
                             f"({self._attachment.model.name!r}).")
        if self._detached is not None:
            raise ValueError(
                f"KFAC.attach(model): this KFAC optimizer ({self.name!r}) was detached: "
                f"{self._detached}. Its state belongs to that model: make a new KFAC.")
        previous = keras_integration.train_step_owner(model)
        if previous is not None and not model.compiled:
            raise ValueError(
                "KFAC.attach(model): this model is already driven by another KFAC "
                f"({previous.name!r}) and has never been compiled; one model takes one "
                "KFAC: compile it with that one, or attach the new one to a fresh model.")
        layers = keras_integration.leaf_layers(model)
        blocks, self._skipped = blocks_lib.discover(layers, self.config)
        curvature = curvature_lib.Curvature(
            blocks, placement_lib.make_placement(self.config.placement, blocks, self._comm,
                                                 self.config.preconditioning_method(),
                                                 self.config.state_dtype),
            self._comm, self.config, self._clocks)
        self._chain = chain_lib.UpdateChain(chain_lib.transforms(
            self.config, curvature, self.inner_optimizer, lambda: dict(
                model=model, communicator=self._comm,
                batch=lambda: self._attached().step_batch)))
        self._curvature = curvature
        self._self_tuning = next((t for t in self._chain.transforms
                                  if isinstance(t, self_tuning.SelfTuning)), None)
        distributed.check_model_strategy(self._comm, model.distribute_strategy)
        self._comm.broadcast_variables(model.variables, root_rank=0)
        if previous is not None:
            previous._detach(f"KFAC {self.name!r} was attached to model {model.name!r} in "
                             "its place")
        self._attachment = Attachment(model, list(layers.values()), blocks, self._comm,
                                      fresh_only=self.config.factor_examples == "fresh",
                                      count_skipped_step=self._count_skipped_step,
                                      fisher=fisher.sampler(self.config, lambda: self.iterations,
                                                            self._comm.rank))
        keras_integration.install_train_step(
            model, self, self._attachment.train_step, self._attachment.averaged_over_ranks,
            self._detach, stale_steps.StaleSteps(self, self._attachment),
            self._attachment.fresh_only, alone=self._comm.size == 1)
        blocks_lib.warn_unsupported(self._skipped)
        if self.built:
            self._create_kfac_state()
        return self

    def _maybe_initialize_trackable(self):
        # The first `model.compile(optimizer=kfac)` tracks KFAC as the model's attribute,
        # which calls this: the one call Keras makes on an optimizer before the first step
        # outside a tf.distribute strategy (docs/guide.md §2).
        if "_attachment" in self.__dict__ and self._attachment is None:
            model = keras_integration.model_compiling(self)
            if model is not None:
                self._attach_compiled(model)
        return super()._maybe_initialize_trackable()

    def _attach_compiled(self, model):
        """Attach to `model`, compiled with this KFAC without `attach`, as if `attach` had
        come first, if it is built and this KFAC is free; whether this KFAC drives it.

        Called when `compile` takes this KFAC and, for a model recompiled from another
        KFAC (whose train step then hands over), at the next `fit`.
        """
        free = (self._attachment is None and self._detached is None
                and not self.__dict__.get("_attaching"))
        if free and model.built:
            self.__dict__["_attaching"] = True  # attach tracks attributes too
            try:
                self.attach(model)
            finally:
                del self.__dict__["_attaching"]
        return self._attachment is not None and self._attachment.model is model

    @keras_integration.no_tracking
    def _detach(self, reason):
        """Give the model back Keras's train step; this KFAC steps no more (`reason`)."""
        model = self._attachment.model
        if model is not None and keras_integration.train_step_owner(model) is self:
            keras_integration.uninstall_train_step(model)
        self._attachment, self._detached = None, reason

    def attached_model(self):
        """The model this KFAC drives; a RuntimeError saying what to do if none."""
        return self._attached().model

    def _attached(self):
        if self._attachment is None:
            if self._detached is not None:
                raise RuntimeError(
                    f"This KFAC optimizer ({self.name!r}) was detached from its model: "
                    f"{self._detached}. Compile the model with the optimizer attached to "
                    "it, or make a new KFAC and attach it.")
            raise RuntimeError(ATTACH_HINT)
        return self._attachment

    def record(self):
        """Custom loop: a `tf.GradientTape` that also records the managed layers' calls."""
        return self._attached().record()

    def minimize(self, loss, var_list=None, tape=None, fresh=None, sample_weight=None):
        """Custom loop: gradients from `tape` (opened by `record()`), then the update.

        Under a tf.distribute strategy call it inside `strategy.run`, with the loss as
        tf.distribute defines it there: this replica's examples' losses summed and
        divided by the global batch (what Keras's losses and `tf.nn.compute_average_loss`
        give); K-FAC averages the gradients over replicas itself.
        `fresh`: the batch's fresh flags (N,), given exactly when factor_examples="fresh".
        `sample_weight`: the weights (N,) `loss` gives the examples, if any, which weigh
        their factor statistics as under `fit` (docs/design.md §2, sample weights).
        """
        if isinstance(var_list, tf.GradientTape):
            raise ValueError(
                "KFAC.minimize(loss, var_list=None, tape=None, fresh=None): the "
                "GradientTape was passed as `var_list`; pass it as `tape=tape`.")
        if tape is None:
            raise ValueError(
                "KFAC.minimize needs the `tape` returned by `optimizer.record()`.")
        attachment = self._attached()
        if var_list is None:
            var_list = attachment.model.trainable_variables
        attachment.step(tape, loss, list(var_list), self.apply,
                        loss_scale=self.scale_loss(1.0),
                        replicas=keras_integration.replicas_in_sync(), fresh=fresh,
                        sample_weight=sample_weight)

    # ---------------------------------------------------------------- state
    def build(self, var_list):
        if self._attachment is None:
            # Compiled without `attach`: Keras builds the optimizer on the model's
            # variables before the first step under a tf.distribute strategy and in
            # `load_model`; that model is the one to manage.
            model = keras_integration.model_building(self, var_list)
            if model is not None:
                self.attach(model)
            elif tf.inside_function():
                # Keras's own traced train step: it cannot be K-FAC's; no state is made
                # in a graph that fails.
                raise RuntimeError(ATTACH_HINT)
        super().build(var_list)
        keras_integration.set_untracked(self, "_built_variables", list(var_list))
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        if self._attachment is not None:
            self._create_kfac_state()
        else:
            self._take_restored_values()

    def _create_kfac_state(self):
        """K-FAC's variables, after the inner optimizer's (docs: state.py)."""
        if self._counters is not None:
            return
        self._state.create(lambda shape, name, dtype, initializer="zeros": self.add_variable(
            shape, initializer=initializer, dtype=dtype, name=name), self._chain,
            self._built_variables,
            chain_lib.variable_paths(self._attachment.model, self._built_variables))
        # Each counter is also an attribute of its own, as in 0.1: tf.train.Checkpoint
        # keys name a variable by its shortest path (`optimizer/_factor_updates/...`).
        for name, variable in zip(self._counters.NAMES, self._counters.variables()):
            setattr(self, f"_{name}", variable)
        self._take_restored_values()

    def _take_restored_values(self):
        """Give the variables created since the last call the values a
        `tf.train.Checkpoint` restored before they existed holds for them, by their
        position in `variables`, the checkpoint's key (docs/design.md §10), as Keras's
        optimizers take theirs. A ValueError naming the keys, before any is assigned,
        when a value's shape is not its variable's or, once K-FAC's state exists, when
        values wait beyond `variables` (a save of another architecture or settings);
        variables left without a value while others took theirs are named in a warning."""
        variables = self.variables
        wrapper = keras_integration.checkpoint_wrapper(self, variables)
        waiting = keras_integration.waiting_shapes(wrapper)
        if not waiting:
            keras_integration.grow_checkpoint_list(wrapper, variables)
            return
        keys = [key for key, _ in self.saved_keys()]
        joined = range(len(wrapper), len(variables))
        shape = lambda i: tuple(variables[i].shape)
        reshaped = [f"{keys[i]} (saved {sorted(waiting[i])[0]}, here {shape(i)})"
                    for i in joined if waiting.get(i, {shape(i)}) != {shape(i)}]
        beyond = sorted(i for i in waiting if i >= len(variables))
        if reshaped or (beyond and self._counters is not None):
            problem = (f"shapes differ for {state_lib.listed(reshaped)}" if reshaped else
                       f"it holds optimizer variables at positions {state_lib.listed(beyond)}"
                       f", beyond this KFAC's {len(keys)} (its last: {keys[-1]})")
            raise ValueError(
                f"KFAC {self.name!r}: a tf.train.Checkpoint restored into it does not match "
                f"it: {problem}. It was saved with another architecture or K-FAC settings "
                "(method, placement, grafting, ...): restore it into the model and settings "
                "it was saved with.")
        keras_integration.grow_checkpoint_list(wrapper, variables)
        missed = [keys[i] for i in joined if i not in waiting]
        if missed and any(i in waiting for i in joined):
            warnings.warn(
                f"KFAC {self.name!r}: the tf.train.Checkpoint restored into it before it was "
                f"built holds no value for {state_lib.listed(missed)}, which start from "
                "their initial values (a save written before they existed).", stacklevel=2)

    def save_own_variables(self, store):
        """Write every variable under its key (tfkfac/state.py): the inner optimizer's,
        then K-FAC's."""
        for key, variable in self._state.saved_variables(self.inner_optimizer.variables):
            store[key] = variable.numpy()

    def load_own_variables(self, store):
        """Load a save by its keys (a ValueError names those that do not match, before
        anything is assigned): the inner optimizer's variables, then K-FAC's (which wait
        for `attach` if the model is not known yet). A save from before the keys holds
        them in `variables` order."""
        keys = list(store.keys())
        values = ([store[str(i)][...] for i in range(len(keys))] if state_lib.indexed(keys)
                  else {key: store[key][...] for key in keys})
        self._state.load(values, self.inner_optimizer.variables)

    # ---------------------------------------------------------------- update
    def apply(self, grads, trainable_variables=None):
        captures = self._attached().captures()
        if trainable_variables is None:
            trainable_variables = self._attachment.model.trainable_variables
        variables = list(trainable_variables)
        if not self.built:
            with keras_integration.name_scope(self):
                self.build(variables)
        # Again here: Keras's `fit` retries inside the first trace a build that failed
        # before it (`keras_integration._symbolic_build_on_local_batch`), which then finds
        # the optimizer built.
        self._take_restored_values()
        grads = list(grads)
        if self.loss_scale_factor is not None:  # the inner optimizer's, taken over
            grads = [None if g is None else g / self.loss_scale_factor for g in grads]
        step = self.iterations
        damping = self.damping_at(step)
        # Zero is a learning rate schedules reach (decay to zero): only it may be 0.
        schedules.checked("learning_rate", self.learning_rate, step, allow_minimum=True)
        curvature, chain = self._curvature, self._chain
        managed = {id(v) for block in curvature.blocks for v in block.variables}
        # The gradients that reach the update: every one present, and every managed
        # variable's (a missing one is preconditioned as zeros).
        slots = [i for i, (g, v) in enumerate(zip(grads, variables))
                 if g is not None or id(v) in managed]
        measure_noise = None
        if captures.sub_batches is not None:
            measure_noise = lambda: self._measure_noise_scale(  # noqa: E731
                step, grads, variables, damping, captures.sub_batches)

        def gradients(update):
            preconditioned = chain.gradients(update)
            return [preconditioned[i] for i in slots]

        def kfac_step():
            return curvature.scheduled(transform.Step(grads, variables, step, damping),
                                       captures, gradients, measure_noise)

        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g))
                                for g in grads if g is not None])

        def skip_step():
            if not captures.stale:  # a stale step's is printed outside XLA (stale_steps)
                warn_if(tf.constant(True), stale_steps.SKIPPED_WARNING)
            self._count_skipped_step()
            return [tf.zeros_like(variables[i]) if id(variables[i]) in managed else grads[i]
                    for i in slots]  # the structure of kfac_step's; not applied

        # The update runs outside the cond: under a tf.distribute strategy Keras's
        # optimizers update through `merge_call`, which no cond branch may call.
        preconditioned = tf.cond(finite, kfac_step, skip_step)
        applied = self._clocks.timed("update", lambda preconditioned: chain.apply(
            finite, preconditioned, [variables[i] for i in slots]), inputs=(preconditioned,))
        chain.after(transform.Step(grads, variables, finite=finite, applied=applied))

    def measure_noise_scale(self, probe):
        """Measure every training step's gradient noise scale into `probe` (a
        `tfkfac.noise_scale.NoiseScaleProbe`; `tfkfac.GradientNoiseScale` makes one) from
        now on; whether that changed the train step."""
        attachment = self._attached()
        if probe.preconditioned and self.config.placement == "owner" and self._comm.size > 1:
            raise ValueError(
                "GradientNoiseScale: the preconditioned gradient's noise scale needs each "
                "rank's own gradient preconditioned, and under placement='owner' a rank "
                "holds only its own blocks' decompositions; use placement='replicated', or "
                "GradientNoiseScale(preconditioned=False) for the plain gradient's alone")
        if probe.preconditioned and self.config.overlap_reduction:
            raise ValueError(
                "GradientNoiseScale: the preconditioned gradient's noise scale reads the "
                "factors after their update, which overlap_reduction lets preconditioning "
                "run beside; use overlap_reduction=False, or "
                "GradientNoiseScale(preconditioned=False) for the plain gradient's alone")
        if attachment.noise_probe is probe:
            return False
        attachment.noise_probe = probe
        return True

    def _measure_noise_scale(self, step, grads, variables, damping, sub_batches):
        """This step's gradient noise scale into the probe (`measure_noise_scale`): of
        `grads` and, if the probe asks, of their preconditioned values before any KL clip
        or grafting (what `precondition` returns). Called after the decompositions'
        update, whose results the preconditioning reads."""
        probe = self._attachment.noise_probe
        precondition = None
        if probe.preconditioned:
            precondition = lambda gradients: self._curvature.precondition(
                gradients, variables, damping, step=step, update_state=False).grads()
        probe.measure(step, grads, sub_batches, precondition)

    def _count_skipped_step(self):
        """A step with a NaN/Inf gradient: nothing reaches the weights, the factors or the
        step count; it is counted (also when a LossScaleOptimizer skipped it, silently:
        loss scaling skips steps by design)."""
        self._counters.skipped_steps.assign_add(1)
        return tf.constant(False)

    def damping_at(self, step):
        """λ at `step` (a tensor, also in a graph), as the update takes it."""
        if self.config.self_tuning:  # γ, tied to the adapted λ (tfkfac/self_tuning.py)
            return tf.cast(self._self_tuning.factor_damping(), self.config.state_dtype)
        return schedules.checked_at("damping", self.config.damping, step,
                                    self.config.state_dtype)

    def current_damping(self):
        if self.config.self_tuning:
            return float(self._self_tuning.factor_damping().numpy())
        return float(schedules.value_at(self.config.damping, self.iterations))

    # -------------------------------------------------------- serialization
    def get_config(self):
        return {"name": self.name,
                "inner_optimizer": inner.serialized(self.inner_optimizer,
                                                    self.loss_scale_factor),
                **self.config.to_config()}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        update_rule, config = inner.from_saved(config, custom_objects)
        name = config.pop("name", "kfac")
        return cls(**update_rule, name=name, config=KFACConfig.from_config(config))


KFAC.__init__.__signature__ = signature_with_settings(KFAC.__init__)
