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
    `start(...)` when training begins; the callback in `fit`; `stop_agreed()` between
    `fit` calls (a collective: every rank calls it at the same point).
    """

    def __init__(self):
        super().__init__()
        self._previous = {}
        self._signal = None  # the first signal received, until the process ends
        self._timer = None
        self._training = False
        self._agreed = False
        self._communicator = None
        self._grace_seconds = None
        self._resume_hint = None
        self.signalled_ranks = []

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python's rule
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc_info):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
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
        if self._signal is not None:
            self._exit_now(signum, f"a second {signal.Signals(signum).name}")
        self._signal = signum
        if not self._training:
            self._exit_now(signum, f"{signal.Signals(signum).name} before training started")
        self._timer = threading.Timer(self._grace_seconds, self._grace_expired)
        self._timer.daemon = True
        self._timer.start()

    def _grace_expired(self):
        self._exit_now(self._signal, f"{self.signal_name}, and the {self._grace_seconds:g} s "
                                     "grace period passed before its checkpoint was written")

    def _exit_now(self, signum, why):
        hint = self._resume_hint() if self._resume_hint else "nothing was trained yet"
        message = f"{_PREFIX}stopped by {why}; exiting without a new checkpoint; {hint}\n"
        # os.write and os._exit: safe from a signal handler or the timer's thread, and
        # nothing (a hung collective, interpreter shutdown) can delay the exit.
        os.write(sys.stderr.fileno(), message.encode())
        os._exit(128 + signum)

    def stop_agreed(self):
        """Whether any rank was signalled; a collective on several ranks. Once True it
        stays True without communicating (every rank knows it at the same step)."""
        if self._agreed or self._communicator is None:
            return self._agreed
        local = tf.constant([self._signal or 0], tf.int32)
        if self._communicator.size > 1:
            flags = self._communicator.allgather(local, category="metrics").numpy()
        else:
            flags = local.numpy()
        self.signalled_ranks = [rank for rank, flag in enumerate(flags) if flag]
        if self.signalled_ranks and self._signal is None:  # another rank's signal
            self._signal = int(flags[self.signalled_ranks[0]])
        self._agreed = bool(self.signalled_ranks)
        return self._agreed

    def on_train_batch_end(self, batch, logs=None):
        # The last step of a `fit` lets it end normally (its epoch may be complete).
        if self.stop_agreed() and batch + 1 < self.params["steps"]:
            raise StopNow()

    def report(self, step, total_steps, checkpoint, model_dir):
        """The one line the chief prints after writing the preemption checkpoint."""
        ranks = ", ".join(str(rank) for rank in self.signalled_ranks)
        plural = "s" if len(self.signalled_ranks) > 1 else ""
        sys.stderr.write(
            f"{_PREFIX}preempted by {self.signal_name} (rank{plural} {ranks}): checkpoint "
            f"{checkpoint} holds step {step} of {total_steps}; continue with --resume "
            f"--model_dir={model_dir} (or --auto_resume); exit code {EXIT_CODE}\n")
        sys.stderr.flush()
