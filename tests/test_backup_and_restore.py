"""Issue 29, 4: a Keras user's own `fit` with tfkfac.KFAC survives preemption with
keras.callbacks.BackupAndRestore: a process killed by a real SIGTERM after two of four
epochs, run again, ends with every variable of a run never stopped (weights, momenta,
K-FAC factors, decompositions, counters) bit for bit. The callback backs up at epoch
ends; the work of an unfinished epoch is redone (see docs/guide.md §6)."""

import os
import signal
import subprocess
import sys

from absl.testing import absltest
import numpy as np

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "backup_and_restore_worker.py")


def run_worker(*argv):
    return subprocess.run([sys.executable, WORKER, *argv], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))


class BackupAndRestoreTest(absltest.TestCase):

    def test_killed_by_sigterm_then_run_again_equals_a_run_never_stopped(self):
        root = self.create_tempdir().full_path
        straight = run_worker(os.path.join(root, "straight_backup"),
                              os.path.join(root, "straight.npz"))
        self.assertEqual(straight.returncode, 0, straight.stderr[-2000:])
        backup = os.path.join(root, "backup")
        killed = run_worker(backup, os.path.join(root, "killed.npz"), "--sigterm_at_epoch=2")
        self.assertEqual(killed.returncode, -signal.SIGTERM, killed.stderr[-2000:])
        self.assertTrue(os.listdir(backup))  # the backup of epoch 2's start
        again = run_worker(backup, os.path.join(root, "resumed.npz"))
        self.assertEqual(again.returncode, 0, again.stderr[-2000:])
        self.assertFalse(os.path.exists(backup))  # removed once fit finished
        want = np.load(os.path.join(root, "straight.npz"))
        have = np.load(os.path.join(root, "resumed.npz"))
        self.assertEqual(want.files, have.files)
        for key in want.files:
            np.testing.assert_array_equal(have[key], want[key], err_msg=key)


if __name__ == "__main__":
    absltest.main()
