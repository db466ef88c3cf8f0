"""Running a job on this host that cannot hang: a horovodrun job, a
MultiWorkerMirroredStrategy job, or a plain process.

The tests and benchmarks start real multi-process training jobs with it; a job that
outlives its timeout is killed whole (its own process group, so no rank lingers) and
reported with its output. The tfkfac library never launches processes, so this lives
with the jobs. As a program it launches the trainer on this host:

    python -m trainers.launch --engine=multi_worker --workers=2 -- --steps=100 ...
    python -m trainers.launch --engine=horovod --workers=2 -- --steps=100 ...

`multi_worker` starts one `python -m trainers.train` per worker with its own `TF_CONFIG`
(free localhost ports); when a worker fails the others are killed at once and the job
exits with the failed worker's code. On a cluster, start one trainer per machine with
`TF_CONFIG` naming every worker (docs/distributed.md).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from tfkfac.distributed.factory import WORLD_SIZE_VARIABLES


def job_environment():
    """This environment with the running Python's bin first on PATH, launcher state removed.

    horovodrun and every rank then use the same Python (the project's `.venv`), and a
    job started from inside another job does not inherit its world size or `TF_CONFIG`.
    """
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    env = dict(os.environ, PATH=path, TF_CPP_MIN_LOG_LEVEL="2")
    for variable in (*WORLD_SIZE_VARIABLES, "TF_CONFIG"):
        env.pop(variable, None)
    return env


def horovodrun_command(argv, num_ranks, env, hosts=None):
    """`horovodrun --gloo` running `python argv...` as `num_ranks` ranks on localhost, or
    on `hosts` (horovodrun's -H, e.g. "localhost:2,127.0.0.1:2": two nodes to Horovod)."""
    horovodrun = shutil.which("horovodrun", path=env["PATH"])
    if horovodrun is None:
        raise FileNotFoundError(f"horovodrun not found on {env['PATH']}: run `make bootstrap`")
    return [horovodrun, "--gloo", "-np", str(num_ranks), "-H",
            hosts or f"localhost:{num_ranks}", sys.executable] + list(argv)


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


def run_horovod_job(script, num_ranks, timeout, args=(), hosts=None):
    """`python script args...` as `num_ranks` Horovod ranks on localhost (or `hosts`, as
    `horovodrun_command`): (exit code, output)."""
    env = job_environment()
    return run_job(horovodrun_command([script, *args], num_ranks, env, hosts), timeout, env)


def free_ports(count):
    """`count` distinct TCP ports free on localhost now (the OS picks them)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("localhost", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def tf_config(ports, index):
    """`TF_CONFIG` of worker `index` of a cluster of localhost workers on `ports`."""
    return json.dumps({"cluster": {"worker": [f"localhost:{port}" for port in ports]},
                       "task": {"type": "worker", "index": index}})


def run_multi_worker_job(argv, num_workers, timeout, env=None, echo=False):
    """`python argv...` as `num_workers` MultiWorkerMirroredStrategy workers on localhost:
    (exit code, output with each line prefixed by its worker).

    Each worker gets its own `TF_CONFIG` and process group. The job ends when every worker
    has exited, or as soon as one fails: the others are killed then (a worker left alone
    would wait in a collective forever) and the code is the failed worker's. After
    `timeout` seconds every worker is killed and TimeoutError raised. `echo` also prints
    the output as it comes.
    """
    env = env or job_environment()
    ports = free_ports(num_workers)
    lines, lock = [], threading.Lock()
    workers = [subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                env=dict(env, TF_CONFIG=tf_config(ports, index)))
               for index in range(num_workers)]
    readers = [threading.Thread(target=_collect, args=(worker, f"[worker {i}] ", lines,
                                                         lock, echo), daemon=True)
               for i, worker in enumerate(workers)]
    for reader in readers:
        reader.start()
    deadline = time.time() + timeout
    try:
        code = _supervise(workers, deadline)
    finally:
        for worker in workers:
            if worker.poll() is None:
                os.killpg(worker.pid, signal.SIGKILL)
        for worker in workers:
            worker.wait()
        for reader in readers:
            reader.join(timeout=10)
    output = "".join(lines)
    if code is None:
        raise TimeoutError(f"{num_workers} workers of {' '.join(argv[:4])} did not finish in "
                           f"{timeout} s:\n{output[-4000:]}")
    return code, output


def _supervise(workers, deadline):
    """The job's exit code once every worker exited 0 or one failed; None at `deadline`."""
    while time.time() < deadline:
        codes = [worker.poll() for worker in workers]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            return failed[0]
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.1)
    return None


def _collect(worker, prefix, lines, lock, echo):
    for line in worker.stdout:
        with lock:
            lines.append(prefix + line)
            if echo:
                sys.stdout.write(prefix + line)
                sys.stdout.flush()


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m trainers.launch",
        description="Launch trainers.train as several processes on this host.")
    parser.add_argument("--engine", choices=("multi_worker", "horovod"), required=True,
                        help="multi_worker: tf.distribute MultiWorkerMirroredStrategy "
                             "(TF_CONFIG); horovod: horovodrun --gloo.")
    parser.add_argument("--workers", type=int, default=2, help="Processes to start.")
    parser.add_argument("--timeout", type=float, default=7 * 24 * 3600,
                        help="multi_worker: seconds before the whole job is killed.")
    parser.add_argument("trainer_flags", nargs="*",
                        help="Flags of trainers.train, after `--`.")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    argv = ["-m", "trainers.train", *args.trainer_flags]
    env = job_environment()
    if args.engine == "horovod":  # horovodrun supervises its ranks itself
        return subprocess.call(horovodrun_command(argv, args.workers, env), env=env)
    try:
        return run_multi_worker_job(argv, args.workers, args.timeout, env, echo=True)[0]
    except TimeoutError as error:
        sys.stderr.write(f"trainers.launch: {error}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main())
