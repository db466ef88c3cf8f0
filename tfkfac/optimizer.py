"""`tfkfac.KFAC`: a Keras 3 optimizer that preconditions gradients with K-FAC.

Usage::

    optimizer = tfkfac.KFAC(learning_rate=0.05, damping=1e-3)
    optimizer.attach(model)            # installs the K-FAC train step on this model only
    model.compile(optimizer=optimizer, loss=..., metrics=[...])
    model.fit(dataset, epochs=...)

This module is the Keras optimizer: arguments, state, update and config. One step
(docs/design.md §1): `attachment` records the managed layers' inputs and output
gradients, `curvature` updates factors and decompositions when due and preconditions the
gradients, and the update rule (momentum SGD or `inner_optimizer`) applies them.
"""

import warnings

import keras
import tensorflow as tf

from tfkfac import blocks as blocks_lib
from tfkfac import curvature as curvature_lib
from tfkfac import distributed, keras_integration, placement as placement_lib, schedules
from tfkfac import state as state_lib, validation
from tfkfac.attachment import ATTACH_HINT, Attachment

METHODS = validation.METHODS
PLACEMENTS = placement_lib.PLACEMENTS
# The constructor arguments kept as attributes of the same name and saved in the config.
SETTINGS = ("damping", "momentum", "factor_decay", "kl_clip", "factor_update_freq",
            "inv_update_freq", "method", "bn_damping_multiplier", "weight_sharing",
            "skip_layers", "xla", "placement", "factor_wire_dtype",
            "decomposition_wire_dtype", "state_dtype", "factor_examples",
            "factor_batch_fraction", "product_dtype", "phase_clocks")


