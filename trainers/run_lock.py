"""One run per model_dir at a time: the process that writes a run's files holds a lock.

The lock is an exclusive `flock` on `<model_dir>/.trainer.lock`, taken before the run
writes anything and held until it ends. The kernel releases a flock when its process
ends, however it ends (an exception, SIGTERM, SIGKILL, a crash), so a lock left by a
process that is gone never blocks the next start; a file system that cannot lock at all
is warned about, not an error. The file names the process holding it (pid, host, start
time), so a second start can say which one it is. The file stays after the run: it
marks the directory as one the trainer started a run in. The lock never follows a
symbolic link and never writes into a file it did not create: a `.trainer.lock` that is
a link, not a regular file, has other hard links, or holds anything but a lock of the
trainer is refused with one line naming it (`LockFileError`), before a run writes
anything.
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket
import stat

from absl import logging

from trainers import errors, storage

LOCK_FILE = ".trainer.lock"


class ModelDirInUse(errors.RunError):
    """Another process holds the model_dir's lock; the message names it."""


def path(model_dir):
    """The lock file of `model_dir`."""
    return os.path.join(model_dir, LOCK_FILE)


class LockFileError(errors.RunError):
    """`<model_dir>/.trainer.lock` is not a lock file of the trainer (a symbolic link,
    another kind of file, a file with another content): it is never followed or
    overwritten; the message names it."""


# The trainer's lock file holds one short JSON line; a larger file is someone else's.
_MAX_LOCK_BYTES = 4096
# Never through a symbolic link; a FIFO opens without waiting for a writer.
_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def check(model_dir):
    """Whether `model_dir` holds the lock file a run of the trainer left (a new run there
    may then rewrite that run's files); raises `LockFileError` naming it when the path is
    taken by anything else (a symbolic link, even to a lock, another kind of file, a
    file with another content), which the trainer never follows or overwrites."""
    lock_path = path(model_dir)
    try:
        descriptor = os.open(lock_path, os.O_RDONLY | _NO_FOLLOW)
    except FileNotFoundError:
        return False
    except OSError as error:
        refused = _refused(lock_path, error)
        if not isinstance(refused, LockFileError):
            refused = LockFileError(f"{lock_path} cannot be read ({error.strerror}): the "
                                    "trainer must read its lock to know whose it is")
        raise refused from None
    try:
        _check_ours(descriptor, lock_path)
    finally:
        os.close(descriptor)
    return True


def _open(lock_path):
    """A descriptor of `lock_path` for reading and writing: a new file, created here (never
    through a symbolic link), or the trainer's lock file that is there already."""
    create = os.O_RDWR | _NO_FOLLOW | os.O_CREAT | os.O_EXCL
    try:
        return os.open(lock_path, create, 0o644)
    except FileExistsError:
        pass
    try:
        return os.open(lock_path, os.O_RDWR | _NO_FOLLOW)
    except FileNotFoundError:  # removed meanwhile: create it after all
        return os.open(lock_path, create, 0o644)
    except OSError as error:
        raise _refused(lock_path, error) from None


def _refused(lock_path, error):
    """The `LockFileError` of a `lock_path` that cannot be opened as a lock file (`error`
    from `os.open` with O_NOFOLLOW), or an OSError of the file system to raise as is."""
    if os.path.islink(lock_path):
        return _not_ours(lock_path, f"is a symbolic link (to {os.readlink(lock_path)})")
    if os.path.isdir(lock_path):
        return _not_ours(lock_path, "is a directory")
    return error


def _check_ours(descriptor, lock_path, content=True):
    """Raises `LockFileError` unless the open `descriptor` is the trainer's lock file: a
    regular file of one link, and (`content`) empty or naming the process that held it."""
    status = os.fstat(descriptor)
    if not stat.S_ISREG(status.st_mode):
        raise _not_ours(lock_path, "is not a regular file")
    if status.st_nlink != 1:
        raise _not_ours(lock_path, f"is a file with {status.st_nlink} hard links (another "
                                   "file's name too)")
    if not content:
        return
    text = os.pread(descriptor, _MAX_LOCK_BYTES + 1, 0).decode("utf-8", errors="replace")
    if text.strip() and not _holder_fields(text):
        raise _not_ours(lock_path, "holds something other than a lock of the trainer (its "
                                   "pid, host and start time)")


def _not_ours(lock_path, what):
    return LockFileError(
        f"{lock_path} {what}: the trainer takes its lock in a file it creates itself and "
        "never follows a link or overwrites a file it did not create; move it away, or "
        "choose another --model_dir")


@contextlib.contextmanager
def holding(model_dir):
    """Holds the lock of `model_dir` (created if missing) while the block runs; raises
    `ModelDirInUse` naming the process that holds it instead, or `LockFileError` when
    the lock's path is taken by something else (`check`)."""
    lock_path = path(model_dir)
    with storage.failing_cleanly(lock_path, 0):
        os.makedirs(model_dir, exist_ok=True)
        descriptor = _open(lock_path)
    try:
        _check_ours(descriptor, lock_path, content=False)  # the content once it is locked
    except LockFileError:
        os.close(descriptor)
        raise
    # Closing it unlocks.
    with os.fdopen(descriptor, "r+", encoding="utf-8", errors="replace") as lock_file:
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
        _check_ours(lock_file.fileno(), lock_path)
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        text = json.dumps(holder) + "\n"
        with storage.failing_cleanly(lock_path, len(text)):
            lock_file.truncate(0)
            lock_file.seek(0)
            lock_file.write(text)
            lock_file.flush()
        yield


def _holder_fields(text):
    """The holder a lock file's `text` names ({pid, host, started}), or None."""
    try:
        holder = json.loads(text)
    except ValueError:
        return None
    if isinstance(holder, dict) and {"pid", "host", "started"} <= set(holder):
        return holder
    return None


def _holder(text):
    """Who holds a lock, from its file's text, as a phrase."""
    holder = _holder_fields(text)
    if holder is None:
        return "a process that has not written its pid yet"
    return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
