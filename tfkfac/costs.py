"""What the library's work costs, counted from shapes: FLOPs and bytes per kernel.

Methods (tfkfac/methods.py) declare what their decompositions and preconditioning cost,
and blocks (tfkfac/blocks/, `Block.cost`) their layer's products and factor statistics,
in the kernels below, next to their math; the planner (trainers/planning/) prices them
on a device. Counts are in the state dtype (float32: `itemsize` 4); nothing here runs
TensorFlow.
"""

import dataclasses
import math

# Golub & Van Loan (4th ed.), §8.3: tridiagonalization and the symmetric QR algorithm
# with the eigenvectors accumulated, about 9n³ FLOPs.
EIGH_FLOPS_PER_N3 = 9.0
# LAPACK potrf (n³/3) then potri (2n³/3): the inverse from the Cholesky factor.
CHOLESKY_INVERSE_FLOPS_PER_N3 = 1.0
# Kernels priced at the roofline; any other kind is a decomposition routine, priced at
# its own measured rate.
ROOFLINE_KINDS = ("matmul", "memory")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One piece of work: "matmul", "memory", or a decomposition routine such as "eigh"
    or "cholesky_inverse"."""

    kind: str
    flops: float
    bytes: float

    def seconds(self, rates):
        """Floor time at `rates` {"matmul": FLOP/s, "bandwidth": bytes/s, and per
        decomposition routine its FLOP/s}: products and elementwise work at the roofline
        max(FLOPs / matmul rate, bytes / bandwidth), a decomposition at its routine's."""
        if self.kind in ROOFLINE_KINDS:
            return max(self.flops / rates["matmul"], self.bytes / rates["bandwidth"])
        if self.kind not in rates:
            raise ValueError(f"no measured rate for the decomposition routine {self.kind!r} "
                             f"(rates known: {', '.join(sorted(rates))})")
        return self.flops / rates[self.kind]


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


def decomposition(routine, flops_per_n3, shape, itemsize=4):
    """The decomposition of a full factor of `shape`, (n, n) or a batch (q, n, n), by
    LAPACK `routine` at `flops_per_n3`·q·n³ FLOPs: each factor read, its result written."""
    n, count = shape[-1], math.prod(shape[:-2])
    return Kernel(routine, flops_per_n3 * count * n ** 3, itemsize * count * 2 * n * n)


def fisher_average(elements, itemsize=4):
    """F ← ξF + (1 − ξ)F_batch over `elements` factor entries."""
    return elementwise(elements, 3, 2, 1, itemsize)


# ------------------------------------------------------------ a block at one batch
@dataclasses.dataclass(frozen=True)
class BlockCost:
    """The work of one block at one batch, as the block declares it (`Block.cost`).

    `block_factor_shapes` and `block_pieces` are the block's own (`factor_shapes()`,
    `pieces()`), so that a method's costs are asked of this as of the block
    (`tfkfac.methods.precondition_kernels`). A subclass counts the layer's products and
    factor statistics, and names in `BATCH_FIELDS` what grows with the batch.
    """

    block_factor_shapes: tuple
    block_pieces: tuple

    BATCH_FIELDS = ()
    # Whether the factor statistics read only `factor_batch_fraction` of the examples
    # (`Block.take_examples`), or the whole batch.
    SAMPLES_EXAMPLES = True

    def factor_shapes(self):
        return list(self.block_factor_shapes)

    def pieces(self):
        return list(self.block_pieces)

    def symmetric_factors(self):
        return [i for i, shape in enumerate(self.block_factor_shapes) if len(shape) >= 2]

    @property
    def parameters(self):
        """Parameters the block preconditions."""
        raise NotImplementedError

    def forward_kernels(self, itemsize=4):
        """The layer's weight products in the forward and backward passes."""
        return []

    def batch_statistics_kernels(self, itemsize=4):
        """The factor statistics of this batch and their running average."""
        raise NotImplementedError

    def statistics_kernels(self, fraction=1.0, itemsize=4):
        """The factor statistics' kernels when they are taken from `fraction` of the
        batch (`factor_batch_fraction`), where the block takes only that share."""
        read = self.at_batch(fraction) if self.SAMPLES_EXAMPLES and fraction != 1 else self
        return read.batch_statistics_kernels(itemsize)

    def at_batch(self, scale):
        """This cost at a batch `scale` times as large."""
        return dataclasses.replace(self, **{name: getattr(self, name) * scale
                                            for name in self.BATCH_FIELDS})


@dataclasses.dataclass(frozen=True)
class KroneckerCost(BlockCost):
    """A Kronecker block (Dense, Conv, EinsumDense).

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

    BATCH_FIELDS = ("product_rows", "statistics_rows", "patch_input",
                    "correlation_multiply_adds")

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

    def batch_statistics_kernels(self, itemsize=4):
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


@dataclasses.dataclass(frozen=True)
class EmbeddingCost(BlockCost):
    """An Embedding block: vocabulary V, width d, `rows` tokens in the batch. Its forward
    and backward passes are a gather and a scatter: no products."""

    vocabulary: int
    width: int
    rows: int

    BATCH_FIELDS = ("rows",)

    @property
    def parameters(self):
        return self.vocabulary * self.width

    def batch_statistics_kernels(self, itemsize=4):
        v, d = self.vocabulary, self.width
        return [elementwise(self.rows, 1, 1, 0, itemsize),  # token counts
                gram(self.rows, d, 1, itemsize), fisher_average(v + d * d, itemsize)]


@dataclasses.dataclass(frozen=True)
class DiagonalCost(BlockCost):
    """A normalization block: `size` parameters (γ and β), `input_elements` over all
    calls, N = `batch_size` examples. Its statistics read the whole batch
    (`NormalizationBlock.take_examples`)."""

    size: int
    input_elements: int
    batch_size: int

    BATCH_FIELDS = ("input_elements", "batch_size")
    SAMPLES_EXAMPLES = False

    @property
    def parameters(self):
        return self.size

    def batch_statistics_kernels(self, itemsize=4):
        # x̂ recomputed (mean 1, variance 2, normalize 2 FLOPs an entry), N·dL/dy (1),
        # times x̂ (1), the γ and β sums (2); x and dL/dy read once. Then the mean of
        # squared per-example gradients and the running average.
        return [elementwise(self.input_elements, 9, 2, 0, itemsize),
                elementwise(self.batch_size * self.size, 2, 1, 0, itemsize),
                fisher_average(self.size, itemsize)]


@dataclasses.dataclass(frozen=True)
class PartsCost(BlockCost):
    """A block of several weight products, each counted as its own block (`parts`):
    a SeparableConv's depthwise and pointwise convolutions."""

    parts: tuple

    @property
    def parameters(self):
        return sum(part.parameters for part in self.parts)

    def forward_kernels(self, itemsize=4):
        return [k for part in self.parts for k in part.forward_kernels(itemsize)]

    def statistics_kernels(self, fraction=1.0, itemsize=4):
        return [k for part in self.parts for k in part.statistics_kernels(fraction, itemsize)]

    def at_batch(self, scale):
        return dataclasses.replace(self, parts=tuple(part.at_batch(scale)
                                                     for part in self.parts))
