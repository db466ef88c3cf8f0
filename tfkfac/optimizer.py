"""`tfkfac.KFAC`: a Keras 3 optimizer that preconditions gradients with K-FAC.

Usage::

    optimizer = tfkfac.KFAC(learning_rate=0.05, damping=1e-3)
    optimizer.attach(model)            # installs the K-FAC train step on this model only
    model.compile(optimizer=optimizer, loss=..., metrics=[...])
    model.fit(dataset, epochs=...)

One step: forward/backward with the managed layers' inputs and pre-activation output
gradients recorded (`capture`), on factor steps the Kronecker factors' running averages
(`blocks`), on inverse steps their damped eigendecompositions or inverses (`linalg`),
then every managed gradient is preconditioned, KL-clipped, and handed to the update
rule: momentum SGD, or any Keras optimizer given as `inner_optimizer`. Communication
between processes goes through a `tfkfac.distributed` communicator and happens between
the XLA-compiled stages.
"""

import contextlib
import re
import sys
import warnings
import weakref

import keras
import numpy as np
import tensorflow as tf

from tfkfac import blocks as blocks_lib
from tfkfac import linalg, schedules
from tfkfac.capture import Recorder
from tfkfac import distributed

METHODS = ("eigen", "inverse")
PLACEMENTS = ("replicated", "owner")
PHASES = ("factors", "decomposition", "precondition", "update")
ATTACH_HINT = (
    "KFAC has no layer captures for this step: it needs its own train step. Attach it "
    "to the model before training with `optimizer.attach(model)` (or "
    "`tfkfac.KFAC(..., model=model)`), or in a custom loop compute gradients with "
    "`optimizer.record()` and `optimizer.minimize(loss, tape)`.")


def _check_positive(name, value):
    if not callable(value) and not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"`{name}` must be a number > 0 or a schedule; received {value!r}")


def _check_frequency(name, value):
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(
            f"`{name}` must be a positive integer or a callable of the step; "
            f"received {value!r}")


def _validate(learning_rate, damping, momentum, factor_decay, kl_clip, factor_update_freq,
              inv_update_freq, method, bn_damping_multiplier, inner_optimizer,
              weight_decay, placement, factor_wire_dtype, eigen_wire_dtype, weight_sharing):
    _check_positive("learning_rate", learning_rate)
    _check_positive("damping", damping)
    _check_positive("bn_damping_multiplier", bn_damping_multiplier)
    if not 0 <= momentum < 1:
        raise ValueError(f"`momentum` must be in [0, 1); received {momentum!r}")
    if not 0 <= factor_decay < 1:
        raise ValueError(f"`factor_decay` must be in [0, 1); received {factor_decay!r}")
    if kl_clip is not None and not kl_clip > 0:
        raise ValueError(f"`kl_clip` must be > 0 or None (disabled); received {kl_clip!r}")
    _check_frequency("factor_update_freq", factor_update_freq)
    _check_frequency("inv_update_freq", inv_update_freq)
    if (not callable(factor_update_freq) and not callable(inv_update_freq)
            and inv_update_freq % factor_update_freq):
        raise ValueError(
            "`inv_update_freq` must be a multiple of `factor_update_freq` so that "
            "decompositions use freshly updated factors; received "
            f"inv_update_freq={inv_update_freq}, factor_update_freq={factor_update_freq}")
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {METHODS}; received {method!r}")
    if weight_sharing not in blocks_lib.WEIGHT_SHARING:
        raise ValueError(f"`weight_sharing` must be one of {blocks_lib.WEIGHT_SHARING}; "
                         f"received {weight_sharing!r}")
    if placement not in PLACEMENTS:
        raise ValueError(f"`placement` must be one of {PLACEMENTS}; received {placement!r}")
    for name, value in (("factor_wire_dtype", factor_wire_dtype),
                        ("eigen_wire_dtype", eigen_wire_dtype)):
        if value not in distributed.packing.WIRE_DTYPES:
            raise ValueError(f"`{name}` must be one of {tuple(distributed.packing.WIRE_DTYPES)}; "
                             f"received {value!r}")
    if inner_optimizer is not None:
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "`inner_optimizer` must be a keras.optimizers.Optimizer or None; "
                f"received {type(inner_optimizer).__name__}")
        if weight_decay is not None:
            raise ValueError(
                "Set `weight_decay` on the `inner_optimizer`, not on KFAC: the inner "
                "optimizer applies the update.")


