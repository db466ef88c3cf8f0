"""KFAC(fisher="sampled") on a real 2-rank Horovod job (Gloo): tests/sampled_fisher_worker.py
trains on the same batches on both ranks, so that only the draws can differ.

- The job ends, and every weight and optimizer variable is bit-identical on both ranks.
- Each rank draws its own labels: the first step's G, the mean over ranks of each rank's,
  is not rank 0's alone, which one process (rank 0's draws) computes from the same batch;
  rank 1's, 2·G − G₀ by that mean, is a Gram matrix of output gradients (symmetric,
  positive semidefinite).
The job must finish within JOB_TIMEOUT_SECONDS: a hang is a failure.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import job_results  # noqa: E402
import sampled_fisher_worker as worker  # noqa: E402
from tfkfac import distributed  # noqa: E402


class SampledFisherDistributedTest(job_results.TwoRankJob, absltest.TestCase):

    WORKER, SCENARIOS = worker, ["sampled"]

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ranks = cls.saved["sampled"]
        # After the job, so that it does not compete with it.
        cls.rank0_alone, _, _ = worker.first_step_and_rest(distributed.SingleProcess())

    def test_every_variable_identical_on_both_ranks(self):
        rank0, rank1 = self.ranks
        self.assertEqual(sorted(rank0), sorted(rank1))
        self.assertTrue(any(key.startswith("optimizer") for key in rank0))
        for key in rank0:
            np.testing.assert_array_equal(rank0[key], rank1[key], err_msg=key)

    def test_each_rank_draws_its_own_labels(self):
        for layer in worker.LAYERS:
            mean = self.ranks[0][f"first_G_{layer}"]
            rank0 = self.rank0_alone[layer]
            self.assertGreater(np.abs(mean - rank0).max(), 1e-3 * np.abs(rank0).max(), layer)
            rank1 = 2.0 * mean.astype(np.float64) - rank0
            np.testing.assert_allclose(rank1, rank1.T, atol=1e-6 * np.abs(rank1).max())
            self.assertGreater(np.linalg.eigvalsh(rank1).min(), -1e-5 * np.abs(rank1).max(),
                               layer)


if __name__ == "__main__":
    absltest.main()
