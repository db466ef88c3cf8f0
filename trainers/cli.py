"""How the binaries (`trainers.train`, `trainers.plan`) end on an error, argparse's way.

A command line that cannot run (a bad or unknown flag, inconsistent values, a stray
argument, a path that cannot be used) is a usage error: a one-line usage hint, then
`<module>: error: <message>`, exit code 2. A run that fails once started (a full disk, a
damaged checkpoint, ranks that disagree) prints the error line alone, exit code 1. The
error is always the last line; no flag list, no traceback.
"""

import sys

from absl import flags

USAGE_EXIT_CODE = 2
FAILURE_EXIT_CODE = 1


class Program:
    """The errors of the binary run as `python -m <module>`."""

    def __init__(self, module):
        self.module = module
        self.usage_hint = (f"usage: python -m {module} [--flag=value ...]; --helpshort lists "
                           "the flags")

    def usage_error(self, message):
        """Ends the process: the usage hint, then `message`; exit code 2."""
        self._exit(f"{self.usage_hint}\n{self.module}: error: {message}\n", USAGE_EXIT_CODE)

    def failure(self, message):
        """Ends the process: `message` alone; exit code 1."""
        self._exit(f"{self.module}: error: {message}\n", FAILURE_EXIT_CODE)

    def parse_flags(self, argv):
        """absl's parsing for `app.run(flags_parser=...)`; a bad flag or an argument that
        is not one is a usage error."""
        try:
            argv = flags.FLAGS(argv)
        except flags.Error as error:
            self.usage_error(str(error))
        if len(argv) > 1:
            self.usage_error(f"unexpected arguments: {' '.join(argv[1:])}")
        return argv

    @staticmethod
    def _exit(text, code):
        sys.stderr.write(text)
        sys.stderr.flush()
        sys.exit(code)
