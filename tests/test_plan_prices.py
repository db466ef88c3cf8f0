"""The planner prices what the library says its work costs (tfkfac/costs.py).

A `Method` written here, outside tfkfac, is priced with no edit to the planner:
`CholeskySolve` keeps each full factor's damped Cholesky factor L (LAPACK potrf, n³/3
FLOPs, priced at the Cholesky inverse's rate) and preconditions a pair by two
triangular solves a side (n² FLOPs a column each). The planner's decompositions,
preconditioning and bytes held are what it declares, its bytes are what a real
tfkfac.KFAC holds with it, and tfkfac trains with it; a method that does not say what
its work costs is refused, naming what to define. `factor_batch_fraction` shrinks the
statistics of the blocks that take a share of the batch, not the diagonal blocks' (they
read the whole batch); the sampled Fisher adds its backward pass on factor steps; the
settings the planner does not price are named in its output. A SeparableConv2D, one
block of two weight products, is priced as its two parts.
"""

import json
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from plan_testing import UNIT_DEVICE, UNIT_FABRIC, run_plan, temporary_path  # noqa: E402
from tfkfac import costs, methods  # noqa: E402
from trainers.planning import memory, step_model, workloads  # noqa: E402

# Dense(8) on 6 inputs (A 7x7, G 8x8), BatchNorm (γ and β of 8), Dense(3) (A 9x9, G 3x3).
PAIRS = ((7, 8), (9, 3))
NORMALIZED = 16


def mlp():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.BatchNormalization(), keras.layers.Dense(3)],
                            name="mlp_with_batchnorm")


@keras.saving.register_keras_serializable(package="test_plan_prices")
class CholeskySolve(tfkfac.Method):
    """(A + √λ I)⁻¹ ∇ (G + √λ I)⁻¹ by each full factor's Cholesky factor, for pairs of
    full factors; ∇ / (F + ρλ) for a lone diagonal."""

    def decomposition_parts(self, shape):
        return [methods.Part(tuple(shape), True)]

    def decompose(self, piece, factors, position, damping):
        factor = factors[position]
        shift = tf.cast(tf.sqrt(damping), factor.dtype)
        return [tf.linalg.cholesky(factor + shift * tf.eye(factor.shape[-1], dtype=factor.dtype))]

    def precondition(self, piece, matrix, factors, decompositions, damping, state, step,
                     product_dtype=None):
        if not piece.pair:
            (fisher,) = factors
            return matrix / (fisher + piece.damping_multiplier * damping), []
        (cholesky_a,), (cholesky_g,) = decompositions
        left = tf.linalg.cholesky_solve(cholesky_a, matrix)
        right = tf.linalg.cholesky_solve(cholesky_g, tf.linalg.matrix_transpose(left))
        return tf.linalg.matrix_transpose(right), []

    def decomposition_kernels(self, shape, itemsize=4):
        return [costs.decomposition("cholesky_inverse", 1 / 3, shape, itemsize)]

    def precondition_kernels(self, piece, matrix_shape, itemsize=4):
        if not piece.pair:
            return [costs.elementwise(math.prod(matrix_shape), 2, 2, 1, itemsize)]
        *batch, a, o = matrix_shape
        q = math.prod(batch)
        return [costs.Kernel("matmul", 2.0 * q * n * n * columns,
                             itemsize * q * (n * n + 2 * n * columns))
                for n, columns in ((a, o), (o, a))]


class Unpriced(tfkfac.Method):
    """Preconditions by nothing, and says nothing of what that costs."""

    def precondition(self, piece, matrix, factors, decompositions, damping, state, step,
                     product_dtype=None):
        return matrix, []


class UnpricedDecomposition(Unpriced):
    """Keeps a decomposition without saying what computing it costs."""

    def decomposition_parts(self, shape):
        return [methods.Part(tuple(shape), True)]

    def precondition_kernels(self, piece, matrix_shape, itemsize=4):
        return []


def flops(kernels_per_block):
    return sum(k.flops for kernels in kernels_per_block for k in kernels)


class MethodWrittenOutsideTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.model = mlp()
        cls.work = workloads.workload(cls.model, 4, cls.model.name)
        cls.method = CholeskySolve()
        cls.phases = step_model.kfac_step(
            cls.work, step_model.Configuration(placement="replicated", method=cls.method),
            1, UNIT_DEVICE, UNIT_FABRIC)

    def test_its_decompositions_are_what_it_declares(self):
        factors = [n for pair in PAIRS for n in pair]
        expected = sum(n ** 3 for n in factors) / 3
        self.assertAlmostEqual(flops(self.work.decompositions(self.method)), expected)
        # One rank decomposes every factor, at the unit device's Cholesky rate.
        self.assertAlmostEqual(
            self.phases["decomposition"].seconds * UNIT_DEVICE.cholesky_inverse, expected)

    def test_its_preconditioning_is_what_it_declares(self):
        expected = sum(2 * (a * a * g + g * g * a) for a, g in PAIRS) + 2 * NORMALIZED
        kernels = self.work.preconditioning(self.method)
        self.assertEqual(flops(kernels), expected)
        declared_s = UNIT_DEVICE.seconds([k for block in kernels for k in block],
                                         "preconditioning")
        self.assertAlmostEqual(self.phases["preconditioning"].seconds / declared_s, 1.0)

    def test_its_bytes_are_what_tfkfac_holds(self):
        model = mlp()
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.01),
                                method=self.method).attach(model)
        optimizer.build(model.trainable_variables)
        needs = memory.worker_bytes(workloads.workload(model, 1, model.name), "replicated",
                                    self.method, ranks=1)
        self.assertEqual(needs["decompositions"],
                         4 * sum(n * n for pair in PAIRS for n in pair))
        self.assertEqual(needs["factors"] + needs["decompositions"] + needs["method_state"]
                         + needs["host"], optimizer.summary()["state_bytes"])

    def test_tfkfac_trains_with_it(self):
        model = mlp()
        optimizer = tfkfac.KFAC(method=CholeskySolve(), factor_update_freq=1,
                                decomposition_update_freq=1, xla=False).attach(model)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        rng = np.random.default_rng(0)
        history = model.fit(rng.normal(size=(16, 6)).astype("float32"),
                            rng.integers(0, 3, size=16), batch_size=8, verbose=0)
        self.assertTrue(np.isfinite(history.history["loss"][-1]))
        self.assertEqual(optimizer.counters()["steps"], 2)

    def test_a_method_without_costs_is_refused_naming_what_to_define(self):
        with self.assertRaisesRegex(NotImplementedError,
                                    "Unpriced does not say what its preconditioning costs: "
                                    "define precondition_kernels"):
            self.work.preconditioning(Unpriced())
        self.assertEqual(flops(self.work.decompositions(Unpriced())), 0)
        with self.assertRaisesRegex(NotImplementedError,
                                    "UnpricedDecomposition keeps a decomposition .* define "
                                    "decomposition_kernels"):
            self.work.decompositions(UnpricedDecomposition())


class SettingsTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.work = workloads.workload(mlp(), 8, "mlp_with_batchnorm")

    def step(self, **settings):
        config = step_model.Configuration(placement="replicated", **settings)
        return step_model.kfac_step(self.work, config, 1, UNIT_DEVICE, UNIT_FABRIC)

    def test_factor_batch_fraction_shrinks_the_statistics_of_blocks_that_sample(self):
        dense, normalization, last = self.work.geometries["expand"].values()
        self.assertEqual(normalization.statistics_kernels(0.25),
                         normalization.statistics_kernels())
        for block in (dense, last):
            self.assertEqual(block.statistics_kernels(0.25),
                             block.at_batch(0.25).statistics_kernels())
            self.assertLess(flops([block.statistics_kernels(0.25)]),
                            flops([block.statistics_kernels()]))
        self.assertLess(self.step(factor_batch_fraction=0.25)["factor_statistics"].seconds,
                        self.step()["factor_statistics"].seconds)

    def test_the_sampled_fisher_adds_its_backward_pass(self):
        empirical, sampled = self.step(), self.step(fisher="sampled")
        added_s = sampled["factor_statistics"].seconds - empirical["factor_statistics"].seconds
        self.assertAlmostEqual(added_s / empirical["forward_backward"].seconds,
                               step_model.SAMPLED_BACKWARD_SHARE)
        self.assertGreater(step_model.step_seconds(sampled), step_model.step_seconds(empirical))

    def test_every_setting_that_changes_the_work_is_priced_or_named(self):
        self.assertEqual(step_model.unpriced_settings(), (
            "stale_threshold", "max_factor_interval", "grafting", "skip_layers", "xla",
            "state_dtype", "factor_examples", "product_dtype", "weight_rescaling",
            "self_tuning", "transforms", "phase_clocks"))
        output_dir = temporary_path("plan")
        code, out, err = run_plan("--model=mlp", "--workers=1", "--placements=replicated",
                                  "--factor_wires=float32", "--decomposition_wires=float32",
                                  "--factor_intervals=10", "--decomposition_intervals=100",
                                  "--weight_sharing=expand", "--methods=inverse",
                                  "--factor_batch_fractions=1,0.25",
                                  "--fishers=empirical,sampled", f"--output_dir={output_dir}")
        self.assertIsNone(code, err)
        self.assertIn("Not priced (every step at tfkfac's default for them): stale_threshold, "
                      "max_factor_interval, grafting,", out)
        with open(os.path.join(output_dir, "plan.json")) as f:
            document = json.load(f)
        self.assertEqual(document["setting"]["unpriced_settings"],
                         list(step_model.unpriced_settings()))
        times = document["results"][0]["kfac_ms"]
        base = "replicated float32/float32 f=10 d=100 expand inverse"
        self.assertEqual(sorted(times), sorted(
            [base, f"{base} fraction=0.25", f"{base} fisher=sampled",
             f"{base} fraction=0.25 fisher=sampled"]))
        self.assertLess(times[f"{base} fraction=0.25"], times[base])
        self.assertGreater(times[f"{base} fisher=sampled"], times[base])
        code, _, err = run_plan("--model=mlp", "--factor_batch_fractions=0")
        self.assertEqual(code, 2)
        self.assertIn("--factor_batch_fractions must be a list of numbers in (0, 1]; got 0",
                      err.splitlines()[-1])


class SeparableConvTest(absltest.TestCase):

    def test_priced_as_its_two_parts(self):
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.SeparableConv2D(4, 3),
                                  keras.layers.Flatten(), keras.layers.Dense(2)])
        work = workloads.workload(model, 2, "separable")
        separable, _ = work.geometries["expand"].values()
        depthwise, pointwise = separable.parts
        self.assertEqual(separable.parameters, 3 * 3 * 3 + (3 + 1) * 4)
        self.assertEqual(separable.forward_kernels(),
                         depthwise.forward_kernels() + pointwise.forward_kernels())
        # A_dw and G_dw per input channel (9x9, 1x1), A_pw (4x4), G_pw (4x4).
        self.assertEqual(separable.factor_shapes(),
                         [(3, 9, 9), (3, 1, 1), (4, 4), (4, 4)])
        self.assertLen(work.decompositions("eigen")[0], 4)


if __name__ == "__main__":
    absltest.main()
