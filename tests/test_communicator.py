"""Communicators: single-process semantics, and a real 2-rank Horovod job checked with numpy."""

import os
import re
import shutil
import sys
import tempfile
import time
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from absl import logging
from absl.testing import absltest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)
sys.path.insert(0, os.path.join(TESTS_DIR, "testdata"))

import communicator_worker as worker  # noqa: E402
from trainers.launch import run_horovod_job  # noqa: E402
from resnet_factors import resnet50_factor_dims  # noqa: E402
from tfkfac import distributed  # noqa: E402

JOB_TIMEOUT_SECONDS = 240  # Start-up of two TF processes on a loaded 2-core machine.
FAILURE_EXIT_SECONDS = 60
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def wire_mean_bound(x0, x1, wire):
    """Entrywise error bound of the mean of two values sent in `wire` dtype.

    Each value is rounded once (u|x|), the sum or mean once more (u|x0+x1|/2 <= u(|x0|+|x1|)):
    together at most 2u(|x0|+|x1|), plus subnormal slack for float16.
    """
    return 2 * UNIT_ROUNDOFF[wire] * (np.abs(x0) + np.abs(x1)) + 2.0 ** -24


class SingleProcessTest(absltest.TestCase):

    def test_collectives_are_identity_and_send_nothing(self):
        comm = distributed.SingleProcess()
        x, y = tf.constant([1.0, 2.0]), tf.constant([[3.0]], tf.float16)

        @tf.function
        def run(x, y):
            return (comm.grouped_allreduce_mean([x, y], category="gradients"),
                    comm.broadcast([x], root_rank=0), comm.allgather(y, category="decompositions"))

        reduced, broadcast, gathered = run(x, y)
        np.testing.assert_array_equal(reduced[0].numpy(), x.numpy())
        np.testing.assert_array_equal(reduced[1].numpy(), y.numpy())
        np.testing.assert_array_equal(broadcast[0].numpy(), x.numpy())
        np.testing.assert_array_equal(gathered.numpy(), y.numpy())
        self.assertEqual(comm.grouped_allreduce_mean([]), [])
        self.assertEqual(set(comm.bytes_sent().values()), {0})
        self.assertEqual(set(comm.collective_calls().values()), {0})
        self.assertEqual((comm.rank, comm.size), (0, 1))

    def test_exchanges_return_inputs_unchanged(self):
        comm = distributed.SingleProcess()
        matrices = [tf.constant([[2.0, 1.0], [1.0, 3.0]])]
        (reduced,) = distributed.allreduce_symmetric(comm, matrices, wire_dtype="float16")
        self.assertIs(reduced, matrices[0])
        values = [tf.constant([1.0, 2.0]), tf.eye(2)]
        gathered = distributed.gather_from_owners(comm, values, [(2,), (2, 2)], [0, 0])
        self.assertIs(gathered[1], values[1])

    def test_rejects_bad_arguments(self):
        comm = distributed.SingleProcess()
        with self.assertRaisesRegex(ValueError, "category must be one of"):
            comm.grouped_allreduce_mean([tf.ones([2])], category="weights")
        with self.assertRaisesRegex(ValueError, "root_rank must be in"):
            comm.broadcast([tf.ones([2])], root_rank=1)
        with self.assertRaisesRegex(ValueError, "one entry per item"):
            distributed.gather_from_owners(comm, [None], [(2,), (3,)], [0, 0])
        with self.assertRaisesRegex(ValueError, "owners must be ranks"):
            distributed.gather_from_owners(comm, [None], [(2,)], [1])
        with self.assertRaisesRegex(ValueError, "wire_dtype must be one of"):
            distributed.allreduce_symmetric(comm, [tf.eye(2)], wire_dtype="int8")
        with self.assertRaisesRegex(ValueError, "shapes must be fully defined"):
            distributed.gather_from_owners(comm, [None], [(None, 2)], [0])
        with self.assertRaisesRegex(ValueError, "kind must be one of"):
            distributed.get_communicator("mpi")

    def test_launcher_environment_selects_communicator(self):
        with mock.patch.dict(os.environ, clear=True):
            self.assertEqual(distributed.launched_world_size(), 1)
            self.assertIsInstance(distributed.get_communicator("auto"), distributed.SingleProcess)
        for variable in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
            with mock.patch.dict(os.environ, {variable: "4"}, clear=True):
                self.assertEqual(distributed.launched_world_size(), 4)
        self.assertIsInstance(distributed.get_communicator("single"), distributed.SingleProcess)
        # Choosing a single-process communicator never imports Horovod.
        self.assertNotIn("horovod", sys.modules)

    def test_missing_horovod_is_a_clear_error_when_ranks_were_launched(self):
        hidden = {"horovod": None, "horovod.tensorflow": None}
        with mock.patch.dict(sys.modules, hidden), \
                mock.patch.dict(os.environ, {"HOROVOD_SIZE": "2"}, clear=True):
            for kind in ("auto", "horovod"):
                with self.assertRaisesRegex(ImportError, "needs horovod.tensorflow"):
                    distributed.get_communicator(kind)


