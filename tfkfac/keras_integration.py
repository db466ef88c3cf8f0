"""What tfkfac needs from Keras and TensorFlow beyond their public API, in one place.

K-FAC needs the layers' activations and output gradients, which Keras's own train step
never shows an optimizer; so tfkfac gives the attached model its own `train_step`,
`test_step`, `make_train_function` and `fit` (Keras's public methods, overridden on that
instance only, not by a subclass swapped in as the model's class, whose name and module a
save would record in place of the user's), built from public Keras (`Model.compute_loss`,
`compute_metrics`, `metrics`). The private Keras and TensorFlow names tfkfac still
uses are listed, each with the reason no public API serves, in docs/design.md §15;
tests/test_keras_seam.py fails naming the one a Keras or TensorFlow release changed.
Besides, `model_compiling` and `model_building` find the model that compiles or builds an
optimizer on Keras's call stack, Keras handing the optimizer nothing else of the model.
"""

import inspect
import re
import warnings
import weakref

import keras
import tensorflow as tf

from tfkfac import example_weights

# Optimizer attributes holding lists of blocks or state would otherwise be tracked by
# Keras and their variables saved twice or in another order; checkpoints depend on it.
no_tracking = keras.src.utils.tracking.no_automatic_dependency_tracking


def set_untracked(obj, name, value):
    """Set an attribute that Keras's automatic tracking must not see (as above)."""
    object.__setattr__(obj, name, value)


def name_scope(optimizer):
    """The scope Keras's `Optimizer.apply` builds variables in."""
    return keras.name_scope(optimizer.name, caller=optimizer)


def leaf_layers(model):
    """{path: layer} for every layer inside `model` that has no sublayers.

    `Model.layers` lists only the top level; a leaf is where weights really live (a
    MultiHeadAttention's weights belong to its EinsumDense sublayers). Keras's own
    traversal, `_flatten_layers`, is the only one that sees nested layers; its order
    fixes the order of K-FAC's saved state. A path joins the names from the model down
    ("attention/query"; a top-level layer's is its name): names repeat, paths do not.
    """
    paths = {}

    def visit(layer, path):
        paths.setdefault(id(layer), path)
        for child in layer._flatten_layers(include_self=False, recursive=False):
            visit(child, f"{path}/{child.name}")

    for child in model._flatten_layers(include_self=False, recursive=False):
        visit(child, child.name)
    return {paths[id(layer)]: layer
            for layer in model._flatten_layers(include_self=False, recursive=True)
            if not list(layer._flatten_layers(include_self=False, recursive=False))}


def train_step_owner(model):
    """The KFAC whose train step `model` runs, or None."""
    owner = getattr(model, "_tfkfac_owner", None)
    return owner() if owner is not None else None


def compiled_optimizer(model):
    """The optimizer `model` is compiled with (None before `compile`), taken out of the
    `LossScaleOptimizer` Keras wraps it in at compile under `mixed_float16`."""
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


# The Keras methods that build a model's optimizer before its first step: `fit` under a
# tf.distribute strategy, and `load_model`.
_BUILDING_METHODS = ("_symbolic_build", "compile_from_config")


def model_building(optimizer, variables):
    """The keras.Model building `optimizer` on its trainable `variables` before its first
    step, or None.

    Keras hands an optimizer its model's variables, never the model: `optimizer.build(
    model.trainable_variables)`, in `Trainer._symbolic_build` (`fit` under a tf.distribute
    strategy) and `Trainer.compile_from_config` (`load_model`). The model is the `self` of
    that method on the call stack, known by being compiled with `optimizer` and by its
    trainable variables being `variables`. A build anywhere else (inside Keras's own
    train step: too late for K-FAC's) finds none.
    """
    keys = [id(v) for v in variables]
    return _calling_model(_BUILDING_METHODS, lambda model, frame: (
        compiled_optimizer(model) is optimizer
        and [id(v) for v in model.trainable_variables] == keys))


