"""Adaptive stale statistics (docs/design.md §12) on a real 2-rank Horovod job (Gloo):
tests/adaptive_staleness_worker.py trains on each rank's half of every global batch,
under both placements.

- Every rank takes the same decisions: at every step the same intervals, next due steps
  and train function (factor or stale), and bit-identical factors (the decisions are
  taken from the factors reduced over ranks).
- They are one process's decisions on the full batches, and the numpy replay of the rule
  on the ranks' recorded factors gives them too.
The job must finish within JOB_TIMEOUT_SECONDS: a hang is a failure.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import adaptive_staleness_worker as worker  # noqa: E402
import job_results  # noqa: E402

FACTOR_TOLERANCE = 5e-5  # of a factor's largest entry


class AdaptiveStalenessDistributedTest(job_results.TwoRankJob, absltest.TestCase):

    WORKER, SCENARIOS, JOB_TIMEOUT_SECONDS = worker, worker.PLACEMENTS, 600

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        x, y = worker.global_batches()
        _, _, records, ran = worker.train(x.reshape((-1, 8, 8, 1)), y.reshape(-1),
                                          2 * worker.BATCH)
        cls.one_process = worker.flat_record(records, ran)
        cls.shape = ([len(factors) for factors in records[0]["factors"]])

    def test_every_rank_decides_alike(self):
        for placement in worker.PLACEMENTS:
            first = self.saved[placement][0]
            for rank, arrays in enumerate(self.saved[placement]):
                with self.subTest(placement=placement, rank=rank):
                    self.assertEqual(sorted(arrays), sorted(first))
                    for key, value in first.items():
                        np.testing.assert_array_equal(arrays[key], value, err_msg=key)

    def test_decisions_are_one_process_on_the_full_batch_and_the_replay(self):
        decisions = [k for k in self.one_process if not k.startswith("factor")]
        self.assertIn("stale", list(self.one_process["ran"]))
        for placement in worker.PLACEMENTS:
            for rank, arrays in enumerate(self.saved[placement]):
                with self.subTest(placement=placement, rank=rank):
                    for key in decisions:
                        np.testing.assert_array_equal(arrays[key], self.one_process[key],
                                                      err_msg=key)
                    records = worker.records_from(arrays, len(self.shape), self.shape)
                    for step, replayed in enumerate(worker.replay(records)):
                        self.assertEqual(records[step]["intervals"], replayed["intervals"])
                        self.assertEqual(records[step]["next_steps"], replayed["next_steps"])
                    # The factors agree with one process's up to float32 rounding, which
                    # the weights carry from step to step (measured: 6e-6 of a factor's
                    # largest entry after 40 steps).
                    for key in self.one_process:
                        if key.startswith("factor"):
                            expected = self.one_process[key]
                            np.testing.assert_allclose(
                                arrays[key], expected, rtol=0,
                                atol=FACTOR_TOLERANCE * np.max(np.abs(expected)), err_msg=key)


if __name__ == "__main__":
    absltest.main()
