"""The arithmetic floor of a training step: FLOPs and bytes per phase, from layer shapes.

A step is a list of kernels per phase (docs/design.md §1). What a block's and a method's
work costs is theirs to say, next to their math, in tfkfac/costs.py's kernels:

- forward/backward (K-FAC and SGD alike): every block's weight products (`Block.cost`'s
  `forward_kernels`: a Kronecker block's layer forward, input gradient and weight
  gradient, ≈ 3x the forward matmul FLOPs) and MultiHeadAttention's score and value
  products, counted here;
- factors, on factor steps: every block's statistics (`statistics_kernels`: im2col and
  the Gram products A = ĀᵀĀ and G = ḡᵀḡ, input correlations, the diagonal blocks'
  per-example gradients, the running averages);
- communication: bytes per collective, for a job of `ranks` processes (none for one);
- decompositions, on decomposition steps: per full factor the method's
  (`Method.decomposition_kernels`: "eigen" one eigendecomposition, 9n³ FLOPs, "inverse"
  one Cholesky inverse, n³);
- preconditioning, every step: the method's per piece of every block
  (`Method.precondition_kernels`), and the KL clip's inner products;
- update: momentum SGD over every trainable parameter (read g, m, w; write m, w).

A kernel's floor time on a machine is `Kernel.seconds(rates)`: products and elementwise
work at the roofline max(FLOPs / matmul rate, bytes / streaming bandwidth), LAPACK
decompositions at their measured rate; `rates` come from
`bench/linalg_benchmark.py`'s `rates()`. Counts are in the state dtype (float32).
`record_geometries` asks the blocks of a model for their costs by recording one forward
pass (`tfkfac.capture.Recorder`).
"""

import functools
import math

from tfkfac import KFACConfig, methods as methods_lib
from tfkfac.costs import Kernel, elementwise, product

# Momentum SGD per parameter: m ← μm − ηg (3 FLOPs), w ← w + m (1); reads g, m, w,
# writes m, w.
UPDATE_FLOPS, UPDATE_READS, UPDATE_WRITES = 4, 3, 2
PHASES = ("forward_backward", "factors", "communication", "decomposition",
          "precondition", "update")


@functools.lru_cache(maxsize=None)
def as_method(method):
    """`method` as a `tfkfac.Method`: a built-in's name as `KFACConfig` resolves it at the
    library's defaults, an object as it is; a ValueError naming `method` otherwise."""
    return KFACConfig(method=method).preconditioning_method()


def decomposition_kernels(geometry, method, itemsize=4):
    """Per full factor of a block's `geometry` (`Block.cost`), the kernels of
    `method`'s (a name or a `tfkfac.Method`) decomposition of it."""
    method = as_method(method)
    return [method.decomposition_kernels(shape, itemsize)
            for shape in methods_lib.full_factor_shapes(geometry)]


def decomposition_elements(geometry, method):
    """Per full factor of a block's `geometry`, the elements `method` stores of it."""
    method = as_method(method)
    return [methods_lib.decomposition_elements(method, shape)
            for shape in methods_lib.full_factor_shapes(geometry)]


def precondition_kernels(geometry, method, itemsize=4):
    """`method`'s preconditioning of a block's `geometry`, its pieces' in order."""
    return methods_lib.precondition_kernels(as_method(method), geometry, itemsize)


def attention_kernels(batch, heads, queries, keys, key_dim, value_dim, itemsize=4):
    """MultiHeadAttention's two weightless products, forward and both gradients:
    scores Q Kᵀ and the weighted values A V, per example and head."""
    count = batch * heads
    scores = [product(queries, key_dim, keys, count, itemsize),
              product(queries, keys, key_dim, count, itemsize),
              product(keys, queries, key_dim, count, itemsize)]
    values = [product(queries, keys, value_dim, count, itemsize),
              product(queries, value_dim, keys, count, itemsize),
              product(keys, queries, value_dim, count, itemsize)]
    return scores + values


