"""The update as a chain of transforms (docs/design.md §1, §5, §11), in the spirit of
optax's `chain`: K-FAC's preconditioning (`curvature.Curvature`), the KL clip or grafting
(or self-tuning), the `transforms` setting's, then, where the update is applied, the
momentum coupling, the inner optimizer and weight rescaling; self-tuning's adaptation
after it. Each is a `tfkfac.Transform` (tfkfac/transform.py): it makes and names its
own state and has one `apply`. `transforms` builds the list from the settings, the one
place that reads them for it; `UpdateChain` runs it.
"""

import dataclasses
import math

import keras
import tensorflow as tf

from tfkfac import blocks as blocks_lib, grafting as grafting_lib, inner as inner_lib
from tfkfac import keras_integration, linalg, self_tuning, transform

# The layers whose kernels weight rescaling renormalizes: Osawa et al. rescale every
# convolution and fully-connected kernel of their ResNet-50 (their code marks each conv
# and the classifier's W; no bias, no BatchNorm parameter).
RESCALED_LAYERS = (keras.layers.Dense,) + blocks_lib.CONVOLUTIONS
# ε of Osawa et al.'s eq. 18.
RESCALING_EPSILON = 1e-9


class KLClip(transform.Transform):
    """Every preconditioned gradient scaled by ν = min(1, sqrt(κ / (η² Σ_layers |<P, ∇>|)))
    (Pauloski et al. eq. 18; docs/design.md §5), in the state dtype, with η the inner
    optimizer's learning rate at this step (`learning_rate()`). Keeps no state."""

    def __init__(self, kappa, learning_rate):
        self.kappa, self.learning_rate = kappa, learning_rate

    def apply(self, step):
        preconditioned = step.preconditioned
        if not preconditioned.blocks:
            return step
        nu = linalg.kl_clip_scale(preconditioned.blocks, preconditioned.block_grads,
                                  self.learning_rate(), self.kappa)
        return dataclasses.replace(step, grads=preconditioned.grads(
            [[p * nu for p in ps] for ps in preconditioned.blocks]))


class InnerOptimizer(transform.Transform):
    """The Keras optimizer that applies the update. Its state is Keras's own, made when
    KFAC builds it and saved first, as "inner:<i>" (tfkfac/state.py)."""

    stage = transform.UPDATE

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def apply(self, step):
        self.optimizer.apply(step.grads, step.variables)
        return step


class WeightRescaling(transform.Transform):
    """Osawa et al. §4.4 eq. 18 (van Laarhoven's normalizing weights): after each update,
    every kernel of `kernels` becomes √(2·d_out) · W / (‖W‖_F + ε), d_out its last axis
    (a Dense layer's units, a convolution's filters). Keeps no state."""

    stage = transform.UPDATE

    def __init__(self, kernels):
        self.kernels = kernels

    def apply(self, step):
        """Rescale the kernels (in replica context, after the inner optimizer's update)."""
        keras_integration.assign_each(self.kernels, rescaled)
        return step


def rescaled(kernel):
    """√(2·d_out) · W / (‖W‖_F + ε) of a kernel W whose last axis is d_out."""
    norm = tf.norm(tf.reshape(kernel, [-1]))
    return kernel * (math.sqrt(2.0 * kernel.shape[-1]) / (norm + RESCALING_EPSILON))


def weight_rescaling(blocks):
    """The `WeightRescaling` of the managed Dense and convolution layers among `blocks`;
    an error when it would rescale nothing."""
    kernels = [block.layer.kernel for block in blocks
               if isinstance(block.layer, RESCALED_LAYERS)]
    if not kernels:
        raise ValueError(
            "KFAC: weight_rescaling=True rescales the kernels of the Dense and Conv1D/2D/3D "
            "layers K-FAC manages, and this model has none (managed: "
            f"{[block.path for block in blocks] or 'no layer'}); set "
            "weight_rescaling=False.")
    return WeightRescaling(kernels)


def variable_paths(model, variables):
    """Per variable of `variables`, "<path of its layer in `model`>/<its name>", the layer
    paths of `keras_integration.leaf_layers` (stable across a save and load, unlike
    Keras's variable paths, which may hold the model's name); "#<i>", its position, for
    one no layer of `model` holds."""
    held = {id(v): f"{path}/{v.name}"
            for path, layer in keras_integration.leaf_layers(model).items()
            for v in layer.weights}
    return [held.get(id(v), f"#{i}") for i, v in enumerate(variables)]


