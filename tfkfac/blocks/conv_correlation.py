"""A stride-1 convolution's A factor from input correlations, without im2col rows.

With x the unpadded input (zero outside its S positions per axis), K taps per axis at
dilation d, `before` zeros of padding and O output positions per axis, the im2col row of
output position p holds x(p + k·d − before) for every kernel offset k, so the (k, k')
block of the patch Gram is

    Σ_n Σ_p x(p + k·d − before) x(p + k'·d − before)ᵀ = Σ_n Σ_{q ∈ B(k)} x(q) x(q + δ)ᵀ,

δ = (k' − k)·d, B(k) the output grid shifted by k·d − before and clipped to the input
(outside it x is zero). Per axis the ends of the K windows cut the input into pieces,
each covered by a contiguous run of taps; a product of pieces over the axes is a region Q
that lies in B(k) for the taps of its pieces' runs, so each block is the sum, over the
regions in B(k), of the correlations R_Q(δ) = Σ_{q ∈ Q} x(q) x(q + δ)ᵀ. Each region's
correlation is computed once, for the offsets its runs need: the core (covered by all
taps) for all (2K − 1)^n of them, (2K − 1)^n / K^(2n) of the im2col Gram's
multiply-adds (25/81 for 3x3), the thin edge pieces for fewer. A piece covered by m
taps needs m + K − 1 ≤ m·K offsets where im2col reads it m·K times, so it never costs
more. Alternatively B(k) is the whole input minus the pieces its window misses, with
coefficients −1: over the whole input R(−δ) = R(δ)ᵀ, so only the offsets with δ_1 ≥ 0
are computed (15 of 25 for 3x3), and the missed pieces are thin where the padding is
"same"; the decomposition with fewer multiply-adds is taken. The bias column is the same
signed sum of Σ_{q ∈ Q} x(q); the bias corner is the number of output positions.

Example weights w_n multiply the left operand x(q), as they multiply a row of the Gram.
"""

import itertools
import math

import numpy as np
import tensorflow as tf


