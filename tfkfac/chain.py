"""The update as a chain (docs/design.md §1, §5, §11): K-FAC's
preconditioning, then one post-transform — the KL clip, grafting, or none — then the
inner optimizer, with Osawa et al.'s momentum coupling before it and weight rescaling
after it when asked, in the spirit of optax's `chain`.

Each piece owns its state and saved variables, and names them (the keys of
tfkfac/state.py): the curvature (`tfkfac.curvature`) its factors, decompositions and
method state, grafting its Adam v, the momentum coupling its peak learning rate, the
inner optimizer its own. `UpdateChain` composes them in one place, the order of
`KFAC.variables` included.
"""

import math

import keras
import tensorflow as tf

from tfkfac import blocks as blocks_lib, grafting as grafting_lib, keras_integration, linalg

# The layers whose kernels weight rescaling renormalizes: Osawa et al. rescale every
# convolution and fully-connected kernel of their ResNet-50 (their code marks each conv
# and the classifier's W; no bias, no BatchNorm parameter).
RESCALED_LAYERS = (keras.layers.Dense,) + blocks_lib.CONVOLUTIONS
# ε of Osawa et al.'s eq. 18.
RESCALING_EPSILON = 1e-9


class KLClip:
    """Every preconditioned gradient scaled by ν = min(1, sqrt(κ / (η² Σ_layers |<P, ∇>|)))
    (Pauloski et al. eq. 18; docs/design.md §5), in the state dtype, with η the inner
    optimizer's learning rate at this step (`learning_rate()`). Keeps no state."""

    def __init__(self, kappa, learning_rate):
        self.kappa, self.learning_rate = kappa, learning_rate

    def create_state(self, model_variables, variable_paths, add_variable):
        del model_variables, variable_paths, add_variable  # nothing to keep: ν is per step

    def saved_variables(self):
        return []

    def update(self, preconditioned, step):
        if not preconditioned.blocks:
            return preconditioned.grads()
        nu = linalg.kl_clip_scale(preconditioned.blocks, preconditioned.block_grads,
                                  self.learning_rate(), self.kappa)
        return preconditioned.grads([[p * nu for p in ps] for ps in preconditioned.blocks])


def post_transform(config, learning_rate):
    """The one post-transform `config` asks for: grafting (the KL clip would cancel in
    the graft, so it is not applied), else the KL clip, else None."""
    if config.grafting is not None:
        return grafting_lib.Grafting(config.grafting, config.adam_beta_2,
                                     config.adam_epsilon, config.state_dtype)
    if config.kl_clip is not None:
        return KLClip(config.kl_clip, learning_rate)
    return None


class WeightRescaling:
    """Osawa et al. §4.4 eq. 18 (van Laarhoven's normalizing weights): after each update,
    every kernel of `kernels` becomes √(2·d_out) · W / (‖W‖_F + ε), d_out its last axis
    (a Dense layer's units, a convolution's filters). Keeps no state."""

    def __init__(self, kernels):
        self.kernels = kernels

    def apply(self):
        """Rescale the kernels (in replica context, after the inner optimizer's update)."""
        _assign_each(self.kernels, rescaled)


def rescaled(kernel):
    """√(2·d_out) · W / (‖W‖_F + ε) of a kernel W whose last axis is d_out."""
    norm = tf.norm(tf.reshape(kernel, [-1]))
    return kernel * (math.sqrt(2.0 * kernel.shape[-1]) / (norm + RESCALING_EPSILON))


def weight_rescaling(config, blocks):
    """The `WeightRescaling` of the managed Dense and convolution layers among `blocks`
    when `config.weight_rescaling`, else None; an error when it would rescale nothing."""
    if not config.weight_rescaling:
        return None
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


