"""Per-example weights of the factor statistics: sample weights and fresh flags.

Two things weigh an example's share of the curvature (docs/design.md §2, sample
weights): the weight w_i its loss carries (`sample_weight`, or Keras's `class_weight`
turned into one), and, with `KFAC(factor_examples="fresh")`, its fresh flag f_i. Both
reach the train step in the third element of a batch, Keras's sample-weight slot: a plain
tensor there is always a sample weight; the fresh flags come in the structure
`fresh_flags` makes, `{FRESH_KEY: flags}` (with sample weights, also
`{SAMPLE_WEIGHT_KEY: weights}`), so that a user's `(x, y, sample_weight)` keeps its
meaning under every setting.

Every block computes its statistics with per-example weights u (`Block.batch_statistics`)
from output gradients it is handed; `StatisticsWeights` gives u and the factor c_i each
example's output gradients are multiplied by, so that the blocks' plain formulas give the
Fisher of the weighted loss (docs/design.md §2, sample weights).
"""

import typing

import tensorflow as tf

# The keys of the batch's third element under factor_examples="fresh" (`fresh_flags`).
FRESH_KEY = "tfkfac_fresh"
SAMPLE_WEIGHT_KEY = "sample_weight"

FRESH_HINT = (
    "KFAC(factor_examples='fresh') takes each example's fresh flag (1 on the first copy "
    "of a source example, 0 on an echoed repeat) from the third element of every "
    "training batch, made by `tfkfac.fresh_flags(flags)` (with sample weights "
    "`tfkfac.fresh_flags(flags, sample_weight=weights)`), as "
    "`pipelines.build(..., fresh_flags=True)` yields it, or from "
    "`minimize(..., fresh=flags)`")
CLASS_WEIGHT_WITH_FRESH = (
    "KFAC(factor_examples='fresh') cannot take `class_weight`: Keras puts the class "
    "weights in the batch's third element, which carries the fresh flags; give each "
    "example its class's weight in the batch instead, (x, y, tfkfac.fresh_flags(flags, "
    "sample_weight=weights))")


def fresh_flags(flags, sample_weight=None):
    """The third element of a training batch under `KFAC(factor_examples="fresh")`.

    `flags` (N,): 1 on the first copy of a source example, 0 on an echoed repeat.
    `sample_weight` (N,), optional: the examples' sample weights, which the loss, the
    metrics and the factor statistics use as without the option. A dataset yields
    `(x, y, tfkfac.fresh_flags(flags))`; `model.fit(x, y, sample_weight=
    tfkfac.fresh_flags(flags))` takes arrays the same way.
    """
    slot = {FRESH_KEY: flags}
    if sample_weight is not None:
        slot[SAMPLE_WEIGHT_KEY] = sample_weight
    return slot


def has_fresh_flags(slot):
    """Whether a batch's third element is `fresh_flags`'s structure."""
    return isinstance(slot, dict) and FRESH_KEY in slot


def split_slot(slot, fresh_only):
    """(fresh flags or None, sample weights or None) from a batch's third element.

    ValueError, when the train step is traced: flags without `fresh_only`, a batch
    without flags with it (a plain tensor there is a sample weight, from `sample_weight`
    or `class_weight`, never the flags), or keys `fresh_flags` does not make.
    """
    if has_fresh_flags(slot):
        unknown = sorted(set(slot) - {FRESH_KEY, SAMPLE_WEIGHT_KEY})
        if unknown:
            raise ValueError(
                f"the batch's `tfkfac.fresh_flags(...)` holds the keys {FRESH_KEY!r} and "
                f"{SAMPLE_WEIGHT_KEY!r} only; received also {unknown}")
        if not fresh_only:
            raise ValueError(
                "the batch carries `tfkfac.fresh_flags(...)`, which only "
                "KFAC(factor_examples='fresh') reads; this optimizer counts every example: "
                "pass factor_examples='fresh' or give the batch (x, y) or "
                "(x, y, sample_weight)")
        return slot[FRESH_KEY], slot.get(SAMPLE_WEIGHT_KEY)
    if fresh_only:
        what = "no third element" if slot is None else (
            "a sample weight there, which is never read as the flags")
        raise ValueError(f"{FRESH_HINT}; this batch has {what}")
    return None, slot


def without_fresh_flags(data):
    """A Keras batch `(x, y, third)` with `fresh_flags`'s structure replaced by the sample
    weights it holds (for Keras's own steps: evaluation, the model's symbolic build)."""
    if not (isinstance(data, (tuple, list)) and len(data) == 3
            and has_fresh_flags(data[2])):
        return data
    x, y, slot = data
    weights = slot.get(SAMPLE_WEIGHT_KEY)
    return (x, y) if weights is None else (x, y, weights)


