"""Products with the exact curvature of the model's loss, the Fisher/GGN F = Jᵀ H_L J
(docs/design.md §14): what self-tuning K-FAC measures its directions with
(tfkfac/self_tuning.py), and what a check of any curvature approximation needs.

J is the Jacobian of the model's output with respect to the trainable variables, H_L
the Hessian of the loss in that output, in closed form (`OutputCurvature`), averaged
over the batch as the loss is (Keras's "sum_over_batch_size"). J v comes from a
forward-mode pass, a `tf.autodiff.ForwardAccumulator` around the forward pass; Jᵀ u from
a reverse-mode one. The quadratic model needs only the Gram matrix vᵢᵀ F vⱼ of its
vectors, which is (J vᵢ)ᵀ H_L (J vⱼ): forward mode alone (`quadratic_forms`), at half the
cost of the products themselves (`products`). Several vectors take one forward-mode pass
each: measured on the trainer's CNN, that was faster than one pass vectorized over them
(`tf.vectorized_map`, 1.09x its time) or nested accumulators (1.29x).

Every forward pass restores the model's non-trainable variables after it (BatchNorm's
moving statistics, dropout's seed state), so that the passes see one function (the same
dropout masks) and leave the model as they found it. Across ranks each rank's product
is of its own batch's loss, and the result is their mean (the communicator's), the
product of the mean loss, as the gradient is.
"""

import typing

import keras
import tensorflow as tf

from tfkfac import fisher

# The compiled losses with a closed-form output curvature: fisher.py's table (the
# predictive distribution each is the negative log-likelihood of).
REDUCTIONS = ("sum_over_batch_size", "mean", "sum")
PURPOSE = "the exact curvature products take the Hessian of the compiled loss in closed form"


class OutputCurvature(typing.NamedTuple):
    """H_L of a compiled loss: "categorical" (softmax cross-entropy), "bernoulli" (binary
    cross-entropy), "normal" (mean squared error); its predictions are logits when
    `from_logits`, else probabilities; `reduction` one of REDUCTIONS.

    Per loss element (the predictions but their last axis, d long), with s the softmax or
    sigmoid of logits:
    - categorical, logits: H = diag(s) − s sᵀ; probabilities p: the categorical Fisher in
      q = p / Σp, H u = (u − q Σu) / (q (Σp)²) elementwise — for p = softmax(z) exactly the
      logits' GGN (their Jacobian carries diag(s) − s sᵀ into p).
    - bernoulli (Keras averages the d outputs): logits H = diag(s (1 − s)) / d;
      probabilities H = diag(1 / (p (1 − p))) / d, the sigmoid's logits' GGN again.
    - normal: H = (2 / d) I.
    Each element's H is weighted by its sample weight and, under "sum_over_batch_size",
    divided by the number of loss elements.
    """

    kind: str
    from_logits: bool
    reduction: str = "sum_over_batch_size"

    def product(self, predictions, tangents, sample_weight=None):
        """H_L u for `tangents` u of `predictions` (same shape), in `compute_dtype`."""
        dtype = compute_dtype(predictions.dtype)
        p, u = tf.cast(predictions, dtype), tf.cast(tangents, dtype)
        width = tf.cast(tf.shape(p)[-1], dtype)
        if self.kind == "categorical" and self.from_logits:
            s = tf.nn.softmax(p, axis=-1)
            hu = s * u - s * tf.reduce_sum(s * u, axis=-1, keepdims=True)
        elif self.kind == "categorical":
            total = tf.reduce_sum(p, axis=-1, keepdims=True)
            q = p / total
            dq = (u - q * tf.reduce_sum(u, axis=-1, keepdims=True)) / total
            hu = tf.math.divide_no_nan(dq, q * total)
        elif self.kind == "bernoulli" and self.from_logits:
            s = tf.sigmoid(p)
            hu = s * (1.0 - s) * u / width
        elif self.kind == "bernoulli":
            hu = tf.math.divide_no_nan(u, p * (1.0 - p)) / width
        else:
            hu = 2.0 * u / width
        if sample_weight is not None:
            hu = hu * _per_element(sample_weight, p, dtype)
        if self.reduction != "sum":
            hu = hu * (width / tf.cast(tf.size(p), dtype))  # 1 / (loss elements)
        return hu


def compute_dtype(dtype):
    """float64 for float64 predictions, float32 for any other (float16 ones widened)."""
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def _per_element(sample_weight, predictions, dtype):
    """`sample_weight` broadcast against the loss elements (the predictions but their last
    axis), as Keras's losses broadcast it: a trailing axis of size 1 squeezed, missing
    trailing axes added; then an axis for the predictions' last."""
    weight = tf.cast(tf.convert_to_tensor(sample_weight), dtype)
    rank = predictions.shape.rank - 1
    if weight.shape.rank == rank + 1 and weight.shape[-1] == 1:
        weight = tf.squeeze(weight, -1)
    while weight.shape.rank < rank:
        weight = weight[..., None]
    return weight[..., None]