class UpdateChain:
    """precondition (`curvature`) → `post` (`KLClip`, `grafting.Grafting` or None) →
    `inner`, the Keras optimizer that applies the update, its momentum coupled to its
    learning rate first by `coupling` (a `tfkfac.inner.MomentumCoupling`) and its
    kernels rescaled after by `rescaling` (a `WeightRescaling`), each if given."""

    def __init__(self, curvature, post, inner, coupling=None, rescaling=None):
        self.curvature, self.post, self.inner = curvature, post, inner
        self.coupling, self.rescaling = coupling, rescaling
        self._inner_update = _InnerUpdate(self)

    def create_state(self, counters, add_variable, model_variables, variable_paths):
        """Every piece's saved state, in `saved_variables` order. `add_variable(shape,
        initializer, name, dtype)` makes an optimizer variable; `variable_paths` name
        `model_variables` in saved keys (`variable_paths`)."""
        self.curvature.create_state(counters, add_variable)
        if self.post is not None:
            self.post.create_state(model_variables, variable_paths,
                                   lambda shape, name, dtype: add_variable(
                                       shape, "zeros", name, dtype))
        self.curvature.create_rebuild_state(add_variable)
        if self.coupling is not None:
            self.coupling.create_state(add_variable, model_variables)

    def saved_variables(self):
        """(key, variable) of the pieces' saved variables, which come after the inner
        optimizer's and the counters: the curvature's, the post-transform's, then an
        owner's rebuild state, late so that saves from before it existed still line up
        (tfkfac/state.py), then the momentum coupling's."""
        return (self.curvature.saved_variables()
                + (self.post.saved_variables() if self.post is not None else [])
                + self.curvature.saved_rebuild_variables()
                + (self.coupling.saved_variables() if self.coupling is not None else []))

    def gradients(self, grads, variables, damping, step, during=None):
        """What the inner optimizer receives for `grads` of `variables` at `step`
        (`during`: see `Curvature.precondition`)."""
        preconditioned = self.curvature.precondition(grads, variables, damping, step=step,
                                                     during=during)
        if self.post is None:
            return preconditioned.grads()
        return self.post.update(preconditioned, step)

    def apply(self, finite, grads, variables):
        """The inner optimizer's update with `grads` if `finite` (a step with a non-finite
        gradient changes nothing), with the coupling before it and the rescaling after;
        whether it ran, a tensor that exists once it has."""
        return keras_integration.apply_if(finite, self._inner_update, grads, variables)


class _InnerUpdate:
    """What `keras_integration.apply_if` runs in each replica as `apply(grads,
    variables)`: the chain's coupling, its inner optimizer's update, its rescaling.

    Without a tf.distribute strategy, in a graph, the update is one tf.function per list
    of variables, so that the factor and the stale train functions (`tfkfac.stale_steps`)
    trace Keras's update once between them: traced in both, it was the largest piece of
    their tracing (~38% on ResNet-20). Under a strategy it stays inline: its `merge_call`
    cannot run in a nested tf.function. Not converted by AutoGraph, as Keras's own train
    step calls its optimizer: converting it took about a quarter of its tracing.
    """

    def __init__(self, chain):
        self.chain = chain
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
        coupling, rescaling = self.chain.coupling, self.chain.rescaling
        if coupling is not None:
            slots, peak, ratio = coupling.step(variables)
            _assign_each([coupling.peak], lambda _, peak: peak, peak)
            _assign_each(slots, lambda slot, ratio: slot * tf.cast(ratio, slot.dtype), ratio)
        self.chain.inner.apply(grads, variables)
        if rescaling is not None:
            rescaling.apply()


def _assign_each(variables, value, *args):
    """From replica context, assign `value(copy, *args)` to every copy of each of
    `variables`: through `merge_call` and `extended.update`, as Keras's optimizers update
    the variables a tf.distribute strategy mirrors (without one, a plain assign)."""
    def update(strategy, *args):
        for variable in variables:
            if isinstance(variable, keras.Variable):
                variable = variable.value  # the tf.Variable
            strategy.extended.update(
                variable, lambda copy, *args: copy.assign(tf.cast(value(copy, *args),
                                                                  copy.dtype)),
                args=args, group=False)

    tf.distribute.get_replica_context().merge_call(update, args=args)
