"""trainers.train under `horovodrun --gloo -np 2`: the job finishes, both ranks end with
identical variables (gradients averaged, state broadcast), metrics count both shards,
and only rank 0 writes logs, checkpoints and the summary."""

import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl.testing import absltest
import numpy as np

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import trainer_worker as worker  # noqa: E402
from trainers.launch import run_horovod_job  # noqa: E402

NUM_RANKS = 2
JOB_TIMEOUT_SECONDS = 280


class TrainerHorovodTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        os.makedirs(absltest.get_default_test_tmpdir(), exist_ok=True)
        cls.out_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        os.environ[worker.OUT_VARIABLE] = cls.out_dir  # read by every rank
        cls.returncode, cls.output = run_horovod_job(
            os.path.join(TESTS_DIR, "trainer_worker.py"), num_ranks=NUM_RANKS,
            timeout=JOB_TIMEOUT_SECONDS)

    def setUp(self):
        super().setUp()
        self.assertEqual(self.returncode, 0, self.output[-4000:])

    def test_ranks_end_with_identical_variables(self):
        for optimizer in worker.OPTIMIZERS:
            ranks = [np.load(os.path.join(self.out_dir, f"{optimizer}.rank{r}.npz"))
                     for r in range(NUM_RANKS)]
            self.assertEqual(ranks[0].files, ranks[1].files)
            for key in ranks[0].files:
                np.testing.assert_array_equal(ranks[0][key], ranks[1][key],
                                              err_msg=f"{optimizer} {key}")

    def test_only_rank_zero_writes_and_reports_both_shards(self):
        for optimizer in worker.OPTIMIZERS:
            model_dir = os.path.join(self.out_dir, optimizer)
            with open(os.path.join(model_dir, "summary.json"), encoding="utf-8") as f:
                summary = json.load(f)
            self.assertEqual(summary["num_ranks"], NUM_RANKS)
            self.assertEqual(summary["steps"], worker.STEPS)
            self.assertEqual(summary["fresh_examples"], NUM_RANKS * worker.STEPS * worker.BATCH)
            # TensorBoard names event files by host and process: one writer, rank 0.
            self.assertLen(os.listdir(os.path.join(model_dir, "tensorboard")), 1)
            checkpoint_dir = os.path.join(model_dir, "checkpoints")
            self.assertEqual(os.listdir(checkpoint_dir), [f"step-{worker.STEPS}"])
            self.assertEqual(sorted(os.listdir(os.path.join(checkpoint_dir, f"step-{worker.STEPS}"))),
                             ["trainer_state.json", "variables.data-00000-of-00001",
                              "variables.index"])
        # One summary line per run, from rank 0 (horovodrun prefixes lines with [rank]).
        summaries = [line for line in self.output.splitlines() if "logs: " in line]
        self.assertLen(summaries, len(worker.OPTIMIZERS), self.output[-4000:])
        self.assertTrue(all(line.startswith("[0]") for line in summaries), summaries)


if __name__ == "__main__":
    absltest.main()
