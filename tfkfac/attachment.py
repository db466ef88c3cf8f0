"""The model side of K-FAC: what `KFAC.attach(model)` sets up on the model.

K-FAC needs each managed layer's inputs and output gradients, which Keras's train step
never shows an optimizer. An `Attachment` records them under its own tape, computes the
weight gradients (averaged over ranks, with the BatchNorm moving statistics) and hands
the captures to the optimizer's `apply` for exactly that one call (`providing`). They
cannot be an argument of `apply`: under mixed precision Keras wraps the optimizer in a
`LossScaleOptimizer`, whose `apply` passes only (gradients, variables) on.
"""

import contextlib
import functools
import typing
import weakref

import keras
import tensorflow as tf

from tfkfac import example_weights, keras_integration
from tfkfac.blocks.base import as_float, batch_size
from tfkfac.capture import Recorder
from tfkfac.self_tuning import StepBatch

NOT_ATTACHED = ("the optimizer is not attached to a model; call `optimizer.attach(model)` "
                "first (or pass `tfkfac.KFAC(..., model=model)`)")
ATTACH_HINT = (
    "KFAC has no layer captures for this step: it needs its own train step. Attach it "
    "to the model before training with `optimizer.attach(model)` (or "
    "`tfkfac.KFAC(..., model=model)`), or in a custom loop compute gradients with "
    "`optimizer.record()` and `optimizer.minimize(loss, tape=tape)`. Compiled without "
    "`attach`, KFAC attaches itself to a model that is built when compiled, or that Keras "
    "builds before the first step (under a tf.distribute strategy, in "
    "`keras.models.load_model`); this model was neither, and Keras's train step calls the "
    "optimizer first after the forward pass, too late to record it: build the model (an "
    "`Input` shape, or call it on a batch) before `compile`.")
SAMPLED_IN_CUSTOM_LOOP = (
    "KFAC(fisher='sampled') draws its labels in the train step KFAC installs on the model "
    "(`model.fit`), from the compiled loss and the model's predictions; a custom loop "
    "(`record()` and `minimize`) hands K-FAC neither: use fisher='empirical' there.")
class Captures(typing.NamedTuple):
    """What one step gives the optimizer's `apply` (docs/design.md §7).

    `calls()`: per block, the (inputs, unscaled output gradients) of every call, each
    example's output gradients multiplied by its `output_scales` entry (docs/design.md
    §2, sample weights). It
    builds the unscaling (and, for the sampled Fisher, the backward pass that gives the
    output gradients) when called, so that inside the factor update's branch it runs on
    factor steps only: a stale step never reads the output gradients, which are as large
    as the layers' activations. `weights`: per-example weights of the factor
    statistics, mean 1 over the examples of all ranks, or None (every example counts
    once): from fresh flags and sample weights (`tfkfac.example_weights`). `ready`:
    whether any rank has an example of positive weight (always True without fresh flags
    or sample weights). `stale`: the step was chosen outside the graph as one whose factors and
    decompositions are not due (`tfkfac.stale_steps`): nothing was recorded, `calls` is
    None.
    """

    calls: typing.Optional[typing.Callable]
    weights: typing.Any = None
    ready: typing.Any = True
    stale: bool = False
    # The batch's sub-batches for the gradient noise scale (`noise_scale.Halves` or
    # `noise_scale.Ranks`) while a `tfkfac.GradientNoiseScale` measures, else None.
    sub_batches: typing.Any = None


