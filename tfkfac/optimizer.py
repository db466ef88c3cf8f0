"""`tfkfac.KFAC`: a Keras 3 optimizer that preconditions gradients with K-FAC.

Usage::

    optimizer = tfkfac.KFAC(learning_rate=0.05, damping=1e-3)
    optimizer.attach(model)            # installs the K-FAC train step on this model only
    model.compile(optimizer=optimizer, loss=..., metrics=[...])
    model.fit(dataset, epochs=...)

This module is the Keras optimizer: its arguments, state, schedule and update. One step
(docs/design.md §1): the managed layers' inputs and output gradients are recorded
(`capture`), `curvature` updates the factors on factor steps and the decompositions on
decomposition steps, preconditions every managed gradient, and the result goes to the
update rule: momentum SGD, or any Keras optimizer given as `inner_optimizer`.
"""

import contextlib
import warnings
import weakref

import keras
import tensorflow as tf

from tfkfac import blocks as blocks_lib
from tfkfac import curvature as curvature_lib
from tfkfac import distributed, keras_integration, placement as placement_lib, schedules
from tfkfac import state as state_lib, validation
from tfkfac.capture import Recorder

METHODS = validation.METHODS
PLACEMENTS = placement_lib.PLACEMENTS
PHASES = ("factors", "decomposition", "precondition", "update")