def per_example(sample_weight, batch):
    """`sample_weight` as one weight per example, (N,) float32, or None without one.

    A scalar applies to every example; (N,) and (N, 1) are one per example. A nest (one
    per model output, as Keras makes of one array for a model of several outputs) must
    hold the same weight per example in every member. Other shapes (weights per position
    or per output unit) give no weight per example: a ValueError when traced.
    """
    if sample_weight is None:
        return None
    members = [tf.convert_to_tensor(w) for w in tf.nest.flatten(sample_weight)
               if w is not None]
    if not members:
        return None
    vectors = [_one_per_example(w, batch) for w in members]
    first = vectors[0]
    checks = [tf.debugging.assert_equal(
        v, first, message="KFAC weighs each example's factor statistics by one weight: "
        "`sample_weight` must give an example the same weight for every model output")
        for v in vectors[1:]]
    checks.append(tf.debugging.assert_non_negative(
        first, message="KFAC: `sample_weight` must be >= 0 (the Fisher of a loss weighted "
        "by negative weights is not a curvature)"))
    with tf.control_dependencies(checks):
        return tf.identity(first)


def _one_per_example(weights, batch):
    rank = weights.shape.rank
    if rank is not None and not (rank <= 1 or (rank == 2 and weights.shape[1] in (1, None))):
        raise ValueError(
            "KFAC weighs each example's factor statistics by its sample weight: "
            "`sample_weight` must hold one weight per example, shape (N,) or (N, 1); "
            f"received shape {tuple(weights.shape)}")
    weights = tf.cast(weights, tf.float32)
    if rank == 0:
        return tf.fill([batch], weights)
    weights = tf.reshape(weights, [-1])
    with tf.control_dependencies([tf.debugging.assert_equal(
            tf.size(weights), batch, message="KFAC: `sample_weight` must hold one weight "
            "per example of the batch, shape (N,) or (N, 1)")]):
        return tf.identity(weights)


class StatisticsWeights(typing.NamedTuple):
    """What the blocks' statistics need of this step's example weights (docs/design.md
    §2, sample weights).

    `weights` (N,), float64: u_i = f_i w_i N / W̄, the blocks' per-example weights, mean 1
    over all ranks' examples; `output_scales` (N,), float64, or None (all 1):
    c_i = √(W̄ / n̄) / w_i (0 where w_i = 0), by which each example's output gradients are
    multiplied; `ready`: whether W̄ > 0 (else the step updates no factor). With n̄ the
    mean over ranks of Σ_i f_i and W̄ that of Σ_i f_i w_i (f_i = 1 without fresh flags,
    w_i = 1 without sample weights).
    """

    weights: typing.Any
    output_scales: typing.Any
    ready: typing.Any


def sums(flags, weights):
    """The per-rank sums averaged over ranks with the gradients: [Σ f] with fresh flags,
    then [Σ f w] with sample weights (float32; counts are whole numbers, exact)."""
    values = []
    if flags is not None:
        values.append(tf.reduce_sum(flags))
    if weights is not None:
        values.append(tf.reduce_sum(weights if flags is None else flags * weights))
    return values


def statistics_weights(flags, weights, mean_sums):
    """`StatisticsWeights` from this rank's `flags` and `weights` ((N,) float32 or None,
    not both None) and `mean_sums`, `sums(flags, weights)` averaged over ranks."""
    mean_sums = [tf.cast(s, tf.float64) for s in mean_sums]
    reference = flags if flags is not None else weights
    batch = tf.cast(tf.size(reference), tf.float64)
    if weights is None:
        # Fresh flags alone: u_i = f_i N / n̄ (docs/design.md §7).
        flags = tf.cast(flags, tf.float64)
        return StatisticsWeights(tf.math.divide_no_nan(flags * batch, mean_sums[0]), None,
                                 mean_sums[0] > 0)
    weights = tf.cast(weights, tf.float64)
    mean_fresh = batch if flags is None else mean_sums[0]
    mean_weight = mean_sums[-1]
    kept = weights if flags is None else tf.cast(flags, tf.float64) * weights
    return StatisticsWeights(
        tf.math.divide_no_nan(kept * batch, mean_weight),
        tf.math.divide_no_nan(tf.sqrt(tf.math.divide_no_nan(mean_weight, mean_fresh)),
                              weights),
        mean_weight > 0)


def scale_examples(tensor, scales, axis=0):
    """`tensor` with each example's rows multiplied by its `scales` entry (N,); the
    examples lie along `axis`, one or more rows each, example-major (as
    `tfkfac.blocks.base.take_rows` reads them)."""
    shape = tf.shape(tensor)
    batch = tf.size(scales)
    by_example = tf.reshape(tensor,
                            tf.concat([shape[:axis], [batch, -1], shape[axis + 1:]], 0))
    rank = tensor.shape.rank
    broadcast = tf.reshape(tf.cast(scales, tensor.dtype),
                           [1] * axis + [-1, 1] + [1] * (rank - axis - 1))
    return tf.reshape(by_example * broadcast, shape)