def model_compiling(optimizer):
    """The keras.Model whose `compile(optimizer=...)` is taking `optimizer`, or None.

    `Model.compile` never calls its optimizer; it sets it as an attribute, and TensorFlow's
    tracking then calls the optimizer's `_maybe_initialize_trackable`, from which this is
    called: the model is the `self` of `compile` on the call stack, its `optimizer`
    argument (after `keras.optimizers.get`) being `optimizer`. This is before the first
    step, so K-FAC can install its train step (docs/guide.md §2).
    """
    return _calling_model(("compile",), lambda model, frame: (
        frame.f_locals.get("optimizer") is optimizer))


def _calling_model(methods, matches):
    """The keras.Model that is the `self` of the nearest call of one of `methods` on the
    call stack for which `matches(model, frame)` holds, or None."""
    frame = inspect.currentframe().f_back.f_back
    while frame is not None:
        model = frame.f_locals.get("self")
        if (frame.f_code.co_name in methods and isinstance(model, keras.Model)
                and matches(model, frame)):
            return model
        frame = frame.f_back
    return None


# What `install_train_step` sets on a model; `uninstall_train_step` takes it away.
_INSTALLED = ("train_step", "make_train_function", "_tfkfac_owner", "_maybe_symbolic_build",
              "test_step", "fit")


