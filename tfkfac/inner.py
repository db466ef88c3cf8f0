"""The update rule KFAC hands its preconditioned gradients to: a Keras optimizer.

Without one, KFAC builds its default, `tfkfac.ScheduleFreeAdamW` (tfkfac/schedule_free.py),
from its own `learning_rate`, `momentum` (the rule's β1) and `weight_decay`; with one,
those belong to it (docs/design.md §5). Saves of 0.1, when KFAC was its own momentum SGD,
hold those three in KFAC's config and load as that SGD. `MomentumCoupling` keeps an inner
SGD's momentum proportional to its learning rate (docs/design.md §5).
"""

import copy

import keras
import tensorflow as tf

from tfkfac import keras_integration, schedule_free, schedules, state as state_lib
from tfkfac import transform, validation

# Keras optimizer arguments that belong to the optimizer applying the update.
INNER_ONLY = ("clipnorm", "clipvalue", "global_clipnorm", "use_ema", "ema_momentum",
              "ema_overwrite_frequency", "loss_scale_factor", "gradient_accumulation_steps")
_DEFAULT_RULE = ("learning_rate", "momentum", "weight_decay")
# The default rule's learning rate and β1 (`momentum`): the declared default
# configuration (docs/guide.md, "The default").
DEFAULT_LEARNING_RATE = 0.01
DEFAULT_MOMENTUM = 0.9
# Update rules K-FAC refuses to precede, and why (the trainer words its refusal with it).
REFUSED_INNER_OPTIMIZERS = {
    keras.optimizers.Muon:
        "Muon replaces each 2-D update by its orthogonal polar factor, which discards the "
        "singular values K-FAC's preconditioning sets (on the MLP K-FAC in front of Muon "
        "reached 0.890 validation accuracy in an epoch against Muon's 0.887, at 1.5x its "
        "step time)",
}
# What a Keras optimizer KFAC drives must have: read here so that an object that only
# looks like one fails in KFAC's constructor, naming `inner_optimizer`.
_INTERFACE = ("learning_rate", "iterations", "variables", "built", "weight_decay",
              "loss_scale_factor", "apply", "build", "finalize_variable_values")


def refuse_inner_only(arguments):
    """A ValueError for any argument of `arguments` that belongs to the inner optimizer."""
    for argument in INNER_ONLY:
        if argument in arguments:
            raise ValueError(f"KFAC does not take `{argument}`: set it on the "
                             "`inner_optimizer`, which applies the update.")


def refused_reason(optimizer_class):
    """Why K-FAC refuses to precede an optimizer of `optimizer_class` (None: it does not)."""
    for refused, reason in REFUSED_INNER_OPTIMIZERS.items():
        if issubclass(optimizer_class, refused):
            return reason
    return None


def inner_optimizer(optimizer, learning_rate, momentum, weight_decay):
    """`optimizer` (checked), or the default rule built from the other arguments:
    `tfkfac.ScheduleFreeAdamW(learning_rate, beta_1=momentum, weight_decay=...)`, at
    DEFAULT_LEARNING_RATE and DEFAULT_MOMENTUM when they are None, without warm-up."""
    given = {name: value for name, value in zip(_DEFAULT_RULE,
                                                (learning_rate, momentum, weight_decay))
             if value is not None}
    if optimizer is not None:
        check_inner_optimizer(optimizer)
        if given:
            raise ValueError(
                f"KFAC received both `inner_optimizer` and {', '.join(map(repr, given))}: "
                "the inner optimizer applies the update, so set "
                f"{'it' if len(given) == 1 else 'them'} on the inner optimizer instead.")
        return optimizer
    learning_rate = DEFAULT_LEARNING_RATE if learning_rate is None else learning_rate
    validation.positive_or_schedule("learning_rate", learning_rate)
    momentum = DEFAULT_MOMENTUM if momentum is None else momentum
    try:
        validation.finite_number("momentum", momentum, 0, 1, low_open=True, high_open=True)
    except ValueError as error:  # β1 = 0 would leave x = (y - (1 - β1) z) / β1 undefined
        raise ValueError(
            f"{error} (β1 of KFAC's default inner optimizer, ScheduleFreeAdamW; for SGD, "
            "pass inner_optimizer=keras.optimizers.SGD(learning_rate, momentum=...))") from None
    if weight_decay is not None:
        validation.finite_number("weight_decay", weight_decay, low=0)
    return schedule_free.ScheduleFreeAdamW(schedules.as_learning_rate(learning_rate),
                                           beta_1=momentum, weight_decay=weight_decay)