def patch_gram(inputs, kernel_size, dilation, before, extents, has_bias, weights=None,
               product_dtype=None):
    """Σ over the im2col rows of ā āᵀ (unnormalized) for one call of a stride-1 convolution.

    inputs: (N, S..., C) with static spatial sizes; before, extents: per axis the zeros of
    padding before and the output positions; ā is the patch in the kernel's
    (spatial..., c_in) order, plus 1 for the bias. Returns (P·C [+1], P·C [+1]).
    """
    sizes = [int(s) for s in inputs.shape[1:-1]]
    channels = int(inputs.shape[-1])
    taps = list(kernel_size)
    left = inputs if weights is None else inputs * tf.reshape(
        tf.cast(weights, inputs.dtype), [-1] + [1] * (len(sizes) + 1))
    # Right operand: x with (K − 1)·d zeros on both sides, so every shift stays inside.
    reach = [(k - 1) * d for k, d in zip(taps, dilation)]
    right = tf.pad(inputs, [[0, 0]] + [[r, r] for r in reach] + [[0, 0]])
    positions = math.prod(taps)
    # Every region's correlation goes into one table (its raw filter gradients, the
    # transpose of `_correlation`'s blocks), and each (k, k') block gathers its terms
    # from it at once: a few ops per region where one gather, scaling and sum each took
    # a dozen more (the statistics' trace and graph optimization grow with them).
    table, totals, terms = [], [], [[] for _ in range(positions * positions)]
    coefficients = np.zeros((positions, 0))
    rows = 0
    for region in regions(sizes, taps, dilation, before, extents):
        window = tuple([slice(None)] + [slice(start, stop) for start, stop, *_ in region])
        inside = left[window]  # sliced once: the bias column sums it too
        reach_window = [slice(None)] + [
            slice(start + r + lo * d, stop + r + hi * d)
            for (start, stop, lo, hi, _), r, d in zip(region, reach, dilation)]
        offsets = [hi - lo + 1 for _, _, lo, hi, _ in region]
        if _whole(region, sizes, taps):  # offsets with δ_1 ≥ 0 only, by symmetry
            reach_window[1] = slice(reach[0], sizes[0] + 2 * reach[0])
            half = _correlation(inside, right[tuple(reach_window)],
                                [taps[0]] + offsets[1:], dilation, product_dtype)
            table.append(tf.gather(tf.concat([half, tf.transpose(half, (0, 2, 1))], 0),
                                   _mirrored(taps)))
        else:
            table.append(_correlation(inside, right[tuple(reach_window)], offsets, dilation,
                                      product_dtype))
        coefficient = np.zeros(positions)
        for k in itertools.product(*[range(t) for t in taps]):
            flat = np.ravel_multi_index(k, taps)
            coefficient[flat] = math.prod(c[k_a] for (*_, c), k_a in zip(region, k))
            if not coefficient[flat]:
                continue
            for k2 in itertools.product(*[range(t) for t in taps]):
                shift = [k2_a - k_a - lo for k_a, k2_a, (_, _, lo, _, _) in zip(k, k2, region)]
                terms[flat * positions + np.ravel_multi_index(k2, taps)].append(
                    (rows + np.ravel_multi_index(shift, offsets), coefficient[flat]))
        rows += math.prod(offsets)
        if has_bias:
            totals.append(tf.reduce_sum(inside, axis=list(range(len(sizes) + 1))))
            coefficients = np.concatenate([coefficients, coefficient[:, None]], axis=1)
    # Per block its terms, padded with zero-weighted reads of row 0 to the most any has.
    most = max(len(block_terms) for block_terms in terms)
    index = np.zeros((len(terms), most), np.int64)
    weight = np.zeros((len(terms), most))
    for flat, block_terms in enumerate(terms):
        for slot, (row, value) in enumerate(block_terms):
            index[flat, slot], weight[flat, slot] = row, value
    gathered = tf.gather(tf.concat(table, 0), index)  # (P·P, most, C', C)
    blocks = tf.reduce_sum(gathered * tf.constant(weight[..., None, None], inputs.dtype), 1)
    # blocks[k, k', c', c] holds the (k, k') block transposed: A's (k, c), (k', c') entry.
    blocks = tf.reshape(blocks, (positions, positions, channels, channels))
    gram = tf.reshape(tf.transpose(blocks, (0, 3, 1, 2)),
                      (positions * channels, positions * channels))
    gram = 0.5 * (gram + tf.transpose(gram))  # the (k', k) block is the (k, k') one's transpose
    if not has_bias:
        return gram
    sums = tf.linalg.matmul(tf.constant(coefficients, inputs.dtype), tf.stack(totals))
    column = tf.reshape(sums, (-1, 1))
    examples = (tf.cast(tf.shape(inputs)[0], inputs.dtype) if weights is None
                else tf.reduce_sum(tf.cast(weights, inputs.dtype)))
    corner = tf.reshape(examples * math.prod(extents), (1, 1))
    return tf.concat([tf.concat([gram, column], axis=1),
                      tf.concat([tf.transpose(column), corner], axis=1)], axis=0)


def regions(sizes, taps, dilation, before, extents):
    """The regions whose correlations `patch_gram` sums: per region, per axis
    (start, stop, lowest and highest offset in taps, coefficient per tap k). Of the two
    decompositions (`_segments`) the one with fewer multiply-adds."""
    return min((list(itertools.product(*[_segments(*axis, complement) for axis in zip(
        sizes, taps, dilation, before, extents)])) for complement in (False, True)),
        key=lambda chosen: _cost(chosen, sizes, taps))


def multiply_adds(sizes, taps, dilation, before, extents, channels):
    """Multiply-adds per example of `patch_gram`'s correlation products."""
    return channels * channels * _cost(regions(sizes, taps, dilation, before, extents),
                                       sizes, taps)


def _cost(chosen, sizes, taps):
    """Σ over the regions of positions × offsets computed."""
    total = 0
    for region in chosen:
        offsets = [hi - lo + 1 for _, _, lo, hi, _ in region]
        if _whole(region, sizes, taps):
            offsets[0] = taps[0]
        total += math.prod(stop - start for start, stop, *_ in region) * math.prod(offsets)
    return total


def _whole(region, sizes, taps):
    """Whether `region` is the whole input at every offset: its correlation at −δ is
    the transpose of the one at δ (x is zero outside), so δ_1 ≥ 0 suffice."""
    return all((start, stop, lo, hi) == (0, size, 1 - k, k - 1)
               for (start, stop, lo, hi, _), size, k in zip(region, sizes, taps))