def install_train_step(model, owner, step_with_tape, reduce_logs, release, stale,
                       fresh_in_sample_weight=False, alone=True):
    """Replace this model's train step by one with K-FAC's tape and update (`owner`'s).

    `step_with_tape(forward, fresh, sample_weight)` runs `forward()` (returning the
    scaled loss and y_pred) under K-FAC's recording tape, applies the update and returns
    y_pred (`sample_weight`, the loss's, for the sampled Fisher's loss);
    `reduce_logs` averages the step's logs over ranks. If `fit` finds the model
    compiled with another optimizer since, `release(reason)` gives it back Keras's
    train step (`uninstall_train_step`) and Keras's own runs. `stale` (a
    `tfkfac.stale_steps.StaleSteps`) gives the stale steps their own train function
    where it can, and chooses between the two before each step. With
    `fresh_in_sample_weight` (factor_examples="fresh") the batch's third element holds
    `tfkfac.fresh_flags(flags, sample_weight)`: the flags go to `step_with_tape` (None
    otherwise); a plain tensor there is always a sample weight, which the loss, the
    metrics and the factor statistics get (`tfkfac.example_weights`); `fit` refuses
    `class_weight` then (Keras would put it where the flags are). The loss and its metric
    are `forward_pass`'s; only `model` is changed. `alone`: no other process trains the
    model (`_symbolic_build_on_local_batch`). A schedule's bad value stops `fit` with the
    one line of its check (`one_line_assertion`).
    """
    multi_worker = _is_multi_worker(model.distribute_strategy)

    def train_step(data, step_with_tape=step_with_tape):
        x, y, slot = keras.utils.unpack_x_y_sample_weight(data)
        fresh, sample_weight = example_weights.split_slot(slot, fresh_in_sample_weight)
        forward = lambda: forward_pass(model, x, y, sample_weight)
        y_pred = step_with_tape(forward, fresh, sample_weight)
        logs = reduce_logs(model.compute_metrics(x, y, y_pred, sample_weight=sample_weight))
        return _as_vectors(logs) if multi_worker else logs

    stale_step = lambda data: train_step(data, stale.step_with_tape)
    keras_make_train_function = type(model).make_train_function.__get__(model)
    owner = weakref.ref(owner)

    def keras_train_function(step, jit_compile):
        """Keras's train function (its tf.function and step loop) around `step`, compiled
        with XLA if `jit_compile`; Keras builds it from `model.train_step`."""
        model_jit_compile, model.jit_compile = model.jit_compile, jit_compile
        set_untracked(model, "train_step", step)
        try:
            keras_make_train_function(force=True)
            return model.train_function
        finally:
            set_untracked(model, "train_step", train_step)
            model.jit_compile = model_jit_compile

    def still_owned():
        """Whether `model` is still compiled with the owner; if not, it is released."""
        optimizer = compiled_optimizer(model)
        if optimizer is owner():
            return True
        release(f"model {model.name!r} was compiled with another optimizer "
                f"({type(optimizer).__name__})")
        return False

    def taken_over():
        """After a release: whether the optimizer compiled since is a KFAC (compiled
        without `attach`) that takes the model over."""
        take_over = getattr(compiled_optimizer(model), "_attach_compiled", None)
        return take_over is not None and take_over(model)

    def make_train_function(force=False):
        if not still_owned():
            if taken_over():
                return model.make_train_function(force)
            return keras_make_train_function(force)
        if multi_worker and model.steps_per_execution > 1:
            raise ValueError(
                "KFAC: under MultiWorkerMirroredStrategy `fit` runs one step per execution "
                f"(steps_per_execution=1, not {model.steps_per_execution}): TensorFlow's "
                "cross-worker collectives in Keras's step loop (its iterator, its log "
                "reduction) fail inside the tf.while_loop of several steps.")
        stale.forget()  # a new `fit`: callbacks may have restored the counters
        if model.train_function is not None and not force:
            return model.train_function
        # The factor step calls LAPACK (and collectives across ranks), which XLA cannot
        # compile: it runs as a tf.function and compiles its own local stages
        # (`KFACConfig.xla`). Only the stale step can compile whole.
        unavailable = stale.unavailable(model)
        not_compiled = unavailable or stale.not_compilable()
        if model.jit_compile and not_compiled:
            warnings.warn(
                "KFAC: with jit_compile=True only K-FAC's stale steps compile with XLA, and "
                f"here none can: {not_compiled}. The train step runs as a tf.function with "
                "jit_compile=False, and K-FAC compiles its own local stages (the `xla` "
                "setting). Pass `jit_compile=False` to `model.compile` to say so and "
                "silence this.", stacklevel=2)
            model.jit_compile = False
        factor_function = keras_train_function(train_step, False)
        model.train_function = _one_line_assertions(
            factor_function if unavailable else stale.choosing(
                model, factor_function, keras_train_function(stale_step, model.jit_compile)))
        return model.train_function

    set_untracked(model, "train_step", train_step)
    set_untracked(model, "make_train_function", make_train_function)
    set_untracked(model, "_tfkfac_owner", owner)
    model.train_function = None  # one made before (e.g. by a `fit` that failed unattached)
    build_on_local_batch = _symbolic_build_on_local_batch(model, alone)

    def maybe_symbolic_build(*args, **kwargs):
        if still_owned():
            return build_on_local_batch(*args, **kwargs)
        taken_over()
        return model._maybe_symbolic_build(*args, **kwargs)  # the new owner's, or Keras's

    set_untracked(model, "_maybe_symbolic_build", maybe_symbolic_build)
    # Evaluation reads a batch's sample weights, never its fresh flags.
    keras_test_step = model.test_step

    def test_step(data):
        logs = keras_test_step(example_weights.without_fresh_flags(data))
        return _as_vectors(logs) if multi_worker else logs

    set_untracked(model, "test_step", test_step)
    if fresh_in_sample_weight:
        keras_fit = model.fit

        def fit(*args, **kwargs):
            try:
                class_weight = inspect.signature(keras_fit).bind(
                    *args, **kwargs).arguments.get("class_weight")
            except TypeError:
                class_weight = None  # Keras's `fit` names the arguments it does not take
            if class_weight is not None and compiled_optimizer(model) is owner():
                raise ValueError(example_weights.CLASS_WEIGHT_WITH_FRESH)
            return keras_fit(*args, **kwargs)

        set_untracked(model, "fit", fit)


def uninstall_train_step(model):
    """Give `model` back Keras's own train step (undo `install_train_step`)."""
    for name in _INSTALLED:
        if name in model.__dict__:
            object.__delattr__(model, name)
    model.train_function = None


def _one_line_assertions(train_function):
    """`train_function` raising a failed K-FAC check of the graph (a schedule's bad value:
    `tfkfac.schedules.checked`) as its one line instead of TensorFlow's graph trace."""

    def checked_train_function(iterator):
        try:
            return train_function(iterator)
        except tf.errors.InvalidArgumentError as error:
            line = one_line_assertion(error.message)
            if line is None:
                raise
            raise type(error)(error.node_def, error.op, line) from None

    return checked_train_function