class Attachment:
    """The recorder, rank averaging and train step of the one model K-FAC manages.

    With `fresh_only`, each step needs the batch's fresh flags
    (`example_weights.FRESH_HINT`). `fisher`:
    a `tfkfac.fisher.SampledFisher`, whose draws give the output gradients, or None (the
    empirical Fisher: those of the observed labels).
    """

    def __init__(self, model, layers, blocks, communicator, fresh_only=False,
                 count_skipped_step=None, fisher=None):
        self._model = weakref.ref(model)
        # Counts a step a wrapping optimizer (Keras's LossScaleOptimizer) skips for
        # non-finite gradients without calling K-FAC's `apply`.
        self._count_skipped_step = count_skipped_step
        self._blocks = list(blocks)
        self._recorder = Recorder(blocks)
        self._comm = communicator
        self._captures = None
        self.fresh_only = fresh_only
        self._fisher = fisher
        self._running_statistics = running_statistics(layers)
        # The `tfkfac.noise_scale.NoiseScaleProbe` measuring `train_step`'s steps, or None.
        self.noise_probe = None
        # This step's batch for self-tuning's extra forward passes during `apply`
        # (a `tfkfac.self_tuning.StepBatch`; None outside `train_step`).
        self.step_batch = None

    @property
    def model(self):
        return self._model()

    @contextlib.contextmanager
    def record(self, persistent=False):
        """A `tf.GradientTape` during which the managed layers' calls are recorded
        (persistent for the sampled Fisher, which asks it for a second backward pass)."""
        with tf.GradientTape(persistent=persistent or self._fisher is not None) as tape, \
                self._recorder.recording():
            yield tape

    def step(self, tape, loss, variables, apply, loss_scale=1.0, replicas=1, fresh=None,
             wrapped=False, stale=False, sampled=None, y_pred=None, sample_weight=None):
        """Gradients of `loss` (recorded by `tape`), then `apply(gradients, variables)`
        with this step's `Captures` provided to the optimizer. `fresh`: the batch's
        fresh flags (N,), needed exactly when `fresh_only`. `replicas`: under a
        tf.distribute strategy the loss is this replica's mean over the replicas in
        sync (Keras's and tf.distribute's convention); its gradients are multiplied back
        before they are averaged over ranks, so they are averaged exactly once.
        `wrapped`: `apply` is a wrapping optimizer's, which may skip the step without
        calling K-FAC. `stale`: a step known to be stale (`Captures.stale`), whose `tape`
        recorded no layer calls. `sampled`: for the sampled Fisher, (the predictions, a
        function giving the gradient of the loss at drawn labels with respect to them).
        `y_pred`: the predictions `loss` was computed from, for `noise_probe` (on one
        process `tape` is then persistent). `sample_weight`: the weights `loss` gave the
        examples, which weigh their factor statistics (docs/design.md §2, sample weights)."""
        if self._fisher is not None and sampled is None and not stale:
            raise ValueError(SAMPLED_IN_CUSTOM_LOOP)
        if self.fresh_only != (fresh is not None):
            raise ValueError(example_weights.FRESH_HINT if self.fresh_only else
                             "`fresh` flags are used only with KFAC(factor_examples="
                             "'fresh'); this optimizer counts every example")
        gradients, captures = self._gradients(tape, loss, variables, loss_scale, replicas,
                                              fresh, stale, sampled, y_pred, sample_weight)
        self._captures = captures
        try:
            apply(gradients, variables)
        finally:
            self._captures = None
        if wrapped and self._count_skipped_step is not None:  # after `apply` built the state
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(g)))
                                    for g in gradients if g is not None])
            tf.cond(finite, lambda: tf.constant(False), self._count_skipped_step)

    def captures(self):
        """This step's `Captures`."""
        if self._captures is None:
            raise RuntimeError(ATTACH_HINT)
        return self._captures

    def train_step(self, forward, fresh=None, sample_weight=None, stale=False):
        """Keras's train step with K-FAC's tape: `forward()` gives (scaled loss, y_pred).
        `sample_weight`: the loss's, for the sampled Fisher's loss at drawn labels and
        the weights of the factor statistics.
        `stale`: a step known to be stale (`tfkfac.stale_steps`): a plain tape, no layer
        call recorded, no output gradient asked for."""
        model = self.model
        fisher = None if stale else self._fisher
        distribution = None if fisher is None else fisher.distribution(model)
        # On one process the noise probe's halves of the batch take a second backward pass.
        persistent = self.noise_probe is not None and self._comm.size == 1
        with (tf.GradientTape(persistent=persistent) if stale
              else self.record(persistent)) as tape:
            scaled_loss, y_pred = forward()
        sampled = None if fisher is None else (y_pred, functools.partial(
            fisher.loss_gradient, distribution, y_pred, sample_weight))
        self.step_batch = StepBatch(forward, sample_weight, model.optimizer.scale_loss(1.0)
                                    / keras_integration.replicas_in_sync())
        try:
            self.step(tape, scaled_loss, model.trainable_variables, model.optimizer.apply,
                      loss_scale=model.optimizer.scale_loss(1.0),
                      replicas=keras_integration.replicas_in_sync(), fresh=fresh,
                      wrapped=keras_integration.train_step_owner(model) is not model.optimizer,
                      stale=stale, sampled=sampled, y_pred=y_pred,
                      sample_weight=sample_weight)
        finally:
            self.step_batch = None
        return y_pred

    def averaged_over_ranks(self, logs):
        """`model.fit` logs as the mean over ranks (each rank's running mean, equal batches)."""
        names = [name for name, value in logs.items() if tf.is_tensor(value)]
        values = self._comm.grouped_allreduce_mean(
            [tf.cast(logs[name], tf.float32) for name in names], category="metrics")
        return {**logs, **dict(zip(names, values))}

    def _gradients(self, tape, loss, variables, loss_scale, replicas, fresh, stale=False,
                   sampled=None, y_pred=None, sample_weight=None):
        """(weight gradients averaged over ranks, `Captures` with unscaled output
        gradients; on a `stale` step, without any).

        `loss_scale` is the factor `loss` was multiplied by (mixed precision), besides
        1/`replicas` (tf.distribute, see `step`), which is undone here for both.
        `sampled` (see `step`): the output gradients are those of the loss at drawn
        labels, scaled as `loss` was (Keras's loss divides by `replicas` too). With a
        `noise_probe` and `y_pred`, the `Captures` hold the batch's sub-batches.
        """
        calls, output_grads, scaled_by = [], [], loss_scale
        if stale:
            gradients = tape.gradient(loss, list(variables))
        else:
            calls = self._recorder.take()
            outputs = [[s for _, s in block_calls] for block_calls in calls]
            if sampled is None:
                gradients, output_grads = tape.gradient(loss, (list(variables), outputs))
            else:
                gradients = tape.gradient(loss, list(variables))
        # Averaged here, before any loss-scale finiteness check, so that every rank takes
        # the same branch and issues the same collectives. BatchNorm moving statistics
        # (updated by this step's forward pass) and the count of fresh examples ride in
        # the same call.
        present = [g for g in gradients if g is not None]
        statistics = self._running_statistics
        flags = None if fresh is None else tf.cast(tf.reshape(fresh, (-1,)), tf.float32)
        if flags is not None and calls:
            tf.debugging.assert_equal(
                tf.size(flags), batch_size(calls[0]),
                message="`fresh` must hold one flag per example of the batch")
            tf.debugging.assert_equal(
                flags * (1.0 - flags), tf.zeros_like(flags),
                message="KFAC(factor_examples='fresh'): the fresh flags must be 0 or 1")
        # The loss's weights per example weigh the factor statistics (docs/design.md §2,
        # sample weights); a stale step computes none.
        weights = (example_weights.per_example(sample_weight, batch_size(calls[0]))
                   if calls else None)
        sums = example_weights.sums(flags, weights)
        reduced = self._comm.grouped_allreduce_mean(
            present + [tf.convert_to_tensor(v) for v in statistics] + sums,
            category="gradients")
        for variable, value in zip(statistics, reduced[len(present):]):
            variable.assign(value)
        statistics_weights = example_weights.StatisticsWeights(None, None, True)
        if sums:
            statistics_weights = example_weights.statistics_weights(
                flags, weights, reduced[len(reduced) - len(sums):])
        sub_batches = None
        if self.noise_probe is not None and y_pred is not None:
            sub_batches = self.noise_probe.sub_batches(
                self.model.optimizer.iterations, gradients, replicas / loss_scale, tape,
                loss, y_pred, variables, self._comm)
        reduced = iter(reduced[:len(present)])
        gradients = [None if g is None else next(reduced) for g in gradients]
        if replicas != 1:
            gradients = [None if g is None else g * tf.cast(replicas, g.dtype)
                         for g in gradients]
            loss_scale = loss_scale / replicas

        output_scales = statistics_weights.output_scales

        def unscaled(s, g, axis=0):  # float16 widened before unscaling; float64 stays float64
            if g is None:
                return tf.zeros_like(s)
            g = as_float(g)
            g = g / tf.cast(loss_scale, g.dtype)
            if output_scales is not None:
                g = example_weights.scale_examples(g, output_scales, axis)
            return g

        def sampled_output_grads(predictions, loss_gradient):
            # A second backward pass, from the predictions to the layer outputs only:
            # reverse mode takes one output cotangent per pass, and the weights' (the
            # observed labels') is not this one.
            cotangent = loss_gradient() * tf.cast(scaled_by, predictions.dtype)
            return tape.gradient(predictions, outputs, output_gradients=cotangent)

        def unscaled_calls():
            grads = output_grads if sampled is None else sampled_output_grads(*sampled)
            return [[(x, tf.nest.map_structure(
                        lambda s, g, axis=block.output_batch_axis: unscaled(s, g, axis), s, g))
                      for (x, s), g in zip(block_calls, block_grads)]
                     for block, block_calls, block_grads in zip(self._blocks, calls, grads)]

        if stale:
            return gradients, Captures(None, stale=True, sub_batches=sub_batches)
        return gradients, Captures(unscaled_calls, statistics_weights.weights,
                                   statistics_weights.ready, sub_batches=sub_batches)


def running_statistics(layers):
    """The variables averaged with the gradients every step besides them: BatchNorm
    moving statistics, updated from each rank's own batch, so that every rank holds the
    same model."""
    return [v for layer in layers
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
            for v in (layer.moving_mean, layer.moving_variance)]