def ring_allreduce_bytes(payload_bytes, ranks):
    """Bytes each rank sends (and receives) in a ring allreduce of `payload_bytes`."""
    return 2.0 * (ranks - 1) / ranks * payload_bytes if ranks > 1 else 0.0


def kl_clip_kernels(parameters, itemsize=4):
    """Σ <P, ∇> over the managed parameters, then P scaled by ν."""
    return [elementwise(parameters, 2, 2, 0, itemsize), elementwise(parameters, 1, 1, 1, itemsize)]


def update_kernels(parameters, itemsize=4):
    return [elementwise(parameters, UPDATE_FLOPS, UPDATE_READS, UPDATE_WRITES, itemsize)]


def total(kernels):
    """(FLOPs, bytes) of `kernels`."""
    return sum(k.flops for k in kernels), sum(k.bytes for k in kernels)


def floor_seconds(kernels, rates):
    return sum(k.seconds(rates) for k in kernels)


# ------------------------------------------------------------------- from a model
def _size(shape):
    return math.prod(int(d) for d in shape)


def record_geometries(model, batch_size, weight_sharing="expand"):
    """{block path: its `Block.cost`} and the attention kernels of `model` at
    `batch_size`, from one recorded forward pass on zeros; also the layers K-FAC leaves
    unmanaged."""
    return record_geometries_by_rule(model, batch_size, (weight_sharing,))[weight_sharing]


def record_geometries_by_rule(model, batch_size, rules):
    """{rule: `record_geometries`' results under weight-sharing `rule`}: rules whose
    blocks manage the same layers share one recorded forward pass (what a layer's call
    records does not depend on the rule; the pass is most of a plan's start)."""
    from tfkfac import blocks as blocks_lib, keras_integration

    layers = keras_integration.leaf_layers(model)
    discovered = {rule: blocks_lib.discover(layers, KFACConfig(weight_sharing=rule))
                  for rule in rules}
    recorded, results = {}, {}
    for rule, (blocks, skipped) in discovered.items():
        key = tuple(id(block.layer) for block in blocks)
        if key not in recorded:
            recorded[key] = _record(model, batch_size, blocks)
        calls = recorded[key]
        geometries = {block.path: block.cost(block_calls, batch_size)
                      for block, block_calls in zip(blocks, calls)}
        results[rule] = (geometries, _attention(model, blocks, calls, batch_size), skipped)
    return results


def _record(model, batch_size, blocks):
    """Per block, its layer's calls in one forward pass of `model` on zeros."""
    import numpy as np

    from tfkfac.capture import Recorder

    recorder = Recorder(blocks)
    inputs = np.zeros((batch_size,) + tuple(model.input_shape[1:]), model.inputs[0].dtype)
    with recorder.recording():
        model(inputs, training=True)
    return recorder.take()


def _attention(model, blocks, calls, batch_size):
    """The kernels of `model`'s MultiHeadAttention layers' weightless products."""
    import keras

    by_layer = {id(block.layer): block_calls for block, block_calls in zip(blocks, calls)}
    attention = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.MultiHeadAttention):
            (_, query), = by_layer[id(layer.query_dense)]
            (_, key), = by_layer[id(layer.key_dense)]
            (_, value), = by_layer[id(layer.value_dense)]
            # (N, T, heads, dim) each: the shapes MultiHeadAttention's einsums contract.
            attention += attention_kernels(batch_size, int(query.shape[-2]),
                                           int(query.shape[1]), int(key.shape[1]),
                                           int(query.shape[-1]), int(value.shape[-1]))
    return attention


def at_batch(geometries, attention, scale):
    """`record_geometries`' results for a batch `scale` times larger: every row count,
    recorded input, example count and attention product grows with the batch. Lets a
    large model be recorded at a small batch (its activations are held in memory)."""
    scaled = {path: g.at_batch(scale) for path, g in geometries.items()}
    return scaled, [Kernel(k.kind, k.flops * scale, k.bytes * scale) for k in attention]


