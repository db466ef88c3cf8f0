"""Everything tfkfac needs from Keras beyond its public API, in one place.

K-FAC needs the layers' activations and output gradients, which Keras's own train step
never shows an optimizer; so tfkfac installs its own train step on the attached model.
Each private name used here says why no public API serves. Nothing else in tfkfac
touches `keras.src` or a private attribute of a Keras object.
"""

import keras
import tensorflow as tf

# Optimizer attributes holding lists of blocks or state would otherwise be tracked by
# Keras and their variables saved twice or in another order; checkpoints depend on it.
no_tracking = keras.src.utils.tracking.no_automatic_dependency_tracking


def set_untracked(obj, name, value):
    """Set an attribute that Keras's automatic tracking must not see (as above)."""
    object.__setattr__(obj, name, value)


def name_scope(optimizer):
    """The scope Keras's `Optimizer.apply` builds variables in (no public equivalent)."""
    return keras.src.backend.name_scope(optimizer.name, caller=optimizer)


def slot_index(optimizer, variable):
    """Index of `variable` in the optimizer's per-variable slots. Keras's own optimizers
    call this protected method from `update_step`; there is no public equivalent."""
    return optimizer._get_variable_index(variable)


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


def install_train_step(model, step_with_tape, reduce_logs, fresh_in_sample_weight=False):
    """Replace this model's train step by Keras's, with K-FAC's tape and update.

    `step_with_tape(forward, fresh)` runs `forward()` (returning the scaled loss and
    y_pred) under K-FAC's recording tape, applies the update and returns y_pred;
    `reduce_logs` averages the step's logs over ranks. With `fresh_in_sample_weight`
    the batch's sample-weight slot holds the fresh flags: they go to `step_with_tape`
    (None otherwise), and the loss and metrics get no sample weights. The loss and
    metrics bookkeeping is the TensorFlow backend's own `train_step`, which calls these
    private helpers; only `model` is changed.
    """
    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        fresh = None
        if fresh_in_sample_weight:
            fresh, sample_weight = sample_weight, None

        def forward():
            y_pred = model(x, training=True) if model._call_has_training_arg else model(x)
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred,
                                       sample_weight=sample_weight, training=True)
            batch = tf.shape(tf.nest.flatten(x)[0])[0]
            model._loss_tracker.update_state(
                keras.src.losses.loss.unscale_loss_for_distribution(loss),
                sample_weight=batch)
            return model.optimizer.scale_loss(loss), y_pred

        y_pred = step_with_tape(forward, fresh)
        return reduce_logs(model.compute_metrics(x, y, y_pred, sample_weight=sample_weight))

    # K-FAC compiles its own local stages with XLA and communicates between them, so
    # the outer train function must stay a plain tf.function.
    keras_make_train_function = type(model).make_train_function.__get__(model)

    def make_train_function(force=False):
        model.jit_compile = False
        return keras_make_train_function(force)

    set_untracked(model, "train_step", train_step)
    set_untracked(model, "make_train_function", make_train_function)
