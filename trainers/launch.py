"""Running a job on this host that cannot hang: a horovodrun job or a plain process.

The tests and benchmarks start real multi-process training jobs with it; a job that
outlives its timeout is killed whole (its own process group, so no rank lingers) and
reported with its output. The tfkfac library never launches processes, so this lives
with the jobs.
"""

import os
import shutil
import signal
import subprocess
import sys

from tfkfac.distributed.factory import WORLD_SIZE_VARIABLES


def job_environment():
    """This environment with the running Python's bin first on PATH, launcher state removed.

    horovodrun and every rank then use the same Python (the project's `.venv`), and a
    job started from inside another job does not inherit its world size.
    """
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = dict(os.environ, PATH=path, TF_CPP_MIN_LOG_LEVEL="2")
    for variable in WORLD_SIZE_VARIABLES:
        env.pop(variable, None)
    return env


def horovodrun_command(argv, num_ranks, env):
    """`horovodrun --gloo` running `python argv...` as `num_ranks` ranks on localhost."""
    horovodrun = shutil.which("horovodrun", path=env["PATH"])
    if horovodrun is None:
        raise FileNotFoundError(f"horovodrun not found on {env['PATH']}: run `make bootstrap`")
    return [horovodrun, "--gloo", "-np", str(num_ranks), "-H", f"localhost:{num_ranks}",
            sys.executable] + list(argv)


def run_job(command, timeout, env):
    """Runs `command`; returns (exit code, stdout+stderr). Raises TimeoutError after `timeout` s."""
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, env=env, start_new_session=True)
    try:
        output, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        raise TimeoutError(f"{' '.join(command[:6])} did not finish in {timeout} s:\n"
                           f"{output[-4000:]}") from None
    return job.returncode, output


def run_horovod_job(script, num_ranks, timeout, args=()):
    """`python script args...` as `num_ranks` Horovod ranks on localhost: (exit code, output)."""
    env = job_environment()
    return run_job(horovodrun_command([script, *args], num_ranks, env), timeout, env)
