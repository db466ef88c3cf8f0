"""`method="eigen_adam"` (docs/design.md §11) against numpy, on every block kind.

tests/every_block_net.py holds one layer of every block kind: Dense, Conv2D, grouped
Conv2D, DepthwiseConv2D, SeparableConv2D, Conv2DTranspose, EinsumDense (one pair, and one
pair per head), Embedding, BatchNormalization, LayerNormalization, and a PReLU without a
block. The expected update is built in numpy (`every_block_net.Reference`,
`kfac_reference.eigen_adam_precondition`): at each decomposition step the eigenbases of
the factors `KFAC.factors` reports, by numpy.linalg.eigh (Q_A = I for an Embedding's
diagonal A; a normalization layer is its own basis); every step ĝ = Q_Aᵀ ∇ Q_G of the
raw gradient (a plain tf.GradientTape on the step's batch), s ← β2 s + (1-β2) ĝ² from 0,
ŝ = s / (1 - β2^t), P = Q_A [ĝ / (√ŝ + ε)] Q_Gᵀ. It is compared with the weight change
under an inner SGD(lr, momentum=0), exactly -lr·P. numpy's eigenvectors may differ from
LAPACK's in sign, which P and s do not see; both sort eigenvalues ascending, so s lines
up across a refresh (the factors have distinct eigenvalues, every_block_net's docstring).

With a float64 model and state: over 4 steps whose bases are refreshed at step 2 (s kept:
steps 2 and 3 scale by the s of steps 0 and 1 in the new basis), every layer's update
within 1e-9 of the reference (measured ≤ 1e-11), the moments the optimizer holds equal
the reference's s, damping (0.3 here) plays no role, PReLU gets its plain gradient, and
`KFAC.precondition` returns the next step's update without storing the moments (called
twice: the same; the step after it: the same again). The KL clip (§5, not part of §11's
P) is off.
Save/restore of the moments: tests/test_adam_moments_saved.py; 2 ranks:
tests/test_eigen_adam_distributed.py.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

import every_block_net as net  # noqa: E402
import tfkfac  # noqa: E402

LR = 2.0 ** -7  # exact in the inner optimizer's float32 learning rate
BATCH, STEPS, REFRESH = 16, 4, 2
FLOAT64_RTOL = 1e-9


class EigenAdamTest(absltest.TestCase):

    def test_every_block_kind_matches_numpy_across_a_refresh(self):
        model = net.every_block_net(dtype="float64")
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), method="eigen_adam",
                                kl_clip=None, state_dtype="float64", damping=0.3,
                                factor_update_freq=1,
                                decomposition_update_freq=REFRESH, xla=False).attach(model)
        managed = {m["layer"]: m["kind"] for m in optimizer.summary()["managed"]}
        self.assertEqual(managed, net.MANAGED_KINDS)
        self.assertEqual([s["layer"] for s in optimizer.summary()["skipped"]],
                         list(net.UNMANAGED))
        reference = net.Reference(model, "eigen_adam", decomposition_freq=REFRESH)
        previews = []

        def preview(step, grads):
            """`precondition` before the last step (not a decomposition step)."""
            if step != STEPS - 1:
                return
            variables = model.trainable_variables
            by_path = {p: g for layer in grads.values() for p, g in layer.items()}
            flat = [by_path[v.path] for v in variables]
            first, second = (optimizer.precondition(flat, variables) for _ in range(2))
            for a, b in zip(first, second):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            previews.append(reference.laid_out(optimizer, net.by_layer(model, first)))

        checked = net.train_checked(model, optimizer,
                                    net.batches(STEPS, BATCH, dtype=np.float64), LR,
                                    reference, before_step=preview)
        self.assertLen(checked, STEPS)
        for step, expected, observed in checked:
            net.assert_updates_close(expected, observed, FLOAT64_RTOL, FLOAT64_RTOL,
                                     msg=f"step {step}")
        net.assert_updates_close(checked[-1][1], previews[0], FLOAT64_RTOL, FLOAT64_RTOL,
                                 msg="KFAC.precondition before the last step")
        counters = optimizer.counters()
        self.assertEqual((counters["steps"], counters["decomposition_updates"]), (STEPS, 2))
        # Private names: the moments have no public API.
        held = net.eigenbasis_moments(optimizer)
        self.assertEqual(set(held), {f"{layer}_moment{k}" for layer, k in reference.moments})
        for (layer, k), moment in reference.moments.items():
            self.assertGreater(np.max(moment), 0.0, layer)
            net.ref.assert_close(held[f"{layer}_moment{k}"], moment, rtol=FLOAT64_RTOL,
                                 atol_scale=FLOAT64_RTOL, msg=f"{layer} moment {k}")


if __name__ == "__main__":
    absltest.main()
