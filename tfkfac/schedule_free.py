"""Schedule-free AdamW as its authors run it (Defazio et al. 2024, "The Road Less
Scheduled"): Keras's `ScheduleFreeAdamW` with its averaging step corrected, and its
evaluation at the averaged weights. It is KFAC's default inner optimizer.

The method keeps three sequences: z (the steps), x (their running average, the model it
returns) and y = (1 - β1) z + β1 x, where the gradients are taken. Keras 3.15 keeps y in
the model's variables and z in its `momentum` slots; x is not stored but follows from
them: x = (y - (1 - β1) z) / β1. Each step recovers x that way before moving it towards
the new z, but Keras 3.15 reads z there after its update (its `momentum.value` is the
variable itself, not the copy its comment means), so its y becomes the plain average of
the z's: gradients at the average, the β1 = 1 method the paper finds slower.
`ScheduleFreeAdamW` here adds back what that costs, so the steps are the paper's.

Keras has no hook that puts x in the model (its `finalize_variable_values` does nothing
for this optimizer, and `fit`'s evaluation runs at y), so `AveragedWeights` does: a
callback that holds x in the model's trainable variables while the model is evaluated
and puts y back, bit for bit, before the next step. BatchNormalization's moving
statistics, gathered at y, do not fit x; as the authors prescribe, they are taken at x
from training batches for the evaluation and put back after it (ResNet-20 after 300
steps: test accuracy 0.822 at y, 0.870 at x with y's statistics, 0.893 with x's from 10
batches, 0.895 from 50). Checkpoints keep y and z, from which a resumed run continues and
`averaged_weights` gives x.
"""

import contextlib

import keras
from keras import ops

from tfkfac import keras_integration

# Training batches whose statistics each BatchNormalization layer averages at x.
STATISTICS_BATCHES = 20


@keras.saving.register_keras_serializable(package="tfkfac")
class ScheduleFreeAdamW(keras.optimizers.ScheduleFreeAdamW):
    """Keras's ScheduleFreeAdamW with x recovered from z before the step, as published.

    Keras recovers x_t from z_{t+1} instead of z_t, which leaves x_{t+1} short by
    (1 - c)(1 - β1)/β1 (z_{t+1} - z_t), c = 1/t its averaging weight, and y_{t+1} short
    by β1 times that; this adds it to y. The model's variables hold y: evaluate and
    export at x with `tfkfac.AveragedWeights`.
    """

    def update_step(self, gradient, variable, learning_rate):
        steps = keras_integration.momentum_slot(self, variable)
        before = ops.copy(steps)  # z_t: read before Keras's update of it
        super().update_step(gradient, variable, learning_rate)
        weight = 1.0 / ops.cast(self.iterations + 1, variable.dtype)
        beta_1 = ops.cast(self.beta_1, variable.dtype)
        self.assign_add(variable, (1 - weight) * (1 - beta_1) * (steps - before))


# Saves written when this class lived in the repository's trainer ("trainers" package)
# load as it.
keras.saving.get_custom_objects()["trainers>ScheduleFreeAdamW"] = ScheduleFreeAdamW


def update_rule(optimizer):
    """The ScheduleFreeAdamW that applies `optimizer`'s updates (`optimizer` itself, or the
    one inside a KFAC or a LossScaleOptimizer), or None when another rule does."""
    while not isinstance(optimizer, keras.optimizers.ScheduleFreeAdamW):
        optimizer = getattr(optimizer, "inner_optimizer", None)
        if optimizer is None:
            return None
    return optimizer


def averaged_weights(optimizer, variables):
    """x of each of `variables` (numpy arrays): from y, the variable's value, and z, its
    momentum slot in the ScheduleFreeAdamW `optimizer` (built on them)."""
    beta_1 = float(optimizer.beta_1)
    return [(variable.numpy() - (1 - beta_1) *
             keras_integration.momentum_slot(optimizer, variable).numpy()) / beta_1
            for variable in variables]