def one_line_assertion(message):
    """The K-FAC check's own line in the message of a graph's failed assertion ("KFAC:
    the schedule of `learning_rate` must give ...; at step 3 it gave -0.1"), or None when
    the failed assertion is not one of K-FAC's."""
    for line in message.splitlines():
        line = line.strip()
        if line.startswith("assertion failed: [KFAC"):
            # tf.debugging.Assert's data in brackets; tf.debugging.assert_*'s message is
            # followed by its condition and values, left out.
            line = " ".join(re.findall(r"\[([^\[\]]*)\]", line))
            return line.split("  Condition ")[0].strip()
    return None


def _as_vectors(logs):
    """Scalar logs as one-element vectors. Keras reduces a step's logs over
    MultiWorkerMirroredStrategy workers with `strategy.reduce(MEAN, log, axis=0)`, which
    fails on a scalar (keras-team/keras#20585); a one-element vector reduces to the mean
    over workers, a scalar again."""
    return {name: tf.reshape(value, [1]) if tf.is_tensor(value) and value.shape.rank == 0
            else value for name, value in logs.items()}


def _is_multi_worker(strategy):
    """Whether `strategy` runs replicas in other processes (MultiWorkerMirroredStrategy
    with several workers)."""
    return (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
            and len(strategy.extended.worker_devices) < strategy.num_replicas_in_sync)


def _symbolic_build_on_local_batch(model, alone):
    """`model._maybe_symbolic_build`: Keras's `_symbolic_build` on a batch of this
    replica's shapes, under every strategy.

    Keras builds the model's metrics and optimizer before training only under an explicit
    strategy; otherwise their variables are made inside the first trace of the train
    function, which TensorFlow then traces again without them: a second trace of K-FAC's
    whole step (a few seconds). In one replica of a process training `alone`, a build
    that fails symbolically is left to the first trace, as Keras leaves it; in one
    replica beside other processes (Horovod ranks) Keras builds as it does itself, the
    same on every rank, where a build failing on one rank only cannot put the ranks'
    collectives out of step. Under a strategy Keras takes the first batch off the
    training iterator (which `fit` then continues from, one batch short, when
    `steps_per_epoch` is given) and reduces it over the replicas, which fails under
    MultiWorkerMirroredStrategy (keras-team/keras#20585). Only the shapes matter: they
    come from the iterator's element spec (the first replica's), no batch is taken.
    """
    keras_build = type(model)._maybe_symbolic_build.__get__(model)
    strategy = model.distribute_strategy

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    def zeros_like_spec(spec):
        first = tf.nest.flatten(spec, expand_composites=True)[0]  # replica 0's
        return tf.zeros([1 if d is None else d for d in first.shape], first.dtype)

    replicated = strategy.num_replicas_in_sync > 1

    def symbolic_build(iterator=None, data_batch=None):
        if not (replicated or alone):
            return keras_build(iterator=iterator, data_batch=data_batch)
        if iterator is not None:
            data_batch = tf.nest.map_structure(zeros_like_spec,
                                               iterator._get_iterator().element_spec)
        data_batch = example_weights.without_fresh_flags(data_batch)
        with strategy.scope():
            try:
                model._symbolic_build(data_batch=tf.nest.map_structure(local, data_batch))
            except Exception:  # pylint: disable=broad-except
                if replicated:
                    raise
                # Alone, this build only saves a trace, and Keras makes it inside the
                # first one instead: what fails here symbolically (e.g. a metric whose
                # result has no static shape) is left to that.
        return None

    return symbolic_build


def forward_pass(model, x, y, sample_weight):
    """(scaled loss, y_pred) of Keras's training forward pass on one batch, the loss
    metric updated: Keras's public `Model.compute_loss` and `Model.metrics`, as in
    Keras's own TensorFlow train step. Run it under the tape that takes the gradients."""
    y_pred = model(x, training=True)
    with_training_arg = "training" in inspect.signature(model.compute_loss).parameters
    options = {"training": True} if with_training_arg else {}
    loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, **options)
    tracker = next((m for m in model.metrics if m.name == "loss"), None)
    if tracker is not None:
        # Keras scales the loss down by the replicas in sync (`replicas_in_sync`); the
        # metric shows it per replica, as Keras's train step does.
        batch = tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]
        tracker.update_state(loss * tf.cast(replicas_in_sync(), loss.dtype),
                             sample_weight=batch)
    return model.optimizer.scale_loss(loss), y_pred


