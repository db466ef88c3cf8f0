"""A real two-rank Horovod job over Gloo on this host: horovodrun must launch both ranks and
each must see correct grouped_allreduce, allgather (uneven) and broadcast results."""

import os

from absl.testing import absltest

from trainers.launch import run_horovod_job

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "horovod_collectives_worker.py")
TIMEOUT_SECONDS = 120


class HorovodCollectivesTest(absltest.TestCase):

    def test_two_ranks_agree_on_collectives(self):
        code, output = run_horovod_job(WORKER, num_ranks=2, timeout=TIMEOUT_SECONDS)
        self.assertEqual(code, 0, msg=output[-4000:])
        for rank in (0, 1):
            for mode in ("eager", "tf.function"):
                self.assertIn(f"rank {rank} of 2: collectives OK ({mode})", output,
                              msg=output[-4000:])


if __name__ == "__main__":
    absltest.main()
