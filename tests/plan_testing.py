"""What the planner tests share: `python -m trainers.plan` run in the test's own
process, and a device whose rates are round numbers."""

import contextlib
import io
import os
import tempfile

from absl.testing import absltest, flagsaver

from trainers import plan
from trainers.planning import collectives, hardware

# Rates do not enter bytes or FLOPs: any device serves those checks.
UNIT_DEVICE = hardware.Device(
    name="unit", matmul={"float32": 1e12, "mixed": 1e12}, bandwidth=1e11, eigh=1e11,
    cholesky_inverse=1e11, fractions={p: {"float32": 1.0, "mixed": 1.0}
                                      for p in hardware.PHASES},
    intra_node=collectives.Link(1e10, 1e-6, 1e-5), sources=())
UNIT_FABRIC = collectives.Fabric(UNIT_DEVICE.intra_node, UNIT_DEVICE.intra_node, 1, 1)


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
