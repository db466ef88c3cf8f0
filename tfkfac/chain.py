"""The update as a chain (docs/design.md §1, §5, §11): K-FAC's preconditioning, then one
post-transform — the KL clip, grafting, or none — then the inner optimizer, in the spirit
of optax's `chain`.

Each piece owns its state and saved variables: the curvature (`tfkfac.curvature`) its
factors, decompositions and method state, grafting its Adam v, the inner optimizer its
own. `UpdateChain` composes them in one place, the save format's order included.
"""

from tfkfac import grafting as grafting_lib, keras_integration, linalg


class KLClip:
    """Every preconditioned gradient scaled by ν = min(1, sqrt(κ / (η² Σ_layers |<P, ∇>|)))
    (Pauloski et al. eq. 18; docs/design.md §5), in the state dtype, with η the inner
    optimizer's learning rate at this step (`learning_rate()`). Keeps no state."""

    def __init__(self, kappa, learning_rate):
        self.kappa, self.learning_rate = kappa, learning_rate

    def create_state(self, model_variables, add_variable):
        del model_variables, add_variable  # nothing to keep: ν is computed every step

    def variables(self):
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


class UpdateChain:
    """precondition (`curvature`) → `post` (`KLClip`, `grafting.Grafting` or None) →
    `inner`, the Keras optimizer that applies the update."""

    def __init__(self, curvature, post, inner):
        self.curvature, self.post, self.inner = curvature, post, inner

    def create_state(self, counters, add_variable, model_variables):
        """Every piece's saved state, in `variables` order. `add_variable(shape,
        initializer, name, dtype)` makes an optimizer variable."""
        self.curvature.create_state(counters, add_variable)
        if self.post is not None:
            self.post.create_state(model_variables, lambda shape, name, dtype: add_variable(
                shape, "zeros", name, dtype))
        self.curvature.create_rebuild_state(add_variable)

    def variables(self):
        """The pieces' saved variables after the inner optimizer's and the counters: the
        curvature's, the post-transform's, then an owner's rebuild state, last so that
        saves from before it existed still line up (tfkfac/state.py)."""
        return (self.curvature.variables(saved_only=True)
                + (self.post.variables() if self.post is not None else [])
                + self.curvature.rebuild_variables())

    def gradients(self, grads, variables, damping, step):
        """What the inner optimizer receives for `grads` of `variables` at `step`."""
        preconditioned = self.curvature.precondition(grads, variables, damping, step=step)
        if self.post is None:
            return preconditioned.grads()
        return self.post.update(preconditioned, step)

    def apply(self, finite, grads, variables):
        """The inner optimizer's update with `grads` if `finite` (a step with a non-finite
        gradient changes nothing); whether it ran, a tensor that exists once it has."""
        return keras_integration.apply_if(finite, self.inner, grads, variables)
