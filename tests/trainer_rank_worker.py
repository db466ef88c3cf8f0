"""One rank of the 2-rank `python -m trainers.train` jobs of tests/test_trainer_horovod.py
whose ranks get different flags, as a scheduler's misconfigured job would.

horovodrun starts the same command on every rank; this replaces itself (exec, same
process) with `python -m trainers.train <arguments> <$RANK<r>_ARGS>`, r being this
rank, so the test sees the trainer exactly as a user would.
"""

import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANK_ARGS_VARIABLE = "RANK{}_ARGS"


def main():
    rank = os.environ["HOROVOD_RANK"]
    own = shlex.split(os.environ.get(RANK_ARGS_VARIABLE.format(rank), ""))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    os.execve(sys.executable, [sys.executable, "-m", "trainers.train", *sys.argv[1:], *own],
              env)


if __name__ == "__main__":
    main()