class TwoRankJobTest(absltest.TestCase):
    """One `horovodrun --gloo -np 2` job of communicator_worker.py, checked piece by piece."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        os.makedirs(absltest.get_default_test_tmpdir(), exist_ok=True)
        cls.out_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        start = time.time()
        with mock.patch.dict(os.environ, {worker.OUT_DIR_VARIABLE: cls.out_dir}):
            cls.returncode, cls.output = run_horovod_job(
                os.path.join(TESTS_DIR, "communicator_worker.py"), num_ranks=2,
                timeout=JOB_TIMEOUT_SECONDS)
        cls.exit_time = time.time()
        logging.info("2-rank job exited %d after %.1f s", cls.returncode, cls.exit_time - start)
        cls.ranks = []
        for rank in range(2):
            path = os.path.join(cls.out_dir, f"rank{rank}.npz")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} saved no results; job output:\n"
                                     + cls.output[-5000:])
            cls.ranks.append(dict(np.load(path)))
        shutil.rmtree(cls.out_dir)

    def both_ranks(self, key):
        """The value under `key`, asserted bit-identical on both ranks."""
        first, second = (saved[key] for saved in self.ranks)
        np.testing.assert_array_equal(first, second, err_msg=key)
        return first

    def test_grouped_allreduce_mean_over_shapes_and_dtypes(self):
        inputs = [worker.rank_gradients(rank) for rank in range(2)]
        position = 0
        for dtype, shapes in worker.GRADIENT_SHAPES.items():
            for index in range(len(shapes)):
                x0, x1 = (inputs[rank][dtype][index] for rank in range(2))
                got = self.both_ranks(f"gradient_{position}")
                if dtype == "float32":
                    np.testing.assert_allclose(got, (x0 + x1) / 2, rtol=1e-6, atol=1e-7)
                else:
                    self.assertTrue(np.all(np.abs(got - (x0 + x1) / 2)
                                           <= wire_mean_bound(x0, x1, dtype)), dtype)
                position += 1
        x0, x1 = (inputs[rank]["bfloat16"][0] for rank in range(2))
        got = self.both_ranks("gradient_unknown_shape_bfloat16")
        self.assertEqual(got.shape, x0.shape)
        self.assertTrue(np.all(np.abs(got - (x0 + x1) / 2)
                               <= wire_mean_bound(x0, x1, "bfloat16")))
        bytes_per_call = sum(int(np.prod(shape)) * ITEMSIZE[dtype]
                             for dtype, shapes in worker.GRADIENT_SHAPES.items()
                             for shape in shapes)
        self.assertEqual(self.both_ranks("gradient_bytes"),
                         worker.GRADIENT_REPEATS * bytes_per_call)
        self.assertEqual(self.both_ranks("gradient_calls"), worker.GRADIENT_REPEATS)

    def test_collectives_inside_cond_run_only_when_taken(self):
        for i, factor_step in enumerate(worker.CONDITIONAL_STEPS):
            np.testing.assert_array_equal(self.both_ranks(f"conditional_gradient_{i}"),
                                          np.full(3, 1.5))
            np.testing.assert_array_equal(self.both_ranks(f"conditional_factor_{i}"),
                                          np.full(3, 3.0 if factor_step else 0.0))
        np.testing.assert_array_equal(
            self.both_ranks("conditional_calls"),
            [len(worker.CONDITIONAL_STEPS), sum(worker.CONDITIONAL_STEPS)])

    def test_packed_factor_allreduce_matches_mean_and_byte_formula(self):
        factors = [worker.rank_factors(rank) for rank in range(2)]
        elements = sum(n * (n + 1) // 2 for n in worker.FACTOR_DIMS)
        self.assertEqual(elements, distributed.packed_size(worker.FACTOR_DIMS))
        for wire in worker.WIRE_DTYPES:
            worst = 0.0
            for i in range(len(worker.FACTOR_DIMS)):
                x0, x1 = factors[0][i], factors[1][i]
                got = self.both_ranks(f"factor_{wire}_{i}")
                np.testing.assert_array_equal(got, got.T)
                if wire == "float32":
                    np.testing.assert_allclose(got, (x0 + x1) / 2, rtol=1e-6, atol=1e-7)
                else:
                    self.assertTrue(np.all(np.abs(got - (x0 + x1) / 2)
                                           <= wire_mean_bound(x0, x1, wire)), wire)
                worst = max(worst, np.max(np.abs(got - (x0 + x1) / 2)
                                          / (np.abs(x0) + np.abs(x1) + 1e-30)))
            logging.info("%s wire: max |error| / (|x0|+|x1|) = %.2e", wire, worst)
            self.assertEqual(self.both_ranks(f"factor_{wire}_bytes"), elements * ITEMSIZE[wire])
            self.assertEqual(self.both_ranks(f"factor_{wire}_calls"), 1)

    def test_owners_decompose_and_every_rank_gets_every_result(self):
        owners = worker.lpt_owners(worker.EIGEN_DIMS, 2)
        np.testing.assert_array_equal(self.both_ranks("eigen_owners"), owners)
        self.assertEqual(sorted(set(owners)), [0, 1])
        for i, matrix in enumerate(worker.shared_eigen_inputs()):
            values = self.both_ranks(f"eigenvalues_{i}")
            vectors = self.both_ranks(f"eigenvectors_{i}")
            np.testing.assert_allclose(values, np.linalg.eigvalsh(matrix.astype(np.float64)),
                                       rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(vectors @ np.diag(values) @ vectors.T, matrix,
                                       atol=1e-4 * np.abs(matrix).max())
        for rank in range(2):
            owned = [n for n, owner in zip(worker.EIGEN_DIMS, owners) if owner == rank]
            self.assertEqual(self.ranks[rank]["eigen_bytes"], 4 * sum(n + n * n for n in owned))
        np.testing.assert_array_equal(self.both_ranks("idle_rank_gather"), np.full(4, 3.5))

    def test_lpt_assignment_identical_on_every_rank(self):
        expected = worker.lpt_owners(resnet50_factor_dims(), 2)
        np.testing.assert_array_equal(self.both_ranks("resnet50_owners"), expected)

    def test_broadcast_variables_and_tensors_from_root(self):
        count = sum(key.startswith("variable_after_") for key in self.ranks[0])
        self.assertEqual(count, 12)  # Dense + BatchNorm + SGD-momentum state.
        for i in range(count):
            before = [saved[f"variable_before_{i}"] for saved in self.ranks]
            self.assertFalse(np.array_equal(before[0], before[1]), i)
            np.testing.assert_array_equal(self.both_ranks(f"variable_after_{i}"), before[0])
        np.testing.assert_array_equal(self.both_ranks("broadcast_float32"), np.full((2, 2), 2.0))
        np.testing.assert_array_equal(self.both_ranks("broadcast_bfloat16"), np.full(3, 2.5))

    def test_failing_rank_ends_job_with_visible_error(self):
        self.assertNotEqual(self.returncode, 0)
        self.assertIn(worker.FAILURE_MESSAGE, self.output)
        failed_at = float(re.search(r"FAILING_AT (\d+\.\d+)", self.output).group(1))
        seconds = self.exit_time - failed_at
        logging.info("job exited %.1f s after rank 1 raised", seconds)
        self.assertLess(seconds, FAILURE_EXIT_SECONDS)


if __name__ == "__main__":
    absltest.main()
