"""Layer-wise grafting (docs/design.md §11): K-FAC gives each layer's direction, another
optimizer its step length (Agarwal et al. 2020; Distributed Shampoo). A transform of the
update chain (tfkfac/chain.py), after the preconditioning.

For a managed layer, its variables taken together: P̃ = (‖r‖ / ‖P‖) P, with r the grafted
optimizer's step direction — the gradient ("sgd") or Adam's ∇ / (√v̂ + ε) ("adam") — and
P K-FAC's preconditioned gradient; P̃ = r where ‖P‖ = 0. Every other variable gets r.
"""

import dataclasses

import tensorflow as tf

from tfkfac import linalg, state as state_lib, transform

KINDS = ("sgd", "adam")


class Grafting(transform.Transform):
    """The grafted optimizer's state (Adam's v per variable) and the graft itself, both
    in K-FAC's state dtype (`state_dtype`: float32, or float64 for float64 models)."""

    name = "grafting"

    def __init__(self, kind, beta_2, epsilon, dtype="float32"):
        if kind not in KINDS:
            raise ValueError(f"`grafting` must be one of {KINDS} or None; received {kind!r}")
        self.kind, self.beta_2, self.epsilon = kind, beta_2, epsilon
        self.dtype = tf.as_dtype(dtype)
        self.moments, self._index, self._paths = [], {}, []

    def create_state(self, context):
        """Adam's v, one per model variable (none for "sgd"), saved under the variable's
        path (a `transform.StateContext`)."""
        if self.kind == "adam":
            variables = context.model_variables
            self.moments = [context.add_variable(v.shape, f"graft_v_{i}", self.dtype)
                            for i, v in enumerate(variables)]
            self._index = {id(v): i for i, v in enumerate(variables)}
            self._paths = list(context.variable_paths)

    def saved_variables(self):
        """Each v under "grafting:adam_v:<its variable's path>" (tfkfac/state.py)."""
        return [(state_lib.key(self.name, "adam_v", path), moment)
                for path, moment in zip(self._paths, self.moments)]

    def apply(self, step):
        """The grafted gradients of the step's `curvature.Preconditioned` ones."""
        preconditioned = step.preconditioned
        directions = self.directions(preconditioned.raw, preconditioned.variables, step.step)
        return dataclasses.replace(step, grads=self.graft(
            preconditioned.grads(), directions, preconditioned.slots))

    def directions(self, grads, variables, step):
        """r per gradient of `variables` (None stays None); "adam" updates v with these
        (rank-averaged) gradients at `step`, 0-based."""
        if self.kind == "sgd":
            return list(grads)
        directions = []
        for grad, variable in zip(grads, variables):
            if grad is None:
                directions.append(None)
                continue
            moment = self.moments[self._index[id(variable)]]
            grad = tf.convert_to_tensor(grad)  # an Embedding's arrives as IndexedSlices
            value = tf.cast(grad, moment.dtype)
            scaled, updated = linalg.adam_scale(value, moment, self.beta_2, self.epsilon,
                                                tf.cast(step, moment.dtype) + 1)
            moment.assign(updated)
            directions.append(tf.cast(scaled, grad.dtype))
        return directions

    def graft(self, preconditioned, directions, block_slots):
        """Each block's preconditioned gradients at its direction's norm; r elsewhere."""
        grafted = list(directions)
        for slots in filter(None, block_slots):  # None: a frozen layer's block
            p = [tf.cast(preconditioned[i], self.dtype) for i in slots]
            r = [tf.zeros_like(p_i) if directions[i] is None
                 else tf.cast(tf.convert_to_tensor(directions[i]), self.dtype)
                 for i, p_i in zip(slots, p)]
            p_norm, r_norm = _norm(p), _norm(r)
            ratio = tf.math.divide_no_nan(r_norm, p_norm)
            for i, p_i, r_i in zip(slots, p, r):
                grafted[i] = tf.cast(tf.where(p_norm > 0, ratio * p_i, r_i),
                                     preconditioned[i].dtype)
        return grafted


def _norm(tensors):
    return tf.sqrt(tf.add_n([tf.reduce_sum(tf.square(t)) for t in tensors]))
