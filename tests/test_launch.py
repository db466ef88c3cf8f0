"""trainers.launch: jobs report their exit code and output, and never hang."""

import os
import re
import sys
import time
from unittest import mock

from absl.testing import absltest

from trainers import launch

SLEEPER = ("import subprocess, sys, time\n"
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
           "print('child', child.pid, flush=True)\n"
           "time.sleep(120)\n")


def running(pid):
    """True while `pid` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class LaunchTest(absltest.TestCase):

    def test_exit_code_and_output_are_returned(self):
        code, output = launch.run_job(
            [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
             "sys.exit(3)"], timeout=60, env=launch.job_environment())
        self.assertEqual(code, 3)
        self.assertIn("out", output)
        self.assertIn("err", output)

    def test_timeout_kills_the_whole_process_group_and_shows_the_output(self):
        start = time.time()
        with self.assertRaisesRegex(TimeoutError, r"did not finish in 3 s") as raised:
            launch.run_job([sys.executable, "-c", SLEEPER], timeout=3,
                           env=launch.job_environment())
        self.assertLess(time.time() - start, 30)
        child = int(re.search(r"child (\d+)", str(raised.exception)).group(1))
        deadline = time.time() + 10
        while running(child) and time.time() < deadline:
            time.sleep(0.1)
        self.assertFalse(running(child), "the job's child process outlived the timeout")

    def test_environment_puts_this_python_first_and_drops_launcher_state(self):
        with mock.patch.dict(os.environ, {"HOROVOD_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "4"}):
            env = launch.job_environment()
        self.assertEqual(env["PATH"].split(os.pathsep)[0], os.path.dirname(sys.executable))
        self.assertNotIn("HOROVOD_SIZE", env)
        self.assertNotIn("OMPI_COMM_WORLD_SIZE", env)

    def test_horovodrun_command_runs_this_python_on_localhost_ranks(self):
        env = launch.job_environment()
        command = launch.horovodrun_command(["worker.py", "--flag=1"], 2, env)
        self.assertTrue(command[0].endswith("horovodrun"), command)
        self.assertEqual(command[1:6], ["--gloo", "-np", "2", "-H", "localhost:2"])
        self.assertEqual(command[6:], [sys.executable, "worker.py", "--flag=1"])

    def test_missing_horovodrun_names_the_fix(self):
        with self.assertRaisesRegex(FileNotFoundError, "make bootstrap"):
            launch.horovodrun_command(["worker.py"], 2, {"PATH": "/nonexistent"})


if __name__ == "__main__":
    absltest.main()