class AveragedWeights(keras.callbacks.Callback):
    """Evaluates the model at x, the averaged weights a schedule-free optimizer returns.

    From `on_test_begin` to `on_test_end` (of `fit`'s validation, or of an `evaluate`
    given this callback) x is in the model's trainable variables and x's statistics in
    its BatchNormalization layers; the training point y and y's statistics are restored
    from copies afterwards, so training goes on unchanged. `applied()` does the same
    around any code, e.g. to export the model at x::

        optimizer = tfkfac.KFAC()                      # ScheduleFreeAdamW inside
        averaged = tfkfac.AveragedWeights(optimizer)
        model.fit(..., validation_data=..., callbacks=[averaged])
        with averaged.applied():
            model.export("served")
    """

    def __init__(self, optimizer, training_batches=None):
        """`optimizer`: a ScheduleFreeAdamW, or a KFAC (or LossScaleOptimizer) in front of
        one. `training_batches`: training batches (images, or tuples with the images
        first) or a callable returning them, of which the first STATISTICS_BATCHES are
        read once; needed when the model has BatchNormalization layers."""
        super().__init__()
        rule = update_rule(optimizer)
        if rule is None:
            raise ValueError(
                "AveragedWeights evaluates at a ScheduleFreeAdamW's averaged weights; "
                f"`optimizer` ({type(optimizer).__name__}) applies its updates with "
                f"{type(getattr(optimizer, 'inner_optimizer', optimizer)).__name__}, whose "
                "weights are the model's own")
        self._optimizer = rule
        self._training_batches = training_batches
        self._images = None
        self._training_point = None

    def set_model(self, model):
        super().set_model(model)
        if self._normalizations() and self._training_batches is None:
            raise ValueError(
                "AveragedWeights: the model has BatchNormalization layers, whose moving "
                "statistics gathered at the training point do not fit the averaged "
                "weights; pass `training_batches` (a dataset of training batches) to take "
                "them at the averaged weights")

    def _normalizations(self):
        return [layer for layer in keras_integration.leaf_layers(self.model).values()
                if isinstance(layer, keras.layers.BatchNormalization)]

    def _kept(self):
        """The trainable variables and the moving statistics: y's while training."""
        return self.model.trainable_variables + [
            statistic for layer in self._normalizations()
            for statistic in (layer.moving_mean, layer.moving_variance)]

    def on_test_begin(self, logs=None):
        if not self._optimizer.built:  # no step yet: x is y
            return
        self._training_point = [variable.numpy() for variable in self._kept()]
        variables = self.model.trainable_variables
        for variable, value in zip(variables, averaged_weights(self._optimizer, variables)):
            variable.assign(value)
        layers = self._normalizations()
        if layers:
            self._take_statistics(layers)

    def _take_statistics(self, layers):
        """Each layer's moving mean and variance: the mean of its batch statistics at x
        over STATISTICS_BATCHES training batches."""
        if self._images is None:
            batches = self._training_batches
            batches = batches() if callable(batches) else batches
            self._images = []
            for batch in batches:
                if len(self._images) == STATISTICS_BATCHES:
                    break
                self._images.append(batch[0] if isinstance(batch, (tuple, list)) else batch)
        momenta = [layer.momentum for layer in layers]
        try:
            for count, images in enumerate(self._images):
                for layer in layers:  # a running mean: the new batch weighs 1 / (count + 1)
                    layer.momentum = count / (count + 1)
                self.model(images, training=True)
        finally:
            for layer, momentum in zip(layers, momenta):
                layer.momentum = momentum

    def on_test_end(self, logs=None):
        if self._training_point is None:
            return
        for variable, value in zip(self._kept(), self._training_point):
            variable.assign(value)
        self._training_point = None

    @contextlib.contextmanager
    def applied(self, model=None):
        """A context in which `model` (default: the model this callback was used with)
        holds the averaged weights x and x's statistics; y and its statistics after."""
        if model is not None:
            self.set_model(model)
        elif self.model is None:
            raise ValueError("AveragedWeights.applied(model): give the model (this callback "
                             "has not been used with one yet)")
        self.on_test_begin()
        try:
            yield self.model
        finally:
            self.on_test_end()
