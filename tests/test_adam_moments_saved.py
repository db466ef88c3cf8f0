"""The second moments of docs/design.md §11 survive save/restore: eigenbasis Adam's s and
grafted Adam's v.

One float32 run of tests/every_block_net.py (every block kind) with
`KFAC(method="eigen_adam", grafting="adam")`, which holds both kinds of moments, and
non-default adam_beta_2=0.99, adam_epsilon=1e-3, under an inner SGD(lr, momentum=0):
- the uninterrupted run matches the numpy reference (`every_block_net.Reference`: s in
  the eigenbases numpy.linalg.eigh gives of the reported factors, v of the raw
  gradients, the graft) within 1e-3 at every step, so both settings are honored (ε =
  1e-7 instead would change P by ~10%, β2 = 0.999 ŝ from step 2 on). float32 limits the
  agreement: LAPACK's float32 eigenvectors of the float32 factors are off numpy's
  float64 ones by ~1e-7·‖A‖/gap (measured up to 2.4e-4 x max|P|), and with ε = 1e-7 an
  entry of ĝ near 0 would turn such rounding into O(1) changes of P;
- after 3 steps (decompositions at steps 0 and 2) it is saved with `model.save(.keras)`
  and with `tf.train.Checkpoint`. The file loaded by `keras.models.load_model` + `attach`,
  and the checkpoint read into a fresh model of another seed, hold every optimizer
  variable as saved, s and v included (non-zero), and their next 2 steps (the first on
  the restored decompositions, the second refreshing them: s carried over) end where the
  uninterrupted run does.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

import every_block_net as net  # noqa: E402

LR = 2.0 ** -7
BATCH, STEPS, SAVED_AFTER, DECOMPOSITION_FREQ = 16, 5, 3, 2
BETA_2, EPSILON = 0.99, 1e-3
SETTINGS = dict(method="eigen_adam", grafting="adam", adam_beta_2=BETA_2,
                adam_epsilon=EPSILON, factor_update_freq=1,
                decomposition_update_freq=DECOMPOSITION_FREQ, xla=False)
RTOL = 1e-3


class AdamMomentsSavedTest(absltest.TestCase):

    def test_moments_survive_keras_save_and_tf_checkpoint(self):
        result = net.resumed_runs(
            SETTINGS, net.batches(STEPS, BATCH), SAVED_AFTER, LR,
            reference_for=lambda model: net.Reference(
                model, "eigen_adam", "adam", decomposition_freq=DECOMPOSITION_FREQ,
                beta_2=BETA_2, epsilon=EPSILON))
        self.assertLen(result["checked"], STEPS)
        for step, expected, observed in result["checked"]:
            net.assert_updates_close(expected, observed, RTOL, RTOL, msg=f"step {step}")
        saved = result["saved"]
        moments = [name for name in saved
                   if net.is_eigenbasis_moment(name) or name.startswith("graft_v_")]
        # s per block (SeparableConv2D: two; no grouped Conv2D here), v per variable.
        blocks = len(net.MANAGED_KINDS) - 1
        self.assertLen(moments, blocks + 1 + len(result["uninterrupted"]))
        for name in moments:
            self.assertGreater(np.max(saved[name]), 0.0, name)
        for run in ("loaded", "restored"):
            state = result[f"{run}_state"]
            self.assertEqual(list(state), list(saved), run)
            for name, value in saved.items():
                np.testing.assert_array_equal(state[name], value, err_msg=f"{run}: {name}")
            for got, want in zip(result[run], result["uninterrupted"]):
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-7, err_msg=run)


if __name__ == "__main__":
    absltest.main()