def transforms(config, curvature, optimizer, self_tuning_inputs):
    """The chain `config` asks for, in order: `curvature` (a `curvature.Curvature`);
    self-tuning, or grafting (the KL clip would cancel in the graft, so it is not
    applied), or the KL clip, or none of them; a copy of each of the `transforms`
    setting's; the momentum coupling; `optimizer`, the inner Keras optimizer; weight
    rescaling; self-tuning's adaptation. `self_tuning_inputs()`: `SelfTuning`'s `model`,
    `batch` and `communicator`, asked for under `self_tuning` only."""
    learning_rate = lambda: optimizer.learning_rate  # noqa: E731 (read at each step)
    chain = [curvature]
    if config.self_tuning:
        tuning = self_tuning.SelfTuning(config.damping, learning_rate=learning_rate,
                                        **self_tuning_inputs())
        chain.append(tuning)
    elif config.grafting is not None:
        chain.append(grafting_lib.Grafting(config.grafting, config.adam_beta_2,
                                           config.adam_epsilon, config.state_dtype))
    elif config.kl_clip is not None:
        chain.append(KLClip(config.kl_clip, learning_rate))
    chain += transform.copies(config.transforms)
    if config.couple_momentum_to_lr:
        chain.append(inner_lib.MomentumCoupling(optimizer))
    chain.append(InnerOptimizer(optimizer))
    if config.weight_rescaling:
        chain.append(weight_rescaling(curvature.blocks))
    if config.self_tuning:
        chain.append(tuning.adaptation(lambda: optimizer.iterations))
    return chain


class UpdateChain:
    """Runs `transforms` (`tfkfac.Transform` objects, the first the curvature) stage by stage
    (tfkfac/transform.py), and holds their state."""

    def __init__(self, transforms):
        self.transforms = list(transforms)
        self.curvature = self.transforms[0]
        self._inner_update = _InnerUpdate(self.staged(transform.UPDATE))

    def staged(self, stage):
        return [t for t in self.transforms if t.stage == stage]

    def create_state(self, context):
        """Every transform's state (`Transform.create_state`), in chain order."""
        for piece in self.transforms:
            piece.create_state(context)

    def saved_variables(self):
        """(key, variable) of every transform's state in chain order, but for an owner's
        rebuild state (`Curvature.rebuild_variables`), which comes after the GRADIENTS
        stage's: saves by position (tfkfac/state.py) from before it existed hold the
        rest in that order. Saves by name do not depend on it."""
        late = {id(v) for v in self.curvature.rebuild_variables()}
        gradients = [pair for piece in self.staged(transform.GRADIENTS)
                     for pair in piece.saved_variables()]
        return ([pair for pair in gradients if id(pair[1]) not in late]
                + [pair for pair in gradients if id(pair[1]) in late]
                + [pair for piece in self.transforms if piece.stage != transform.GRADIENTS
                   for pair in piece.saved_variables()])

    def gradients(self, step):
        """What the inner optimizer receives for `step` (a `Step`): the GRADIENTS stage's
        transforms applied in order."""
        for piece in self.staged(transform.GRADIENTS):
            step = piece.apply(step)
        return step.grads

    def apply(self, finite, grads, variables):
        """The UPDATE stage with `grads` if `finite` (a step with a non-finite gradient
        changes nothing); whether it ran, a tensor that exists once it has."""
        return keras_integration.apply_if(finite, self._inner_update, grads, variables)

    def after(self, step):
        """The AFTER stage, on `step` (its `finite` and `applied` set)."""
        for piece in self.staged(transform.AFTER):
            step = piece.apply(step)


class _InnerUpdate:
    """What `keras_integration.apply_if` runs in each replica as `apply(grads,
    variables)`: the UPDATE stage's `transforms`, in order.

    Without a tf.distribute strategy, in a graph, the update is one tf.function per list
    of variables, so that the factor and the stale train functions (`tfkfac.stale_steps`)
    trace Keras's update once between them: traced in both, it was the largest piece of
    their tracing (~38% on ResNet-20). Under a strategy it stays inline: its `merge_call`
    cannot run in a nested tf.function. Not converted by AutoGraph, as Keras's own train
    step calls its optimizer: converting it took about a quarter of its tracing.
    """

    def __init__(self, transforms):
        self.transforms = transforms
        self._traced = {}  # tuple of variable ids -> tf.function of the gradients

    def apply(self, grads, variables):
        if tf.executing_eagerly() or tf.distribute.has_strategy():
            self._update(grads, variables)
            return
        key = tuple(id(v) for v in variables)
        if key not in self._traced:
            self._traced[key] = tf.function(lambda grads: self._update(grads, variables),
                                            autograph=False)
        self._traced[key](list(grads))

    def _update(self, grads, variables):
        step = transform.Step(list(grads), list(variables))
        for piece in self.transforms:
            step = piece.apply(step)