def _mirrored(taps):
    """For each offset δ (row-major, from −(K−1)), its index among the δ_1 ≥ 0 offsets
    followed by their transposes: δ itself, or the transpose of −δ."""
    half_shape = [taps[0]] + [2 * k - 1 for k in taps[1:]]
    half = math.prod(half_shape)
    index = []
    for m in itertools.product(*[range(2 * k - 1) for k in taps]):
        delta = [m_a - (k - 1) for m_a, k in zip(m, taps)]
        if delta[0] >= 0:
            index.append(np.ravel_multi_index([delta[0]] + list(m[1:]), half_shape))
        else:
            mirror = [-delta[0]] + [2 * (k - 1) - m_a for m_a, k in zip(m[1:], taps[1:])]
            index.append(half + np.ravel_multi_index(mirror, half_shape))
    return index


def _segments(size, taps, dilation, before, extent, complement):
    """One axis's segments: (start, stop, lo, hi, coefficient per tap k), the taps with a
    nonzero coefficient needing the offsets k' − k in [lo, hi].

    The ends of the taps' windows B(k) (clipped to the input) cut it into pieces. Either
    each piece with coefficient 1 for the taps whose window covers it (contiguous, as
    the windows' ends grow with k); or (`complement`) the whole input with 1 for every
    tap, and each piece with −1 for the taps whose window misses it: fewer regions'
    positions when the windows miss little, and the whole input's correlation is
    symmetric (`_whole`).
    """
    starts = [min(max(k * dilation - before, 0), size) for k in range(taps)]
    stops = [min(max(k * dilation - before + extent, 0), size) for k in range(taps)]
    cuts = sorted(set([0, size] + starts + stops))
    segments = [(0, size, 1 - taps, taps - 1, [1.0] * taps)] if complement else []
    for start, stop in zip(cuts, cuts[1:]):
        covering = {k for k in range(taps) if starts[k] <= start and stop <= stops[k]}
        chosen = [k for k in range(taps) if (k in covering) != complement]
        if chosen:
            sign = -1.0 if complement else 1.0
            segments.append((start, stop, -max(chosen), taps - 1 - min(chosen),
                             [sign if k in chosen else 0.0 for k in range(taps)]))
    return segments


def _correlation(left, right, offsets, dilation, product_dtype):
    """(Π offsets, C, C): for every offset m (row-major), Σ_q right(q + m·d) left(q)ᵀ,
    where `right` starts at the first offset (its extent is left's + (offsets − 1)·d).

    TensorFlow's filter gradient of a VALID convolution is exactly this sum, without
    materializing the shifted copies: in CPU time 1.1-3.3x faster than one matmul
    against them stacked, on ResNet-20's stride-1 convolutions at batch 128. Its CPU
    kernels take no dilation: each axis's positions are first split by their residue
    mod d into the batch, where offsets m·d become m.
    """
    for axis, d in enumerate(dilation):
        if d > 1:
            left, right = _split_residues(left, right, axis + 1, d)
    if len(offsets) == 1:  # as a 1 x K two-dimensional one
        left, right, offsets = left[:, None], right[:, None], [1] + list(offsets)
    gradient = (tf.raw_ops.Conv2DBackpropFilter if len(offsets) == 2
                else tf.raw_ops.Conv3DBackpropFilterV2)
    channels = int(left.shape[-1])
    wide = left.dtype
    if product_dtype is not None:
        left, right = tf.cast(left, product_dtype), tf.cast(right, product_dtype)
    filters = gradient(input=right, filter_sizes=list(offsets) + [channels, channels],
                       out_backprop=left, strides=[1] * (len(offsets) + 2), padding="VALID")
    # filters[m, c', c] = Σ_q right(q + m)[c'] left(q)[c]
    return tf.reshape(tf.cast(filters, wide), (-1, channels, channels))


def _split_residues(left, right, axis, d):
    """`left` and `right` with `axis`'s positions q split into q mod d (moved into the
    batch) and q // d; `right` ends (offsets − 1)·d after `left` on that axis, and both
    are padded with zeros to whole multiples of d."""
    size = int(left.shape[axis])
    extra = int(right.shape[axis]) - size
    whole = -(-size // d) * d
    split = []
    for tensor, length in ((left, whole), (right, whole + extra)):
        pad = [[0, 0]] * len(tensor.shape)
        pad[axis] = [0, length - int(tensor.shape[axis])]
        tensor = tf.pad(tensor, pad)
        shape = [-1 if i == 0 else int(n) for i, n in enumerate(tensor.shape)]
        shape[axis:axis + 1] = [length // d, d]
        tensor = tf.reshape(tensor, shape)
        order = [axis + 1] + [i for i in range(len(shape)) if i != axis + 1]
        tensor = tf.transpose(tensor, order)
        split.append(tf.reshape(tensor, [-1] + [int(n) for n in tensor.shape[2:]]))
    return split
