"""Preemption: SIGTERM or SIGINT end a run after the step in progress, with a checkpoint
at that step, so a restarted job loses no training.

Job schedulers (Slurm, Kubernetes, preemptible cloud VMs) send SIGTERM and kill the job
a grace period later; Ctrl-C sends SIGINT. While a `Preemption` is active the two
signals only set a flag. After each training step every rank learns which ranks were
signalled (one small allgather), so all ranks stop after the same step even when the
signal reaches them a step apart; the trainer writes its checkpoint at that step
(skipping the epoch's evaluation) and raises `Preempted`, which ends the process with
`EXIT_CODE`. `--resume`/`--auto_resume` continue from that checkpoint exactly as if the
run had not stopped.

The checkpoint must be written within the grace period (`--preemption_grace_seconds`)
after the signal: if it is not (a step or a disk slower than that), or a second signal
comes, the process ends at once with 128 + the signal's number (what the signal itself
would give: 143 for SIGTERM, 130 for SIGINT) and says which checkpoint a restart
continues from. A signal before training starts ends the process the same way; there
is nothing to save yet.
"""

import contextlib
import os
import signal
import sys
import threading

import keras
import tensorflow as tf

# sysexits.h EX_TEMPFAIL, "temporary failure, the user is invited to retry": the run
# stopped cleanly with a checkpoint and continues when the job is started again.
EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGINT)
_PREFIX = "trainers.train: "


@contextlib.contextmanager
def handling(handler):
    """SIGTERM and SIGINT go to `handler` while the block runs, then to what they went to
    before. Only the main thread may set handlers (Python's rule): elsewhere nothing
    changes."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, handler_before in previous.items():
            signal.signal(signum, handler_before)


class Preempted(SystemExit):
    """Ends the process with `EXIT_CODE`; raised once the preemption checkpoint is
    written. `step` is the step it holds."""

    def __init__(self, step):
        super().__init__(EXIT_CODE)
        self.step = step


class StopNow(Exception):
    """Raised by the callback to leave `fit` right after the agreed step (Keras would
    otherwise evaluate before returning)."""


class Preemption(keras.callbacks.Callback):
    """Catches SIGTERM and SIGINT while active (a context manager) and stops training at
    a step all ranks agree on.

    Use: `with Preemption() as preemption:` around building and training a run;
    `start(...)` when training begins; the callback in `fit`; `stop_agreed()` before
    each `fit` (a collective: every rank calls it at the same point).
    """

    def __init__(self):
        super().__init__()
        self._handling = None
        self._received = None  # the first signal this process received
        self._signal = None  # the signal the ranks stop for (received here or elsewhere)
        self._timer = None
        self._training = False
        self._agreed = False
        self._communicator = None
        self._grace_seconds = None
        self._resume_hint = None
        self.signalled_ranks = []

    def __enter__(self):
        self._handling = handling(self._on_signal)
        self._handling.__enter__()  # pylint: disable=unnecessary-dunder-call
        return self

    def __exit__(self, *exc_info):
        self._handling.__exit__(None, None, None)
        if self._timer is not None:
            self._timer.cancel()
        self._training = False

    def start(self, communicator, grace_seconds, resume_hint):
        """Training begins: from now on a signal stops at a step boundary.

        `resume_hint()` returns where a restart would continue from (a phrase), for the
        message when the process must end without a new checkpoint.
        """
        self._communicator = communicator
        self._grace_seconds = grace_seconds
        self._resume_hint = resume_hint
        self._training = True

    @property
    def signal_name(self):
        return signal.Signals(self._signal).name if self._signal else None

    def _on_signal(self, signum, frame):
        del frame
        name = signal.Signals(signum).name
        if not self._training:
            self._exit_now(signum, f"{name} before training started; nothing new to save")
        if self._received is not None:
            self._exit_now(signum, f"a second {name}; exiting without a new checkpoint; "
                                   f"{self._resume_hint()}")
        self._received = signum
        self._signal = self._signal or signum
        self._timer = threading.Timer(self._grace_seconds, self._grace_expired)
        self._timer.daemon = True
        self._timer.start()

    def _grace_expired(self):
        self._exit_now(self._received, (
            f"{signal.Signals(self._received).name}, and the {self._grace_seconds:g} s grace "
            "period passed before its checkpoint was written; exiting without a new "
            f"checkpoint; {self._resume_hint()}"))

    @staticmethod
    def _exit_now(signum, why):
        # os.write and os._exit: safe from a signal handler or the timer's thread, and
        # nothing (a hung collective, interpreter shutdown) can delay the exit.
        os.write(sys.stderr.fileno(), f"{_PREFIX}stopped by {why}\n".encode())
        os._exit(128 + signum)

    @property
    def agreed(self):
        """Whether the ranks agreed to stop already (no communication)."""
        return self._agreed

    def stop_agreed(self):
        """Whether any rank was signalled; a collective on several ranks. Once True it
        stays True without communicating (every rank knows it at the same step)."""
        if self._agreed or self._communicator is None:
            return self._agreed
        local = tf.constant([self._received or 0], tf.int32)
        if self._communicator.size > 1:
            flags = self._communicator.allgather(local, category="metrics").numpy()
        else:
            flags = local.numpy()
        self.signalled_ranks = [rank for rank, flag in enumerate(flags) if flag]
        if self.signalled_ranks and self._signal is None:  # another rank's signal
            self._signal = int(flags[self.signalled_ranks[0]])
        self._agreed = bool(self.signalled_ranks)
        return self._agreed

    def wait_for_every_rank(self):
        """Returns once every rank called it (a collective), so that no rank exits
        before the chief's checkpoint is written: horovodrun ends the other ranks as
        soon as one exits non-zero."""
        if self._communicator is not None and self._communicator.size > 1:
            self._communicator.allgather(tf.constant([0], tf.int32), category="metrics")

    def on_train_batch_end(self, batch, logs=None):
        # The last step of a `fit` lets it end normally (its epoch may be complete).
        if self.stop_agreed() and batch + 1 < self.params["steps"]:
            raise StopNow()

    def report(self, step, total_steps, checkpoint, model_dir):
        """The one line the chief prints when the run stops: `checkpoint` holds `step`
        (None: stopped before its first step, nothing to save)."""
        ranks = ", ".join(str(rank) for rank in self.signalled_ranks)
        plural = "s" if len(self.signalled_ranks) > 1 else ""
        where = (f"checkpoint {checkpoint} holds step {step} of {total_steps}; continue with "
                 f"--resume --model_dir={model_dir} (or --auto_resume)" if checkpoint else
                 "stopped before the first step, nothing to save; start the same command "
                 "again")
        sys.stderr.write(f"{_PREFIX}preempted by {self.signal_name} (rank{plural} {ranks}): "
                         f"{where}; exit code {EXIT_CODE}\n")
        sys.stderr.flush()
