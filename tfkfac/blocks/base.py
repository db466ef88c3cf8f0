"""What every K-FAC block provides to the optimizer.

A block owns the geometry of one Keras layer's curvature: it turns that layer's captured
inputs and pre-activation output gradients into factor statistics, and says which
pieces its curvature is made of and how the layer's gradients become one matrix per
piece and back. How a piece is preconditioned is the method's (`tfkfac.methods`).
Blocks never communicate across processes.
"""

import tensorflow as tf

from tfkfac.methods import Piece


class Unsupported(Exception):
    """Raised by a block's builder: this layer's configuration has no block (the reason)."""


class Block:
    """One managed layer. Subclasses set `variables` and the factor layout."""

    kind = "block"
    # Axis of the examples in the recorded pre-activations (and their gradients).
    output_batch_axis = 0
    # dtype of the operands of the block's large matrix products (docs/design.md §9).
    product_dtype = None

    def __init__(self, layer, variables):
        self.layer = layer
        self.name = layer.name
        self.path = layer.name  # `discover` sets the path in the model ("mha/query")
        self.variables = list(variables)

    # --- the optimizer's view of the statistics --------------------------------
    def factor_shapes(self):
        """Shapes of the running statistics this block keeps (in the state dtype)."""
        raise NotImplementedError

    def factor_names(self):
        """Names of `factor_shapes()` in docs/design.md's terms: ("A", "G") or ("F",)."""
        return {1: ("F",), 2: ("A", "G")}[len(self.factor_shapes())]

    def symmetric_factors(self):
        """Indices of `factor_shapes()` that are symmetric matrices or batches of them.

        A 1-D factor is a diagonal: it needs no decomposition.
        """
        return [i for i, shape in enumerate(self.factor_shapes()) if len(shape) >= 2]

    def pre_activation_call(self, call, args, kwargs):
        """Run the layer's `call`; return ((inputs, pre-activations), output).

        The tape gives dL/d(pre-activations) for the recorded pair; both members may be
        nests of tensors (a layer with two weight products records both).
        """
        output = call(*args, **kwargs)
        return (layer_input(args, kwargs), output), output

    def batch_statistics(self, calls, batch_size, weights=None):
        """Factor statistics of one batch from `calls`, a list of (inputs, out_grads).

        `out_grads` is dL/ds for the mean loss L of the batch, already unscaled, in the
        structure of the recorded pre-activations. `weights` (N,), if given, weighs each
        example's terms (all its positions): every (1/N) Σ_i becomes (1/N) Σ_i w_i
        (docs/design.md §7). None counts every example once, at no extra cost.
        """
        raise NotImplementedError

    def use_product_dtype(self, product_dtype):
        """Run the factor Gram products and the preconditioning products with operands in
        `product_dtype` (None: the state dtype); docs/design.md §9."""
        self.product_dtype = product_dtype

    def take_examples(self, calls, weights, keep, batch):
        """`calls` and `weights` of the examples `keep` (of `batch`) only, for factor
        statistics from part of the batch (docs/design.md §8).

        Output gradients are scaled by N/n (N = `batch`, n the examples kept), so that
        N·dL/ds, the per-example gradient every block forms from `batch_size` times the
        output gradient, keeps the whole batch's N when `batch_size` is n. Inputs hold
        the examples on their leading axis, output gradients on `output_batch_axis`
        (either as N rows or N groups of rows, example-major).
        """
        scale = tf.cast(batch, tf.float64) / tf.cast(tf.size(keep), tf.float64)
        take = lambda t: take_rows(t, keep, batch)
        take_grad = lambda g: (take_rows(g, keep, batch, self.output_batch_axis)
                               * tf.cast(scale, g.dtype))
        calls = [(tf.nest.map_structure(take, inputs), tf.nest.map_structure(take_grad, grads))
                 for inputs, grads in calls]
        return calls, None if weights is None else tf.gather(weights, keep)

    # --- what the planner prices (trainers/planning/) ----------------------------
    def cost(self, calls, batch_size):
        """What this block's work costs at one batch, a `tfkfac.costs.BlockCost`, from
        its recorded `calls` [(inputs, pre-activations)] of `batch_size` examples."""
        raise NotImplementedError(f"{type(self).__name__} does not say what its work costs: "
                                  "define Block.cost")

    def cost_layout(self):
        """The `costs.BlockCost` fields every block fills alike: its factors and pieces."""
        return {"block_factor_shapes": tuple(tuple(s) for s in self.factor_shapes()),
                "block_pieces": tuple(self.pieces())}

    # --- what the method preconditions ----------------------------------------
    def pieces(self):
        """The independent pieces of this block's curvature (`tfkfac.methods.Piece`):
        by default one, over all its factors, a 1-D factor being a diagonal."""
        shapes = self.factor_shapes()
        return [Piece(tuple(range(len(shapes))), tuple(len(s) == 1 for s in shapes))]

    def gradient_matrices(self, grads):
        """The layer's gradients (aligned with `variables`) as one matrix per piece, in
        the state dtype they arrive in (float64) or float32."""
        raise NotImplementedError

    def split_matrices(self, matrices):
        """The inverse of `gradient_matrices`: per variable its preconditioned gradient."""
        raise NotImplementedError


def layer_input(args, kwargs):
    """The first argument of a layer call."""
    return args[0] if args else kwargs["inputs"]


def batch_size(block_calls):
    """N, the leading axis of the first input of a block's recorded (inputs, outputs)
    calls."""
    return tf.shape(tf.nest.flatten(block_calls[0][0])[0])[0]


def per_row(weights, rows):
    """`weights` (N,) repeated over `rows` (..., N·T, d), whose rows are example-major."""
    return tf.repeat(weights, tf.shape(rows)[-2] // tf.shape(weights)[0])


def take_rows(tensor, keep, batch, axis=0):
    """The examples `keep` of `tensor`, whose `axis` holds `batch` examples' rows, one or
    more per example, example-major (as `per_row` assumes)."""
    shape = tf.shape(tensor)
    by_example = tf.reshape(tensor, tf.concat([shape[:axis], [batch, -1], shape[axis + 1:]], 0))
    taken = tf.gather(by_example, keep, axis=axis)
    return tf.reshape(taken, tf.concat([shape[:axis], [-1], shape[axis + 1:]], 0))


def as_float(tensor):
    """`tensor` in the state dtype it arrives in (float64), or float32 from a narrower float."""
    tensor = tf.convert_to_tensor(tensor)
    return tf.cast(tensor, tf.float64 if tensor.dtype == tf.float64 else tf.float32)
