"""Which Fisher the G factors estimate: the empirical one, or the sampled (true) one.

The empirical Fisher builds G (and the diagonal blocks' statistics) from the output
gradients of the loss at the observed labels, which the weight gradients need anyway.
The sampled Fisher (Martens & Grosse 2015 §5; kfac-jax's and TF1 tensorflow/kfac's
default) takes them from the same loss at labels ỹ ~ p(y | x; θ), the model's own
predictive distribution, one draw per example: softmax cross-entropy draws ỹ from the
softmax, binary cross-entropy each output from its Bernoulli, mean squared error draws ỹ = f(x) + N(0, σ²I) with σ² = d/2 (d the size of the
last axis, which Keras's MSE averages over), the variance for which that loss is the
Gaussian's negative log-likelihood up to a constant, so that E[g gᵀ] is the loss's own
Hessian in output space, (2/d)·I (docs/design.md §2). The weight gradients handed to the
update stay those of the observed labels.

The draws are stateless, keyed by (`fisher_seed`, the update count, the rank, the
tf.distribute replica): every rank and replica draws its own labels, and a resumed run
draws what the uninterrupted one did.
"""

import collections.abc
import typing

import keras
import numpy as np
import tensorflow as tf

from tfkfac import keras_integration

FISHERS = ("empirical", "sampled")
# The compiled losses the sampled Fisher knows the predictive distribution of, as
# classes, their functions and the names `model.compile` takes.
SAMPLED_LOSSES = {
    keras.losses.SparseCategoricalCrossentropy: "categorical",
    keras.losses.CategoricalCrossentropy: "categorical",
    keras.losses.BinaryCrossentropy: "bernoulli",
    keras.losses.MeanSquaredError: "normal",
    keras.losses.sparse_categorical_crossentropy: "categorical",
    keras.losses.categorical_crossentropy: "categorical",
    keras.losses.binary_crossentropy: "bernoulli",
    keras.losses.mean_squared_error: "normal",
}
ALLOWED = ("keras.losses.SparseCategoricalCrossentropy, CategoricalCrossentropy, "
           "BinaryCrossentropy (with or without from_logits) or MeanSquaredError, as an "
           "instance, a function or its name (e.g. 'sparse_categorical_crossentropy', 'mse')")


class PredictiveDistribution(typing.NamedTuple):
    """The distribution a compiled loss is the negative log-likelihood of (up to a
    constant): "categorical" over the last axis or "bernoulli" per output (the
    predictions are logits when `from_logits`, else probabilities), or "normal" (mean
    the predictions, σ² = d/2).
    `reduction`: the compiled loss's, which the loss at the draws keeps, so that G's
    normalisation is the empirical Fisher's."""

    kind: str
    from_logits: bool
    reduction: typing.Any

    def loss_gradient(self, predictions, sample_weight, seed):
        """d/d(predictions) of the loss at labels drawn at `predictions` (one per
        example, stateless RNG `seed`), weighted and reduced as the compiled loss."""
        predictions = keras_integration.unfused(predictions)
        labels = tf.stop_gradient(self._draw(predictions, seed))
        if self.kind == "categorical":
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=self.from_logits,
                                                              reduction=self.reduction)
        elif self.kind == "bernoulli":
            loss = keras.losses.BinaryCrossentropy(from_logits=self.from_logits,
                                                   reduction=self.reduction)
        else:
            loss = keras.losses.MeanSquaredError(reduction=self.reduction)
        with tf.GradientTape() as tape:
            tape.watch(predictions)
            value = loss(labels, predictions, sample_weight=sample_weight)
        return tf.cast(tape.gradient(value, predictions), predictions.dtype)

    def _draw(self, predictions, seed):
        values = tf.cast(predictions, tf.float32)
        if self.kind == "normal":
            stddev = tf.sqrt(tf.cast(tf.shape(values)[-1], tf.float32) / 2.0)
            return values + stddev * tf.random.stateless_normal(tf.shape(values), seed)
        if self.kind == "bernoulli":
            ones = tf.sigmoid(values) if self.from_logits else values
            return tf.cast(tf.random.stateless_uniform(tf.shape(values), seed) < ones,
                           tf.float32)
        classes = tf.shape(values)[-1]
        logits = tf.reshape(values, (-1, classes))
        if not self.from_logits:  # probabilities, normalized or not
            logits = tf.math.log(tf.maximum(logits, np.finfo(np.float32).tiny))
        draws = tf.random.stateless_categorical(logits, 1, seed, dtype=tf.int32)
        return tf.reshape(draws, tf.shape(values)[:-1])


