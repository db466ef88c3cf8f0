"""`tfkfac.Transform`: the one interface of every piece of the update chain
(tfkfac/chain.py; docs/design.md §1), optax-style: state made and saved by name, one
`apply`.

K-FAC's preconditioning (`curvature.Curvature`), the KL clip, grafting, self-tuning,
the momentum coupling, the inner optimizer and weight rescaling are transforms, and so
is what a user passes as the `transforms` setting. Kept apart from chain.py so that the
settings (tfkfac/config.py) can check that setting without importing the chain.
"""

import dataclasses
import typing

import keras

# Where a transform's `apply` runs (its `stage`):
# - GRADIENTS: inside the step's branch for finite gradients, once per step, in chain
#   order; it maps `Step.grads` (and may read `Step.preconditioned`);
# - UPDATE: where the inner optimizer applies the update, in each replica, only when the
#   step's gradients are finite: the inner optimizer and what must act right before or
#   after it (the momentum coupling, weight rescaling);
# - AFTER: after the update, every step (`Step.finite` says whether it was applied).
GRADIENTS, UPDATE, AFTER = "gradients", "update", "after"
STAGES = (GRADIENTS, UPDATE, AFTER)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step's update as it passes along the chain: what `Transform.apply` receives
    and returns (`dataclasses.replace` of it).

    `grads`, aligned with `variables` (None: no gradient); `step`, the 0-based step;
    `damping`, the factors' damping this step; `preconditioned`, from the curvature on,
    its `curvature.Preconditioned`; `during`, for the curvature (`Curvature.precondition`);
    `finite` and `applied`, at the AFTER stage: whether the step was taken, and a tensor
    that exists once the update has run.
    """

    grads: list
    variables: list
    step: typing.Any = None
    damping: typing.Any = None
    preconditioned: typing.Any = None
    during: typing.Any = None
    finite: typing.Any = None
    applied: typing.Any = None


@dataclasses.dataclass(frozen=True)
class StateContext:
    """What `Transform.create_state` makes its state with: `add_variable(shape, name,
    dtype, initializer="zeros")`, a saved optimizer variable; `model_variables`, those
    the optimizer is built on, named in keys by `variable_paths` (`chain.variable_paths`);
    `counters`, K-FAC's step counters (`state.Counters`)."""

    add_variable: typing.Callable
    model_variables: list = ()
    variable_paths: list = ()
    counters: typing.Any = None


class Transform:
    """A piece of the update chain. Subclass it and override what the piece needs:

    - `name`: the owner of its saved keys, their first part (tfkfac/state.py);
    - `stage`: where `apply` runs (GRADIENTS, UPDATE or AFTER, above);
    - `create_state(context)`: its variables, made with `context.add_variable` (a
      `StateContext`) when the optimizer is built;
    - `saved_variables()`: [(key, variable)] of them, keyed `state.key(self.name, ...)`
      (the curvature keeps the keys of its blocks and method from before the chain):
      saves and restores find them by key;
    - `apply(step)`: the `Step` after this piece (in graph mode: TensorFlow ops).

    A transform passed in the `transforms` setting runs at the GRADIENTS stage after
    K-FAC's own (the KL clip or grafting), before the inner optimizer; it is saved with
    the optimizer's config through `get_config` (its constructor's arguments) and Keras
    registration, and each KFAC works on a copy of it.
    """

    name = None
    stage = GRADIENTS

    def create_state(self, context):
        del context  # no state

    def saved_variables(self):
        return []

    def apply(self, step):
        return step

    def get_config(self):
        return {}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def check(name, value):
    """`value` (the `transforms` setting) is a tuple or list of `Transform` objects of the
    GRADIENTS stage, each with a `name`, Keras-registered so that a save can hold it."""
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"`{name}` must be a tuple of tfkfac.Transform; received {value!r}")
    for transform in value:
        if not isinstance(transform, Transform) or transform.stage != GRADIENTS:
            raise ValueError(f"`{name}` must hold tfkfac.Transform objects of the "
                             f"'{GRADIENTS}' stage; received {transform!r}")
        if not transform.name:
            raise ValueError(f"`{name}`: {type(transform).__name__} has no `name`, the "
                             "first part of its saved keys")
        registered = keras.saving.get_registered_name(type(transform))
        if keras.saving.get_registered_object(registered) is not type(transform):
            raise ValueError(
                f"`{name}`: {type(transform).__name__} cannot be saved with the optimizer: "
                "decorate it with @keras.saving.register_keras_serializable() and return "
                "its arguments from get_config.")
    return tuple(value)


def serialize(transforms):
    return [keras.saving.serialize_keras_object(t) for t in transforms]


def copies(transforms):
    """A fresh copy of each of `transforms` (from its config): one KFAC's state is not
    another's, though they share a `KFACConfig`."""
    return [type(t).from_config(t.get_config()) for t in transforms]