def output_curvature(loss):
    """The `OutputCurvature` of `loss` (what `model.compile(loss=...)` took); a ValueError
    naming it for a loss, reduction or layout without a closed form."""
    distribution = fisher.predictive_distribution(loss, purpose=PURPOSE)
    reduction = distribution.reduction
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"{PURPOSE}, averaged over the batch as the loss is: the loss's `reduction` must "
            f"be one of {', '.join(map(repr, REDUCTIONS))}; received {reduction!r}")
    return OutputCurvature(distribution.kind, distribution.from_logits, reduction)


def _primal(variable):
    """The tf.Variable a forward-mode accumulator watches (a Keras variable's value)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


class Restoring:
    """`function` (a forward pass) with the variables of `state` (BatchNorm's moving
    statistics, dropout's seeds, metrics) put back after each call to the values they
    held when this was made: every call computes the same function and changes nothing."""

    def __init__(self, function, state):
        self._function, self._state = function, list(state)
        self._saved = [tf.identity(_primal(v).read_value()) for v in self._state]

    def __call__(self):
        outputs = self._function()
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            restores = [_primal(variable).assign(value)
                        for variable, value in zip(self._state, self._saved)]
        with tf.control_dependencies(restores):
            return tf.nest.map_structure(tf.identity, outputs)


def output_tangents(predict, variables, vectors, state=()):
    """(predictions, [J v for v in `vectors`]): one forward-mode pass per vector.

    `predict()` runs the forward pass, reading `variables`; each vector holds one tensor
    per variable (cast to its dtype). `state`: the non-trainable variables put back
    after each pass (`model.non_trainable_variables`).
    """
    predict = Restoring(predict, state)
    primals = [_primal(v) for v in variables]
    predictions, tangents = None, []
    for vector in vectors:
        with tf.autodiff.ForwardAccumulator(primals, _cast_like(vector, variables)) as acc:
            predictions = predict()
        tangents.append(acc.jvp(predictions, unconnected_gradients="zero"))
    return predictions, tangents


def quadratic_forms(predict, variables, vectors, curvature, sample_weight=None,
                    communicator=None, state=()):
    """The k×k matrix [vᵢᵀ F vⱼ] of the k `vectors` (float64): (J vᵢ)ᵀ H_L (J vⱼ) summed
    over the batch's outputs, averaged over the ranks of `communicator` (if given).
    Forward mode only; arguments as `output_tangents` and `OutputCurvature.product`."""
    predictions, tangents = output_tangents(predict, variables, vectors, state)
    hu = [curvature.product(predictions, u, sample_weight) for u in tangents]
    k = len(vectors)
    rows = [[tf.reduce_sum(tf.cast(tangents[i], hu[j].dtype) * hu[j]) for j in range(k)]
            for i in range(k)]
    matrix = tf.stack([tf.stack(row) for row in rows])
    matrix = 0.5 * (matrix + tf.transpose(matrix))  # H_L is symmetric; rounding is not
    if communicator is not None:
        (matrix,) = communicator.grouped_allreduce_mean([matrix], category="gradients")
    return tf.cast(matrix, tf.float64)


def products(predict, variables, vectors, curvature, sample_weight=None, communicator=None,
             state=()):
    """[F v for v in `vectors`], each a list of one tensor per variable (its dtype):
    J v forward, H_L, then Jᵀ back through the first pass's tape (one reverse pass per
    vector); averaged over the ranks of `communicator` (if given), all in one call."""
    restoring = Restoring(predict, state)
    primals = [_primal(v) for v in variables]
    vectors = [_cast_like(vector, variables) for vector in vectors]
    with tf.GradientTape(persistent=len(vectors) > 1, watch_accessed_variables=False) as tape:
        tape.watch(primals)
        with tf.autodiff.ForwardAccumulator(primals, vectors[0]) as acc:
            predictions = restoring()
        tangents = [acc.jvp(predictions, unconnected_gradients="zero")]
    for vector in vectors[1:]:
        with tf.autodiff.ForwardAccumulator(primals, vector) as acc:
            tangents.append(acc.jvp(restoring(), unconnected_gradients="zero"))
    results = []
    for u in tangents:
        w = tf.stop_gradient(tf.cast(curvature.product(predictions, u, sample_weight),
                                     predictions.dtype))
        grads = tape.gradient(predictions, primals, output_gradients=w,
                              unconnected_gradients="zero")
        results.append([tf.cast(g, v.dtype) for g, v in zip(grads, variables)])
    del tape
    if communicator is not None:
        flat = communicator.grouped_allreduce_mean(
            [g for result in results for g in result], category="gradients")
        results = [flat[i * len(variables):(i + 1) * len(variables)]
                   for i in range(len(results))]
    return results


def _cast_like(vector, variables):
    vector = list(vector)
    if len(vector) != len(variables):
        raise ValueError(f"a vector must hold one tensor per variable ({len(variables)}); "
                         f"received {len(vector)}")
    return [tf.cast(t, v.dtype) for t, v in zip(vector, variables)]
