"""trainers/planning/floor_model.py: the FLOPs and bytes of a step, counted from layer shapes.

The floor that bench/step_floor.py sets against measured step times is only as good as
its counts. Here a Dense and a Conv2D layer, recorded in a real forward pass, get their
factor statistics, decompositions, preconditioning and forward/backward counted by the
model and by hand (docs/design.md §2: A = ĀᵀĀ over the im2col rows with a ones column
for the bias, or for a stride-1 convolution its input correlations' multiply-adds, G = ḡᵀḡ; eigen: Q_Aᵀ ∇ Q_G, a division, Q_A (.) Q_Gᵀ; inverse: A⁻¹ ∇ G⁻¹).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from tfkfac import methods  # noqa: E402
from trainers.planning import floor_model  # noqa: E402

BYTES = 4  # float32


def geometry(layer, input_shape, batch_size):
    """The single block geometry of a one-layer model on `input_shape` (no batch)."""
    inputs = keras.Input(input_shape)
    model = keras.Model(inputs, layer(inputs))
    geometries, attention, skipped = floor_model.record_geometries(model, batch_size)
    assert not skipped and not attention
    (block,) = geometries.values()
    return block


def flops(kernels):
    return floor_model.total(kernels)[0]


def decompositions(block, method):
    """Every kernel of `method`'s decompositions of `block`'s full factors."""
    return [k for ks in floor_model.decomposition_kernels(block, method) for k in ks]


class DenseCountTest(absltest.TestCase):
    """Dense(30) with bias on 20 inputs, batch 8: a = 21, g = 30, 8 rows."""

    def setUp(self):
        super().setUp()
        self.block = geometry(keras.layers.Dense(30), (20,), batch_size=8)

    def test_geometry(self):
        self.assertEqual((self.block.product_rows, self.block.statistics_rows), (8, 8))
        self.assertEqual((self.block.a_dim, self.block.out_dim, self.block.groups),
                         (21, 30, 1))
        self.assertEqual(self.block.patch_input, 0)  # rows are the input itself

    def test_factor_statistics(self):
        grams = 2 * 8 * 21 * 21 + 2 * 8 * 30 * 30
        average = 3 * (21 * 21 + 30 * 30)  # ξF + (1 − ξ)F_batch per entry
        kernels = self.block.statistics_kernels()
        self.assertEqual(flops(kernels), grams + average)
        gram_bytes = BYTES * (8 * 21 + 21 * 21) + BYTES * (8 * 30 + 30 * 30)
        average_bytes = BYTES * 3 * (21 * 21 + 30 * 30)
        self.assertEqual(floor_model.total(kernels)[1], gram_bytes + average_bytes)

    def test_preconditioning(self):
        left, right = 2 * 21 * 21 * 30, 2 * 21 * 30 * 30  # (21x21)(21x30), (21x30)(30x30)
        self.assertEqual(flops(floor_model.precondition_kernels(self.block, "inverse")),
                         left + right)
        self.assertEqual(flops(floor_model.precondition_kernels(self.block, "eigen")),
                         2 * (left + right) + 3 * 21 * 30)

    def test_decompositions(self):
        self.assertEqual(flops(decompositions(self.block, "eigen")),
                         9 * (21 ** 3 + 30 ** 3))
        self.assertEqual(flops(decompositions(self.block, "inverse")),
                         21 ** 3 + 30 ** 3)

    def test_forward_backward(self):
        self.assertEqual(flops(self.block.forward_kernels()), 3 * 2 * 8 * 20 * 30)

    def test_schedule_and_communication(self):
        parameters = 21 * 30
        floor = floor_model.model_floor(
            {"dense": self.block}, [], parameters, "inverse", factor_update_freq=10,
            decomposition_update_freq=100, ranks=2)
        rates = {"matmul": 1e9, "bandwidth": 1e9, "eigh": 1e9, "cholesky_inverse": 1e9}
        summary = floor_model.phase_summary(floor, rates)
        self.assertEqual(summary["factors"]["flops_per_step"],
                         flops(self.block.statistics_kernels()) / 10)
        self.assertEqual(summary["decomposition"]["flops_per_step"], (21 ** 3 + 30 ** 3) / 100)
        # KL clip: Σ<P, ∇> (2 FLOPs) and the scaling (1) per managed parameter.
        self.assertEqual(summary["precondition"]["flops_per_step"],
                         flops(floor_model.precondition_kernels(self.block, "inverse"))
                         + 3 * parameters)
        self.assertEqual(summary["update"]["flops_per_step"], 4 * parameters)
        communication = floor["communication"]
        packed = 21 * 22 // 2 + 30 * 31 // 2  # upper triangles on the wire
        self.assertEqual(communication["factor_payload_bytes_per_factor_step"], BYTES * packed)
        # Ring allreduce over 2 ranks: each sends 2 (p − 1) / p = 1 payload.
        self.assertEqual(communication["factor_bytes_sent_per_rank_per_factor_step"],
                         BYTES * packed)
        # A⁻¹ (21²) is owned by one rank and G⁻¹ (30²) by the other (greedy LPT on n³).
        self.assertEqual(
            communication["decomposition_bytes_received_per_rank_per_decomposition_step"],
            BYTES * 30 * 30)


class Conv2DCountTest(parameterized.TestCase):
    """Conv2D(4, 3x3) with bias on 6x6xc inputs, batch 2: a = 3·3·c + 1, g = 4."""

    @parameterized.named_parameters(
        # Stride 1 and 8 input channels: A from input correlations
        # (tfkfac/blocks/conv_correlation.py). Per axis the taps' windows [k, k + 4) cut
        # 0..6 into [0,1) (tap 0: offsets 0..2), [1,2) (taps 0-1: 4 offsets), [2,4) (all
        # taps: 5), [4,5) (4), [5,6) (3): 3 + 4 + 2·5 + 4 + 3 = 24 (position, offset)
        # pairs per axis, 24² per example, each c² = 64 multiply-adds (im2col: 16 rows ·
        # 72² = 82944 per example).
        ("valid_stride_1", dict(padding="valid"), 8, 4 * 4, 2 * 24 * 24 * 64),
        ("same_strided", dict(padding="same", strides=2), 3, 3 * 3, 0),  # ceil(6 / 2) = 3
        ("valid_3_channels", dict(padding="valid"), 3, 4 * 4, 0))  # im2col: few channels
    def test_factor_statistics_and_preconditioning(self, options, c, positions, correlation):
        block = geometry(keras.layers.Conv2D(4, 3, **options), (6, 6, c), batch_size=2)
        rows, d, a = 2 * positions, 9 * c, 9 * c + 1
        self.assertEqual((block.product_rows, block.in_dim, block.a_dim, block.out_dim),
                         (rows, d, a, 4))
        self.assertEqual(block.patch_input, 2 * 6 * 6 * c)
        self.assertEqual(block.correlation_multiply_adds, correlation)
        kernels = block.statistics_kernels()
        if correlation:  # the input read as both operands, A written; no patch matrix
            a_flops, a_bytes = 2 * correlation, BYTES * (2 * 2 * 6 * 6 * c + a * a)
        else:  # im2col moves bytes only
            a_flops = 2 * rows * a * a
            a_bytes = BYTES * (2 * 6 * 6 * c + rows * d) + BYTES * (rows * a + a * a)
        average = 3 * (a * a + 4 * 4)
        self.assertEqual(flops(kernels), a_flops + 2 * rows * 4 * 4 + average)
        self.assertEqual(floor_model.total(kernels)[1],
                         a_bytes + BYTES * (rows * 4 + 4 * 4) + BYTES * 3 * (a * a + 4 * 4))
        left, right = 2 * a * a * 4, 2 * a * 4 * 4
        self.assertEqual(flops(floor_model.precondition_kernels(block, "inverse")), left + right)
        self.assertEqual(flops(floor_model.precondition_kernels(block, "eigen")),
                         2 * (left + right) + 3 * a * 4)
        self.assertEqual(flops(block.forward_kernels()), 3 * 2 * rows * d * 4)


class KernelTimeTest(absltest.TestCase):

    def test_roofline_and_lapack_rates(self):
        rates = {"matmul": 100.0, "bandwidth": 10.0, "eigh": 50.0, "cholesky_inverse": 5.0}
        self.assertEqual(floor_model.Kernel("matmul", 1000.0, 50.0).seconds(rates), 10.0)
        self.assertEqual(floor_model.Kernel("memory", 100.0, 500.0).seconds(rates), 50.0)
        self.assertEqual(methods.Eigen().decomposition_kernels((2, 10, 10))[0].seconds(rates),
                         9 * 2 * 1000 / 50.0)
        self.assertEqual(methods.Inverse().decomposition_kernels((10, 10))[0].seconds(rates),
                         1000 / 5.0)


if __name__ == "__main__":
    absltest.main()
