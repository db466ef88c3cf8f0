"""trainers.train under `horovodrun --gloo -np 2`: the job finishes, both ranks end with
identical variables (gradients averaged, state broadcast), metrics count both shards,
and only rank 0 writes logs, checkpoints and the summary.

Issue 29: ranks launched with different settings, or resuming from different steps
(per-rank storage), end the job within seconds with one line naming the setting and
each rank's value (6); SIGTERM reaching one rank stops both after the same step, with
a checkpoint of it, and the resumed job ends with the variables of one never stopped
(4)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import logging
from absl.testing import absltest
import numpy as np
import psutil

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import trainer_testing as tt  # noqa: E402
import trainer_worker as worker  # noqa: E402
from trainer_rank_worker import RANK_ARGS_VARIABLE  # noqa: E402
from trainers import launch, preemption  # noqa: E402
from trainers.launch import run_horovod_job  # noqa: E402

NUM_RANKS = 2
JOB_TIMEOUT_SECONDS = 280
TWO_NODES = "localhost:2,127.0.0.1:2"  # 4 ranks as 2 nodes to Horovod
RANK_WORKER = os.path.join(TESTS_DIR, "trainer_rank_worker.py")
RUNS_WORKER = os.path.join(TESTS_DIR, "trainer_runs_worker.py")
# The K-FAC run of trainer_worker.py as flags of the binary (its model_dir aside).
KFAC_FLAGS = [f"--{name}={value}" for name, value in worker.SETTINGS.items()]


def rank_process(launcher_pid, rank):
    """The trainer process of `rank` among the launcher's descendants."""
    found = []
    for process in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if ("trainers.train" in process.cmdline()
                    and process.environ().get("HOROVOD_RANK") == str(rank)):
                found.append(process)
        except psutil.Error:  # a process that ended meanwhile
            continue
    if len(found) != 1:
        raise AssertionError(f"expected one trainer process of rank {rank}, found {found}")
    return found[0]


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

    def run_ranks(self, argv, rank_argv=None):
        """`python -m trainers.train argv` on 2 ranks, rank r adding `rank_argv[r]`;
        returns (exit code, output, seconds)."""
        for rank, extra in (rank_argv or {}).items():
            variable = RANK_ARGS_VARIABLE.format(rank)
            os.environ[variable] = " ".join(extra)
            self.addCleanup(os.environ.pop, variable)
        start = time.monotonic()
        returncode, output = run_horovod_job(RANK_WORKER, NUM_RANKS, JOB_TIMEOUT_SECONDS, argv)
        return returncode, output, time.monotonic() - start

    def assert_every_rank_ends_with(self, output, message):
        for rank in range(NUM_RANKS):
            lines = [line.split(":", 1)[1] for line in output.splitlines()
                     if line.startswith(f"[{rank}]<stderr>:")]
            # horovodrun ends the other rank once one has exited; a rank still shutting
            # down after its error line gets the shell's "Terminated" after it.
            while lines and lines[-1] == "Terminated":
                lines.pop()
            self.assertTrue(lines, output[-3000:])
            self.assertEqual(lines[-1], message, output[-3000:])
            self.assertFalse([line for line in lines if "Traceback" in line], lines)

    def test_ranks_with_different_flags_stop_in_seconds_naming_the_setting(self):
        model_dir = tempfile.mkdtemp(dir=self.out_dir)
        returncode, output, seconds = self.run_ranks(
            [*KFAC_FLAGS, f"--model_dir={model_dir}"], {1: ["--batch_size=64"]})
        self.assertNotEqual(returncode, 0)
        self.assert_every_rank_ends_with(
            output, "trainers.train: error: ranks disagree on batch_size (rank 0: 32, rank 1: "
            "64); steps_per_epoch (rank 0: 20, rank 1: 10); every rank must run with the same "
            "settings")
        logging.info("ranks with different --batch_size: job ended after %.1f s", seconds)

    def test_rank_resuming_from_another_step_stops_naming_the_storage(self):
        # Per-rank storage: rank 0 holds the 12-step run, rank 1 an empty directory.
        rank_0 = os.path.join(tempfile.mkdtemp(dir=self.out_dir), "run")
        shutil.copytree(os.path.join(self.out_dir, "kfac"), rank_0)
        rank_1 = tempfile.mkdtemp(dir=self.out_dir)
        returncode, output, _ = self.run_ranks(
            [*KFAC_FLAGS, "--steps=24", "--auto_resume"],
            {0: [f"--model_dir={rank_0}"], 1: [f"--model_dir={rank_1}"]})
        self.assertNotEqual(returncode, 0)
        self.assert_every_rank_ends_with(
            output, f"trainers.train: error: ranks disagree on resume_step (rank 0: "
            f"{worker.STEPS}, rank 1: 0); each rank resumes from the newest checkpoint in its "
            f"own model_dir (rank 0: \"{rank_0}\", rank 1: \"{rank_1}\"), which rank 0 "
            "writes: give every rank the same storage; every rank must run with the same "
            "settings")

    def test_hierarchical_reduction_on_two_nodes_trains_as_the_flat_mean(self):
        """`--hierarchical_reduction` on 4 ranks as 2 nodes (two host names of this
        machine) reaches K-FAC's communicator: the run ends with the flat run's weights
        within float32 rounding (the means sum in another order). One job runs both, the
        hierarchical run first (it initializes Horovod with the process sets it adds). On
        one process the flag is refused with one line (tests/test_trainer.py)."""
        model_dirs = {name: os.path.join(tempfile.mkdtemp(dir=self.out_dir), "run")
                      for name in ("hierarchical", "flat")}
        runs = [[*KFAC_FLAGS, f"--model_dir={model_dirs['hierarchical']}",
                 "--hierarchical_reduction"], [*KFAC_FLAGS, f"--model_dir={model_dirs['flat']}"]]
        returncode, output = run_horovod_job(RUNS_WORKER, 4, JOB_TIMEOUT_SECONDS,
                                             [json.dumps(runs)], hosts=TWO_NODES)
        self.assertEqual(returncode, 0, output[-3000:])
        saved = {name: tt.step_tensors(model_dir, worker.STEPS)
                 for name, model_dir in model_dirs.items()}
        self.assertEqual(sorted(saved["flat"]), sorted(saved["hierarchical"]))
        for key, want in saved["flat"].items():
            if key.startswith("model/"):
                np.testing.assert_allclose(saved["hierarchical"][key], want, rtol=0,
                                           atol=1e-4 * np.max(np.abs(want)), err_msg=key)

    def test_sigterm_to_one_rank_stops_both_after_one_step_and_resume_is_exact(self):
        model_dir = os.path.join(tempfile.mkdtemp(dir=self.out_dir), "run")
        # 10 ms per example: a step takes at least 0.32 s. Rank 0's progress bar shows
        # when training runs; a generous grace period (a loaded machine is not the subject).
        argv = [*KFAC_FLAGS, f"--model_dir={model_dir}", "--read_latency=0.01", "--verbose=1",
                "--preemption_grace_seconds=300"]
        env = launch.job_environment()
        log_path = os.path.join(tempfile.mkdtemp(dir=self.out_dir), "job.log")
        with open(log_path, "w", encoding="utf-8") as log:
            job = subprocess.Popen(launch.horovodrun_command([RANK_WORKER, *argv], NUM_RANKS, env),
                                   stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                                   start_new_session=True)
        try:
            # Rank 0's progress bar (12 steps in this epoch) has passed 2 steps.
            tt.wait_for(job, log_path, r"\[0\]<stdout>:.*\b([2-9]|10)/12",
                        timeout=JOB_TIMEOUT_SECONDS)
            rank_process(job.pid, 1).send_signal(signal.SIGTERM)
            job.wait(timeout=JOB_TIMEOUT_SECONDS)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
        with open(log_path, encoding="utf-8") as log:
            output = log.read()
        self.assertNotEqual(job.returncode, 0, output[-3000:])
        # Both ranks leave after the checkpoint; the first to exit (75) makes horovodrun
        # end the other, which may still be shutting down.
        self.assertRegex(output, rf"Process \d exit with status code {preemption.EXIT_CODE}\.")
        found = re.search(r"\[0\]<stderr>:trainers.train: preempted by SIGTERM \(rank 1\): "
                          r"checkpoint (\S+) holds step (\d+) of 12", output)
        self.assertIsNotNone(found, output[-3000:])
        step = int(found.group(2))
        self.assertEqual(found.group(1), tt.checkpoint_dir(model_dir, step))
        self.assertLess(step, worker.STEPS)
        logging.info("SIGTERM to rank 1: both ranks stopped after step %d", step)
        returncode, output, _ = self.run_ranks([f"--model_dir={model_dir}", "--resume"])
        self.assertEqual(returncode, 0, output[-3000:])
        tt.assert_same_tensors(self, tt.step_tensors(os.path.join(self.out_dir, "kfac"),
                                                     worker.STEPS),
                               tt.step_tensors(model_dir, worker.STEPS))


if __name__ == "__main__":
    absltest.main()