@keras.saving.register_keras_serializable(package="tfkfac")
class KFAC(keras.optimizers.Optimizer):
    """K-FAC preconditioned optimizer (Martens & Grosse 2015; Grosse & Martens 2016).

    Args:
      learning_rate: step size η (number, schedule, or callable of the step).
      damping: Tikhonov damping λ (number, schedule, or callable of the step).
      momentum: momentum of the built-in SGD update (ignored with `inner_optimizer`).
      factor_decay: ξ of the factors' running average, in [0, 1).
      kl_clip: κ of the KL clip; `None` disables it.
      factor_update_freq: update factors every this many steps (int or callable).
      inv_update_freq: recompute decompositions every this many steps (int or callable).
      method: "eigen" (exact damped Kronecker inverse) or "inverse" (π-corrected
        factored Tikhonov damping).
      bn_damping_multiplier: ρ of the diagonal blocks (BatchNorm, LayerNorm,
        GroupNorm), preconditioned by 1/(F + ρ λ).
      weight_sharing: how a layer whose weights act at several positions per example
        (a Dense layer on sequences, EinsumDense, convolutions) counts them: "expand"
        (every position like an example) or "reduce" (positions summed per example
        first; cheaper). See docs/design.md.
      skip_layers: layer names, paths or class names (regular expressions, full match)
        that get the plain gradient.
      inner_optimizer: a Keras optimizer that receives the preconditioned gradients
        instead of the built-in momentum SGD.
      weight_decay: decoupled weight decay of the built-in update (Keras semantics).
      xla: compile the factor statistics and the preconditioning with XLA: True, False,
        or "auto" (XLA when a GPU is visible; on CPU it measured slower, see
        docs/benchmarks.md). Decompositions never use XLA (`tfkfac.linalg`).
      placement: "replicated" (Pauloski et al.: every rank holds every decomposition and
        preconditions every layer; stale steps send only gradients) or "owner" (Osawa et
        al.: each layer's owner preconditions it and the results are gathered every
        step; decompositions are recomputed from the factors after a restore). See
        docs/design.md §6.
      factor_wire_dtype: dtype of the packed factors on the wire ("float32",
        "float16", "bfloat16"); accumulation and storage stay float32.
      decomposition_wire_dtype: dtype of decompositions (eigenbases or inverses) and of
        preconditioned gradients on the wire. Formerly `eigen_wire_dtype`, still
        accepted with a DeprecationWarning.
      state_dtype: dtype of the factors, decompositions and preconditioning: "float32",
        or "float64" to check results against a float64 reference (slower).
      factor_examples: which examples the factor statistics count: "all" (default), or
        "fresh" for data echoing: each source example once, so echoed repeats do not make
        the curvature look more certain than it is. Every training batch then carries
        its examples' fresh flags, (x, y, fresh) in `fit` (in place of sample weights;
        `pipelines.build(..., fresh_flags=True)`) or `minimize(..., fresh=flags)`; a
        step without a fresh example on any rank (a batch-echo repeat) is a stale step.
        The loss and gradients still use every example. Its effect on time to accuracy
        is not measured yet. See docs/design.md §7.
      factor_batch_fraction: share of each rank's batch the factor statistics are taken
        from, in (0, 1]: at 1 (default) every example, exactly; below 1 a random subset
        of ceil(fraction · N) examples per factor step, an unbiased estimate of the
        batch's statistics at about that fraction of their cost. The loss and gradients
        still use every example. See docs/design.md §8.
      product_dtype: dtype of the operands of the factor Gram products and the
        preconditioning products: None (default; the state dtype, exact) or "bfloat16"
        for CPUs with native bfloat16 (AVX512-BF16, AMX), each product rounded to
        bfloat16; the decompositions' matrices are stored in bfloat16 (rounded once,
        when computed), factors, eigenvalues and updates stay in `state_dtype`. Measured
        in docs/benchmarks.md; see docs/design.md §9.
      phase_clocks: time each phase (factors, decomposition, precondition, update) into
        `summary()["phase_seconds"]`; off by default, the timestamps cost 0.2-0.6 ms a
        step (docs/benchmarks.md).
      communicator: a `tfkfac.distributed` communicator; default
        `tfkfac.distributed.get_communicator("auto")` (Horovod under horovodrun).
      model: if given, `attach(model)` is called.
    """

    def __init__(self, learning_rate=0.01, damping=1e-3, momentum=0.9, factor_decay=0.95,
                 kl_clip=1e-3, factor_update_freq=1, inv_update_freq=10, method="eigen",
                 bn_damping_multiplier=1.0, skip_layers=(), inner_optimizer=None,
                 weight_decay=None, xla="auto", placement="replicated",
                 factor_wire_dtype="float32", decomposition_wire_dtype="float32",
                 communicator=None, model=None, weight_sharing="expand",
                 state_dtype="float32", factor_examples="all", factor_batch_fraction=1.0,
                 product_dtype=None, phase_clocks=False, name="kfac", **kwargs):
        if "eigen_wire_dtype" in kwargs:  # the name before 0.2; old saves' configs hold it
            warnings.warn("KFAC: `eigen_wire_dtype` is deprecated, use "
                          "`decomposition_wire_dtype` (it also carries inverses and "
                          "preconditioned gradients)", DeprecationWarning, stacklevel=2)
            decomposition_wire_dtype = kwargs.pop("eigen_wire_dtype")
        settings = dict(
            damping=damping, momentum=momentum, factor_decay=factor_decay, kl_clip=kl_clip,
            factor_update_freq=factor_update_freq, inv_update_freq=inv_update_freq,
            method=method, bn_damping_multiplier=bn_damping_multiplier,
            weight_sharing=weight_sharing, skip_layers=skip_layers, xla=xla,
            placement=placement, factor_wire_dtype=factor_wire_dtype,
            decomposition_wire_dtype=decomposition_wire_dtype, state_dtype=state_dtype,
            factor_examples=factor_examples, factor_batch_fraction=factor_batch_fraction,
            product_dtype=product_dtype, phase_clocks=phase_clocks)
        validation.validate(learning_rate=learning_rate, inner_optimizer=inner_optimizer,
                            weight_decay=weight_decay, **settings)
        super().__init__(learning_rate=schedules.as_learning_rate(learning_rate),
                         weight_decay=weight_decay, name=name, **kwargs)
        for setting, value in settings.items():  # each is also a `get_config` entry
            setattr(self, setting, value)
        self.skip_layers = tuple(skip_layers)
        self.inner_optimizer = inner_optimizer
        self._comm = communicator or distributed.get_communicator("auto")
        self._init_kfac_fields()
        if model is not None:
            self.attach(model)

    @keras_integration.no_tracking
    def _init_kfac_fields(self):
        self._curvature = None
        self._skipped = []
        self._stashed_state = None
        self._attachment = None
        self._due = None
        self._clocks = state_lib.PhaseClocks(self.phase_clocks)

    # ------------------------------------------------------------------ attach
    @keras_integration.no_tracking
    def attach(self, model):
        """Manage `model`'s supported layers and install the K-FAC train step on it.

        Only this model instance is changed: its `train_step` records layer inputs and
        pre-activation gradients. Layers without a block get the plain gradient.
        """
        if not model.built:
            raise ValueError(
                "KFAC.attach(model): the model is not built. Build it first (give it "
                "an `Input` shape or call it on a batch) so its layers have weights.")
        if self._attachment is not None:
            raise ValueError("This KFAC optimizer is already attached to a model.")
        layers = keras_integration.leaf_layers(model)
        blocks, self._skipped = blocks_lib.discover(
            layers, self.skip_layers, self.bn_damping_multiplier, self.weight_sharing,
            self.product_dtype)
        self._curvature = curvature_lib.Curvature(
            blocks, placement_lib.make_placement(self.placement, blocks, self._comm,
                                                 self.method, self.state_dtype),
            self._comm, self.method, self.factor_decay, self.factor_wire_dtype,
            self.decomposition_wire_dtype, self.xla, self.state_dtype,
            self.factor_batch_fraction)
        self._comm.broadcast_variables(model.variables, root_rank=0)
        self._attachment = Attachment(model, list(layers.values()), blocks, self._comm,
                                      fresh_only=self.factor_examples == "fresh")
        keras_integration.install_train_step(model, self._attachment.train_step,
                                             self._attachment.averaged_over_ranks,
                                             self._attachment.fresh_only)
        blocks_lib.warn_unsupported(self._skipped)
        if self.built:
            self._create_kfac_state()
        return self

    def _attached(self):
        if self._attachment is None:
            raise RuntimeError(ATTACH_HINT)
        return self._attachment

    def record(self):
        """Custom loop: a `tf.GradientTape` that also records the managed layers' calls."""
        return self._attached().record()

    def minimize(self, loss, var_list=None, tape=None, fresh=None):
        """Custom loop: gradients from `tape` (opened by `record()`), then the update.

        `fresh`: the batch's fresh flags (N,), given exactly when factor_examples="fresh".
        """
        if tape is None:
            raise ValueError(
                "KFAC.minimize needs the `tape` returned by `optimizer.record()`.")
        attachment = self._attached()
        if var_list is None:
            var_list = attachment.model.trainable_variables
        attachment.step(tape, loss, list(var_list), self.apply, fresh=fresh)

    # ---------------------------------------------------------------- state
    def build(self, var_list):
        super().build(var_list)
        uses_momentum = self.inner_optimizer is None and self.momentum > 0
        self._momenta = (self.add_optimizer_variables(var_list, "momentum")
                         if uses_momentum else None)
        if self.inner_optimizer is not None:
            self.inner_optimizer.build(var_list)
        if self._attachment is not None:
            self._create_kfac_state()

    def _create_kfac_state(self):
        """K-FAC variables, after the base ones: counters, then per block (docs: state.py)."""
        if self._curvature.states is not None:
            return
        counters = state_lib.Counters(self.add_variable)
        keras_integration.set_untracked(self, "_counters", counters)
        # Each counter is also an attribute of its own, as in 0.1: tf.train.Checkpoint
        # keys name a variable by its shortest path (`optimizer/_factor_updates/...`).
        for name, variable in zip(counters.NAMES, counters.variables()):
            setattr(self, f"_{name}", variable)
        self._curvature.create_state(counters, lambda shape, initializer, name, dtype:
                                     self.add_variable(shape, initializer=initializer,
                                                       dtype=dtype, name=name))
        if self._stashed_state is not None:
            stashed, self._stashed_state = self._stashed_state, None
            state_lib.restore(
                counters.variables() + self._curvature.variables(saved_only=True), stashed)

    def load_own_variables(self, store):
        """Load saved state; K-FAC state waits for `attach` if the model is not known."""
        count = len(store.keys())
        kfac_state_missing = self._curvature is None or self._curvature.states is None
        if kfac_state_missing and self.built and count > len(self.variables):
            base = len(self.variables)
            for i, variable in enumerate(self.variables):
                variable.assign(store[str(i)])
            keras_integration.set_untracked(
                self, "_stashed_state", [store[str(i)][...] for i in range(base, count)])
            return
        super().load_own_variables(store)

    # ---------------------------------------------------------------- update
    def apply(self, grads, trainable_variables=None):
        captures = self._attached().captures()
        if trainable_variables is None:
            trainable_variables = self._attachment.model.trainable_variables
        variables = list(trainable_variables)
        if not self.built:
            with keras_integration.name_scope(self):
                self.build(variables)
        grads = list(grads)
        step = self.iterations
        damping = self._damping_at(step)

        def kfac_step():
            # Every gradient must be a tensor of this branch's graph: Keras's update sums
            # gradients over replicas through a custom_gradient, which rejects a mix of
            # tensors captured from the outer graph (plain-gradient layers) and ones made
            # in the branch (preconditioned layers).
            branch_grads = [None if g is None else tf.identity(g) for g in grads]
            curvature = self._curvature
            self._clocks.timed("factors", lambda: curvature.update_factors_if_due(
                step, captures.calls, self._interval(self.factor_update_freq),
                captures.weights, captures.ready))
            self._clocks.timed("decomposition", lambda: curvature.update_decompositions_if_due(
                step, damping, self._interval(self.inv_update_freq), captures.ready))
            optimizer = self.inner_optimizer or self
            clip = (None if self.kl_clip is None else
                    curvature_lib.kl_clip_scale(optimizer.learning_rate, self.kl_clip))
            preconditioned = self._clocks.timed("precondition", lambda: curvature.precondition(
                branch_grads, variables, damping, clip))
            self._clocks.timed("update", lambda: self._apply_update(preconditioned, variables))
            return tf.constant(True)

        def skip_step():
            # A NaN/Inf gradient must not reach the weights, the factors or the step count.
            self._counters.skipped_steps.assign_add(1)
            curvature_lib.warn_if(
                tf.constant(True),
                "KFAC warning: non-finite gradients; step skipped, weights unchanged")
            return tf.constant(False)

        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g))
                                for g in grads if g is not None])
        tf.cond(finite, kfac_step, skip_step)

    @staticmethod
    def _interval(value):
        return lambda step: tf.cast(schedules.value_at(value, step), tf.int64)

    def _apply_update(self, grads, variables):
        if self.inner_optimizer is None:
            super().apply(grads, variables)
        else:
            self.inner_optimizer.apply(grads, variables)
            self.iterations.assign_add(1)
        return tf.constant(0)

    def update_step(self, gradient, variable, learning_rate):
        """Momentum SGD (Keras convention): m ← μ m - η g; w ← w + m."""
        lr = tf.cast(learning_rate, variable.dtype)
        gradient = tf.cast(gradient, variable.dtype)
        if self._momenta is None:
            self.assign_sub(variable, lr * gradient)
            return
        momentum = self._momenta[keras_integration.slot_index(self, variable)]
        self.assign(momentum, self.momentum * momentum - lr * gradient)
        self.assign_add(variable, momentum)

    # ---------------------------------------------------------- curvature API
    def factors(self, layer):
        """The running curvature factors of `layer` (a Keras layer, its path or its name).

        A dict of float32 tensors named as in docs/design.md: {"A": ..., "G": ...} for
        Kronecker blocks (a batch of pairs, e.g. per group, has a leading axis; an
        Embedding's A is the diagonal as a vector), {"F": ...} for diagonal blocks.
        """
        if self._curvature is None:
            raise RuntimeError(ATTACH_HINT)
        return self._curvature.factors(layer)

    def precondition(self, gradients, variables):
        """`gradients` of `variables` preconditioned with the current decompositions.

        What the update receives, before the KL clip: managed variables' gradients become
        (curvature + λI)⁻¹ ∇ per docs/design.md; the others come back unchanged. Usable
        eagerly or in a `tf.function`, after a training step has computed decompositions;
        in a multi-process job every rank calls it (placement "owner" gathers).
        """
        if self._curvature is None or self._curvature.states is None or (
                tf.executing_eagerly() and not int(self._counters.decomposition_updates)):
            raise RuntimeError(
                "KFAC.precondition needs decompositions: train at least one step first "
                "(factors and decompositions are computed in the training step).")
        damping = self._damping_at(self.iterations)
        return self._curvature.precondition(list(gradients), list(variables), damping)

    # ---------------------------------------------------------- introspection
    def summary(self):
        """Managed and skipped layers, factor shapes, state size, counters, timings."""
        info = {"managed": [], "state_bytes": 0, **(
                    self._curvature.summary() if self._curvature else {}),
                "skipped": list(self._skipped), "counters": {},
                "phase_seconds": self._clocks.values()}
        if self._curvature is not None and self._curvature.states is not None:
            counters = self._counters.values()
            info["counters"] = {"steps": int(self.iterations.numpy()), **{
                name: counters[name] for name in state_lib.Counters.NAMES
                if not name.startswith("next_")}}
        return info

    def step_phase(self, step):
        """The K-FAC work of training step `step` (0-based) by this optimizer's schedule:
        "factors_and_decompositions", "decompositions", "factors" or "stale".

        The schedule only: with factor_examples="fresh", steps without fresh examples
        are stale and defer due work, which this does not know.
        """
        if self._due is None:
            keras_integration.set_untracked(self, "_due", (
                schedules.DueSteps(self.factor_update_freq),
                schedules.DueSteps(self.inv_update_freq)))
        factors, decompositions = (step in due for due in self._due)
        return {(True, True): "factors_and_decompositions", (False, True): "decompositions",
                (True, False): "factors", (False, False): "stale"}[factors, decompositions]

    def _damping_at(self, step):
        return tf.cast(schedules.value_at(self.damping, step), self.state_dtype)

    def current_damping(self):
        return float(schedules.value_at(self.damping, self.iterations))

    # -------------------------------------------------------- serialization
    def get_config(self):
        config = super().get_config()
        config.update({setting: schedules.serialize(getattr(self, setting))
                       for setting in SETTINGS})
        config["skip_layers"] = list(self.skip_layers)
        config["inner_optimizer"] = (
            None if self.inner_optimizer is None
            else keras.saving.serialize_keras_object(self.inner_optimizer))
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for setting in SETTINGS:
            if setting in config:  # saves before 0.2 lack the newer settings
                config[setting] = schedules.deserialize(config[setting])
        if config.get("inner_optimizer") is not None:
            config["inner_optimizer"] = keras.saving.deserialize_keras_object(
                config["inner_optimizer"], custom_objects=custom_objects)
        return super().from_config(config, custom_objects=custom_objects)
