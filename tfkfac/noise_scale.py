"""The gradient noise scale, measured during training (docs/design.md
§13).

McCandlish et al. (2018, appendix A): the gradient averaged over b examples, G_b, has
E|G_b|² = |G|² + tr(Σ)/b, so its squared norm at two batch sizes b_small < b_big gives
unbiased estimates of |G|² and tr(Σ), and B_simple = tr(Σ)/|G|² predicts the critical
batch size. Training has two such batch sizes at hand: each rank's gradient and their
average over ranks (data parallel: one more pair of numbers averaged over ranks), or on
one process the two halves of the batch (one more backward pass on the steps measured).
The K-FAC analogue takes every norm of the preconditioned gradient P.

`GradientNoiseScale`, a Keras callback, adds both to `fit`'s epoch logs.
"""

import typing

import keras
import tensorflow as tf

from tfkfac import keras_integration, validation

# What the epoch logs get: B_simple of the plain gradient and of K-FAC's preconditioned one.
LOG_NAMES = ("noise_scale", "preconditioned_noise_scale")
ONE_EXAMPLE = (
    "GradientNoiseScale: on one process (and for Keras's own optimizers, on each rank) it "
    "compares the gradients of each batch's two halves, and a batch of 1 example has no "
    "two halves: it measures nothing. Train with batches of at least 2 examples per rank "
    "(`batch_size` >= 2)")


def square_norm(gradients):
    """Σ |g|² over the gradients (None: absent), in float64."""
    return tf.add_n([tf.constant(0.0, tf.float64)] + [
        tf.cast(tf.reduce_sum(tf.square(tf.convert_to_tensor(g))), tf.float64)
        for g in gradients if g is not None])


class Halves(typing.NamedTuple):
    """One process: the batch's first `first` and last `second` examples, gradients g₁ and
    g₂, and `difference` = (g₁ − g₂)/2. The halves are independent, so
    E|difference|² = tr(Σ)(1/n₁ + 1/n₂)/4: with equal halves this is the estimate from
    b_small = N/2 (|G_small|² the mean of |g₁|², |g₂|²) and b_big = N."""

    difference: list
    first: typing.Any
    second: typing.Any

    def trace(self, big_square, transform):
        """(tr(Σ) estimated in the norm after `transform`, b_big)."""
        del big_square  # the difference alone holds the noise
        square = square_norm(self.difference if transform is None
                             else transform(self.difference))
        return 4.0 * square / (1.0 / self.first + 1.0 / self.second), self.first + self.second


class Ranks(typing.NamedTuple):
    """Data parallel: `local`, this rank's gradient over its `local_batch` examples (the
    mean over ranks), `mean_square` the mean over ranks of |local|², `ranks` of them, and
    `mean_over_ranks(x)`, a collective every rank calls. b_small = local_batch, b_big =
    ranks · local_batch."""

    local: list
    mean_square: typing.Any
    local_batch: typing.Any
    ranks: int
    mean_over_ranks: typing.Callable

    def trace(self, big_square, transform):
        """(tr(Σ) estimated in the norm after `transform`, b_big)."""
        small_square = (self.mean_square if transform is None
                        else self.mean_over_ranks(square_norm(transform(self.local))))
        small, big = self.local_batch, self.local_batch * self.ranks
        return (small_square - big_square) / (1.0 / small - 1.0 / big), big


def estimates(gradients, sub_batches, transform=None):
    """[|G|², tr(Σ)] estimated from one step: `gradients`, the batch's, and its
    `sub_batches` (`Halves` or `Ranks`), every norm taken after `transform` (None: of
    the gradients themselves)."""
    big_square = square_norm(gradients if transform is None else transform(gradients))
    trace, big = sub_batches.trace(big_square, transform)
    # (b_big |G_big|² − b_small |G_small|²)/(b_big − b_small) = |G_big|² − tr(Σ)/b_big.
    return tf.stack([big_square - trace / big, trace])


