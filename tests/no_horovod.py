"""Horovod made unimportable, to prove that a code path never imports it: the
tf.distribute engine must run where Horovod is not built, although this
machine has it.

- `install()`: from now on, in this process, `import horovod` (or any `horovod.*`, or
  `importlib.util.find_spec` of them) raises ModuleNotFoundError and is recorded in
  `ATTEMPTS` (with the importer's stack), and in the file $NO_HOROVOD_LOG when set.
- `variables(directory)`: environment variables under which every Python process started
  installs it at startup, recording into `attempts(directory)`: `directory` gets a copy of
  this file as `sitecustomize.py` and goes first on PYTHONPATH.
A recorded attempt fails the tests even where the importer caught the ImportError: with
Horovod built, that path would have imported it.
"""

import os
import shutil
import sys
import traceback

LOG_VARIABLE = "NO_HOROVOD_LOG"
LOG_NAME = "horovod_imports.log"
ATTEMPTS = []


class _HorovodBlocker:
    """A `sys.meta_path` finder, first in line, refusing Horovod's modules."""

    def find_spec(self, name, path=None, target=None):
        if name != "horovod" and not name.startswith("horovod."):
            return None
        attempt = (f"import {name} in process {os.getpid()} ({' '.join(sys.argv)[:200]}):\n"
                   + "".join(traceback.format_stack()[:-1]))
        ATTEMPTS.append(attempt)
        if os.environ.get(LOG_VARIABLE):
            with open(os.environ[LOG_VARIABLE], "a", encoding="utf-8") as log:
                log.write(attempt + "\n")
        raise ModuleNotFoundError(f"No module named {name!r} (blocked by tests/no_horovod.py)",
                                  name=name)


def install():
    """Blocks Horovod in this process; it must not have been imported already."""
    if any(name == "horovod" or name.startswith("horovod.") for name in sys.modules):
        raise RuntimeError("horovod was imported before tests/no_horovod.py could block it")
    if not any(isinstance(finder, _HorovodBlocker) for finder in sys.meta_path):
        sys.meta_path.insert(0, _HorovodBlocker())


def variables(directory, environ=None):
    """{variable: value} to add to `environ` (default: this process's) so that the Python
    processes started with it block Horovod, recording in `directory`."""
    environ = os.environ if environ is None else environ
    shutil.copyfile(os.path.abspath(__file__), os.path.join(directory, "sitecustomize.py"))
    path = os.pathsep.join(p for p in (directory, environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, LOG_VARIABLE: os.path.join(directory, LOG_NAME)}


def attempts(directory):
    """What the processes started with `variables(directory)` tried to import ("": none)."""
    path = os.path.join(directory, LOG_NAME)
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as log:
        return log.read()


if __name__ == "sitecustomize" and os.environ.get(LOG_VARIABLE):
    install()
