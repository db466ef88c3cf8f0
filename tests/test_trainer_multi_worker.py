"""trainers.train under MultiWorkerMirroredStrategy, started by
`python -m trainers.launch --engine=multi_worker --workers=2`: a run saved by one process
resumes on 2 workers and finishes, rank 0 alone writing; a worker killed mid-run ends the
whole job within a minute, the launcher naming it (exit code 137), and no worker
outlives it; Ctrl-C to the launcher stops every worker with a checkpoint (exit code 75).
No Horovod here: the runs have it unimportable (tests/no_horovod.py), as where it is not
built."""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import logging
from absl.testing import absltest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import no_horovod  # noqa: E402
import trainer_testing as tt  # noqa: E402
from process_output import running  # noqa: E402
from trainers import launch, preemption  # noqa: E402

WORKERS = 2
FIRST_STEPS, STEPS = 6, 12
KFAC_FLAGS = ["--factor_update_freq=5", "--decomposition_update_freq=10"]
JOB_TIMEOUT_SECONDS = 420  # a start of two TF processes takes 1-2 min on the loaded machine
FAILURE_EXIT_SECONDS = 60
# TensorFlow's distributed input iterator (a MultiDeviceIterator, per-replica buffer 1)
# holds up to a buffered and a prefetched batch per worker beyond the step (measured 2).
PREFETCHED_BATCHES = 2


def launcher(*trainer_flags):
    """The command line of the launcher running trainers.train with `trainer_flags`."""
    return [sys.executable, "-m", "trainers.launch", "--engine=multi_worker",
            f"--workers={WORKERS}", "--", *tt.SMALL_FLAGS, *KFAC_FLAGS, *trainer_flags]


def worker_processes(parent):
    """{TF_CONFIG task index: pid} of the launcher's children."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (FileNotFoundError, ProcessLookupError, ValueError, PermissionError):
            continue
        if b"TF_CONFIG" in environ:
            found[json.loads(environ[b"TF_CONFIG"])["task"]["index"]] = int(pid)
    return found


def kill_job(job):
    """Kills what is left of a job the test started (its session)."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


class TrainerMultiWorkerTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        os.makedirs(absltest.get_default_test_tmpdir(), exist_ok=True)
        cls.model_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        # Both runs, the launcher and its workers, with Horovod unimportable.
        cls.blocked = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        first = tt.run_binary(*tt.SMALL_FLAGS, *KFAC_FLAGS, f"--steps={FIRST_STEPS}",
                              "--distribution=none", f"--model_dir={cls.model_dir}",
                              env=no_horovod.variables(cls.blocked),
                              timeout=JOB_TIMEOUT_SECONDS)
        if first.returncode != 0:
            raise AssertionError(first.stderr[-4000:])
        env = launch.job_environment()
        cls.resumed = subprocess.run(
            launcher(f"--model_dir={cls.model_dir}", "--resume", f"--steps={STEPS}"),
            cwd=tt.ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_SECONDS,
            env=dict(env, **no_horovod.variables(cls.blocked, env)))

    def test_run_of_one_process_resumes_on_two_workers(self):
        self.assertEqual(self.resumed.returncode, 0, self.resumed.stdout[-4000:])
        summary = tt.read_json(os.path.join(self.model_dir, "summary.json"))
        self.assertEqual(summary["num_ranks"], WORKERS)
        self.assertEqual(summary["steps"], STEPS)
        self.assertEqual(summary["kfac"]["counters"]["steps"], STEPS)
        # Epoch ends at steps 10 and 12 on 2 workers; the trainer keeps the newest 2.
        self.assertEqual(sorted(os.listdir(os.path.join(self.model_dir, "checkpoints"))),
                         ["step-10", "step-12"])
        history = tt.read_json(os.path.join(self.model_dir, "run_history.json"))
        self.assertEqual([start["from_step"] for start in history], [0, FIRST_STEPS])
        self.assertEqual(history[1]["changed"], {"steps": [FIRST_STEPS, STEPS]})
        # The resumed run's fresh examples count both workers' shards, and the batches
        # TensorFlow's distributed iterator fetched ahead of each `fit` call's steps.
        trained = FIRST_STEPS * tt.BATCH + (STEPS - FIRST_STEPS) * WORKERS * tt.BATCH
        fits = 2  # the rest of epoch 0 (10 steps per epoch on 2 workers), then epoch 1
        self.assertBetween(summary["fresh_examples"], trained,
                           trained + fits * PREFETCHED_BATCHES * WORKERS * tt.BATCH)
        # Only rank 0 printed the summary.
        self.assertEqual(self.resumed.stdout.count("logs: "), 1, self.resumed.stdout[-3000:])

    def test_trainer_and_launcher_never_import_horovod(self):
        # The runs above trained (one process, then 2 workers) where every process had
        # Horovod unimportable: none of them tried to import it.
        self.assertEqual(self.resumed.returncode, 0, self.resumed.stdout[-4000:])
        self.assertEqual(no_horovod.attempts(self.blocked), "")

    def start_training(self, model_dir, started="run_history.json"):
        """The launcher of a long run in `model_dir`, once `started` is there (by default
        once both workers train): (its Popen, {worker index: pid}, the path of its
        output)."""
        log_path = os.path.join(model_dir + ".log")
        with open(log_path, "w", encoding="utf-8") as log:
            job = subprocess.Popen(launcher(f"--model_dir={model_dir}", "--steps=100000"),
                                   cwd=tt.ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   text=True, env=launch.job_environment(),
                                   start_new_session=True)
        self.addCleanup(kill_job, job)
        deadline = time.time() + JOB_TIMEOUT_SECONDS
        # Training has started once rank 0 recorded the start of the run.
        while not os.path.exists(os.path.join(model_dir, started)):
            self.assertIsNone(job.poll(), f"the job ended before {started} was written")
            self.assertLess(time.time(), deadline, f"{started} was not written")
            time.sleep(0.5)
        time.sleep(5)
        workers = worker_processes(job.pid)
        self.assertEqual(sorted(workers), list(range(WORKERS)))
        return job, workers, log_path

    def test_killed_worker_ends_the_job_naming_it_and_leaves_no_process(self):
        model_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        job, workers, log_path = self.start_training(model_dir)
        os.kill(workers[1], signal.SIGKILL)
        killed_at = time.time()
        job.wait(timeout=FAILURE_EXIT_SECONDS + 30)
        seconds = time.time() - killed_at
        logging.info("the job exited %d, %.1f s after worker 1 was killed",
                     job.returncode, seconds)
        self.assertEqual(job.returncode, 128 + signal.SIGKILL)
        self.assertLess(seconds, FAILURE_EXIT_SECONDS)
        self.assertFalse([pid for pid in workers.values() if running(pid)])
        with open(log_path, encoding="utf-8") as log:
            self.assertEqual(tt.own_lines(log.read())[-1], (
                f"trainers.launch: worker 1 (pid {workers[1]}) was killed by SIGKILL; the "
                "other workers were stopped; exit code 137"))

    def test_ctrl_c_to_the_launcher_checkpoints_and_exits_75(self):
        """SIGINT (Ctrl-C) to the launcher reaches every worker: they stop after the same
        step with its checkpoint, the launcher exits 75 and no worker outlives it."""
        model_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        # After the first epoch's checkpoint (10 steps on 2 workers): training runs.
        job, workers, log_path = self.start_training(model_dir, "checkpoints/step-10")
        job.send_signal(signal.SIGINT)
        job.wait(timeout=JOB_TIMEOUT_SECONDS)
        with open(log_path, encoding="utf-8") as log:
            lines = tt.own_lines(log.read())
        self.assertEqual(job.returncode, preemption.EXIT_CODE, lines[-5:])
        self.assertFalse([line for line in lines if "Traceback" in line
                          or "KeyboardInterrupt" in line], lines[-20:])
        # The ranks named are those the signal had reached when they agreed to stop (the
        # launcher forwards it to each in turn): one or both.
        found = [re.search(r"^\[worker 0\] trainers.train: preempted by SIGINT "
                           r"\((rank 0|rank 1|ranks 0, 1)\): "
                           r"checkpoint (\S+) holds step (\d+) of 100000", line) for line in lines]
        found = [match for match in found if match]
        self.assertLen(found, 1, lines[-10:])
        self.assertEqual(found[0].group(2), tt.checkpoint_dir(model_dir, int(found[0].group(3))))
        self.assertTrue(os.path.isdir(found[0].group(2)))
        self.assertEqual(lines[-1], "trainers.launch: SIGINT forwarded to every worker; every "
                         "worker stopped after the same step (worker 0's line above says where "
                         "the run continues from); exit code 75")
        self.assertFalse([pid for pid in workers.values() if running(pid)])

if __name__ == "__main__":
    absltest.main()
