"""One rank of a Horovod job of tests/test_trainer_horovod.py that runs
`python -m trainers.train` several times in one process: one start-up of the job's ranks
for several runs.

Its argument is a JSON list of command lines (lists of flags); each is parsed by the
binary's flags, then checked and run as the binary's `main` does, in order.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from trainers import runner, train  # noqa: E402


def main():
    for argv in json.loads(sys.argv[1]):
        flags.FLAGS.unparse_flags()
        train.CLI.parse_flags([train.CLI.module, *argv])
        runner.run(runner.prepare(*train.config_from_flags(flags.FLAGS)))


if __name__ == "__main__":
    main()