def check_inner_optimizer(optimizer):
    """A ValueError naming `inner_optimizer` unless `optimizer` is one Keras 3 optimizer
    that applies the update itself, and one K-FAC can precede."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError("`inner_optimizer` must be a Keras 3 optimizer (a "
                         "keras.optimizers.Optimizer) that applies the update; received "
                         f"{type(optimizer).__module__}.{type(optimizer).__qualname__}")
    reason = refused_reason(type(optimizer))
    if reason:
        raise ValueError(f"`inner_optimizer` {name} is refused: {reason}; use {name} alone, "
                         "or KFAC with another inner optimizer (its default "
                         "tfkfac.ScheduleFreeAdamW, or keras.optimizers.AdamW)")
    wrapped = getattr(optimizer, "inner_optimizer", None)
    if wrapped is not None:
        raise ValueError(
            "`inner_optimizer` must be the Keras optimizer that applies the update, not "
            f"one that wraps another: received {name} around "
            f"{type(wrapped).__name__}; pass the {type(wrapped).__name__} itself.")
    held = _held_optimizers(vars(optimizer))
    if held:
        raise ValueError(
            "`inner_optimizer` must be one Keras optimizer that applies every update: "
            f"received {name}, which holds other optimizers "
            f"({', '.join(sorted({type(o).__name__ for o in held}))}); KFAC hands every "
            "preconditioned gradient to its one inner optimizer (one rule for all layers).")
    for attribute in _INTERFACE:
        try:
            getattr(optimizer, attribute)
        except Exception as error:  # pylint: disable=broad-except
            raise ValueError(
                f"`inner_optimizer` {name} is not a usable Keras optimizer: reading its "
                f"`{attribute}` fails ({type(error).__name__}: {error}); pass a "
                "keras.optimizers.Optimizer made by its constructor.") from None


def _held_optimizers(value, depth=3):
    """The Keras optimizers among `value`'s values, looking `depth` containers deep."""
    if isinstance(value, keras.optimizers.Optimizer):
        return [value]
    if depth == 0 or isinstance(value, (str, bytes)):
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if not isinstance(value, (list, tuple)):
        return []
    return [held for item in value for held in _held_optimizers(item, depth - 1)]


def saved_rule(learning_rate=0.05, momentum=0.9, weight_decay=None):
    """The momentum SGD a save of 0.1 holds the arguments of (0.1's defaults where absent:
    KFAC was that SGD)."""
    validation.positive_or_schedule("learning_rate", learning_rate)
    validation.fraction("momentum", momentum)
    if weight_decay is not None:
        validation.finite_number("weight_decay", weight_decay, low=0)
    return keras.optimizers.SGD(schedules.as_learning_rate(learning_rate), momentum=momentum,
                                weight_decay=weight_decay)


def take_loss_scale_factor(optimizer):
    """`optimizer`'s `loss_scale_factor`, which KFAC applies from now on in its place.

    The gradients must be unscaled before they are preconditioned (the KL clip and the
    factors are not linear in them), so KFAC scales the loss and unscales the gradients
    itself, and the inner optimizer, handed unscaled gradients, must not divide again.
    Keras's `LossScaleOptimizer` takes its inner optimizer's factor the same way.
    """
    factor, optimizer.loss_scale_factor = optimizer.loss_scale_factor, None
    return factor


def serialized(optimizer, loss_scale_factor):
    """`optimizer`'s Keras config, holding again the `loss_scale_factor` KFAC took."""
    config = keras.saving.serialize_keras_object(optimizer)
    config["config"]["loss_scale_factor"] = loss_scale_factor
    return config


def from_saved(config, custom_objects=None):
    """(KFAC's `inner_optimizer` argument, the rest of `config`) from a saved config: the
    inner optimizer, deserialized, or for a save of 0.1 the momentum SGD it was
    (`saved_rule`); Keras's base optimizer arguments, which 0.1 saved with their defaults,
    dropped."""
    config = dict(config)
    inner = config.pop("inner_optimizer", None)
    legacy = {key: config.pop(key) for key in _DEFAULT_RULE if key in config}
    for key in INNER_ONLY:
        config.pop(key, None)
    if inner is not None:  # Keras deserializes nested configs in place: a copy
        return {"inner_optimizer": keras.saving.deserialize_keras_object(
            copy.deepcopy(inner), custom_objects=custom_objects)}, config
    if isinstance(legacy.get("learning_rate"), dict):
        legacy["learning_rate"] = keras.saving.deserialize_keras_object(
            legacy["learning_rate"], custom_objects=custom_objects)
    return {"inner_optimizer": saved_rule(**legacy)}, config


