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
exits with the failed worker's code (128 + N for one killed by signal N), after one line
naming the worker and how it ended. `horovod` runs `horovodrun --gloo` in a session of
its own. For both, SIGTERM and SIGINT (Ctrl-C) to the launcher are forwarded to every
worker, which stop after the same step with a checkpoint (trainers/preemption.py); the
launcher waits for them and exits 75 when they did (horovodrun itself exits 1 then), or
kills them past their --preemption_grace_seconds and a margin. Nothing it started
outlives it. On a cluster, start one trainer per machine with `TF_CONFIG` naming every
worker (docs/guide.md §5).
"""

import argparse
import contextlib
import ctypes
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from tfkfac.distributed.factory import WORLD_SIZE_VARIABLES
from trainers import config as config_lib, preemption

# After one worker exited with `preemption.EXIT_CODE` (the chief's checkpoint is written),
# seconds the others, stopping after the same step, get to exit before they are killed.
PREEMPTED_EXIT_SECONDS = 60.0
# After a signal the launcher forwarded, seconds beyond the trainers' own
# --preemption_grace_seconds (past which they end themselves) before it kills them.
STOP_MARGIN_SECONDS = 30.0
_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


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


def exit_status(code):
    """A process's exit code as a shell reports it: 128 + N for one ended by signal N."""
    return 128 - code if code < 0 else code


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def how_ended(code):
    """How a process with `Popen.returncode` `code` ended, as a phrase."""
    return f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"


def descendants(pid):
    """The pids of every live descendant of `pid` (from /proc; [] where there is none)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # ended meanwhile
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _kill(pids):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _adopt_orphans():
    """Makes this process the subreaper of its descendants (Linux): a process whose
    parent ends (a rank whose horovodrun is gone) becomes its child, not init's, so that
    `descendants` still finds it and nothing of a job outlives the launcher."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


