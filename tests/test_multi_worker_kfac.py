"""K-FAC under MultiWorkerMirroredStrategy: one job of 2 worker processes on localhost
(gRPC collectives, `TF_CONFIG` from `trainers.launch`) runs tests/strategy_kfac_worker.py;
every scenario is checked against one process with the global batch
(tests/strategy_kfac_checks.py). Then worker 1 raises inside `fit` while worker 0 trains
on: the launcher must end the job, non-zero, within a minute. No Horovod on this path:
the workers and this process run with it unimportable (tests/no_horovod.py), as where it
is not built."""

import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import no_horovod  # noqa: E402

no_horovod.install()  # before anything else is imported: this process may not need it

from absl import logging  # noqa: E402
from absl.testing import absltest  # noqa: E402

import job_results  # noqa: E402
import strategy_kfac_checks as checks  # noqa: E402
import strategy_kfac_worker as worker  # noqa: E402
from trainers.launch import job_environment, run_multi_worker_job  # noqa: E402

WORKERS = 2
# Measured ~100 s per scenario on the 2-core machine at load 30 (6 other jobs running).
JOB_TIMEOUT_SECONDS = 1500


class MultiWorkerKfacTest(checks.StrategyChecks, absltest.TestCase):
    ranks = [0, 1]

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        os.makedirs(absltest.get_default_test_tmpdir(), exist_ok=True)
        # Every worker runs with Horovod unimportable (tests/no_horovod.py).
        cls.blocked = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())

        def launch():
            env = dict(job_environment(), **no_horovod.variables(cls.blocked))
            return run_multi_worker_job(
                [os.path.join(TESTS_DIR, "strategy_kfac_worker.py")], WORKERS,
                timeout=JOB_TIMEOUT_SECONDS, env=env)

        names = list(worker.scenarios(None, None)) + ["timings", "steps_per_execution"]
        cls.returncode, cls.output, cls.exit_time, cls.saved = job_results.run_and_load(
            launch, worker.OUT_DIR_VARIABLE, names, "worker", WORKERS)
        cls.references = checks.references()  # after the job, not competing with it

    def test_several_steps_per_execution_is_one_clear_error(self):
        for saved in self.saved["steps_per_execution"]:
            self.assertRegex(str(saved["message"]), r"under MultiWorkerMirroredStrategy `fit` "
                             r"runs one step per execution \(steps_per_execution=1, not 2\)")

    def test_failing_worker_ends_job_with_visible_error(self):
        self.assert_failure_ended_job(self.returncode, self.output, self.exit_time,
                                      worker.FAILURE_MESSAGE)

    def test_trains_where_horovod_cannot_be_imported(self):
        # The workers trained every scenario (setUpClass loaded what each saved) and
        # neither they nor this process (tfkfac, trainers.launch, the references) tried
        # to import Horovod.
        self.assertEqual(no_horovod.attempts(self.blocked), "")
        self.assertEqual(no_horovod.ATTEMPTS, [])
        self.assertNotIn("horovod", sys.modules)
        # The block works in a process started the same way: the check above can fail.
        with tempfile.TemporaryDirectory(dir=absltest.get_default_test_tmpdir()) as control:
            env = dict(job_environment(), **no_horovod.variables(control))
            probe = subprocess.run([sys.executable, "-c", "import horovod.tensorflow"],
                                   env=env, capture_output=True, text=True, timeout=60)
            self.assertNotEqual(probe.returncode, 0)
            self.assertIn("blocked by tests/no_horovod.py", probe.stderr)
            self.assertIn("import horovod", no_horovod.attempts(control))
        logging.info("no process of the job imported Horovod")


if __name__ == "__main__":
    absltest.main()
