"""tfkfac.linalg decompositions: LAPACK (the CPU default) and TensorFlow backends.

Both must give what float64 numpy gives: Q diag(v) Qᵀ == the symmetric part of the
factor with orthonormal Q and v >= 0, and (M + shift I)⁻¹ == np.linalg.inv. A factor
that cannot be decomposed (non-finite, or a damped matrix that is not positive
definite) must come back non-finite, never as an exception: the optimizer then keeps
its previous decomposition.

Tolerances: float32 results against float64 numpy on factors of dimension 3 to 289
(condition numbers below 1e4), relative to the largest entry: 1e-4 for eigh
reconstruction and orthonormality, 1e-3 for inverses. OpenBLAS runs on one thread while any
decomposition runs, and the process gets its count back when the last one ends.
"""

import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from tfkfac import linalg  # noqa: E402

BACKENDS = ("lapack", "tensorflow")


def factor(dim, seed):
    """A PSD Kronecker-style factor: the mean outer product of 2*dim random rows."""
    rows = np.random.default_rng(seed).standard_normal((2 * dim, dim))
    return (rows.T @ rows / (2 * dim)).astype(np.float32)


class DecompositionTest(parameterized.TestCase):

    @parameterized.product(backend=BACKENDS, dim=(3, 64, 289))
    def test_eigh_reconstructs_the_factor(self, backend, dim):
        a = factor(dim, seed=dim)
        a[0, 1] += 1e-3  # a slightly asymmetric input is decomposed as its symmetric part
        values, vectors = tf.function(lambda m: linalg.symmetric_eigh(m, backend))(a)
        values, vectors = values.numpy().astype(np.float64), vectors.numpy().astype(np.float64)
        symmetric = 0.5 * (a + a.T).astype(np.float64)
        scale = np.abs(symmetric).max()
        self.assertTrue(np.all(values >= 0))
        np.testing.assert_allclose(vectors.T @ vectors, np.eye(dim), atol=1e-4)
        np.testing.assert_allclose((vectors * values) @ vectors.T, symmetric,
                                   atol=1e-4 * scale)
        np.testing.assert_allclose(np.sort(values), np.linalg.eigvalsh(symmetric),
                                   atol=1e-4 * scale)

    @parameterized.product(backend=BACKENDS, dim=(3, 64, 289), shift=(1e-3, 0.1))
    def test_damped_inverse_matches_numpy(self, backend, dim, shift):
        a = factor(dim, seed=dim + 1)
        inverse = tf.function(lambda m: linalg.damped_inverse(m, shift, backend))(a)
        expected = np.linalg.inv(a.astype(np.float64) + shift * np.eye(dim))
        np.testing.assert_allclose(inverse.numpy(), expected,
                                   atol=1e-3 * np.abs(expected).max())
        np.testing.assert_allclose(inverse.numpy(), inverse.numpy().T,
                                   atol=1e-6 * np.abs(expected).max())

    @parameterized.parameters(*BACKENDS)
    def test_non_finite_factor_gives_non_finite_decompositions(self, backend):
        a = factor(5, seed=0)
        a[2, 2] = np.inf
        values, vectors = linalg.symmetric_eigh(tf.constant(a), backend)
        self.assertFalse(np.all(np.isfinite(values.numpy())) and
                         np.all(np.isfinite(vectors.numpy())))
        inverse = linalg.damped_inverse(tf.constant(a), 0.1, backend)
        self.assertFalse(np.all(np.isfinite(inverse.numpy())))

    @parameterized.parameters(*BACKENDS)
    def test_batch_of_factors_is_decomposed_member_by_member(self, backend):
        batch = np.stack([factor(6, seed=s) for s in range(4)])
        shifts = np.array([1e-3, 1e-2, 0.1, 1.0], np.float32)
        values, vectors = linalg.symmetric_eigh(tf.constant(batch), backend)
        inverses = linalg.damped_inverse(tf.constant(batch), tf.constant(shifts), backend)
        self.assertEqual(values.shape, (4, 6))
        for k, member in enumerate(batch.astype(np.float64)):
            q, v = vectors[k].numpy().astype(np.float64), values[k].numpy()
            np.testing.assert_allclose((q * v) @ q.T, member, atol=1e-4 * np.abs(member).max())
            expected = np.linalg.inv(member + shifts[k] * np.eye(6))
            np.testing.assert_allclose(inverses[k].numpy(), expected,
                                       atol=1e-3 * np.abs(expected).max())

    def test_batched_preconditioning_equals_each_member_alone(self):
        rng = np.random.default_rng(2)
        a, g = np.stack([factor(4, s) for s in (1, 2)]), np.stack([factor(3, s) for s in (3, 4)])
        grad = rng.standard_normal((2, 4, 3)).astype(np.float32)
        (v_a, q_a), (v_g, q_g) = linalg.symmetric_eigh(a), linalg.symmetric_eigh(g)
        batched = linalg.eigen_precondition(grad, q_a, v_a, q_g, v_g, 0.1).numpy()
        pi = linalg.pi_correction(a, g).numpy()
        for k in range(2):
            (va, qa), (vg, qg) = linalg.symmetric_eigh(a[k]), linalg.symmetric_eigh(g[k])
            single = linalg.eigen_precondition(grad[k], qa, va, qg, vg, 0.1).numpy()
            np.testing.assert_allclose(batched[k], single, rtol=1e-5, atol=1e-6)
            expected_pi = np.sqrt(np.trace(a[k]) / 4 / (np.trace(g[k]) / 3))
            self.assertAlmostEqual(pi[k], expected_pi, places=5)

    def test_lapack_inverse_of_an_indefinite_matrix_is_non_finite(self):
        indefinite = np.diag([1.0, -2.0, 3.0]).astype(np.float32)
        inverse = linalg.damped_inverse(tf.constant(indefinite), 0.5, "lapack")
        self.assertTrue(np.all(np.isnan(inverse.numpy())))

    def test_static_shapes_survive_the_lapack_call(self):
        spec = tf.TensorSpec((7, 7), tf.float32)
        eigh = tf.function(lambda m: linalg.symmetric_eigh(m, "lapack"), input_signature=[spec])
        values, vectors = eigh.get_concrete_function().structured_outputs
        self.assertEqual(values.shape, (7,))
        self.assertEqual(vectors.shape, (7, 7))

    def test_lapack_runs_on_one_openblas_thread_until_the_last_concurrent_call_ends(self):
        # numpy's and scipy's wheels each bundle an OpenBLAS with the setter, which sets
        # the process's count and returns the one it replaces: a probe setting 1 reads it.
        setters = linalg._openblas_thread_setters()
        self.assertLen(setters, 2)

        def counts():
            return [setter(1) for setter in setters]

        first_inside, second_inside, first_left = (threading.Event() for _ in range(3))
        seen = {}

        def first():
            seen["first entered"] = counts()
            first_inside.set()
            second_inside.wait(60)

        def second():
            first_inside.wait(60)
            seen["both inside"] = counts()
            second_inside.set()
            first_left.wait(60)
            seen["first left"] = counts()

        before = [setter(3) for setter in setters]
        try:
            threads = [threading.Thread(target=linalg._one_blas_thread(first)),
                       threading.Thread(target=linalg._one_blas_thread(second))]
            for thread in threads:
                thread.start()
            threads[0].join(60)
            first_left.set()
            threads[1].join(60)
            after = counts()
        finally:
            for setter, count in zip(setters, before):
                setter(count)
        self.assertEqual(seen, {"first entered": [1, 1], "both inside": [1, 1],
                                "first left": [1, 1]})
        self.assertEqual(after, [3, 3])

    def test_unknown_backend_names_the_allowed_ones(self):
        with self.assertRaisesRegex(ValueError, r"`backend` must be one of .*lapack"):
            linalg.symmetric_eigh(tf.eye(2), "magma")


if __name__ == "__main__":
    absltest.main()
