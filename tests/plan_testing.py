"""`python -m trainers.plan` run in the test's own process, as the planner tests use it."""

import contextlib
import io
import os
import tempfile

from absl.testing import absltest, flagsaver

from trainers import plan


def run_plan(*args):
    """(exit code or None, stdout, stderr) of `python -m trainers.plan *args`, run in this
    process (flags restored afterwards)."""
    out, err = io.StringIO(), io.StringIO()
    code = None
    with flagsaver.flagsaver(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            plan.main(plan.CLI.parse_flags(["trainers.plan", *args]))
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def temporary_path(name):
    """A path `name` in a new directory of the test's temporary directory."""
    return os.path.join(tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir()), name)
