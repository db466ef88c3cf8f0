"""One run per model_dir at a time: the process that writes a run's files holds a lock.

The lock is an exclusive `flock` on `<model_dir>/.trainer.lock`, taken before the run
writes anything and held until it ends. The kernel releases a flock when its process
ends, however it ends (an exception, SIGTERM, SIGKILL, a crash), so a lock left by a
process that is gone never blocks the next start; a file system that cannot lock at all
is warned about, not an error. The file names the process holding it (pid, host, start
time), so a second start can say which one it is. The file stays after the run: it
marks the directory as one the trainer started a run in.
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket

from absl import logging

from trainers import errors, storage

LOCK_FILE = ".trainer.lock"


class ModelDirInUse(errors.RunError):
    """Another process holds the model_dir's lock; the message names it."""


def path(model_dir):
    """The lock file of `model_dir`."""
    return os.path.join(model_dir, LOCK_FILE)


@contextlib.contextmanager
def holding(model_dir):
    """Holds the lock of `model_dir` (created if missing) while the block runs; raises
    `ModelDirInUse` naming the process that holds it instead."""
    lock_path = path(model_dir)
    with storage.failing_cleanly(lock_path, 0):
        os.makedirs(model_dir, exist_ok=True)
        lock_file = open(lock_path, "a+", encoding="utf-8")  # pylint: disable=consider-using-with
    with lock_file:  # closing it unlocks
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            raise ModelDirInUse(
                f"model_dir {model_dir} is in use by another run of the trainer "
                f"({_holder(lock_file.read())}; it holds {lock_path}): wait for it to end, or "
                "choose another --model_dir") from None
        except OSError as error:  # a file system without locks (ENOLCK, EOPNOTSUPP, ...)
            logging.warning("cannot lock %s (%s): nothing stops a second run from writing "
                            "into %s meanwhile", lock_path, error.strerror, model_dir)
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        text = json.dumps(holder) + "\n"
        with storage.failing_cleanly(lock_path, len(text)):
            lock_file.truncate(0)
            lock_file.write(text)
            lock_file.flush()
        yield


def _holder(text):
    """Who holds a lock, from its file's text, as a phrase."""
    try:
        holder = json.loads(text)
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
    except (ValueError, TypeError, KeyError):
        return "a process that has not written its pid yet"
