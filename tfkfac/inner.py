"""The update rule KFAC hands its preconditioned gradients to: a Keras optimizer.

Without one, KFAC builds momentum SGD from its own `learning_rate`, `momentum` and
`weight_decay`; with one, those belong to it (docs/design.md §5). Saves of 0.1, when KFAC
was its own momentum SGD, hold those three in KFAC's config. `MomentumCoupling` keeps an
inner SGD's momentum proportional to its learning rate (docs/large_batch.md).
"""

import copy

import keras
import tensorflow as tf

from tfkfac import schedules, state as state_lib, validation

# Keras optimizer arguments that belong to the optimizer applying the update.
INNER_ONLY = ("clipnorm", "clipvalue", "global_clipnorm", "use_ema", "ema_momentum",
              "ema_overwrite_frequency", "loss_scale_factor", "gradient_accumulation_steps")
_DEFAULT_RULE = ("learning_rate", "momentum", "weight_decay")


def refuse_inner_only(arguments):
    """A ValueError for any argument of `arguments` that belongs to the inner optimizer."""
    for argument in INNER_ONLY:
        if argument in arguments:
            raise ValueError(f"KFAC does not take `{argument}`: set it on the "
                             "`inner_optimizer`, which applies the update.")


def inner_optimizer(optimizer, learning_rate, momentum, weight_decay):
    """`optimizer`, or the default momentum SGD built from the other arguments."""
    given = {name: value for name, value in zip(_DEFAULT_RULE,
                                                (learning_rate, momentum, weight_decay))
             if value is not None}
    if optimizer is not None:
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError("`inner_optimizer` must be a keras.optimizers.Optimizer; "
                             f"received {type(optimizer).__name__}")
        wrapped = getattr(optimizer, "inner_optimizer", None)
        if wrapped is not None:
            raise ValueError(
                "`inner_optimizer` must be the Keras optimizer that applies the update, not "
                f"one that wraps another: received {type(optimizer).__name__} around "
                f"{type(wrapped).__name__}; pass the {type(wrapped).__name__} itself.")
        if given:
            raise ValueError(
                f"KFAC received both `inner_optimizer` and {', '.join(map(repr, given))}: "
                "the inner optimizer applies the update, so set "
                f"{'it' if len(given) == 1 else 'them'} on the inner optimizer instead.")
        return optimizer
    learning_rate = 0.05 if learning_rate is None else learning_rate
    validation.positive_or_schedule("learning_rate", learning_rate)
    momentum = 0.9 if momentum is None else momentum
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
    """(KFAC's arguments of the update rule, the rest of `config`) from a saved config:
    the inner optimizer, deserialized, or for a save of 0.1 its default rule's arguments;
    Keras's base optimizer arguments, which 0.1 saved with their defaults, dropped."""
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
    return legacy, config


class MomentumCoupling:
    """Osawa et al. §4.3 eq. 16: the inner SGD's momentum kept proportional to its learning
    rate, m(t) = m(0) · η(t) / η_max(t), η_max(t) the largest learning rate of the steps so
    far (η(0) under a non-increasing schedule, as in the paper; during a warm-up m(t) stays
    m(0), never above it). Keras's SGD multiplies its velocity by its constant `momentum`
    m(0), so before each step the velocities of the updated variables are scaled by
    η(t)/η_max(t): v ← m(0)·(η(t)/η_max(t))·v − η(t)·g is v ← m(t)·v − η(t)·g. η_max is
    optimizer state (saved).
    """

    def __init__(self, optimizer):
        refusal = _uncoupled_reason(optimizer)
        if refusal:
            raise ValueError(
                "`couple_momentum_to_lr` couples the momentum of a keras.optimizers.SGD "
                "with momentum > 0 and nesterov=False (the heavy-ball momentum of Osawa et "
                f"al.'s eq. 17) to its learning rate; the inner optimizer here {refusal}. "
                "Set couple_momentum_to_lr=False.")
        self.optimizer = optimizer
        self.peak, self._slots = None, None

    def create_state(self, add_variable, model_variables):
        """The peak learning rate (an optimizer variable), and which of the SGD's velocity
        slots belongs to which of `model_variables` (it was built on them, in order)."""
        self.peak = add_variable((), "zeros", "peak_learning_rate", "float32")
        slots = self.optimizer.momentums
        if len(slots) != len(model_variables):
            raise RuntimeError(
                f"couple_momentum_to_lr: the inner optimizer holds {len(slots)} momentum "
                f"slots for the {len(model_variables)} variables KFAC was built on; build "
                "it through KFAC (pass it unbuilt).")
        self._slots = {id(v): slot for v, slot in zip(model_variables, slots)}

    def saved_variables(self):
        return [(state_lib.key("momentum_coupling", "peak_learning_rate"), self.peak)]

    def step(self, variables):
        """(the velocity slots of `variables`, η_max after this step, η(t)/η_max) at the
        step the inner optimizer is about to take (0 when every rate so far is 0), in
        float64: the float32 rates (η_max one of them) divide without rounding."""
        rate = tf.cast(self.optimizer.learning_rate, tf.float64)
        peak = tf.maximum(tf.cast(self.peak, tf.float64), rate)
        return ([self._slots[id(v)] for v in variables], peak,
                tf.math.divide_no_nan(rate, peak))


def _uncoupled_reason(optimizer):
    """Why `couple_momentum_to_lr` has no meaning for `optimizer` ('' when it has)."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, keras.optimizers.SGD):
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
