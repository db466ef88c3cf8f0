"""A job of several processes that save their results as `<scenario>.<label><i>.npz`:
the horovodrun jobs (label "rank") and the MultiWorkerMirroredStrategy ones ("worker").

`run_and_load` runs the job (`trainers.launch.run_horovod_job` or `run_multi_worker_job`:
killed whole after their timeout, a hang is a failure) with an environment variable
naming a fresh directory every process writes to, then loads what each saved there.
`TwoRankJob` is that for a test class whose tests all read one 2-rank Horovod job.
"""

import os
import shutil
import tempfile
import time

import numpy as np
from absl import logging
from absl.testing import absltest

from process_output import in_background


def run_and_load(launch, out_variable, scenarios, process_label="rank", processes=2):
    """Runs `launch()` -> (exit code, output) with $`out_variable` naming a fresh directory;
    returns (exit code, job output, the time the job exited, {scenario: [process 0's
    arrays, process 1's, ...]}). A missing file fails with the end of the job's output."""
    os.makedirs(absltest.get_default_test_tmpdir(), exist_ok=True)
    out_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
    start = time.time()
    os.environ[out_variable] = out_dir  # Read by every process.
    try:
        returncode, output = launch()
    finally:
        del os.environ[out_variable]
    exit_time = time.time()
    logging.info("%d-%s job exited %d after %.1f s", processes, process_label, returncode,
                 exit_time - start)
    saved = {}
    for scenario in scenarios:
        saved[scenario] = []
        for index in range(processes):
            path = os.path.join(out_dir, f"{scenario}.{process_label}{index}.npz")
            if not os.path.exists(path):
                raise AssertionError(f"{process_label} {index} saved no {scenario}; job "
                                     "output:\n" + output[-6000:])
            saved[scenario].append(dict(np.load(path)))
    shutil.rmtree(out_dir)
    if "timings" in saved:
        logging.info("scenario seconds on %s 0: %s", process_label,
                     {k: round(float(v), 1) for k, v in saved["timings"][0].items()})
    return returncode, output, exit_time, saved


class TwoRankJob:
    """Mixin of an absltest.TestCase whose tests read one 2-rank Horovod job of the worker
    module `WORKER`, run once (started by setUpClass, or earlier by `start_job`), killed
    after `JOB_TIMEOUT_SECONDS`: sets `returncode`, `output` and `saved` ({scenario:
    [rank 0's arrays, rank 1's]}, the `SCENARIOS` the worker saves to its
    $`WORKER.OUT_DIR_VARIABLE`). Not a TestCase itself, so that no test module collects
    it."""

    WORKER = None
    SCENARIOS = ()
    JOB_TIMEOUT_SECONDS = 400
    _job = None  # the job's Future, once started

    @classmethod
    def start_job(cls):
        """Starts the job in a thread of its own (once): a module's setUpModule calls it
        so that the job runs while the module's other tests do."""
        if cls._job is None:
            from trainers.launch import run_horovod_job  # the test process's alone
            script = os.path.splitext(os.path.abspath(cls.WORKER.__file__))[0] + ".py"
            cls._job = in_background(
                run_and_load,
                lambda: run_horovod_job(script, num_ranks=2, timeout=cls.JOB_TIMEOUT_SECONDS),
                cls.WORKER.OUT_DIR_VARIABLE, list(cls.SCENARIOS))
        return cls._job

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.returncode, cls.output, _, cls.saved = cls.start_job().result()

    def test_job_exits_cleanly(self):
        self.assertEqual(self.returncode, 0, self.output[-4000:])


def save_each_placement(out_dir, placements, run):
    """In a 2-rank Horovod job's process: saves `run(comm, placement)` of every placement
    as `<placement>.rank<r>.npz` in `out_dir`; returns the communicator."""
    from tfkfac import distributed  # only the job's processes need Horovod
    comm = distributed.get_communicator("auto")
    assert type(comm).__name__ == "HorovodCommunicator" and comm.size == 2, comm
    for placement in placements:
        np.savez(os.path.join(out_dir, f"{placement}.rank{comm.rank}.npz"),
                 **run(comm, placement))
        print(f"rank {comm.rank}: {placement} done", flush=True)
    return comm
