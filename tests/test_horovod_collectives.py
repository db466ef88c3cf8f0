"""A real two-rank Horovod job over Gloo on this host: horovodrun must launch both ranks and
each must see correct grouped_allreduce, allgather (uneven) and broadcast results."""

import os
import shutil
import signal
import subprocess
import sys

from absl.testing import absltest

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "horovod_collectives_worker.py")
TIMEOUT_SECONDS = 120


def run_under_horovodrun(script, num_ranks, timeout):
    """Runs `script` with horovodrun --gloo on localhost; returns (exit code, output).

    The job runs in its own process group, killed whole on timeout so no rank lingers.
    """
    venv_bin = os.path.dirname(sys.executable)
    path = os.pathsep.join([venv_bin, os.environ.get("PATH", "")])
    horovodrun = shutil.which("horovodrun", path=path)
    if horovodrun is None:
        raise FileNotFoundError(f"horovodrun not found on {path}: run `make bootstrap`")
    env = dict(os.environ, PATH=path, TF_CPP_MIN_LOG_LEVEL="2")
    command = [horovodrun, "--gloo", "-np", str(num_ranks), "-H", f"localhost:{num_ranks}",
               sys.executable, script]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=env, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        raise AssertionError(f"horovodrun did not finish in {timeout} s:\n{output[-4000:]}")
    return job.returncode, output


class HorovodCollectivesTest(absltest.TestCase):

    def test_two_ranks_agree_on_collectives(self):
        code, output = run_under_horovodrun(WORKER, num_ranks=2, timeout=TIMEOUT_SECONDS)
        self.assertEqual(code, 0, msg=output[-4000:])
        for rank in (0, 1):
            for mode in ("eager", "tf.function"):
                self.assertIn(f"rank {rank} of 2: collectives OK ({mode})", output,
                              msg=output[-4000:])


if __name__ == "__main__":
    absltest.main()