def replicas_in_sync():
    """Replicas of the tf.distribute strategy in scope (1 without one). Keras's losses
    (and `tf.nn.compute_average_loss` in custom loops) scale a replica's loss by its
    inverse, so that the Keras optimizers' sum of gradients over replicas averages them;
    K-FAC averages over ranks itself and undoes that scale."""
    return tf.distribute.get_strategy().num_replicas_in_sync


def unfused(predictions):
    """`predictions` through an identity, keeping their Keras mask. Keras's cross-entropy
    of a softmax's output reads the softmax's input instead (its TensorFlow backend's
    `_get_logits`), so a gradient with respect to the output itself would be None; of
    the copy it is the loss's. A Keras layer's call carries the mask over to the copy,
    where Keras's losses look for it; the layer's dtype is the predictions', so nothing
    is cast."""
    identity = keras.layers.Lambda(tf.identity, mask=lambda inputs, mask: mask,
                                   dtype=predictions.dtype, name="unfused")
    return identity(predictions)


def update_count(optimizer):
    """The `apply` calls that updated the Keras `optimizer`'s variables, a Python int:
    its "iteration" variable, which `iterations` divides by `gradient_accumulation_steps`."""
    return read_scalar(own_variable(optimizer, "iteration"), int)


def own_variable(optimizer, name):
    """The variable the Keras `optimizer` made for itself named `name` ("iteration", or
    "learning_rate" unless its learning rate is a schedule or callable), or None: among
    its public `variables`, by the names its constructor gives them."""
    return next((v for v in optimizer.variables if v.name == name), None)


def momentum_slot(optimizer, variable):
    """The "momentum" slot of `variable` in the Keras `optimizer` (built on it; Adam's
    first moment, ScheduleFreeAdamW's z): Keras's own lookup, which also finds the slot
    of a tf.distribute replica's copy of the variable, as `update_step` receives it."""
    return optimizer._momentums[optimizer._get_variable_index(variable)]


def read_scalar(variable, kind):
    """`kind(value)` (int, bool) of a scalar Keras or TensorFlow `variable`, outside the
    graph; a tf.distribute variable's is its first replica's. `int(variable.value)`
    takes a third of the time of `int(variable.numpy())` (measured), which matters
    before every step."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    if isinstance(value, tf.distribute.DistributedValues):
        value = tf.convert_to_tensor(value)  # in cross-replica context: the first replica's
    return kind(value)


def without_replica_sum(optimizer):
    """Turn off the sum of gradients over tf.distribute replicas that Keras's TensorFlow
    optimizers do in `apply` (`_all_reduce_sum_gradients`; no public switch): KFAC hands
    its inner optimizer gradients its communicator has averaged already. Without a
    strategy that sum is the identity, so this changes nothing there."""
    set_untracked(optimizer, "_all_reduce_sum_gradients", lambda grads_and_vars: grads_and_vars)


def apply_if(condition, optimizer, grads, variables):
    """`optimizer.apply(grads, variables)` when `condition` (a bool, equal on every rank).

    Under a tf.distribute strategy Keras's TensorFlow optimizers update every replica's
    copy of a variable through `ReplicaContext.merge_call`, which a `tf.cond` branch in
    replica context may not call. So, as Keras's `LossScaleOptimizer` does, the condition
    is taken in cross-replica context and the update runs in each replica from there.
    Without a strategy that is a plain `tf.cond`. Call it in replica context.
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        raise ValueError("KFAC.apply must be called in a replica context (inside "
                         "`strategy.run`), as the Keras optimizers' `apply`.")

    def cross_replica(strategy, condition, grads):
        def update():
            strategy.extended.call_for_each_replica(optimizer.apply, args=(grads, variables))
            return tf.constant(True)

        return tf.cond(strategy.experimental_local_results(condition)[0], update,
                       lambda: tf.constant(False))

    return context.merge_call(cross_replica, args=(condition, list(grads)))


