"""A 2-rank horovodrun job whose ranks save their results as `<scenario>.rank<r>.npz`.

`run_and_load` runs a worker script under `trainers.launch.run_horovod_job` (killed
whole after `timeout` s: a hang is a failure) with an environment variable naming a fresh
directory every rank writes to, then loads what each rank saved there.
"""

import os
import shutil
import tempfile
import time

import numpy as np
from absl import logging
from absl.testing import absltest

from trainers.launch import run_horovod_job


def run_and_load(script, out_variable, scenarios, timeout, num_ranks=2):
    """(exit code, job output, {scenario: [rank 0's arrays, rank 1's, ...]}); a missing
    file fails with the end of the job's output."""
    os.makedirs(absltest.get_default_test_tmpdir(), exist_ok=True)
    out_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
    start = time.time()
    os.environ[out_variable] = out_dir  # Read by every rank.
    try:
        returncode, output = run_horovod_job(script, num_ranks=num_ranks, timeout=timeout)
    finally:
        del os.environ[out_variable]
    logging.info("%d-rank job %s exited %d after %.1f s", num_ranks,
                 os.path.basename(script), returncode, time.time() - start)
    saved = {}
    for scenario in scenarios:
        saved[scenario] = []
        for rank in range(num_ranks):
            path = os.path.join(out_dir, f"{scenario}.rank{rank}.npz")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} saved no {scenario}; job output:\n"
                                     + output[-6000:])
            saved[scenario].append(dict(np.load(path)))
    shutil.rmtree(out_dir)
    return returncode, output, saved
