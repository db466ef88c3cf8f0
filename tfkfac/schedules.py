"""Hyperparameter schedules: numbers, Keras schedules or callables of the step.

Osawa et al. (2019) give two that K-FAC training at scale relies on: a warmup of the
damping from a large value towards its target (eq. 13-14) and a growing interval
between curvature updates (eq. 20).
"""

import math

import keras
import tensorflow as tf

from tfkfac import validation


def value_at(hyperparameter, step):
    """The hyperparameter's value at `step`: a number, or a schedule called with it."""
    if callable(hyperparameter):
        return hyperparameter(step)
    return hyperparameter


def checked_at(name, hyperparameter, step, dtype, minimum=0.0, allow_minimum=False,
               integer=False):
    """The hyperparameter's value at `step` in `dtype`; a schedule's value `checked`."""
    if callable(hyperparameter):
        return tf.cast(checked(name, hyperparameter(step), step, minimum, allow_minimum,
                               integer), dtype)
    return tf.cast(_as_tensor(hyperparameter), dtype)


def _as_tensor(value):
    """`value` as a tensor, a Python float as float64: TensorFlow would make it a float32,
    which a float64 state would then receive rounded (0.3 as 0.30000001192...)."""
    return tf.convert_to_tensor(value, tf.float64 if isinstance(value, float) else None)


def interval(name, value):
    """The interval schedule `value` as a callable of the step giving an int64 >= 1."""
    return lambda step: checked_at(name, value, step, tf.int64, minimum=1,
                                   allow_minimum=True, integer=True)


def checked(name, value, step, minimum=0.0, allow_minimum=False, integer=False):
    """`value` (a schedule's, at `step`), stopping the step with an error naming `name`
    and the step unless it is finite and above `minimum` (or equal, if allowed), and a
    whole number if `integer`. What is not one real number (a string, a bool, a vector)
    is a ValueError when the step is traced."""
    relation = ">=" if allow_minimum else ">"
    wanted = f"{'an integer' if integer else 'a finite number'} {relation} {minimum}"
    try:
        tensor = _as_tensor(value)
    except (TypeError, ValueError):
        tensor = None
    if tensor is None or tensor.shape.rank not in (0, None) or not (
            tensor.dtype.is_floating or tensor.dtype.is_integer):
        received = (f"a {tensor.dtype.name} tensor of shape {tensor.shape}"
                    if tf.is_tensor(value) else repr(value))
        raise ValueError(f"KFAC: the schedule of `{name}` must give {wanted}; "
                         f"received {received}")
    as_float = tf.cast(tensor, tf.float64)
    valid = tf.logical_and(tf.math.is_finite(as_float),
                           as_float >= minimum if allow_minimum else as_float > minimum)
    if integer:
        valid = tf.logical_and(valid, tf.equal(as_float, tf.round(as_float)))
    with tf.control_dependencies([tf.debugging.Assert(
            valid, [f"KFAC: the schedule of `{name}` must give {wanted}; at step", step,
                    "it gave", tensor], name=f"check_{name}")]):
        return tf.identity(tensor)


class StepCallable(keras.optimizers.schedules.LearningRateSchedule):
    """Adapts a plain callable of the step to Keras's learning-rate schedule API."""

    def __init__(self, function):
        self.function = function

    def __call__(self, step):
        return self.function(step)

    def get_config(self):
        return {"function": keras.saving.serialize_keras_object(self.function)}


def as_learning_rate(value):
    """A learning rate Keras accepts: a float, a Keras schedule, or a wrapped callable."""
    if isinstance(value, int):
        return float(value)
    if callable(value) and not isinstance(
            value, keras.optimizers.schedules.LearningRateSchedule):
        return StepCallable(value)
    return value


def serialize(hyperparameter):
    """A number as is; a schedule as a Keras-serialized object."""
    if callable(hyperparameter):
        return keras.saving.serialize_keras_object(hyperparameter)
    return hyperparameter


def deserialize(config):
    if isinstance(config, dict):
        return keras.saving.deserialize_keras_object(config)
    return config


@keras.saving.register_keras_serializable(package="tfkfac")
class WarmupDamping(keras.optimizers.schedules.LearningRateSchedule):
    """Osawa et al. eq. 13-14: γ ← (1-α) γ + α γ_target, α = 2 log10(γ0/γ_target)/t_warmup.

    Evaluated in closed form: γ(t) = γ_target + (γ0 - γ_target)(1 - α)^t.
    """

    def __init__(self, initial_damping, target_damping, warmup_steps):
        validation.positive("initial_damping", initial_damping)
        validation.positive("target_damping", target_damping)
        validation.positive_integer("warmup_steps", warmup_steps)
        alpha = 2.0 * math.log10(initial_damping / target_damping) / warmup_steps
        if not 0 <= alpha < 1:
            raise ValueError(
                "WarmupDamping needs 0 <= α = 2 log10(initial/target) / warmup_steps < 1; "
                f"received α={alpha:.4g}: use more `warmup_steps` or initial >= target")
        self.initial_damping = float(initial_damping)
        self.target_damping = float(target_damping)
        self.warmup_steps = int(warmup_steps)
        self.alpha = alpha

    def __call__(self, step):
        t = tf.cast(step, tf.float32)
        decay = tf.pow(tf.constant(1.0 - self.alpha, tf.float32), t)
        return self.target_damping + (self.initial_damping - self.target_damping) * decay

    def get_config(self):
        return {"initial_damping": self.initial_damping,
                "target_damping": self.target_damping,
                "warmup_steps": self.warmup_steps}


@keras.saving.register_keras_serializable(package="tfkfac")
class OsawaInterval:
    """Osawa et al. eq. 20: interval(e) = min(20, 5 floor(e/5) + 1), e the epoch.

    A callable of the step, usable as `factor_update_freq` / `decomposition_update_freq`.
    """

    def __init__(self, steps_per_epoch, max_interval=20):
        if not (isinstance(steps_per_epoch, int) and steps_per_epoch > 0):
            raise ValueError(
                f"`steps_per_epoch` must be a positive int; received {steps_per_epoch!r}")
        self.steps_per_epoch = steps_per_epoch
        self.max_interval = int(max_interval)

    def __call__(self, step):
        epoch = tf.cast(step, tf.int64) // self.steps_per_epoch
        return tf.minimum(tf.constant(self.max_interval, tf.int64), 5 * (epoch // 5) + 1)

    def get_config(self):
        return {"steps_per_epoch": self.steps_per_epoch, "max_interval": self.max_interval}

    @classmethod
    def from_config(cls, config):
        return cls(**config)