def assign_each(variables, value, *args):
    """From replica context, assign `value(copy, *args)` to every copy of each of
    `variables`: through `merge_call` and `extended.update`, as Keras's optimizers update
    the variables a tf.distribute strategy mirrors (without one, a plain assign)."""
    def update(strategy, *args):
        for variable in variables:
            if isinstance(variable, keras.Variable):
                variable = variable.value  # the tf.Variable
            strategy.extended.update(
                variable, lambda copy, *args: copy.assign(tf.cast(value(copy, *args),
                                                                  copy.dtype)),
                args=args, group=False)

    tf.distribute.get_replica_context().merge_call(update, args=args)


def checkpoint_children(children, kfac):
    """`tf.train.Checkpoint` children of a KFAC, laid out as they were when KFAC was its
    own momentum SGD (0.1), so those checkpoints still restore: the inner optimizer's
    iterations and learning rate under KFAC's names, and every variable (inner's, then
    K-FAC's) in `_variables`. TensorFlow's `Trackable._trackable_children` is the only
    hook that lets an object choose its checkpoint layout."""
    children = dict(children)
    children.pop("inner_optimizer", None)
    inner = kfac.inner_optimizer
    # The step count's variable (`iterations` is a quotient of it under accumulation).
    children["_iterations"] = own_variable(inner, "iteration")
    learning_rate = own_variable(inner, "learning_rate")
    if learning_rate is not None:
        children["_learning_rate"] = learning_rate
    else:
        children.pop("_learning_rate", None)
    children["_variables"] = checkpoint_list(kfac, kfac.variables)
    return children


def checkpoint_list(kfac, variables):
    """The list a `tf.train.Checkpoint` sees as `kfac`'s `_variables`, grown to
    `variables` (in `KFAC.variables` order): `grow_checkpoint_list`."""
    wrapper = checkpoint_wrapper(kfac, variables)
    grow_checkpoint_list(wrapper, variables)
    return wrapper


def checkpoint_wrapper(kfac, variables):
    """The list a `tf.train.Checkpoint` sees as `kfac`'s `_variables`, not yet grown.

    One TensorFlow list wrapper for the optimizer's life (a checkpoint matches children by
    identity), which its variables join as they are created, as Keras's optimizers'
    `_variables` does: a restore that finds fewer variables than the checkpoint holds
    leaves the other positions' values waiting in the wrapper
    (`Trackable._deferred_dependencies`, TensorFlow's restore-on-create), and each is
    assigned when a variable joins at its position (docs/design.md §10). Should
    `variables` not extend it, it is made anew: a ValueError if values were waiting.
    """
    variables = list(variables)
    wrapper = kfac.__dict__.get("_checkpoint_variables")
    if wrapper is not None and [id(v) for v in wrapper] != [
            id(v) for v in variables[:len(wrapper)]]:
        if waiting_shapes(wrapper):
            raise ValueError(
                f"KFAC {kfac.name!r}: a tf.train.Checkpoint restored before its variables "
                "existed holds values by position in `variables`, whose order has changed "
                "since; restore after the optimizer is built (after `model.fit` starts or "
                "`optimizer.build(model.trainable_variables)`).")
        wrapper = None
    if wrapper is None:
        wrapper = tf.__internal__.tracking.wrap([])
        set_untracked(kfac, "_checkpoint_variables", wrapper)
    return wrapper


def grow_checkpoint_list(wrapper, variables):
    """Append to `wrapper` (`checkpoint_wrapper`) those of `variables` beyond its length,
    each taking the value a restore left waiting for its position, if any. TensorFlow
    skips a waiting value of another shape without a word: check `waiting_shapes` first."""
    for variable in list(variables)[len(wrapper):]:
        wrapper.append(variable)


def waiting_shapes(wrapper):
    """{position: the shapes (tuples) of the values restores left waiting in `wrapper`
    (`checkpoint_wrapper`) for a variable at that position}."""
    wrapper._maybe_initialize_trackable()  # makes the (empty) deferred dependencies
    return {int(name): {tuple(position.value_shape() or ()) for position in positions}
            for name, positions in wrapper._deferred_dependencies.items() if positions}
