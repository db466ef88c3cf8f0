"""Eigenbasis Adam and grafting (docs/design.md §11) in a real 2-rank Horovod job (Gloo).

One `horovodrun --gloo -np 2` job of eigen_adam_worker.py trains tests/every_block_net.py
(every block kind, LayerNorm as the normalization layer) with `model.fit`, each rank on
its half of every global batch; the same function in this process with batch 2B is the
reference (with one process both placements run the same code: one reference per
method). For `method="eigen_adam"` and for `grafting="adam"` under both placements:
- 2 ranks end with the weights of one process on the double batch;
- every saved optimizer variable is bit-identical on both ranks; the eigenbasis moments
  s are among them under both placements (held and saved on every rank; under "owner"
  gathered from each block's owner) and equal the one process's;
  grafting's v (from the rank-averaged gradients) is saved under both and equals the
  one process's;
- a .keras file saved by rank 0 mid-run (replicated eigen_adam) loads on both ranks with
  s, and the run goes on to the uninterrupted run's weights and counters.
The job must finish within JOB_TIMEOUT_SECONDS: a hang is a failure.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from absl import logging  # noqa: E402
from absl.testing import absltest  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import eigen_adam_worker as worker  # noqa: E402
import every_block_net as net  # noqa: E402
import job_results  # noqa: E402
from tfkfac import distributed  # noqa: E402
from trainers.launch import run_horovod_job  # noqa: E402

JOB_TIMEOUT_SECONDS = 600  # Measured 120 s on the 2-core machine at load 7.
# 2 ranks vs 1 process differ by summation order in gradients and factors, relative to
# the largest weight (weights) or to each variable's largest entry (optimizer state), by
# the dtype the worker runs each method in (worker.DTYPES). Measured on the weights:
# grafting over eigen in float32 1.3e-5 x max|w|, eigenbasis Adam in float64 5.5e-13.
EQUIVALENCE_RTOL = {"float32": 1e-4, "float64": 1e-9}


class EigenAdamDistributedTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        start = time.time()
        cls.returncode, cls.output, _, cls.saved = job_results.run_and_load(
            lambda: run_horovod_job(os.path.join(TESTS_DIR, "eigen_adam_worker.py"),
                                    num_ranks=2, timeout=JOB_TIMEOUT_SECONDS),
            worker.OUT_DIR_VARIABLE, [worker.name(case) for case in worker.CASES])
        # The single-process references (batch 2B), after the job so they do not compete.
        comm = distributed.SingleProcess()
        cls.references = {(method, grafting): worker.run(comm, ("replicated", method, grafting))
                          for _, method, grafting in worker.CASES}
        logging.info("job and references done after %.1f s", time.time() - start)

    def both_ranks(self, scenario, key):
        """`key` of `scenario`, asserted bit-identical on both ranks."""
        first, second = (saved[key] for saved in self.saved[scenario])
        np.testing.assert_array_equal(first, second, err_msg=f"{scenario}: {key}")
        return first

    def assert_matches_reference(self, scenario, reference, select, method):
        """Every key of `scenario` that `select` picks (equal on both ranks) matches the
        one-process reference."""
        keys = [k for k in reference if select(k)]
        self.assertNotEmpty(keys)
        rtol = EQUIVALENCE_RTOL[worker.DTYPES[method]]
        largest_weight = max(np.max(np.abs(reference[k])) for k in reference if is_weight(k))
        for key in keys:
            expected = reference[key]
            scale = largest_weight if is_weight(key) else np.max(np.abs(expected))
            np.testing.assert_allclose(self.both_ranks(scenario, key), expected, rtol=0,
                                       atol=rtol * scale, err_msg=f"{scenario}: {key}")

    def test_job_exits_cleanly(self):
        self.assertEqual(self.returncode, 0, self.output[-4000:])

    def test_two_ranks_match_one_process_with_double_batch(self):
        for case in worker.CASES:
            placement, method, grafting = case
            with self.subTest(worker.name(case)):
                scenario = worker.name(case)
                self.assert_matches_reference(scenario, self.references[method, grafting],
                                              is_weight, method)
                np.testing.assert_array_equal(
                    self.both_ranks(scenario, "counters"),
                    [worker.STEPS, worker.STEPS, worker.STEPS // worker.DECOMPOSITION_FREQ])

    def test_saved_state_is_the_same_on_both_ranks_and_holds_the_moments(self):
        for case in worker.CASES:
            placement, method, grafting = case
            with self.subTest(worker.name(case)):
                scenario = worker.name(case)
                keys = sorted(self.saved[scenario][0])
                self.assertEqual(keys, sorted(self.saved[scenario][1]))
                for key in keys:
                    self.both_ranks(scenario, key)
                moments = [k for k in keys if is_moment(k)]
                graft_v = [k for k in keys if is_graft_v(k)]
                reference = self.references[method, grafting]
                if method == "eigen_adam":
                    self.assertNotEmpty(moments)
                    self.assert_matches_reference(scenario, reference, is_moment, method)
                else:
                    self.assertEmpty(moments)
                if grafting == "adam":
                    self.assertLen(graft_v, len([k for k in keys if is_weight(k)]))
                    self.assert_matches_reference(scenario, reference, is_graft_v, method)
                else:
                    self.assertEmpty(graft_v)

    def test_keras_file_saved_by_rank_0_resumes_on_both_ranks(self):
        scenario = worker.name(worker.RESTORE_CASE)
        saved = self.saved[scenario][0]
        loaded_moments = [k for k in saved if k.startswith("loaded/") and is_moment(k)]
        self.assertNotEmpty(loaded_moments)
        for key in loaded_moments:
            self.assertGreater(np.max(self.both_ranks(scenario, key)), 0.0, key)
        weights = [k for k in saved if is_weight(k)]
        self.assertNotEmpty(weights)
        for key in weights:
            np.testing.assert_allclose(self.both_ranks(scenario, f"resumed/{key}"), saved[key],
                                       rtol=0, atol=1e-12, err_msg=key)
        np.testing.assert_array_equal(self.both_ranks(scenario, "resumed/counters"),
                                      saved["counters"])


def is_weight(key):
    return key.startswith("weight")


def is_moment(key):
    """Eigenbasis Adam's s of a block (an optimizer variable `<layer>_moment<k>`)."""
    return "optimizer/" in key and net.is_eigenbasis_moment(key)


def is_graft_v(key):
    return "optimizer/graft_v_" in key


if __name__ == "__main__":
    absltest.main()
