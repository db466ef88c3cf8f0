"""Writes of a run's files that fail cleanly on a full or failing disk.

A write that fails (no space left, an I/O error, a quota, a read-only remount) ends the
run with one `WriteError` naming the file, the reason, about how many bytes it needed,
how many are free there, and what of the run is safe to delete, after removing what
the failed write left behind, so the next start is not blocked by it.
"""

import contextlib
import os
import re
import shutil

import tensorflow as tf

from trainers import errors


class WriteError(errors.RunError):
    """A file of the run could not be written; the message says how to make room."""


def human_bytes(count):
    """`count` bytes in words: "812 B", "4.7 MB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


def tree_bytes(path):
    """Bytes of a file, or of every file under a directory (0 if it is gone)."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for directory, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(directory, name))
    return total


def free_bytes(path):
    """Bytes free to this user on the file system holding `path` (or its nearest
    existing parent)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return shutil.disk_usage(existing).free


def remove(path):
    """Removes a file or directory tree if it is there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _reason(error):
    """The operating system's words for a failed write, from an OSError or TensorFlow's
    error (whose message ends "...; No space left on device [Op:SaveV2]")."""
    if isinstance(error, OSError):
        return error.strerror or str(error)
    message = re.sub(r"\s*\[Op:\w+\]\s*$", "", error.message.strip())
    return message.rsplit("; ", 1)[-1].splitlines()[-1]


@contextlib.contextmanager
def failing_cleanly(path, needed_bytes, leftovers=(), advice=None):
    """Runs a write of `path`; if it fails, removes `leftovers` and raises `WriteError`.

    Args:
      path: what is being written, named in the error.
      needed_bytes: about how many bytes the write needs.
      leftovers: files or directories the failed write may have left; removed.
      advice: returns what of the run is safe to delete (a phrase), asked on failure.
    """
    try:
        yield
    except (OSError, tf.errors.OpError) as error:
        for leftover in leftovers:
            remove(leftover)
        removed = " (the partial write was removed)" if leftovers else ""
        message = (f"cannot write {path}: {_reason(error)}{removed}; it needs about "
                   f"{human_bytes(needed_bytes)} and {human_bytes(free_bytes(path))} are free "
                   "there")
        hint = advice() if advice else ""
        raise WriteError(f"{message}; {hint}" if hint else message) from None