SAMPLED_PURPOSE = ("KFAC(fisher='sampled') draws labels from the predictive distribution "
                   "of the compiled loss")


def predictive_distribution(loss, purpose=SAMPLED_PURPOSE):
    """The `PredictiveDistribution` of `loss` (what `model.compile(loss=...)` took), or a
    ValueError naming it and the losses supported, after `purpose` (what needs it: the
    sampled Fisher, or the exact curvature of tfkfac/ggn.py)."""
    def refuse(why):
        return ValueError(f"{purpose}; {why}. It supports {ALLOWED}.")

    if loss is None:
        raise refuse("the model is compiled without a loss")
    if isinstance(loss, (collections.abc.Sequence, collections.abc.Mapping)) and not \
            isinstance(loss, str):
        raise refuse(f"the model is compiled with a list or dict of losses ({loss!r}): give "
                     "the one loss of a model of one output by itself")
    resolved = keras.losses.get(loss) if isinstance(loss, str) else loss
    kind = next((kind for known, kind in SAMPLED_LOSSES.items()
                 if resolved is known or type(resolved) is known), None)
    name = repr(loss) if isinstance(loss, str) else getattr(
        loss, "__name__", type(loss).__name__)
    if kind is None:
        raise refuse(f"loss {name} is not one it knows")
    if not isinstance(resolved, keras.losses.Loss):  # a function: Keras's defaults
        return PredictiveDistribution(kind, False, "sum_over_batch_size")
    # The arguments the loss passes its function (from_logits, axis, ignore_class).
    arguments = resolved.get_config()
    if arguments.get("axis", -1) != -1:
        raise refuse(f"loss {name} takes its classes along axis {arguments['axis']}; "
                     "the classes must be the last axis (-1)")
    if arguments.get("ignore_class") is not None:
        raise refuse(f"loss {name} ignores class {arguments['ignore_class']}, which a "
                     "drawn label would not")
    return PredictiveDistribution(kind, bool(arguments.get("from_logits", False)),
                                  resolved.reduction)


class SampledFisher:
    """The sampled Fisher's draws for one KFAC: `seed` its `fisher_seed`, `step()` its
    update count, `rank` this process's rank."""

    def __init__(self, seed, step, rank):
        self._seed, self._step, self._rank = seed, step, rank

    def distribution(self, model):
        """The `PredictiveDistribution` of `model`'s compiled loss, checked when the train
        step is traced, before any step runs."""
        return predictive_distribution(model.loss)

    def loss_gradient(self, distribution, predictions, sample_weight):
        """This step's gradient with respect to `predictions` of the loss at labels drawn
        from `distribution` at them (called in the factor branch only)."""
        if tf.nest.is_nested(predictions):
            raise ValueError("KFAC(fisher='sampled') draws labels for a model of one output; "
                             "this model has several")
        return distribution.loss_gradient(predictions, sample_weight, self.seed())

    def seed(self):
        """The stateless RNG seed of this step's draws on this rank and replica."""
        step = tf.cast(tf.convert_to_tensor(self._step()), tf.int64)
        seed = tf.stack([tf.constant(self._seed, tf.int64), step])
        seed = tf.random.experimental.stateless_fold_in(seed, self._rank)
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            seed = tf.random.experimental.stateless_fold_in(
                seed, context.replica_id_in_sync_group)
        return seed


def sampler(config, step, rank):
    """The `SampledFisher` of a KFAC with `config`, or None for the empirical Fisher."""
    return SampledFisher(config.fisher_seed, step, rank) if config.fisher == "sampled" else None
