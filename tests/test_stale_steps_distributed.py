"""Stale steps in their own train function (tfkfac/stale_steps.py) on a real 2-rank
Horovod job (Gloo): tests/stale_steps_worker.py trains with `model.fit` on each rank's
half of every global batch, factors every 3 steps, under both placements.

- Both ranks choose the same train function at every step (the factor one at 0, 3, 6;
  the stale one otherwise): they read the same counters, and issue the same collectives
  (the job ends, none waits for a peer).
- Weights, every optimizer variable and the counters are bit-identical on both ranks;
  they and the decompositions each rank holds are bit-identical to the same job with
  `steps_per_execution=2`, where every step is the factor step.
- `jit_compile=True` on 2 ranks: the stale step's gradient average is a Horovod
  collective, which XLA cannot compile; a warning says so, and every step runs as a
  tf.function (jit_compile off), still choosing its train function per step.
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
import stale_steps_worker as worker  # noqa: E402

CHOSEN = ["factor" if step % worker.FACTOR_FREQ == 0 else "stale"
          for step in range(worker.STEPS)]


class StaleStepsDistributedTest(job_results.TwoRankJob, absltest.TestCase):

    WORKER, SCENARIOS = worker, list(worker.PLACEMENTS) + ["jit"]

    def test_ranks_choose_alike_and_end_bit_identical_to_the_factor_step_alone(self):
        for placement in worker.PLACEMENTS:
            for rank, arrays in enumerate(self.saved[placement]):
                with self.subTest(placement=placement, rank=rank):
                    self.assertEqual(list(arrays["chosen/ran"]), CHOSEN)
                    self.assertEqual(list(arrays["factor_only/ran"]), [])
                    chosen = [k for k in arrays if k.startswith("chosen/") and k != "chosen/ran"]
                    self.assertTrue(any("/decomposition" in k for k in chosen))
                    for key in chosen:
                        np.testing.assert_array_equal(
                            arrays[key], arrays[key.replace("chosen/", "factor_only/", 1)],
                            err_msg=key)
                    # Every rank holds the same state but an owner's own decompositions.
                    for key in chosen:
                        if "/decomposition" not in key:
                            np.testing.assert_array_equal(
                                arrays[key], self.saved[placement][0][key], err_msg=key)

    def test_jit_compile_on_two_ranks_warns_and_runs_without_xla(self):
        for rank, arrays in enumerate(self.saved["jit"]):
            with self.subTest(rank=rank):
                self.assertLen(arrays["warnings"], 1)
                self.assertIn("over 2 ranks is a collective", str(arrays["warnings"][0]))
                self.assertFalse(arrays["jit_compile"])
                self.assertEqual(list(arrays["ran"]), CHOSEN)


if __name__ == "__main__":
    absltest.main()