class NoiseScaleProbe:
    """One epoch's sums over its measured steps of the estimates of |G|² and tr(Σ), of
    the plain gradient and (`preconditioned`) of K-FAC's preconditioned one, taken
    every `interval` steps. B_simple is the ratio of the sums: numerator and denominator
    are averaged before the ratio is taken."""

    def __init__(self, interval, preconditioned):
        self.interval = interval
        self.preconditioned = preconditioned
        # [measured steps, |G|², tr(Σ), preconditioned |G|², preconditioned tr(Σ)]; under
        # a tf.distribute strategy every replica measures the same values.
        self.sums = tf.Variable(tf.zeros([5], tf.float64), trainable=False,
                                name="noise_scale_sums",
                                synchronization=tf.VariableSynchronization.ON_READ,
                                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        # Due steps left unmeasured because the batch held 1 example (one process).
        self.single_example_steps = tf.Variable(
            tf.zeros([], tf.int64), trainable=False, name="noise_scale_single_example_steps",
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def due(self, step):
        """Whether `step` (0-based) is measured."""
        return tf.equal(tf.math.floormod(tf.cast(step, tf.int64), self.interval), 0)

    def sub_batches(self, step, gradients, scale, tape, loss, y_pred, variables, comm=None):
        """This step's `Ranks` when `comm` (a `tfkfac.distributed` communicator) has
        several ranks (from this rank's `gradients`), else its `Halves` (from the
        persistent `tape` that recorded `loss` from `y_pred`: one more backward pass, on
        measured steps only). `scale` turns the tape's gradients into the loss's (the loss
        scale and tf.distribute's 1/replicas undone)."""
        outputs = tf.nest.flatten(y_pred)
        examples = tf.shape(outputs[0])[0]
        scaled = lambda g: tf.convert_to_tensor(g) * tf.cast(scale, g.dtype)
        if comm is not None and comm.size > 1:
            local = [None if g is None else scaled(g) for g in gradients]
            mean_square, local_batch = comm.grouped_allreduce_mean(
                [tf.cast(square_norm(local), tf.float32), tf.cast(examples, tf.float32)],
                category="metrics")
            return Ranks(local, tf.cast(mean_square, tf.float64),
                         tf.cast(local_batch, tf.float64), comm.size,
                         lambda x: tf.cast(comm.grouped_allreduce_mean(
                             [tf.cast(x, tf.float32)], category="metrics")[0], tf.float64))
        first = examples // 2
        second = examples - first

        def difference():
            # g_i = N dL/dy_i; weighting example i by N/(2n₁) in the first half and by
            # −N/(2n₂) in the second gives (g₁ − g₂)/2 from one backward pass.
            output_grads = tape.gradient(loss, outputs)
            position = tf.range(examples)
            weight = tf.cast(examples, tf.float64) / 2.0 * tf.where(
                position < first, 1.0 / tf.cast(first, tf.float64),
                -1.0 / tf.cast(second, tf.float64))
            weighted = [tf.zeros_like(y) if d is None else d * tf.reshape(
                tf.cast(weight, d.dtype), [-1] + [1] * (len(d.shape) - 1))
                for y, d in zip(outputs, output_grads)]
            return [tf.zeros_like(v) if g is None else scaled(g)
                    for v, g in zip(variables, tape.gradient(outputs, variables,
                                                             output_gradients=weighted))]

        measured = tf.logical_and(self.due(step), first > 0)
        zeros = lambda: [tf.zeros_like(v) for v in variables]
        return Halves(tf.cond(measured, difference, zeros),
                      tf.cast(first, tf.float64), tf.cast(second, tf.float64))

    def measure(self, step, gradients, sub_batches, precondition=None):
        """Adds this step's estimates if it is `due` (with `precondition`, a function of a
        list of gradients, also those of the preconditioned gradient)."""

        def add():
            rows = [estimates(gradients, sub_batches)]
            rows.append(estimates(gradients, sub_batches, precondition)
                        if precondition is not None else tf.zeros([2], tf.float64))
            self.sums.assign_add(tf.concat([tf.ones([1], tf.float64)] + rows, 0))
            return tf.constant(True)

        if isinstance(sub_batches, Halves):  # a batch of one example has no halves
            measured = tf.logical_and(self.due(step), sub_batches.first > 0)
            self.single_example_steps.assign_add(tf.cast(
                tf.logical_and(self.due(step), sub_batches.first <= 0), tf.int64))
        else:
            measured = self.due(step)
        return tf.cond(measured, add, lambda: tf.constant(False))

    def reset(self):
        self.sums.assign(tf.zeros([5], tf.float64))

    def measured_and_single_example_steps(self):
        """(steps measured since the last `reset`, due steps of one example so far)."""
        return int(self.sums.numpy()[0]), int(self.single_example_steps.numpy())

    def noise_scales(self):
        """{log name: B_simple} of the sums so far (NaN before a measured step)."""
        steps, square, trace, pre_square, pre_trace = (
            float(v) for v in self.sums.numpy())
        scales = {LOG_NAMES[0]: trace / square if steps and square else float("nan")}
        if self.preconditioned:
            scales[LOG_NAMES[1]] = (pre_trace / pre_square if steps and pre_square
                                    else float("nan"))
        return scales


class GradientNoiseScale(keras.callbacks.Callback):
    """Logs the gradient noise scale B_simple of each epoch: "noise_scale" of the plain
    gradient and, under K-FAC, "preconditioned_noise_scale" of the preconditioned one
    (docs/design.md §13).

    Data parallel (K-FAC's communicator over several ranks or replicas), from each
    rank's gradient and their average; on one process, and for Keras's own optimizers on
    each rank, from the two halves of the batch, at the cost of one more backward pass
    on every measured step.

    Args:
      interval: measure every this many steps (1: every step).
      preconditioned: also the preconditioned gradient's (K-FAC only); default: whether
        the model is trained by K-FAC.
    """

    def __init__(self, interval=1, preconditioned=None):
        super().__init__()
        validation.positive_integer("interval", interval)
        if preconditioned not in (None, True, False):
            raise ValueError("GradientNoiseScale: `preconditioned` must be None (whether the "
                             "model is trained by K-FAC), True or False; received "
                             f"{preconditioned!r}")
        self.interval = interval
        self.preconditioned = preconditioned
        self.probe = None
        self._measuring_seen = False

    def on_train_begin(self, logs=None):
        model = self.model
        kfac = keras_integration.train_step_owner(model)
        preconditioned = kfac is not None if self.preconditioned is None else self.preconditioned
        if preconditioned and kfac is None:
            raise ValueError(
                "GradientNoiseScale(preconditioned=True) needs a model trained by "
                f"tfkfac.KFAC; model {model.name!r} is compiled with "
                f"{type(keras_integration.compiled_optimizer(model)).__name__}")
        if self.probe is None:
            with model.distribute_strategy.scope():
                self.probe = NoiseScaleProbe(self.interval, preconditioned)
        if kfac is not None:
            changed = kfac.measure_noise_scale(self.probe)
        else:
            changed = _install_halves_train_step(model, self.probe)
        if changed:  # the train function `fit` made before the callbacks start
            model.train_function = None
            model.make_train_function()
        self._measuring_seen = False

    def on_train_batch_end(self, batch, logs=None):
        # Until a step is measured: a due step of a one-example batch means that every
        # batch is one (a short last batch comes after a measured one), so nothing can be
        # measured. Said after that first step, not as a NaN at the epoch's end.
        if self._measuring_seen:
            return
        measured, single = self.probe.measured_and_single_example_steps()
        if single and not measured:
            raise ValueError(ONE_EXAMPLE)
        self._measuring_seen = measured > 0

    def on_epoch_begin(self, epoch, logs=None):
        self.probe.reset()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self.probe.noise_scales())


def _install_halves_train_step(model, probe):
    """Give `model` (trained by a Keras optimizer) Keras's train step with the gradients
    of the batch's two halves measured into `probe`; whether it was not there yet."""
    if getattr(model, "_tfkfac_noise_probe", None) is probe:
        return False

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape(persistent=True) as tape:
            loss, y_pred = keras_integration.forward_pass(model, x, y, sample_weight)
        variables = model.trainable_variables
        gradients = tape.gradient(loss, variables)
        optimizer = model.optimizer
        step = optimizer.iterations
        # Keras's optimizers average over ranks in `apply` (trainers/data_parallel.py),
        # after the gradients reach it: each rank measures its own batch's halves.
        scale = (keras_integration.replicas_in_sync()
                 / tf.cast(optimizer.scale_loss(1.0), tf.float64))
        measured = [None if g is None else tf.convert_to_tensor(g) * tf.cast(scale, g.dtype)
                    for g in gradients]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g))
                                for g in measured if g is not None])
        halves = probe.sub_batches(step, gradients, scale, tape, loss, y_pred, variables)
        tf.cond(finite, lambda: probe.measure(step, measured, halves),
                lambda: tf.constant(False))
        optimizer.apply_gradients(zip(gradients, variables))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    keras_integration.set_untracked(model, "train_step", train_step)
    keras_integration.set_untracked(model, "_tfkfac_noise_probe", probe)
    return True