def _warn_if(condition, *message):
    """Print `message` to stderr when the (graph-time) `condition` holds."""
    def warn():
        tf.print(*message, output_stream=sys.stderr)
        return tf.constant(True)

    tf.cond(condition, warn, lambda: tf.constant(False))


def _identities(shape, dtype=None):
    """Initializer: identity matrices, also for a batch of them (..., n, n)."""
    return tf.eye(shape[-1], batch_shape=shape[:-2], dtype=dtype or "float32")


class _StepCallable(keras.optimizers.schedules.LearningRateSchedule):
    """Adapts a plain callable of the step to Keras's learning-rate schedule API."""

    def __init__(self, function):
        self.function = function

    def __call__(self, step):
        return self.function(step)

    def get_config(self):
        return {"function": keras.saving.serialize_keras_object(self.function)}


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
      eigen_wire_dtype: dtype of decompositions / preconditioned gradients on the wire.
      communicator: a `tfkfac.distributed` communicator; default
        `tfkfac.distributed.get_communicator("auto")` (Horovod under horovodrun).
      model: if given, `attach(model)` is called.
    """

    def __init__(self, learning_rate=0.01, damping=1e-3, momentum=0.9, factor_decay=0.95,
                 kl_clip=1e-3, factor_update_freq=1, inv_update_freq=10, method="eigen",
                 bn_damping_multiplier=1.0, skip_layers=(), inner_optimizer=None,
                 weight_decay=None, xla="auto", placement="replicated",
                 factor_wire_dtype="float32", eigen_wire_dtype="float32",
                 communicator=None, model=None, weight_sharing="expand", name="kfac",
                 **kwargs):
        _validate(learning_rate, damping, momentum, factor_decay, kl_clip,
                  factor_update_freq, inv_update_freq, method, bn_damping_multiplier,
                  inner_optimizer, weight_decay, placement, factor_wire_dtype,
                  eigen_wire_dtype, weight_sharing)
        if isinstance(learning_rate, int):
            learning_rate = float(learning_rate)
        if callable(learning_rate) and not isinstance(
                learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            learning_rate = _StepCallable(learning_rate)
        super().__init__(learning_rate=learning_rate, weight_decay=weight_decay,
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
        if xla not in (True, False, "auto"):
            raise ValueError(f"`xla` must be True, False or 'auto'; received {xla!r}")
        self.xla = xla
        self.placement = placement
        self.factor_wire_dtype = factor_wire_dtype
        self.eigen_wire_dtype = eigen_wire_dtype
        self._comm = communicator or distributed.get_communicator("auto")
        self._init_kfac_fields()
        if model is not None:
            self.attach(model)

    @keras.src.utils.tracking.no_automatic_dependency_tracking
    def _init_kfac_fields(self):
        self._blocks = []
        self._skipped = []
        self._block_state = None
        self._pending_calls = None
        self._stashed_state = None
        self._model_ref = None
        self._recorder = None
        self._phase_seconds = {phase: tf.Variable(0.0, dtype=tf.float64, trainable=False)
                               for phase in PHASES}
        jit = (bool(tf.config.list_physical_devices("GPU")) if self.xla == "auto"
               else self.xla)
        self._statistics_fn = tf.function(self._batch_statistics, jit_compile=jit)
        # XLA:CPU lowers eigh to a Jacobi solver: measured 16x (n=289) to 100x (n=577)
        # slower than TensorFlow's own kernel, so decompositions stay out of XLA.
        self._decompose_fn = tf.function(self._decompose)
        self._precondition_fn = tf.function(self._precondition, jit_compile=jit)

    # ------------------------------------------------------------------ attach
    @keras.src.utils.tracking.no_automatic_dependency_tracking
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
        self._blocks, self._skipped = self._discover(model)
        self._recorder = Recorder(self._blocks)
        self._owners = self._assign_owners()
        # BatchNorm moving statistics are updated from each rank's own batch: averaged
        # with the gradients every step so that every rank holds the same model.
        self._running_statistics = [
            v for layer in model._flatten_layers(include_self=False, recursive=True)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
            for v in (layer.moving_mean, layer.moving_variance)]
        self._comm.broadcast_variables(model.variables, root_rank=0)
        self._model_ref = weakref.ref(model)
        object.__setattr__(model, "train_step", self._make_train_step(model))
        object.__setattr__(model, "make_train_function",
                           self._make_train_function_factory(model))
        unsupported = [f"{s['layer']} ({s['reason']})" for s in self._skipped
                       if s["reason"] != "skipped by skip_layers"]
        if unsupported:
            warnings.warn(
                "KFAC: these layers have no K-FAC block and get the plain gradient: "
                + ", ".join(unsupported), stacklevel=2)
        if self.built:
            self._create_block_state()
        return self

    def _discover(self, model):
        blocks, skipped = [], []
        patterns = [re.compile(p) for p in self.skip_layers]
        for layer in model._flatten_layers(include_self=False, recursive=True):
            if list(layer._flatten_layers(include_self=False, recursive=False)):
                continue  # a container: its weights belong to its sublayers
            if not layer.trainable_weights:
                continue
            names = (layer.name, type(layer).__name__)
            if any(p.fullmatch(n) for p in patterns for n in names):
                skipped.append({"layer": layer.name, "reason": "skipped by skip_layers"})
                continue
            block, reason = blocks_lib.block_for(layer, self.bn_damping_multiplier,
                                                 self.weight_sharing)
            if block is None:
                skipped.append({"layer": layer.name, "reason": reason})
            else:
                blocks.append(block)
        return blocks, skipped

    def _make_train_step(self, model):
        def train_step(data):
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            with self.record() as tape:
                y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
                loss = model._compute_loss(x=x, y=y, y_pred=y_pred,
                                           sample_weight=sample_weight, training=True)
                batch = tf.shape(tf.nest.flatten(x)[0])[0]
                model._loss_tracker.update_state(
                    keras.src.losses.loss.unscale_loss_for_distribution(loss),
                    sample_weight=batch)
                scaled_loss = model.optimizer.scale_loss(loss)
            variables = model.trainable_variables
            gradients = self.gradients(tape, scaled_loss, variables,
                                       loss_scale=model.optimizer.scale_loss(1.0))
            model.optimizer.apply(gradients, variables)
            return self._averaged_over_ranks(
                model.compute_metrics(x, y, y_pred, sample_weight=sample_weight))

        return train_step

    def _averaged_over_ranks(self, logs):
        """`model.fit` logs as the mean over ranks (each rank's running mean, equal batches)."""
        if self._comm.size == 1:
            return logs
        names = [name for name, value in logs.items() if tf.is_tensor(value)]
        values = self._comm.grouped_allreduce_mean(
            [tf.cast(logs[name], tf.float32) for name in names], category="metrics")
        return {**logs, **dict(zip(names, values))}

    @staticmethod
    def _make_train_function_factory(model):
        # K-FAC compiles its own local stages with XLA and communicates between them,
        # so the outer train function must stay a plain tf.function.
        keras_make_train_function = type(model).make_train_function.__get__(model)

        def make_train_function(force=False):
            model.jit_compile = False
            return keras_make_train_function(force)

        return make_train_function

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
        if self._comm.size > 1:
            # Averaged here, before any loss-scale finiteness check, so that every rank
            # takes the same branch and issues the same collectives. BatchNorm moving
            # statistics (updated by this step's forward pass) ride in the same call.
            statistics = self._running_statistics
            reduced = self._comm.grouped_allreduce_mean(
                [tf.zeros(v.shape, v.dtype) if g is None else g
                 for g, v in zip(gradients, variables)]
                + [tf.convert_to_tensor(v) for v in statistics], category="gradients")
            gradients = reduced[:len(gradients)]
            for variable, value in zip(statistics, reduced[len(gradients):]):
                variable.assign(value)
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
            self._create_block_state()

    @keras.src.utils.tracking.no_automatic_dependency_tracking
    def _create_block_state(self):
        """K-FAC variables, created after the base ones so their order is stable."""
        if self._block_state is not None:
            return
        counter = lambda name: self.add_variable((), initializer="zeros", dtype="int64",
                                                 name=name)
        self._skipped_steps = counter("skipped_steps")
        self._factor_updates = counter("factor_updates")
        self._skipped_factor_updates = counter("skipped_factor_updates")
        self._decomposition_updates = counter("decomposition_updates")
        self._failed_decompositions = counter("failed_decompositions")
        self._next_factor_step = counter("next_factor_step")
        self._next_decomposition_step = counter("next_decomposition_step")
        state = []
        for b, block in enumerate(self._blocks):
            factors = [self.add_variable(shape, initializer="zeros",
                                         name=f"{block.name}_factor{i}")
                       for i, shape in enumerate(block.factor_shapes())]
            decompositions = None
            if self._holds_decompositions(b):
                decompositions = [
                    [self._decomposition_variable(shape, f"{block.name}_decomp{j}_{k}")
                     for k, shape in enumerate(shapes)]
                    for j, shapes in enumerate(block.decomposition_shapes(self.method))]
            state.append({"factors": factors, "decompositions": decompositions})
        # Set without tracking: checkpoints save state through `variables` only, so
        # an owner's unsaved decompositions stay out of them.
        object.__setattr__(self, "_block_state", state)
        # Unsaved decompositions ("owner") are missing after a restore: the first step
        # then recomputes them from the restored factors.
        with tf.init_scope():
            current = tf.Variable(self._saves_decompositions, trainable=False,
                                  name="decompositions_current")
        object.__setattr__(self, "_decompositions_current", current)
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

    @property
    def _saves_decompositions(self):
        """Replicated decompositions are saved; an owner's own ones are rank-specific."""
        return self.placement == "replicated"

    def _holds_decompositions(self, b):
        return self._saves_decompositions or self._owners[b] == self._comm.rank

    def _decomposition_variable(self, shape, name):
        initializer = _identities if len(shape) >= 2 else "zeros"
        if self._saves_decompositions:
            return self.add_variable(shape, initializer=initializer, name=name)
        # Not an optimizer variable: outside `variables`, so checkpoints skip it.
        with tf.init_scope():
            return keras.Variable(keras.initializers.get(initializer)(shape),
                                  trainable=False, name=name)

    def _state_variables(self, saved_only):
        """Per-block factors and held decompositions (only saved ones if `saved_only`)."""
        with_decompositions = self._saves_decompositions or not saved_only
        variables = []
        for s in self._block_state:
            variables += s["factors"]
            if with_decompositions and s["decompositions"]:
                variables += [v for d in s["decompositions"] for v in d]
        return variables

    def _kfac_variables(self):
        counters = [self._skipped_steps, self._factor_updates, self._skipped_factor_updates,
                    self._decomposition_updates, self._failed_decompositions,
                    self._next_factor_step, self._next_decomposition_step]
        return counters + self._state_variables(saved_only=True)

    def load_own_variables(self, store):
        """Load saved state; K-FAC state waits for `attach` if the model is not known."""
        count = len(store.keys())
        if self._block_state is None and self.built and count > len(self.variables):
            base = len(self.variables)
            for i, variable in enumerate(self.variables):
                variable.assign(store[str(i)])
            object.__setattr__(self, "_stashed_state",
                               [np.array(store[str(i)]) for i in range(base, count)])
            return
        super().load_own_variables(store)

    # ---------------------------------------------------------------- update
    def apply(self, grads, trainable_variables=None):
        if self._pending_calls is None:
            raise RuntimeError(ATTACH_HINT)
        calls, self._pending_calls = self._pending_calls, None
        if trainable_variables is None:
            trainable_variables = self._trainable_variables
        variables = list(trainable_variables)
        if not self.built:
            with keras.src.backend.name_scope(self.name, caller=self):
                self.build(variables)
        grads = list(grads)
        step = self._iterations
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
            preconditioned = self._timed(
                "precondition",
                lambda: self._preconditioned(branch_grads, variables, damping))
            self._timed("update", lambda: self._apply_update(preconditioned, variables))
            return tf.constant(True)

        def skip_step():
            # A NaN/Inf gradient must not reach the weights, the factors or the step count.
            self._skipped_steps.assign_add(1)
            _warn_if(tf.constant(True),
                     "KFAC warning: non-finite gradients; step skipped, weights unchanged")
            return tf.constant(False)

        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g))
                                for g in grads if g is not None])
        tf.cond(finite, kfac_step, skip_step)

    def _apply_update(self, grads, variables):
        if self.inner_optimizer is None:
            super().apply(grads, variables)
        else:
            self.inner_optimizer.apply(grads, variables)
            self._iterations.assign_add(1)
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

    @staticmethod
    def _frequency(value, step):
        return tf.cast(schedules.value_at(value, step), tf.int64)

    # factors -------------------------------------------------------------
    def _batch_statistics(self, calls):
        return [block.batch_statistics(
                    block_calls, tf.shape(tf.nest.flatten(block_calls[0][0])[0])[0])
                for block, block_calls in zip(self._blocks, calls)]

    def _maybe_update_factors(self, step, calls):
        def update():
            statistics = self._statistics_fn(calls)
            statistics = self._reduce_statistics(statistics)
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(s))
                                    for block_stats in statistics for s in block_stats])
            first = tf.equal(self._factor_updates, 0)
            decay = tf.where(first, 0.0, self.factor_decay)
            for state, block_stats in zip(self._block_state, statistics):
                for variable, batch_value in zip(state["factors"], block_stats):
                    average = decay * variable + (1.0 - decay) * batch_value
                    variable.assign(tf.where(finite, average, variable))
            self._factor_updates.assign_add(tf.cast(finite, tf.int64))
            self._skipped_factor_updates.assign_add(1 - tf.cast(finite, tf.int64))
            _warn_if(tf.logical_not(finite),
                     "KFAC warning: non-finite factor statistics; factor update skipped")
            self._next_factor_step.assign(step + self._frequency(self.factor_update_freq, step))
            return finite

        return tf.cond(step >= self._next_factor_step, update, lambda: tf.constant(False))

    def _reduce_statistics(self, statistics):
        """Average factor statistics over ranks: one grouped call, symmetric-packed."""
        if self._comm.size == 1:
            return statistics
        reduced = iter(distributed.allreduce_symmetric(
            self._comm, [stat for block_stats in statistics for stat in block_stats],
            self.factor_wire_dtype, "factors"))
        return [[next(reduced) for _ in block_stats] for block_stats in statistics]

    # decompositions ------------------------------------------------------
    def _assign_owners(self):
        """Owner rank per decomposition item (replicated) or per block (owner).

        Greedy longest-processing-time on cost dim³: deterministic, so every rank
        computes the same assignment without talking.
        """
        def cost(block, j):
            shape = block.factor_shapes()[j]
            return distributed.eigen_cost(shape[-1], int(np.prod(shape[:-2])))

        if self.placement == "owner":
            costs = [sum(cost(block, j) for j in block.symmetric_factors()) or 1.0
                     for block in self._blocks]
        else:
            costs = [cost(self._blocks[b], j) for b, j in self._work_items()]
        return distributed.lpt_assignment(costs, self._comm.size)

    def _work_items(self):
        return [(b, j) for b, block in enumerate(self._blocks)
                for j in block.symmetric_factors()]

    def _owned_items(self):
        """Decomposition items this rank computes."""
        items = self._work_items()
        if self.placement == "owner":
            return [(b, j) for b, j in items if self._owners[b] == self._comm.rank]
        return [item for item, owner in zip(items, self._owners) if owner == self._comm.rank]

    def _decompose(self, items, factors, damping):
        return [self._blocks[b].decompose(j, factors[b], self.method, damping)
                for b, j in items]

    def _decomposition_targets(self, b, j):
        index = self._blocks[b].symmetric_factors().index(j)
        return self._block_state[b]["decompositions"][index]

    def _share_decompositions(self, owned, results):
        """Replicated placement: every rank gets every item from its owner."""
        if self.placement == "owner" or self._comm.size == 1:
            return owned, results
        items = self._work_items()
        computed = dict(zip(owned, results))
        local, shapes, owners = [], [], []
        for item, owner in zip(items, self._owners):
            for k, variable in enumerate(self._decomposition_targets(*item)):
                local.append(computed[item][k] if item in computed else None)
                shapes.append(variable.shape)
                owners.append(owner)
        values = iter(distributed.gather_from_owners(
            self._comm, local, shapes, owners, self.eigen_wire_dtype, "eigen"))
        return items, [[next(values) for _ in self._decomposition_targets(*item)]
                       for item in items]

    def _maybe_update_decompositions(self, step, damping):
        def update():
            factors = [[v.value for v in s["factors"]] for s in self._block_state]
            owned = self._owned_items()
            results = self._decompose_fn(owned, factors, damping) if owned else []
            items, results = self._share_decompositions(owned, results)
            failures = [tf.constant(False)]
            for item, result in zip(items, results):
                ok = tf.reduce_all([tf.reduce_all(tf.math.is_finite(r)) for r in result])
                for variable, value in zip(self._decomposition_targets(*item), result):
                    variable.assign(tf.where(ok, value, variable))
                failures.append(tf.logical_not(ok))
            failed = tf.reduce_sum(tf.cast(failures, tf.int64))
            self._failed_decompositions.assign_add(failed)
            self._decomposition_updates.assign_add(1)
            _warn_if(failed > 0, "KFAC warning:", failed,
                     "decomposition(s) not finite; keeping the previous ones")
            # A recomputation after a restore keeps the saved schedule.
            due = step >= self._next_decomposition_step
            self._next_decomposition_step.assign(tf.where(
                due, step + self._frequency(self.inv_update_freq, step),
                self._next_decomposition_step))
            self._decompositions_current.assign(True)
            return failed

        needed = tf.logical_or(step >= self._next_decomposition_step,
                               tf.logical_not(self._decompositions_current))
        return tf.cond(needed, update, lambda: tf.constant(0, tf.int64))

    # preconditioning -----------------------------------------------------
    def _precondition(self, block_indices, block_grads, factors, decompositions, damping):
        return [self._blocks[b].precondition(grads, block_factors, decomposition,
                                             self.method, damping)
                for b, grads, block_factors, decomposition
                in zip(block_indices, block_grads, factors, decompositions)]

    def _preconditioned_blocks(self, block_grads, damping):
        """Preconditioned gradients per block: all locally, or by owners then gathered."""
        indices = list(range(len(self._blocks)))
        if self.placement == "owner" and self._comm.size > 1:
            indices = [b for b in indices if self._owners[b] == self._comm.rank]
        state = [self._block_state[b] for b in indices]
        local = self._precondition_fn(
            tuple(indices), [block_grads[b] for b in indices],
            [[v.value for v in s["factors"]] for s in state],
            [[[v.value for v in d] for d in s["decompositions"]] for s in state],
            damping) if indices else []
        if not (self.placement == "owner" and self._comm.size > 1):
            return local
        computed = dict(zip(indices, local))
        values, shapes, owners = [], [], []
        for b, block in enumerate(self._blocks):
            for k, variable in enumerate(block.variables):
                values.append(computed[b][k] if b in computed else None)
                shapes.append(variable.shape)
                owners.append(self._owners[b])
        gathered = iter(distributed.gather_from_owners(
            self._comm, values, shapes, owners, self.eigen_wire_dtype, "preconditioned"))
        return [[next(gathered) for _ in block.variables] for block in self._blocks]

    def _preconditioned(self, grads, variables, damping, kl_clip=True):
        """`grads` with every managed variable's gradient preconditioned (and KL-clipped)."""
        if not self._blocks:
            return list(grads)
        index = {id(v): i for i, v in enumerate(variables)}
        missing = [v.path for block in self._blocks for v in block.variables
                   if id(v) not in index]
        if missing:
            raise ValueError(f"`variables` must hold every K-FAC-managed variable; missing "
                             f"{missing}")
        slots = [[index[id(v)] for v in block.variables] for block in self._blocks]
        # Dense float32 gradients (an Embedding's arrives as IndexedSlices).
        block_grads = [[tf.zeros(variables[i].shape) if grads[i] is None
                        else tf.cast(tf.convert_to_tensor(grads[i]), tf.float32)
                        for i in block_slots]
                       for block_slots in slots]
        preconditioned = self._preconditioned_blocks(block_grads, damping)
        if kl_clip and self.kl_clip is not None:
            optimizer = self.inner_optimizer or self
            nu = linalg.kl_clip_scale(preconditioned, block_grads,
                                      optimizer.learning_rate, self.kl_clip)
            preconditioned = [[p * nu for p in ps] for ps in preconditioned]
        grads = list(grads)
        for block_slots, block_p in zip(slots, preconditioned):
            for i, p in zip(block_slots, block_p):
                grads[i] = tf.cast(p, variables[i].dtype)
        return grads

    # ---------------------------------------------------------- curvature API
    def factors(self, layer):
        """The running curvature factors of `layer` (a Keras layer or its name).

        A dict of float32 tensors named as in docs/design.md: {"A": ..., "G": ...} for
        Kronecker blocks (a batch of pairs, e.g. per group, has a leading axis; an
        Embedding's A is the diagonal as a vector), {"F": ...} for diagonal blocks.
        """
        block = self._block_of(layer)
        state = self._block_state[self._blocks.index(block)]
        return {name: tf.convert_to_tensor(v)
                for name, v in zip(block.factor_names(), state["factors"])}

    def precondition(self, gradients, variables):
        """`gradients` of `variables` preconditioned with the current decompositions.

        What the update receives, before the KL clip: managed variables' gradients become
        (curvature + λI)⁻¹ ∇ per docs/design.md; the others come back unchanged. Usable
        eagerly or in a `tf.function`, after a training step has computed decompositions;
        in a multi-process job every rank calls it (placement "owner" gathers).
        """
        if self._block_state is None or (tf.executing_eagerly()
                                         and not int(self._decomposition_updates.numpy())):
            raise RuntimeError(
                "KFAC.precondition needs decompositions: train at least one step first "
                "(factors and decompositions are computed in the training step).")
        damping = tf.cast(schedules.value_at(self.damping, self.iterations), tf.float32)
        return self._preconditioned(list(gradients), list(variables), damping, kl_clip=False)

    def _block_of(self, layer):
        name = layer if isinstance(layer, str) else getattr(layer, "name", None)
        for block in self._blocks:
            if block.name == name and (isinstance(layer, str) or block.layer is layer):
                return block
        managed = [block.name for block in self._blocks]
        raise ValueError(f"`layer` must be a K-FAC-managed layer or its name, one of "
                         f"{managed}; received {layer!r}")

    # ---------------------------------------------------------- introspection
    def summary(self):
        """Managed and skipped layers, factor shapes, state size, counters, timings."""
        info = {
            "managed": [{"layer": b.name, "kind": b.kind,
                         "factor_shapes": [list(s) for s in b.factor_shapes()]}
                        for b in self._blocks],
            "skipped": list(self._skipped),
            "state_bytes": 0,
            "counters": {},
            "phase_seconds": {p: float(v.numpy()) for p, v in self._phase_seconds.items()},
        }
        if self._block_state is not None:
            info["state_bytes"] = int(sum(
                np.prod(v.shape) * np.dtype(v.dtype).itemsize
                for v in self._state_variables(saved_only=False)))
            info["counters"] = {
                "steps": int(self._iterations.numpy()),
                "skipped_steps": int(self._skipped_steps.numpy()),
                "factor_updates": int(self._factor_updates.numpy()),
                "skipped_factor_updates": int(self._skipped_factor_updates.numpy()),
                "decomposition_updates": int(self._decomposition_updates.numpy()),
                "failed_decompositions": int(self._failed_decompositions.numpy()),
            }
        return info

    def current_damping(self):
        return float(schedules.value_at(self.damping, self._iterations))

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
            "eigen_wire_dtype": self.eigen_wire_dtype,
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
