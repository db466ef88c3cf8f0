"""`product_dtype="bfloat16"`: K-FAC's Gram and preconditioning products in bfloat16.

The reference is the same K-FAC with float32 products (docs/design.md §9):
- `tfkfac.linalg.matmul` rounds its operands and its product to bfloat16: it equals a
  numpy float64 product of the rounded operands, rounded;
- the decompositions' matrices are stored rounded to bfloat16 once, when computed;
- on a model with every block kind (tests/modern_net.py), the factors and the
  preconditioned gradients stay within a few bfloat16 roundings of float32's (relative
  Frobenius error); the diagonal blocks, which have no products, are unchanged;
- unset, nothing changes; the trainer's `--product_dtype` reaches the optimizer; bad
  values name the argument and the allowed ones.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from modern_net import modern_net  # noqa: E402
from test_factor_batch_fraction import split_by_kind  # noqa: E402
from test_kfac_fresh_examples import all_factors, custom_step  # noqa: E402
from tfkfac import linalg, methods  # noqa: E402
from trainer_testing import SMALL_FLAGS, config_from_argv  # noqa: E402
from trainers import runner  # noqa: E402

RNG = np.random.default_rng(2)
# bfloat16 keeps 8 significant bits: rounding to nearest is off by at most 2^-9
# relative. A product rounds both operands and its result (three roundings); a
# preconditioned gradient goes through two products (A⁻¹ ∇, then · G⁻¹). How a product
# accumulates is the CPU's: oneDNN on CPUs with AVX-512 BF16 accumulates in float32 (one
# rounding of the result; earlier machines met 16u), Eigen's kernel on AVX2-only CPUs rounds
# partial sums to bfloat16 too (an AMD EPYC: up to 0.036 = 18u): 32u holds for both.
UNIT_ROUNDOFF = 2.0 ** -9
FACTOR_TOLERANCE = 8 * UNIT_ROUNDOFF
PRECONDITIONED_TOLERANCE = 32 * UNIT_ROUNDOFF


def rounded(array):
    return tf.cast(tf.cast(array, tf.bfloat16), tf.float64).numpy()


def relative_error(got, expected):
    return np.linalg.norm(got - expected) / np.linalg.norm(expected)


class MatmulTest(absltest.TestCase):

    def test_rounds_operands_and_product(self):
        a = RNG.normal(size=(37, 19)).astype(np.float32)
        b = RNG.normal(size=(37, 11)).astype(np.float32)
        got = linalg.matmul(tf.constant(a), tf.constant(b), "bfloat16", transpose_a=True)
        self.assertEqual(got.dtype, tf.float32)
        exact_of_rounded = rounded(a).T @ rounded(b)
        # The result is a bfloat16 number, within the error of a sum of 37 products
        # accumulated in bfloat16 or wider (float32 in oneDNN on AVX-512 BF16 CPUs, partial
        # sums rounded in Eigen's kernel elsewhere) and rounded: 37·u·|Ã|ᵀ|B̃| + u·|P|.
        np.testing.assert_array_equal(got.numpy(), rounded(got.numpy()))
        bound = (a.shape[0] * UNIT_ROUNDOFF * (np.abs(rounded(a)).T @ np.abs(rounded(b)))
                 + UNIT_ROUNDOFF * np.abs(exact_of_rounded))
        self.assertTrue(np.all(np.abs(got.numpy() - exact_of_rounded) <= bound))
        self.assertGreater(relative_error(got.numpy(), a.T @ b), 0)
        np.testing.assert_allclose(linalg.matmul(a, b, transpose_a=True), a.T @ b, rtol=1e-5)


class ModelTest(absltest.TestCase):

    def step(self, x, y, **settings):
        model = modern_net(seed=8)
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                                damping=1e-2, kl_clip=1e-3, xla=False,
                                method="inverse", **settings).attach(model)
        custom_step(optimizer, model, x, y)
        gradients = [tf.random.stateless_normal(v.shape, seed=[i, 0])
                     for i, v in enumerate(model.trainable_variables)]
        preconditioned = optimizer.precondition(gradients, model.trainable_variables)
        return optimizer, all_factors(optimizer, model), [p.numpy() for p in preconditioned]

    def test_close_to_float32(self):
        x = RNG.normal(size=(8, 28, 28, 1)).astype(np.float32)
        y = RNG.integers(0, 10, 8)
        _, exact, exact_p = self.step(x, y)
        _, rounded_factors, rounded_p = self.step(x, y, product_dtype="bfloat16")
        kronecker, diagonal = split_by_kind(exact)
        errors = {key: relative_error(rounded_factors[key], value)
                  for key, value in kronecker.items()}
        self.assertLess(max(errors.values()), FACTOR_TOLERANCE, errors)
        errors_f = errors.values()
        # The products did round (an Embedding's A, token counts, has no product).
        self.assertGreater(errors["logits/A"], 0)
        self.assertGreater(errors["attention/query/G"], 0)
        for key, value in diagonal.items():
            np.testing.assert_allclose(rounded_factors[key], value, rtol=1e-6, err_msg=key)
        errors = [relative_error(r, e) for r, e in zip(rounded_p, exact_p)]
        self.assertLess(max(errors), PRECONDITIONED_TOLERANCE, errors)
        print(f"bfloat16 products, largest relative error: factors {max(errors_f):.1e}, "
              f"preconditioned gradients {max(errors):.1e}")

    def test_decompositions_rounded_once(self):
        """The decompositions' matrices are stored in bfloat16: the float32 decomposition
        of the stored factors, rounded once; eigenvalues stay float32."""
        x = RNG.normal(size=(8, 28, 28, 1)).astype(np.float32)
        y = RNG.integers(0, 10, 8)
        for method in ("inverse", "eigen"):
            model = modern_net(seed=8)
            optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                                    damping=1e-2, kl_clip=1e-3, xla=False,
                                    method=method, product_dtype="bfloat16").attach(model)
            custom_step(optimizer, model, x, y)
            # Private: the stored decompositions and their blocks have no public API.
            curvature, damping = optimizer.curvature, optimizer.current_damping()
            for block, state in zip(curvature.blocks, curvature.states):
                for j, stored in zip(block.symmetric_factors(), state.decompositions):
                    expected = methods.decompose_factor(curvature.method, block, j,
                                                        state.factor_values(), damping)
                    for k, (variable, value) in enumerate(zip(stored, expected)):
                        name = f"{method} {block.path} factor {j} part {k}"
                        self.assertEqual(variable.dtype,  # the matrix, then eigenvalues
                                         "bfloat16" if k == 0 else "float32", name)
                        if method == "inverse":  # (eigenvectors have a free sign)
                            got = tf.cast(variable, tf.float64).numpy()
                            np.testing.assert_allclose(
                                got, rounded(value), rtol=2 * UNIT_ROUNDOFF,
                                atol=1e-6 * np.abs(got).max(), err_msg=name)

    def test_unset_is_float32(self):
        x = RNG.normal(size=(4, 28, 28, 1)).astype(np.float32)
        y = RNG.integers(0, 10, 4)
        _, default, default_p = self.step(x, y)
        _, unset, unset_p = self.step(x, y, product_dtype=None)
        for key in default:
            np.testing.assert_array_equal(unset[key], default[key], err_msg=key)
        for got, expected in zip(unset_p, default_p):
            np.testing.assert_array_equal(got, expected)


class SettingsTest(absltest.TestCase):

    def test_bad_values_name_the_argument(self):
        for value in ("float16", "bf16", "float32", 16):
            with self.subTest(value=value), self.assertRaisesRegex(
                    ValueError, r"`product_dtype` must be one of None, bfloat16; received "):
                tfkfac.KFAC(product_dtype=value)

    def test_config_round_trip(self):
        optimizer = tfkfac.KFAC(product_dtype="bfloat16")
        self.assertEqual(tfkfac.KFAC.from_config(optimizer.get_config()).product_dtype,
                         "bfloat16")

    def test_trainer_flag_reaches_the_optimizer(self):
        config, given = config_from_argv("--model=mlp", "--product_dtype=bfloat16",
                                         *SMALL_FLAGS)
        config.validate(given)
        optimizer = runner.Trainer(config).optimizer
        self.assertEqual(optimizer.product_dtype, "bfloat16")
        # Private: which dtype each block computes in has no public API.
        self.assertTrue(all(b.product_dtype == "bfloat16"
                            for b in optimizer.curvature.blocks))
        sgd, given = config_from_argv("--optimizer=sgd", "--product_dtype=bfloat16")
        with self.assertRaisesRegex(ValueError, "only applies to optimizer=kfac"):
            sgd.validate(given)


if __name__ == "__main__":
    absltest.main()