class SignalForwarder:
    """While active (a context manager, in the main thread), SIGTERM and SIGINT to this
    process are sent on to the pids `targets()` returns instead of ending it: the
    trainers then stop after the same step with a checkpoint (trainers/preemption.py).
    `signals` lists the signals received; `deadline` (time.monotonic) is when the
    workers must have left, `grace_seconds` (their --preemption_grace_seconds) plus a
    margin after the first; a second signal is forwarded too (the trainers then end at
    once). `forward_pending` sends it to workers started after it came."""

    def __init__(self, targets, grace_seconds):
        self._targets = targets
        self.grace_seconds = grace_seconds
        self.signals = []
        self.deadline = None
        self._handling = None
        self._sent = set()

    def __enter__(self):
        self._handling = preemption.handling(self._forward)
        self._handling.__enter__()  # pylint: disable=unnecessary-dunder-call
        return self

    def __exit__(self, *exc_info):
        self._handling.__exit__(None, None, None)

    def _forward(self, signum, frame):
        del frame
        self.signals.append(signum)
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace_seconds + STOP_MARGIN_SECONDS
        self._send(signum, self._targets())

    def _send(self, signum, pids):
        for pid in pids:
            self._sent.add(pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def forward_pending(self):
        """Sends the first signal received to the workers started since."""
        if self.signals:
            self._send(self.signals[0], [pid for pid in self._targets() if pid not in self._sent])

    @property
    def signal_name(self):
        return _signal_name(self.signals[0]) if self.signals else None

    def overdue(self):
        """Whether a forwarded signal's deadline has passed."""
        return self.deadline is not None and time.monotonic() > self.deadline


class MultiWorkerJob:
    """`python argv...` as `num_workers` MultiWorkerMirroredStrategy workers on localhost,
    each with its own `TF_CONFIG` and process group; `output` holds their lines, each
    prefixed by its worker (`echo`: also printed as they come)."""

    def __init__(self, argv, num_workers, env=None, echo=False):
        self.argv, self.num_workers = list(argv), num_workers
        self.env = env or job_environment()
        self.echo = echo
        self.workers = []
        # (index, exit code) of the worker whose failure ended the job, or None.
        self.failed = None
        self._lines, self._lock = [], threading.Lock()

    @property
    def output(self):
        return "".join(self._lines)

    def pids(self):
        """The workers still running."""
        return [worker.pid for worker in self.workers if worker.poll() is None]

    def run(self, timeout, forwarder=None):
        """Runs the job; returns its exit code (`Popen.returncode`: negative for a worker
        ended by a signal), or None when `timeout` s passed first.

        The job ends when every worker has exited; as soon as one fails (exit code other
        than 0 and `preemption.EXIT_CODE`), the others are killed (a worker left alone
        would wait in a collective forever) and the code is the failed worker's (also in
        `failed`). A worker that exits with `preemption.EXIT_CODE` stopped after the
        chief's checkpoint: the others, stopping after the same step, get
        `PREEMPTED_EXIT_SECONDS` to leave, and the code is `preemption.EXIT_CODE`. With
        `forwarder` (a `SignalForwarder`), workers it signalled that are still running at
        its deadline are killed and the code is 128 + the signal. Nothing outlives it.
        """
        ports = free_ports(self.num_workers)
        readers = []
        try:
            for index in range(self.num_workers):
                worker = subprocess.Popen([sys.executable, *self.argv], stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True,
                                          env=dict(self.env, TF_CONFIG=tf_config(ports, index)))
                self.workers.append(worker)
                readers.append(threading.Thread(target=self._collect,
                                                args=(worker, f"[worker {index}] "), daemon=True))
                readers[-1].start()
            return self._supervise(time.monotonic() + timeout, forwarder)
        finally:
            for worker in self.workers:
                if worker.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(worker.pid, signal.SIGKILL)
            for worker in self.workers:
                worker.wait()
            for reader in readers:
                reader.join(timeout=10)

    def _supervise(self, deadline, forwarder):
        preempted_at = None
        while True:
            codes = [worker.poll() for worker in self.workers]
            failed = [(index, code) for index, code in enumerate(codes)
                      if code not in (None, 0, preemption.EXIT_CODE)]
            if failed:
                self.failed = failed[0]
                return failed[0][1]
            if all(code is not None for code in codes):
                return preemption.EXIT_CODE if preemption.EXIT_CODE in codes else 0
            now = time.monotonic()
            if preempted_at is None and preemption.EXIT_CODE in codes:
                preempted_at = now
            if preempted_at is not None and now > preempted_at + PREEMPTED_EXIT_SECONDS:
                return preemption.EXIT_CODE  # the checkpoint is written; the rest is exiting
            if forwarder is not None:
                if forwarder.overdue():
                    return 128 + forwarder.signals[0]
                forwarder.forward_pending()
            if now > deadline:
                return None
            time.sleep(0.1)

    def _collect(self, worker, prefix):
        for line in worker.stdout:
            with self._lock:
                self._lines.append(prefix + line)
                if self.echo:
                    sys.stdout.write(prefix + line)
                    sys.stdout.flush()


def run_multi_worker_job(argv, num_workers, timeout, env=None, echo=False):
    """`python argv...` as `num_workers` MultiWorkerMirroredStrategy workers on localhost:
    (exit code, output with each line prefixed by its worker), as `MultiWorkerJob.run`
    ends it. After `timeout` seconds every worker is killed and TimeoutError raised.
    `echo` also prints the output as it comes.
    """
    job = MultiWorkerJob(argv, num_workers, env, echo)
    code = job.run(timeout)
    if code is None:
        raise TimeoutError(f"{num_workers} workers of {' '.join(argv[:4])} did not finish in "
                           f"{timeout} s:\n{job.output[-4000:]}")
    return code, job.output


class HorovodJob:
    """`python argv...` as `num_ranks` ranks of `horovodrun --gloo` on localhost, in a
    session of its own (a Ctrl-C in the terminal reaches the launcher alone, which
    forwards it to the ranks; horovodrun itself would end them 5 s later). Its output is
    printed as it comes; `rank_codes` collects the non-zero exit code horovodrun reports
    of each rank ("Process 1 exit with status code 75.")."""

    _RANK_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.$")

    def __init__(self, argv, num_ranks, env):
        self.command = horovodrun_command(argv, num_ranks, env)
        self.env = env
        self.process = None
        self.rank_codes = {}

    def ranks(self):
        """The pids of the rank processes running (horovodrun's descendants that hold
        a HOROVOD_RANK; not its middlemen and shells)."""
        found = []
        for pid in descendants(self.process.pid) if self.process else []:
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if b"\0HOROVOD_RANK=" in b"\0" + f.read():
                        found.append(pid)
            except OSError:
                continue
        return found

    def run(self, timeout, forwarder=None):
        """horovodrun's exit code, or None after `timeout` s or, with `forwarder`, past
        its deadline (then every process of the job is killed)."""
        self.process = subprocess.Popen(self.command, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=self.env,
                                        start_new_session=True)
        reader = threading.Thread(target=self._collect, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        try:
            while self.process.poll() is None:
                if time.monotonic() > deadline or (forwarder is not None
                                                   and forwarder.overdue()):
                    return None
                if forwarder is not None:
                    forwarder.forward_pending()
                time.sleep(0.1)
            return self.process.returncode
        finally:
            if self.process.poll() is None:
                _kill(descendants(self.process.pid) + [self.process.pid])
            self.process.wait()
            reader.join(timeout=10)

    def _collect(self):
        for line in self.process.stdout:
            found = self._RANK_EXIT.match(line.strip())
            if found:
                self.rank_codes.setdefault(int(found.group(1)), int(found.group(2)))
            sys.stdout.write(line)
            sys.stdout.flush()


def _trainer_grace_seconds(trainer_flags):
    """The trainers' --preemption_grace_seconds among `trainer_flags` (else its default)."""
    value = None
    for index, flag in enumerate(trainer_flags):
        name, equals, given = flag.partition("=")
        if name == "--preemption_grace_seconds":
            value = given if equals else next(iter(trainer_flags[index + 1:]), None)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return config_lib.TrainConfig.preemption_grace_seconds
    return seconds if math.isfinite(seconds) and seconds > 0 else (
        config_lib.TrainConfig.preemption_grace_seconds)


def _say(message):
    sys.stdout.flush()
    sys.stderr.write(f"trainers.launch: {message}\n")
    sys.stderr.flush()


def _run_multi_worker(argv, workers, timeout, env, grace_seconds):
    job = MultiWorkerJob(argv, workers, env, echo=True)
    with SignalForwarder(job.pids, grace_seconds) as forwarder:
        code = job.run(timeout, forwarder)
    if code is None:
        _say(f"{workers} workers did not finish in {timeout:g} s (--timeout); killed them")
        return 1
    failed = None
    if job.failed is not None:
        index, worker_code = job.failed
        failed = (index, f"(pid {job.workers[index].pid}) {how_ended(worker_code)}")
    return _report(code, forwarder, "worker", failed)


def _run_horovod(argv, workers, timeout, env, grace_seconds):
    job = HorovodJob(argv, workers, env)
    with SignalForwarder(job.ranks, grace_seconds) as forwarder:
        code = job.run(timeout, forwarder)
    if code is None:
        if forwarder.overdue():
            return _report(128 + forwarder.signals[0], forwarder, "rank", None)
        _say(f"{workers} ranks did not finish in {timeout:g} s (--timeout); killed them")
        return 1
    if preemption.EXIT_CODE in job.rank_codes.values():
        code = preemption.EXIT_CODE  # horovodrun itself exits 1
    failed = None
    if code not in (0, preemption.EXIT_CODE) and job.rank_codes:
        rank = min(job.rank_codes)
        failed = (rank, f"exited with code {job.rank_codes[rank]}"
                  + (f" (128 + {_signal_name(job.rank_codes[rank] - 128)})"
                     if job.rank_codes[rank] > 128 else ""))
    return _report(code, forwarder, "rank", failed)


def _report(code, forwarder, kind, failed):
    """The launcher's exit code for a job that ended with `code`, after one line saying
    why when it did not simply finish."""
    signalled = forwarder.signal_name
    if code == preemption.EXIT_CODE:
        _say(f"{f'{signalled} forwarded to every {kind}; ' if signalled else ''}every "
             f"{kind} stopped after the same step ({kind} 0's line above says where the run "
             f"continues from); exit code {code}")
        return code
    if forwarder.overdue():
        _say(f"{signalled} forwarded to every {kind}; some did not stop within "
             f"{forwarder.grace_seconds:g} s (their --preemption_grace_seconds) + "
             f"{STOP_MARGIN_SECONDS:g} s and were killed; exit code {code}")
        return code
    code = exit_status(code)
    if failed is not None:
        index, how = failed
        _say(f"{f'{signalled} forwarded to every {kind}; ' if signalled else ''}{kind} {index} {how}"
             + ("" if kind == "rank" else f"; the other {kind}s were stopped")
             + f"; exit code {code}")
    elif signalled and code:
        _say(f"{signalled} forwarded to every {kind}; they stopped without a new checkpoint "
             f"(see their last lines); exit code {code}")
    return code


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m trainers.launch",
        description="Launch trainers.train as several processes on this host. SIGTERM "
                    "and SIGINT (Ctrl-C) are forwarded to every worker, which stop after "
                    "the same step with a checkpoint; the launcher then exits 75.")
    parser.add_argument("--engine", choices=("multi_worker", "horovod"), required=True,
                        help="multi_worker: tf.distribute MultiWorkerMirroredStrategy "
                             "(TF_CONFIG); horovod: horovodrun --gloo.")
    parser.add_argument("--workers", type=int, default=2, help="Processes to start.")
    parser.add_argument("--timeout", type=float, default=7 * 24 * 3600,
                        help="Seconds before the whole job is killed.")
    parser.add_argument("trainer_flags", nargs="*",
                        help="Flags of trainers.train, after `--`.")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        parser.error(f"--timeout must be a finite number of seconds > 0, got {args.timeout:g}")
    argv = ["-m", "trainers.train", *args.trainer_flags]
    env = job_environment()
    run = _run_horovod if args.engine == "horovod" else _run_multi_worker
    _adopt_orphans()
    try:
        return run(argv, args.workers, args.timeout, env,
                   _trainer_grace_seconds(args.trainer_flags))
    finally:
        orphans = descendants(os.getpid())  # e.g. a rank whose horovodrun was killed
        _kill(orphans)
        for _ in orphans:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(-1, os.WNOHANG)


if __name__ == "__main__":
    sys.exit(main())