class MomentumCoupling(transform.Transform):
    """Osawa et al. §4.3 eq. 16: the inner SGD's momentum kept proportional to its learning
    rate, m(t) = m(0) · η(t) / η_max(t), η_max(t) the largest learning rate of the steps so
    far (η(0) under a non-increasing schedule, as in the paper; during a warm-up m(t) stays
    m(0), never above it). Keras's SGD multiplies its velocity by its constant `momentum`
    m(0), so before each step the velocities of the updated variables are scaled by
    η(t)/η_max(t): v ← m(0)·(η(t)/η_max(t))·v − η(t)·g is v ← m(t)·v − η(t)·g. η_max is
    optimizer state (saved).
    """

    name = "momentum_coupling"
    stage = transform.UPDATE

    def __init__(self, optimizer):
        check_couplable(optimizer)
        self.optimizer = optimizer
        self.peak, self._slots = None, None

    def create_state(self, context):
        """The peak learning rate (an optimizer variable), and which of the SGD's velocity
        slots belongs to which of the model variables (it was built on them, in order)."""
        self.peak = context.add_variable((), "peak_learning_rate", "float32")
        slots = self.optimizer.momentums
        model_variables = context.model_variables
        if len(slots) != len(model_variables):
            raise RuntimeError(
                f"couple_momentum_to_lr: the inner optimizer holds {len(slots)} momentum "
                f"slots for the {len(model_variables)} variables KFAC was built on; build "
                "it through KFAC (pass it unbuilt).")
        self._slots = {id(v): slot for v, slot in zip(model_variables, slots)}

    def saved_variables(self):
        return [(state_lib.key(self.name, "peak_learning_rate"), self.peak)]

    def apply(self, step):
        """Before the inner optimizer's update of `step.variables` (in replica context):
        η_max updated and their velocities scaled by η(t)/η_max (0 when every rate so far
        is 0), computed in float64: the float32 rates (η_max one of them) divide without
        rounding."""
        rate = tf.cast(self.optimizer.learning_rate, tf.float64)
        peak = tf.maximum(tf.cast(self.peak, tf.float64), rate)
        ratio = tf.math.divide_no_nan(rate, peak)
        keras_integration.assign_each([self.peak], lambda _, peak: peak, peak)
        keras_integration.assign_each([self._slots[id(v)] for v in step.variables],
                                      lambda slot, ratio: slot * tf.cast(ratio, slot.dtype),
                                      ratio)
        return step


def check_couplable(optimizer):
    """A ValueError unless `MomentumCoupling` can couple `optimizer`'s momentum; KFAC
    asks when it is made, before the chain is."""
    refusal = _uncoupled_reason(optimizer)
    if refusal:
        raise ValueError(
            "`couple_momentum_to_lr` couples the momentum of a keras.optimizers.SGD "
            "with momentum > 0 and nesterov=False (the heavy-ball momentum of Osawa et "
            f"al.'s eq. 17) to its learning rate; the inner optimizer here {refusal}. "
            "Pass inner_optimizer=keras.optimizers.SGD(learning_rate, momentum=0.9), "
            "or set couple_momentum_to_lr=False.")


def _uncoupled_reason(optimizer):
    """Why `couple_momentum_to_lr` has no meaning for `optimizer` ('' when it has)."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, keras.optimizers.SGD):
        if isinstance(optimizer, keras.optimizers.ScheduleFreeAdamW):
            return (f"is {name} (KFAC's default), whose β1 places the gradient between its "
                    "steps and their average: no heavy-ball momentum")
        if hasattr(optimizer, "beta_1"):
            return (f"is {name}, whose β1 also enters the bias correction 1 − β1^t, which "
                    "assumes it constant")
        return f"is {name}"
    if optimizer.momentum == 0:
        return "is SGD with momentum 0: there is no momentum to couple"
    if optimizer.nesterov:
        return ("is SGD with nesterov=True, whose look-ahead step would use the uncoupled "
                "momentum")
    if optimizer.gradient_accumulation_steps:
        return (f"accumulates gradients over {optimizer.gradient_accumulation_steps} "
                "steps, updating (and using its momentum) only on every last one")
    return ""
