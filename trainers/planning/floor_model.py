"""The arithmetic floor of a training step: FLOPs and bytes per phase, from layer shapes.

A step is a list of kernels per phase (docs/design.md §1), each counted from the shapes
of the layers K-FAC manages at a given batch:

- forward/backward (K-FAC and SGD alike): every weight product of the model (a
  Kronecker block's layer, MultiHeadAttention's score and value products) three times,
  forward, input gradient and weight gradient (≈ 3x the forward matmul FLOPs);
- factors, on factor steps: im2col of convolutions (the patch matrix written), the Gram
  products A = ĀᵀĀ and G = ḡᵀḡ of every Kronecker block (2·rows·n² each, full products
  as TensorFlow computes them; a symmetric rank-k update would halve them), or for a
  convolution whose A comes from input correlations (tfkfac/blocks/conv_correlation.py)
  those products' multiply-adds and no patch matrix, the diagonal blocks' per-example
  gradients, and the running averages;
- communication: bytes per collective, for a job of `ranks` processes (none for one);
- decompositions, on decomposition steps: per symmetric factor (a batch of q counts q
  times) one eigendecomposition (method "eigen", 9n³ FLOPs) or one Cholesky inverse
  (method "inverse", n³: potrf n³/3 + potri 2n³/3);
- preconditioning, every step: Q_Aᵀ ∇ Q_G, the scaling and Q_A (.) Q_Gᵀ (eigen), or
  A⁻¹ ∇ G⁻¹ (inverse), per block; the diagonal blocks; the KL clip's inner products;
- update: momentum SGD over every trainable parameter (read g, m, w; write m, w).

A kernel's floor time on a machine is `Kernel.seconds(rates)`: products and elementwise
work at the roofline max(FLOPs / matmul rate, bytes / streaming bandwidth), LAPACK
decompositions at their measured rate; `rates` come from
`bench/linalg_benchmark.py`'s `rates()`. Counts are in the state dtype (float32).

Pure counting functions of numbers (`product`, `gram`, `elementwise`, `decomposition`,
the `*_kernels` of each geometry) do not touch TensorFlow; `model_floor` derives the
geometries from a model by recording one forward pass (`tfkfac.capture.Recorder`).
"""

import dataclasses
import math

# Golub & Van Loan (4th ed.), §8.3: tridiagonalization and the symmetric QR algorithm
# with the eigenvectors accumulated, about 9n³ FLOPs.
EIGH_FLOPS_PER_N3 = 9.0
# LAPACK potrf (n³/3) then potri (2n³/3): the inverse from the Cholesky factor.
CHOLESKY_INVERSE_FLOPS_PER_N3 = 1.0
DECOMPOSITION_FLOPS_PER_N3 = {"eigen": EIGH_FLOPS_PER_N3,
                              "inverse": CHOLESKY_INVERSE_FLOPS_PER_N3}
