"""Osawa et al.'s weight rescaling and momentum coupling (docs/design.md §5) on a real
2-rank Horovod job (Gloo): tests/osawa_recipe_worker.py trains with both on each rank's
half of every global batch, under both placements.

- Every model and optimizer variable is bit-identical on both ranks: each rank rescales
  its replicated kernels alike and holds the same peak learning rate.
- Each Conv2D and Dense kernel has the norm √(2·d_out).
- 2 ranks with batch B end as 1 process with batch 2B on the same examples (to float32
  summation order, tests/distributed_checks.py's EQUIVALENCE_RTOL).
The job must finish within JOB_TIMEOUT_SECONDS: a hang is a failure.
"""

import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import job_results  # noqa: E402
import osawa_recipe_worker as worker  # noqa: E402
from distributed_checks import EQUIVALENCE_RTOL  # noqa: E402
from tfkfac import distributed  # noqa: E402


class OsawaRecipeDistributedTest(job_results.TwoRankJob, absltest.TestCase):

    WORKER, SCENARIOS = worker, worker.PLACEMENTS

    def test_ranks_hold_identical_rescaled_weights_and_state(self):
        for placement in worker.PLACEMENTS:
            ranks = self.saved[placement]
            with self.subTest(placement=placement):
                self.assertEqual(ranks[0].keys(), ranks[1].keys())
                for key in ranks[0]:
                    np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
                for path, d_out in worker.RESCALED.items():
                    self.assertAlmostEqual(float(np.linalg.norm(ranks[0][f"weight/{path}"])),
                                           math.sqrt(2 * d_out), delta=1e-6 * d_out)
                np.testing.assert_allclose(ranks[0]["peak_learning_rate"],
                                           [worker.INITIAL_RATE], rtol=1e-7)

    def test_two_ranks_end_as_one_process_with_their_global_batch(self):
        for placement in worker.PLACEMENTS:
            with self.subTest(placement=placement):
                reference = worker.run(distributed.get_communicator("auto"), placement)
                got = self.saved[placement][0]
                weights = [k for k in reference if k.startswith("weight/")]
                self.assertLen(weights, 6)
                for key in weights:
                    tolerance = EQUIVALENCE_RTOL * np.max(np.abs(reference[key]))
                    np.testing.assert_allclose(got[key], reference[key], rtol=0,
                                               atol=tolerance, err_msg=key)


if __name__ == "__main__":
    absltest.main()