ATTACH_HINT = (
    "KFAC has no layer captures for this step: it needs its own train step. Attach it "
    "to the model before training with `optimizer.attach(model)` (or "
    "`tfkfac.KFAC(..., model=model)`), or in a custom loop compute gradients with "
    "`optimizer.record()` and `optimizer.minimize(loss, tape)`.")


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
      skip_layers: layer names or class names (regular expressions, full match)
        that get the plain gradient.
      inner_optimizer: a Keras optimizer that receives the preconditioned gradients
        instead of the built-in momentum SGD.
      weight_decay: decoupled weight decay of the built-in update (Keras semantics).
      xla: compile the factor statistics and the preconditioning with XLA
        (`jit_compile=True`): True, False, or "auto" (XLA when a GPU is visible). On
        CPU, XLA measured slower here (patch extraction 12x, factor statistics 2.8x),
        hence "auto". Decompositions never use XLA (XLA:CPU's eigh measured 16-100x
        slower); on CPU they run in LAPACK (see `tfkfac.linalg`).
      placement: where preconditioning happens across processes. "replicated"
        (Pauloski et al.): every rank receives every decomposition and preconditions
        all layers; stale steps send nothing but gradients. "owner" (Osawa et al.):
        each layer's owner decomposes and preconditions it, and the preconditioned
        gradients are gathered every step. A rank then holds only its own layers'
        decompositions, and they are not saved: after a restore they are recomputed
        from the saved factors at the first step, so every rank can load rank 0's
        checkpoint.
      factor_wire_dtype: dtype of the packed factors on the wire ("float32",
        "float16", "bfloat16"); accumulation and storage stay float32.
      decomposition_wire_dtype: dtype of decompositions (eigenbases or inverses) and of
        preconditioned gradients on the wire. Formerly `eigen_wire_dtype`, still
        accepted with a DeprecationWarning.
      communicator: a `tfkfac.distributed` communicator; default
        `tfkfac.distributed.get_communicator("auto")` (Horovod under horovodrun).
      model: if given, `attach(model)` is called.
    """

    def __init__(self, learning_rate=0.01, damping=1e-3, momentum=0.9, factor_decay=0.95,
                 kl_clip=1e-3, factor_update_freq=1, inv_update_freq=10, method="eigen",
                 bn_damping_multiplier=1.0, skip_layers=(), inner_optimizer=None,
                 weight_decay=None, xla="auto", placement="replicated",
                 factor_wire_dtype="float32", decomposition_wire_dtype="float32",
                 communicator=None, model=None, weight_sharing="expand", name="kfac",
                 **kwargs):
        if "eigen_wire_dtype" in kwargs:  # the name before 0.2; old saves' configs hold it
            warnings.warn("KFAC: `eigen_wire_dtype` is deprecated, use "
                          "`decomposition_wire_dtype` (it also carries inverses and "
                          "preconditioned gradients)", DeprecationWarning, stacklevel=2)
            decomposition_wire_dtype = kwargs.pop("eigen_wire_dtype")
        validation.validate(
            learning_rate=learning_rate, damping=damping, momentum=momentum,
            factor_decay=factor_decay, kl_clip=kl_clip, factor_update_freq=factor_update_freq,
            inv_update_freq=inv_update_freq, method=method,
            bn_damping_multiplier=bn_damping_multiplier, inner_optimizer=inner_optimizer,
            weight_decay=weight_decay, xla=xla, placement=placement,
            factor_wire_dtype=factor_wire_dtype,
            decomposition_wire_dtype=decomposition_wire_dtype, weight_sharing=weight_sharing)
        super().__init__(learning_rate=schedules.as_learning_rate(learning_rate), weight_decay=weight_decay,
                         name=name, **kwargs)
        self.damping = damping
        self.momentum = float(momentum)
        self.factor_decay = float(factor_decay)
        self.kl_clip = kl_clip
        self.factor_update_freq = factor_update_freq
        self.inv_update_freq = inv_update_freq
        self.method = method
        self.bn_damping_multiplier = float(bn_damping_multiplier)
        self.weight_sharing = weight_sharing
        self.skip_layers = tuple(skip_layers)
        self.inner_optimizer = inner_optimizer
        self.xla = xla
        self.placement = placement
        self.factor_wire_dtype = factor_wire_dtype
        self.decomposition_wire_dtype = decomposition_wire_dtype
        self._comm = communicator or distributed.get_communicator("auto")
        self._init_kfac_fields()
        if model is not None:
            self.attach(model)

    @keras_integration.no_tracking
    def _init_kfac_fields(self):
        self._curvature = None
        self._skipped = []
        self._pending_calls = None
        self._stashed_state = None
        self._model_ref = None
        self._recorder = None
        self._due = None
        self._phase_seconds = {phase: tf.Variable(0.0, dtype=tf.float64, trainable=False)
                               for phase in PHASES}

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
        if self._model_ref is not None:
            raise ValueError("This KFAC optimizer is already attached to a model.")
        layers = keras_integration.leaf_layers(model)
        blocks, self._skipped = blocks_lib.discover(
            layers, self.skip_layers, self.bn_damping_multiplier, self.weight_sharing)
        jit = (bool(tf.config.list_physical_devices("GPU")) if self.xla == "auto"
               else self.xla)
        self._curvature = curvature_lib.Curvature(
            blocks, placement_lib.make_placement(self.placement, blocks, self._comm,
                                                 self.method),
            self._comm, self.method, self.factor_decay, self.factor_wire_dtype,
            self.decomposition_wire_dtype, jit)
        self._recorder = Recorder(blocks)
        # BatchNorm moving statistics are updated from each rank's own batch: averaged
        # with the gradients every step so that every rank holds the same model.
        self._running_statistics = [
            v for layer in layers
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
            for v in (layer.moving_mean, layer.moving_variance)]
        self._comm.broadcast_variables(model.variables, root_rank=0)
        self._model_ref = weakref.ref(model)
        keras_integration.install_train_step(model, self._train_step,
                                             self._averaged_over_ranks)
        unsupported = [f"{s['layer']} ({s['reason']})" for s in self._skipped
                       if s["reason"] != blocks_lib.SKIPPED_BY_REQUEST]
        if unsupported:
            warnings.warn(
                "KFAC: these layers have no K-FAC block and get the plain gradient: "
                + ", ".join(unsupported), stacklevel=2)
        if self.built:
            self._create_kfac_state()
        return self

    def _train_step(self, forward):
        """Keras's train step with K-FAC's tape: `forward()` gives (scaled loss, y_pred)."""
        model = self._model_ref()
        with self.record() as tape:
            scaled_loss, y_pred = forward()
        variables = model.trainable_variables
        gradients = self.gradients(tape, scaled_loss, variables,
                                   loss_scale=model.optimizer.scale_loss(1.0))
        model.optimizer.apply(gradients, variables)
        return y_pred

    def _averaged_over_ranks(self, logs):
        """`model.fit` logs as the mean over ranks (each rank's running mean, equal batches)."""
        names = [name for name, value in logs.items() if tf.is_tensor(value)]
        values = self._comm.grouped_allreduce_mean(
            [tf.cast(logs[name], tf.float32) for name in names], category="metrics")
        return {**logs, **dict(zip(names, values))}

    # ------------------------------------------------------- custom-loop API
    @contextlib.contextmanager
    def record(self):
        """A `tf.GradientTape` during which the managed layers' calls are recorded."""
        if self._recorder is None:
            raise RuntimeError(ATTACH_HINT)
        with tf.GradientTape() as tape, self._recorder.recording():
            yield tape

    def gradients(self, tape, loss, variables, loss_scale=1.0):
        """Weight gradients of `loss` (averaged over ranks), keeping the layer captures.

        `loss_scale` is the factor `loss` was multiplied by (mixed precision); the
        captured output gradients are unscaled by it before they enter G.
        """
        calls = self._recorder.take()
        outputs = [[s for _, s in block_calls] for block_calls in calls]
        gradients, output_grads = tape.gradient(loss, (list(variables), outputs))
        # Averaged here, before any loss-scale finiteness check, so that every rank takes
        # the same branch and issues the same collectives. BatchNorm moving statistics
        # (updated by this step's forward pass) ride in the same call.
        present = [g for g in gradients if g is not None]
        statistics = self._running_statistics
        reduced = self._comm.grouped_allreduce_mean(
            present + [tf.convert_to_tensor(v) for v in statistics], category="gradients")
        for variable, value in zip(statistics, reduced[len(present):]):
            variable.assign(value)
        reduced = iter(reduced[:len(present)])
        gradients = [None if g is None else next(reduced) for g in gradients]
        inverse_scale = 1.0 / tf.cast(loss_scale, tf.float32)
        unscaled = lambda s, g: (tf.zeros_like(s) if g is None
                                 else tf.cast(g, tf.float32) * inverse_scale)
        self._pending_calls = [
            [(x, tf.nest.map_structure(unscaled, s, g))
             for (x, s), g in zip(block_calls, block_grads)]
            for block_calls, block_grads in zip(calls, output_grads)]
        return gradients

    def minimize(self, loss, var_list=None, tape=None):
        """Custom-loop step: gradients from `tape` (opened by `record()`), then apply."""
        if tape is None:
            raise ValueError(
                "KFAC.minimize needs the `tape` returned by `optimizer.record()`.")
        if var_list is None:
            var_list = self._model_ref().trainable_variables
        self.apply(self.gradients(tape, loss, var_list), var_list)

    # ---------------------------------------------------------------- state
    def build(self, var_list):
        super().build(var_list)
        uses_momentum = self.inner_optimizer is None and self.momentum > 0
        self._momenta = (self.add_optimizer_variables(var_list, "momentum")
                         if uses_momentum else None)
        if self.inner_optimizer is not None:
            self.inner_optimizer.build(var_list)
        if self._model_ref is not None:
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
        self._curvature.create_state(counters, lambda shape, initializer, name:
                                     self.add_variable(shape, initializer=initializer,
                                                       name=name))
        if self._stashed_state is not None:
            stashed, self._stashed_state = self._stashed_state, None
            kfac_variables = self._kfac_variables()
            if len(stashed) != len(kfac_variables):
                raise ValueError(
                    f"The restored K-FAC state has {len(stashed)} variables but the "
                    f"attached model needs {len(kfac_variables)}: attach the optimizer "
                    "to the same architecture it was saved with.")
            for variable, value in zip(kfac_variables, stashed):
                variable.assign(value)

    def _kfac_variables(self):
        return self._counters.variables() + self._curvature.variables(saved_only=True)

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
        if self._pending_calls is None:
            raise RuntimeError(ATTACH_HINT)
        calls, self._pending_calls = self._pending_calls, None
        if trainable_variables is None:
            trainable_variables = self._model_ref().trainable_variables
        variables = list(trainable_variables)
        if not self.built:
            with keras_integration.name_scope(self):
                self.build(variables)
        grads = list(grads)
        step = self.iterations
        damping = tf.cast(schedules.value_at(self.damping, step), tf.float32)

        def kfac_step():
            # Every gradient must be a tensor of this branch's graph: Keras's update sums
            # gradients over replicas through a custom_gradient, which rejects a mix of
            # tensors captured from the outer graph (plain-gradient layers) and ones made
            # in the branch (preconditioned layers).
            branch_grads = [None if g is None else tf.identity(g) for g in grads]
            self._timed("factors", lambda: self._maybe_update_factors(step, calls))
            self._timed("decomposition",
                        lambda: self._maybe_update_decompositions(step, damping))
            optimizer = self.inner_optimizer or self
            clip = (None if self.kl_clip is None else
                    curvature_lib.kl_clip_scale(optimizer.learning_rate, self.kl_clip))
            preconditioned = self._timed("precondition", lambda: self._curvature.precondition(
                branch_grads, variables, damping, clip))
            self._timed("update", lambda: self._apply_update(preconditioned, variables))
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

    def _maybe_update_factors(self, step, calls):
        def update():
            updated = self._curvature.update_factors(calls)
            self._counters.next_factor_step.assign(
                step + self._frequency(self.factor_update_freq, step))
            return updated

        due = step >= self._counters.next_factor_step
        return tf.cond(due, update, lambda: tf.constant(False))

    def _maybe_update_decompositions(self, step, damping):
        def update():
            failed = self._curvature.update_decompositions(damping)
            # A recomputation after a restore ("owner") keeps the saved schedule.
            self._counters.next_decomposition_step.assign(tf.where(
                due, step + self._frequency(self.inv_update_freq, step),
                self._counters.next_decomposition_step))
            return failed

        due = step >= self._counters.next_decomposition_step
        needed = tf.logical_or(due, tf.logical_not(self._curvature.decompositions_current))
        return tf.cond(needed, update, lambda: tf.constant(0, tf.int64))

    @staticmethod
    def _frequency(value, step):
        return tf.cast(schedules.value_at(value, step), tf.int64)

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
        momentum = self._momenta[self._get_variable_index(variable)]
        self.assign(momentum, self.momentum * momentum - lr * gradient)
        self.assign_add(variable, momentum)

    def _timed(self, phase, function):
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            result = function()
        with tf.control_dependencies(tf.nest.flatten(result)):
            self._phase_seconds[phase].assign_add(tf.timestamp() - start)
        return result

    # ---------------------------------------------------------- curvature API
    def factors(self, layer):
        """The running curvature factors of `layer` (a Keras layer or its name).

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
        damping = tf.cast(schedules.value_at(self.damping, self.iterations), tf.float32)
        return self._curvature.precondition(list(gradients), list(variables), damping)

    # ---------------------------------------------------------- introspection
    def summary(self):
        """Managed and skipped layers, factor shapes, state size, counters, timings."""
        blocks = self._curvature.blocks if self._curvature else []
        info = {
            "managed": [{"layer": b.name, "kind": b.kind,
                         "factor_shapes": [list(s) for s in b.factor_shapes()]}
                        for b in blocks],
            "skipped": list(self._skipped),
            "state_bytes": 0,
            "counters": {},
            "phase_seconds": {p: float(v.numpy()) for p, v in self._phase_seconds.items()},
        }
        if self._curvature is not None and self._curvature.states is not None:
            info["state_bytes"] = self._curvature.state_bytes()
            counters = self._counters.values()
            info["counters"] = {"steps": int(self.iterations.numpy()), **{
                name: counters[name] for name in state_lib.Counters.NAMES
                if not name.startswith("next_")}}
        return info

    def step_phase(self, step):
        """The K-FAC work of training step `step` (0-based) by this optimizer's schedule:
        "factors_and_decompositions", "decompositions", "factors" or "stale"."""
        if self._due is None:
            keras_integration.set_untracked(self, "_due", (
                schedules.DueSteps(self.factor_update_freq),
                schedules.DueSteps(self.inv_update_freq)))
        factors, decompositions = (step in due for due in self._due)
        return {(True, True): "factors_and_decompositions", (False, True): "decompositions",
                (True, False): "factors", (False, False): "stale"}[factors, decompositions]

    def current_damping(self):
        return float(schedules.value_at(self.damping, self.iterations))

    # -------------------------------------------------------- serialization
    def get_config(self):
        config = super().get_config()
        config.update({
            "damping": schedules.serialize(self.damping),
            "momentum": self.momentum,
            "factor_decay": self.factor_decay,
            "kl_clip": self.kl_clip,
            "factor_update_freq": schedules.serialize(self.factor_update_freq),
            "inv_update_freq": schedules.serialize(self.inv_update_freq),
            "method": self.method,
            "bn_damping_multiplier": self.bn_damping_multiplier,
            "weight_sharing": self.weight_sharing,
            "skip_layers": list(self.skip_layers),
            "inner_optimizer": (None if self.inner_optimizer is None else
                                keras.saving.serialize_keras_object(self.inner_optimizer)),
            "xla": self.xla,
            "placement": self.placement,
            "factor_wire_dtype": self.factor_wire_dtype,
            "decomposition_wire_dtype": self.decomposition_wire_dtype,
        })
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        for key in ("damping", "factor_update_freq", "inv_update_freq"):
            config[key] = schedules.deserialize(config[key])
        if config.get("inner_optimizer") is not None:
            config["inner_optimizer"] = keras.saving.deserialize_keras_object(
                config["inner_optimizer"], custom_objects=custom_objects)
        return super().from_config(config, custom_objects=custom_objects)