DECOMPOSITION_KINDS = {"eigen": "eigh", "inverse": "cholesky_inverse"}
# Momentum SGD per parameter: m ← μm − ηg (3 FLOPs), w ← w + m (1); reads g, m, w,
# writes m, w.
UPDATE_FLOPS, UPDATE_READS, UPDATE_WRITES = 4, 3, 2
PHASES = ("forward_backward", "factors", "communication", "decomposition",
          "precondition", "update")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One piece of work: "matmul", "memory", "eigh" or "cholesky_inverse"."""

    kind: str
    flops: float
    bytes: float

    def seconds(self, rates):
        """Floor time at `rates` {"matmul", "eigh", "cholesky_inverse": FLOP/s,
        "bandwidth": bytes/s}."""
        if self.kind in ("eigh", "cholesky_inverse"):
            return self.flops / rates[self.kind]
        return max(self.flops / rates["matmul"], self.bytes / rates["bandwidth"])


def product(m, k, n, count=1, itemsize=4):
    """`count` products (m, k) x (k, n): 2mkn FLOPs each; both inputs read, output written."""
    return Kernel("matmul", 2.0 * count * m * k * n, itemsize * count * (m * k + k * n + m * n))


def gram(rows, dim, count=1, itemsize=4):
    """`count` Gram matrices XᵀX of (rows, dim): 2·rows·dim² FLOPs, X read once."""
    return Kernel("matmul", 2.0 * count * rows * dim * dim,
                  itemsize * count * (rows * dim + dim * dim))


def elementwise(elements, flops_per_element, reads, writes, itemsize=4):
    """Work over `elements` entries, each read `reads` and written `writes` times."""
    return Kernel("memory", float(flops_per_element) * elements,
                  float(itemsize) * elements * (reads + writes))


def decomposition(dim, count, method, itemsize=4):
    """`count` damped decompositions of (dim, dim) factors: eigh or Cholesky inverse."""
    return Kernel(DECOMPOSITION_KINDS[method],
                  DECOMPOSITION_FLOPS_PER_N3[method] * count * dim ** 3,
                  itemsize * count * 2 * dim * dim)


def fisher_average(elements, itemsize=4):
    """F ← ξF + (1 − ξ)F_batch over `elements` factor entries."""
    return elementwise(elements, 3, 2, 1, itemsize)


@dataclasses.dataclass(frozen=True)
class KroneckerGeometry:
    """A Kronecker block (Dense, Conv, EinsumDense) at one batch.

    groups: q pairs (grouped convolutions, EinsumDense shared letters), else 1.
    product_rows: rows of the layer's product per group, N·T over all calls.
    statistics_rows: rows of the Gram products per group: product_rows under "expand",
      N per call under "reduce".
    in_dim, out_dim: the weight matrix per group; a_dim = in_dim + 1 with a bias.
    patch_input: elements of the inputs im2col reads (0 when rows are a reshape).
    correlation_multiply_adds: per group, those of A's input correlations when A comes
      from them instead of the im2col Gram (0 otherwise).
    """

    groups: int
    product_rows: int
    statistics_rows: int
    in_dim: int
    out_dim: int
    has_bias: bool
    patch_input: int = 0
    correlation_multiply_adds: int = 0

    @property
    def a_dim(self):
        return self.in_dim + int(self.has_bias)

    @property
    def parameters(self):
        return self.groups * self.a_dim * self.out_dim

    def forward_kernels(self, itemsize=4):
        """Forward product, its input gradient and its weight gradient."""
        q, rows, d_in, d_out = self.groups, self.product_rows, self.in_dim, self.out_dim
        return [product(rows, d_in, d_out, q, itemsize), product(rows, d_out, d_in, q, itemsize),
                product(d_in, rows, d_out, q, itemsize)]

    def statistics_kernels(self, itemsize=4):
        q, a, o = self.groups, self.a_dim, self.out_dim
        kernels = []
        if self.correlation_multiply_adds:  # the input read as both operands, A written
            kernels.append(Kernel("matmul", 2.0 * q * self.correlation_multiply_adds,
                                  itemsize * (2 * self.patch_input + q * a * a)))
        elif self.patch_input:  # the patch matrix: inputs read, q·rows·in_dim written
            kernels.append(Kernel("memory", 0.0, itemsize * (
                self.patch_input + q * self.product_rows * self.in_dim)))
        if self.statistics_rows != self.product_rows:  # "reduce": sums over positions
            kernels.append(elementwise(q * self.product_rows * (self.in_dim + o), 1, 1, 0,
                                       itemsize))
        if not self.correlation_multiply_adds:
            kernels.append(gram(self.statistics_rows, a, q, itemsize))
        kernels += [gram(self.statistics_rows, o, q, itemsize),
                    fisher_average(q * (a * a + o * o), itemsize)]
        return kernels

    def factor_shapes(self):
        batch = () if self.groups == 1 else (self.groups,)
        return [batch + (self.a_dim, self.a_dim), batch + (self.out_dim, self.out_dim)]

    def decomposition_kernels(self, method, itemsize=4):
        return [decomposition(n, self.groups, method, itemsize) for n in (self.a_dim,
                                                                          self.out_dim)]

    def decomposition_elements(self, method):
        """Elements of each factor's stored decomposition (eigen, eigen_adam: Q and v;
        inverse: M⁻¹)."""
        return [self.groups * (n * n + (n if method != "inverse" else 0))
                for n in (self.a_dim, self.out_dim)]

    def precondition_kernels(self, method, itemsize=4):
        q, a, o = self.groups, self.a_dim, self.out_dim
        left, right = product(a, a, o, q, itemsize), product(a, o, o, q, itemsize)
        if method == "inverse":  # A⁻¹ ∇ G⁻¹
            return [left, right]
        # Q_Aᵀ ∇ Q_G, divided by v_A v_Gᵀ + λ (3 FLOPs an entry), then Q_A (.) Q_Gᵀ.
        return [left, right, elementwise(q * a * o, 3, 1, 1, itemsize), left, right]


@dataclasses.dataclass(frozen=True)
class EmbeddingGeometry:
    """An Embedding block: vocabulary V, width d, `rows` tokens in the batch."""

    vocabulary: int
    width: int
    rows: int

    @property
    def parameters(self):
        return self.vocabulary * self.width

    def forward_kernels(self, itemsize=4):
        return []  # a gather, and a scatter of the gradient: no products

    def statistics_kernels(self, itemsize=4):
        v, d = self.vocabulary, self.width
        return [elementwise(self.rows, 1, 1, 0, itemsize),  # token counts
                gram(self.rows, d, 1, itemsize), fisher_average(v + d * d, itemsize)]

    def factor_shapes(self):
        return [(self.vocabulary,), (self.width, self.width)]

    def decomposition_kernels(self, method, itemsize=4):
        return [decomposition(self.width, 1, method, itemsize)]

    def decomposition_elements(self, method):
        d = self.width
        return [d * d + (d if method != "inverse" else 0)]

    def precondition_kernels(self, method, itemsize=4):
        v, d = self.vocabulary, self.width
        if method == "inverse":  # ∇ / (a + π√λ), then (.) G⁻¹
            return [elementwise(v * d, 1, 1, 1, itemsize), product(v, d, d, 1, itemsize)]
        return [product(v, d, d, 1, itemsize), elementwise(v * d, 3, 1, 1, itemsize),
                product(v, d, d, 1, itemsize)]


@dataclasses.dataclass(frozen=True)
class DiagonalGeometry:
    """A normalization block: `size` parameters (γ and β), `input_elements` over all
    calls, N = `batch_size` examples."""

    size: int
    input_elements: int
    batch_size: int

    @property
    def parameters(self):
        return self.size

    def forward_kernels(self, itemsize=4):
        return []

    def statistics_kernels(self, itemsize=4):
        # x̂ recomputed (mean 1, variance 2, normalize 2 FLOPs an entry), N·dL/dy (1),
        # times x̂ (1), the γ and β sums (2); x and dL/dy read once. Then the mean of
        # squared per-example gradients and the running average.
        return [elementwise(self.input_elements, 9, 2, 0, itemsize),
                elementwise(self.batch_size * self.size, 2, 1, 0, itemsize),
                fisher_average(self.size, itemsize)]

    def factor_shapes(self):
        return [(self.size,)]

    def decomposition_kernels(self, method, itemsize=4):
        return []

    def decomposition_elements(self, method):
        return []

    def precondition_kernels(self, method, itemsize=4):
        return [elementwise(self.size, 2, 2, 1, itemsize)]  # ∇ / (F + ρλ)


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


def block_geometry(block, calls, batch_size):
    """The geometry of a tfkfac block from its recorded calls [(inputs, pre-activations)]."""
    # Imported here: the counting above needs no TensorFlow.
    from tfkfac import blocks as blocks_lib
    from tfkfac.blocks.normalization import NormalizationBlock

    if isinstance(block, blocks_lib.SeparableConvBlock):
        raise NotImplementedError("separable convolutions: count their two parts")
    if isinstance(block, blocks_lib.EmbeddingBlock):
        rows = sum(_size(inputs.shape) for inputs, _ in calls)
        return EmbeddingGeometry(block.vocabulary, block.width, rows)
    if isinstance(block, blocks_lib.KroneckerBlock):
        rows = sum(int(block.output_rows(out).shape[-2]) for _, out in calls)
        reduce = block.weight_sharing == "reduce"
        patch = isinstance(block, blocks_lib.ConvBlock)
        correlation = [block.correlation_multiply_adds(inputs.shape) if patch else None
                       for inputs, _ in calls]
        return KroneckerGeometry(
            groups=block.groups, product_rows=rows,
            statistics_rows=batch_size * len(calls) if reduce else rows,
            in_dim=block.in_dim, out_dim=block.out_dim, has_bias=block.has_bias,
            patch_input=sum(_size(inputs.shape) for inputs, _ in calls) if patch else 0,
            correlation_multiply_adds=(sum(correlation) if None not in correlation else 0))
    if isinstance(block, NormalizationBlock):
        return DiagonalGeometry(block.factor_shapes()[0][0],
                                sum(_size(inputs.shape) for inputs, _ in calls), batch_size)
    raise NotImplementedError(f"no floor model for {type(block).__name__}")


def record_geometries(model, batch_size, weight_sharing="expand"):
    """{block path: geometry} and the attention kernels of `model` at `batch_size`, from
    one recorded forward pass on zeros; also the layers K-FAC leaves unmanaged."""
    import keras
    import numpy as np

    from tfkfac import KFACConfig, blocks as blocks_lib, keras_integration
    from tfkfac.capture import Recorder

    blocks, skipped = blocks_lib.discover(keras_integration.leaf_layers(model),
                                          KFACConfig(weight_sharing=weight_sharing))
    recorder = Recorder(blocks)
    inputs = np.zeros((batch_size,) + tuple(model.input_shape[1:]), model.inputs[0].dtype)
    with recorder.recording():
        model(inputs, training=True)
    calls = recorder.take()
    geometries = {block.path: block_geometry(block, block_calls, batch_size)
                  for block, block_calls in zip(blocks, calls)}
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
    return geometries, attention, skipped


def at_batch(geometries, attention, scale):
    """`record_geometries`' results for a batch `scale` times larger: every row count,
    recorded input, example count and attention product grows with the batch. Lets a
    large model be recorded at a small batch (its activations are held in memory)."""
    fields = {KroneckerGeometry: ("product_rows", "statistics_rows", "patch_input",
                                  "correlation_multiply_adds"),
              EmbeddingGeometry: ("rows",), DiagonalGeometry: ("input_elements", "batch_size")}
    scaled = {path: dataclasses.replace(g, **{f: getattr(g, f) * scale for f in fields[type(g)]})
              for path, g in geometries.items()}
    return scaled, [Kernel(k.kind, k.flops * scale, k.bytes * scale) for k in attention]


def model_floor(geometries, attention, trainable_parameters, method, factor_update_freq,
                decomposition_update_freq, ranks=2, kl_clip=True, itemsize=4):
    """Per phase the kernels of one step and how often they run, and the bytes a job of
    `ranks` processes would move.

    Returns {"phases": {phase: {"kernels": [...], "per_step": fraction of steps}},
    "communication": {...}}. SGD's step is "forward_backward" + "update".
    """
    from tfkfac.distributed import assignment, packing

    blocks = list(geometries.values())
    managed = sum(g.parameters for g in blocks)
    forward = [k for g in blocks for k in g.forward_kernels(itemsize)] + list(attention)
    statistics = [k for g in blocks for k in g.statistics_kernels(itemsize)]
    decompositions = [k for g in blocks for k in g.decomposition_kernels(method, itemsize)]
    precondition = [k for g in blocks for k in g.precondition_kernels(method, itemsize)]
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
    items = [(n, count) for g in blocks for s in g.factor_shapes() if len(s) >= 2
             for n, count in [(s[-1], _size(s[:-2]))]]
    elements = [e for g in blocks for e in g.decomposition_elements(method)]
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
