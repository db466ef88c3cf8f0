"""Symmetric packing against numpy: sizes, exact float32 round trip, narrow-dtype error."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import ml_dtypes
import numpy as np
import tensorflow as tf
from absl.testing import absltest, parameterized

from tfkfac.distributed import packing

DIMS = [1, 3, 17, 40]
# Unit roundoff (half an ulp at 1.0) of the narrow wire dtypes.
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
NUMPY_WIRE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def random_spd(n, rng):
    x = rng.standard_normal((n, n + 4)).astype(np.float32)
    return (x @ x.T / (n + 4)).astype(np.float32)


class PackingTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(0)
        self.matrices = [random_spd(n, rng) for n in DIMS]

    def test_packed_size_counts_upper_triangles(self):
        expected = sum(len(np.triu_indices(n)[0]) for n in DIMS)
        self.assertEqual(packing.packed_size(DIMS), expected)
        self.assertEqual(packing.packed_size([]), 0)

    def test_pack_is_concatenated_row_major_upper_triangles(self):
        buffer = packing.pack_upper_triangles(self.matrices).numpy()
        expected = np.concatenate([m[np.triu_indices(m.shape[0])] for m in self.matrices])
        self.assertEqual(buffer.dtype, np.float32)
        np.testing.assert_array_equal(buffer, expected)

    def test_float32_round_trip_is_exact(self):
        buffer = packing.pack_upper_triangles(self.matrices, dtype="float32")
        for got, want in zip(packing.unpack_upper_triangles(buffer, DIMS), self.matrices):
            self.assertEqual(got.dtype, tf.float32)
            np.testing.assert_array_equal(got.numpy(), want)

    def test_unpack_mirrors_the_upper_triangle(self):
        asymmetric = np.arange(16, dtype=np.float32).reshape(4, 4)
        (got,) = packing.unpack_upper_triangles(
            packing.pack_upper_triangles([asymmetric]), [4])
        expected = np.triu(asymmetric) + np.triu(asymmetric, 1).T
        np.testing.assert_array_equal(got.numpy(), expected)

    def test_batch_of_matrices_packs_like_its_members_in_turn(self):
        rng = np.random.default_rng(1)
        batch = np.stack([random_spd(5, rng) for _ in range(3)])
        single = self.matrices[1]
        shapes = [batch.shape, single.shape[0]]
        self.assertEqual(packing.packed_size(shapes), 3 * 15 + 6)
        buffer = packing.pack_upper_triangles([batch, single])
        expected = packing.pack_upper_triangles(list(batch) + [single])
        np.testing.assert_array_equal(buffer.numpy(), expected.numpy())
        got_batch, got_single = packing.unpack_upper_triangles(buffer, shapes)
        self.assertEqual(got_batch.shape, batch.shape)
        np.testing.assert_array_equal(got_batch.numpy(), batch)
        np.testing.assert_array_equal(got_single.numpy(), single)

    @parameterized.parameters("float16", "bfloat16")
    def test_narrow_wire_dtype_rounds_each_entry_once(self, name):
        buffer = packing.pack_upper_triangles(self.matrices, dtype=name)
        self.assertEqual(buffer.dtype, packing.wire_dtype(name))
        self.assertEqual(buffer.shape[0], packing.packed_size(DIMS))
        unpacked = packing.unpack_upper_triangles(buffer, DIMS)
        for got, want in zip(unpacked, self.matrices):
            got = got.numpy()
            self.assertEqual(got.dtype, np.float32)
            # Same rounding as numpy / ml_dtypes (round to nearest even) ...
            rounded = want.astype(NUMPY_WIRE[name]).astype(np.float32)
            np.testing.assert_array_equal(got, rounded)
            # ... hence |error| <= u |x| entrywise, or half a subnormal step if tiny.
            tiny = float(ml_dtypes.finfo(NUMPY_WIRE[name]).smallest_subnormal)
            bound = UNIT_ROUNDOFF[name] * np.abs(want) + tiny
            self.assertTrue(np.all(np.abs(got - want) <= bound))
            np.testing.assert_array_equal(got, got.T)

    @parameterized.parameters("float32", "float16", "bfloat16")
    def test_xla_compiled_matches_eager(self, name):
        @tf.function(jit_compile=True)
        def round_trip(*matrices):
            buffer = packing.pack_upper_triangles(matrices, dtype=name)
            return packing.unpack_upper_triangles(buffer, DIMS)

        eager = packing.unpack_upper_triangles(
            packing.pack_upper_triangles(self.matrices, dtype=name), DIMS)
        for got, want in zip(round_trip(*self.matrices), eager):
            np.testing.assert_array_equal(got.numpy(), want.numpy())

    def test_empty_list_packs_to_empty_buffer(self):
        buffer = packing.pack_upper_triangles([], dtype="float16")
        self.assertEqual(buffer.shape, (0,))
        self.assertEqual(packing.unpack_upper_triangles(buffer, []), [])

    def test_rejects_bad_input(self):
        with self.assertRaisesRegex(ValueError, "wire_dtype must be one of"):
            packing.pack_upper_triangles(self.matrices, dtype="int8")
        with self.assertRaisesRegex(ValueError, "square"):
            packing.pack_upper_triangles([np.zeros((2, 3), np.float32)])
        with self.assertRaisesRegex(ValueError, "packed_size"):
            packing.unpack_upper_triangles(tf.zeros([5]), [2])
        with self.assertRaisesRegex(ValueError, "dims must be positive"):
            packing.packed_size([3, 0])


if __name__ == "__main__":
    absltest.main()