def model_floor(geometries, attention, trainable_parameters, method, factor_update_freq,
                decomposition_update_freq, ranks=2, kl_clip=True, itemsize=4):
    """Per phase the kernels of one step and how often they run, and the bytes a job of
    `ranks` processes would move; `method` a built-in's name or a `tfkfac.Method`.

    Returns {"phases": {phase: {"kernels": [...], "per_step": fraction of steps}},
    "communication": {...}}. SGD's step is "forward_backward" + "update".
    """
    from tfkfac.distributed import assignment, packing

    blocks = list(geometries.values())
    managed = sum(g.parameters for g in blocks)
    forward = [k for g in blocks for k in g.forward_kernels(itemsize)] + list(attention)
    statistics = [k for g in blocks for k in g.statistics_kernels(itemsize=itemsize)]
    decompositions = [k for g in blocks for ks in decomposition_kernels(g, method, itemsize)
                      for k in ks]
    precondition = [k for g in blocks for k in precondition_kernels(g, method, itemsize)]
    if kl_clip:
        precondition += kl_clip_kernels(managed, itemsize)
    phases = {
        "forward_backward": {"kernels": forward, "per_step": 1.0},
        "factors": {"kernels": statistics, "per_step": 1.0 / factor_update_freq},
        "communication": {"kernels": [], "per_step": 1.0},  # nothing moves on 1 process
        "decomposition": {"kernels": decompositions,
                          "per_step": 1.0 / decomposition_update_freq},
        "precondition": {"kernels": precondition, "per_step": 1.0},
        "update": {"kernels": update_kernels(trainable_parameters, itemsize), "per_step": 1.0},
    }
    # Communication of a `ranks`-process job (docs/design.md §6, placement "replicated"):
    # gradients every step, packed factors on factor steps, each decomposition from its
    # owner (greedy LPT on q·n³) to the other ranks on decomposition steps.
    shapes = [s for g in blocks for s in g.factor_shapes()]
    factor_elements = (packing.packed_size([s for s in shapes if len(s) >= 2])
                       + sum(_size(s) for s in shapes if len(s) == 1))
    items = [(s[-1], _size(s[:-2])) for g in blocks for s in methods_lib.full_factor_shapes(g)]
    elements = [e for g in blocks for e in decomposition_elements(g, method)]
    owners = assignment.lpt_assignment([assignment.eigen_cost(n, c) for n, c in items], ranks)
    received = max(sum(e for e, owner in zip(elements, owners) if owner != rank)
                   for rank in range(ranks)) if ranks > 1 else 0
    communication = {
        "ranks": ranks,
        "gradient_payload_bytes_per_step": itemsize * trainable_parameters,
        "gradient_bytes_sent_per_rank_per_step": ring_allreduce_bytes(
            itemsize * trainable_parameters, ranks),
        "factor_payload_bytes_per_factor_step": itemsize * factor_elements,
        "factor_bytes_sent_per_rank_per_factor_step": ring_allreduce_bytes(
            itemsize * factor_elements, ranks),
        "decomposition_bytes_received_per_rank_per_decomposition_step": itemsize * received,
    }
    communication["kfac_bytes_per_rank_per_step"] = (
        communication["factor_bytes_sent_per_rank_per_factor_step"] / factor_update_freq
        + communication["decomposition_bytes_received_per_rank_per_decomposition_step"]
        / decomposition_update_freq)
    return {"phases": phases, "communication": communication}


def phase_summary(floor, rates):
    """{phase: {flops, bytes, floor_s} per step (amortized by the schedule)}."""
    summary = {}
    for phase, entry in floor["phases"].items():
        flops, moved = total(entry["kernels"])
        every = entry["per_step"]
        summary[phase] = {"flops_per_step": flops * every, "bytes_per_step": moved * every,
                          "floor_s_per_step": floor_seconds(entry["kernels"], rates) * every,
                          "per_step": every}
    return summary
