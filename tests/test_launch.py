"""trainers.launch: jobs report their exit code and output, and never hang.

`SignalTest` runs the launcher's command line on stand-in trainers (a `trainers.train`
that only waits for a signal, found first on the workers' path), so the launcher's own
part is tested in seconds on both engines: SIGTERM and SIGINT forwarded to every worker,
exit code 75 when they stopped with their checkpoint, a worker killed by SIGKILL named,
and no process of the job left. tests/test_trainer_multi_worker.py does the same with
the real trainer."""

import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from unittest import mock

from absl.testing import absltest

from process_output import own_lines, running
from trainers import launch, preemption

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A stand-in `trainers.train`: records its pid, and on SIGTERM or SIGINT records the
# signal and exits as a preempted trainer does (75).
FAKE_TRAINER = """import json, os, signal, sys, time
directory = os.environ["FAKE_TRAINER_DIR"]
rank = os.environ.get("HOROVOD_RANK") or str(json.loads(os.environ["TF_CONFIG"])["task"]["index"])


def stop(signum, frame):
    with open(os.path.join(directory, f"signal-{rank}"), "w") as f:
        f.write(signal.Signals(signum).name)
    print(f"trainers.train: preempted by {signal.Signals(signum).name}", file=sys.stderr,
          flush=True)
    os._exit(75)


for signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, stop)
with open(os.path.join(directory, f"pid-{rank}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.rename(os.path.join(directory, f"pid-{rank}.tmp"), os.path.join(directory, f"pid-{rank}"))
while True:
    time.sleep(0.1)
"""
# The launcher's command line (`python -m trainers.launch`), the repository's `trainers`
# first on its own path; its workers run in `cwd`, whose stand-in comes first on theirs.
LAUNCHER = ("import sys; sys.path.insert(0, {root!r}); from trainers import launch; "
            "sys.exit(launch.main(sys.argv[1:]))")
JOB_SECONDS = 120

SLEEPER = ("import subprocess, sys, time\n"
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
           "print('child', child.pid, flush=True)\n"
           "time.sleep(120)\n")


def kill(pids):
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


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


class SignalTest(absltest.TestCase):

    def start(self, engine):
        """The launcher of 2 stand-in trainers on `engine`, once both are running: (its
        Popen, {rank: pid}, the directory the stand-ins write in)."""
        root = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        os.makedirs(os.path.join(root, "trainers"))
        for name, text in (("__init__.py", ""), ("train.py", FAKE_TRAINER)):
            with open(os.path.join(root, "trainers", name), "w", encoding="utf-8") as f:
                f.write(text)
        self.stderr_path = os.path.join(root, "launcher.stderr")
        with open(self.stderr_path, "w", encoding="utf-8") as stderr:
            job = subprocess.Popen(
                [sys.executable, "-c", LAUNCHER.format(root=REPO_ROOT), f"--engine={engine}",
                 "--workers=2", "--", "--steps=10"], cwd=root, stdout=subprocess.DEVNULL,
                stderr=stderr, start_new_session=True,
                env=dict(os.environ, FAKE_TRAINER_DIR=root, TF_CPP_MIN_LOG_LEVEL="2"))
        self.addCleanup(self.kill_group, job)
        deadline = time.monotonic() + JOB_SECONDS
        paths = [os.path.join(root, f"pid-{rank}") for rank in range(2)]
        while not all(os.path.exists(path) for path in paths):
            self.assertIsNone(job.poll(), self.stderr())
            self.assertLess(time.monotonic(), deadline, "the workers did not start")
            time.sleep(0.1)
        pids = {}
        for rank, path in enumerate(paths):
            with open(path, encoding="utf-8") as f:
                pids[rank] = int(f.read())
        self.addCleanup(kill, pids.values())  # should the launcher have left them
        return job, pids, root

    @staticmethod
    def kill_group(job):
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()

    def stderr(self):
        with open(self.stderr_path, encoding="utf-8") as f:
            return own_lines(f.read())

    def assert_none_running(self, pids):
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertFalse([pid for pid in pids if running(pid)], "workers outlived the job")

    def test_signals_reach_every_worker_and_the_launcher_exits_75(self):
        for engine, signum in (("multi_worker", signal.SIGINT), ("multi_worker", signal.SIGTERM),
                               ("horovod", signal.SIGTERM)):
            with self.subTest(engine=engine, signal=signum.name):
                job, pids, root = self.start(engine)
                job.send_signal(signum)
                self.assertEqual(job.wait(timeout=JOB_SECONDS), preemption.EXIT_CODE,
                                 self.stderr())
                for rank in pids:
                    with open(os.path.join(root, f"signal-{rank}"), encoding="utf-8") as f:
                        self.assertEqual(f.read(), signum.name)
                kind = "worker" if engine == "multi_worker" else "rank"
                self.assertEqual(self.stderr()[-1], (
                    f"trainers.launch: {signum.name} forwarded to every {kind}; every {kind} "
                    f"stopped after the same step ({kind} 0's line above says where the run "
                    "continues from); exit code 75"))
                self.assertFalse([line for line in self.stderr() if "Traceback" in line])
                self.assert_none_running(pids.values())

    def test_a_worker_killed_is_named_and_ends_the_job(self):
        job, pids, _ = self.start("multi_worker")
        os.kill(pids[1], signal.SIGKILL)
        self.assertEqual(job.wait(timeout=JOB_SECONDS), 128 + signal.SIGKILL)
        self.assertEqual(self.stderr()[-1], f"trainers.launch: worker 1 (pid {pids[1]}) was "
                         "killed by SIGKILL; the other workers were stopped; exit code 137")
        self.assert_none_running(pids.values())

    def test_timeout_must_be_a_positive_finite_number_of_seconds(self):
        for value in ("nan", "-5", "0", "inf"):
            with self.subTest(value), contextlib.redirect_stderr(io.StringIO()) as err, \
                    self.assertRaises(SystemExit) as raised:
                launch.main(["--engine=multi_worker", f"--timeout={value}", "--", "--steps=1"])
            self.assertEqual(raised.exception.code, 2)
            self.assertEqual(err.getvalue().splitlines()[-1],
                             "python -m trainers.launch: error: --timeout must be a finite "
                             f"number of seconds > 0, got {float(value):g}")


if __name__ == "__main__":
    absltest.main()
