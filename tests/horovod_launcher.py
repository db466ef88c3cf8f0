"""Runs a script as a real multi-process Horovod job on this host, for tests.

Shared by the tests that need several ranks; a hang becomes a failure, not a stuck suite.
"""

import os
import shutil
import signal
import subprocess
import sys


def run_under_horovodrun(script, num_ranks, timeout):
    """Runs `script` under `horovodrun --gloo` on localhost; returns (exit code, output).

    `.venv/bin` (where sys.executable lives) goes first on PATH so horovodrun and every
    rank use the project's Python. The job runs in its own process group, killed whole on
    timeout so no rank lingers.
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
