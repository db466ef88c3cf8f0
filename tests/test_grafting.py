"""Layer-wise grafting, `KFAC(grafting="sgd" | "adam")` (docs/design.md §11), against numpy.

On tests/every_block_net.py (one layer of every block kind and a PReLU without a block)
the expected update is built in numpy (`every_block_net.Reference`): r = ∇ ("sgd") or
r = ∇ / (√v̂ + ε) with v ← β2 v + (1-β2) ∇² from 0 and v̂ = v / (1 - β2^t) ("adam"), from
the raw gradients (a plain tf.GradientTape on the step's batch); P from the factors
`KFAC.factors` reports, by an explicit (A ⊗ G + λI)⁻¹ vec(∇) solve per Kronecker pair
(method "eigen", decompositions every other step) or by numpy's eigenbasis Adam (method
"eigen_adam"); then per managed layer, its variables together,
P̃ = (‖r‖_F / ‖P‖_F) P. It is compared with the weight change under an inner
SGD(lr, momentum=0), exactly -lr·P̃, for 3 steps of a float64 model and state:
- every layer's update within RTOL (the graft and Adam's v are computed in the float64
  state dtype), PReLU's is r; Adam's v is float64;
- ‖P̃_ℓ‖ = ‖r_ℓ‖ for every managed layer, read off the weight change;
- a KL clip of 1e-8, which would scale K-FAC's step by less than 0.1 (ν from the
  reference's Σ|<P, ∇>|), changes nothing: it is not applied under grafting.
`Grafting.graft` with ‖P‖ = 0 gives r (for a layer with a gradient, P is zero only
when ∇ is, and then r is too: the branch is unreachable through a model).
Save/restore of Adam's v: tests/test_adam_moments_saved.py; 2 ranks:
tests/test_eigen_adam_distributed.py.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import every_block_net as net  # noqa: E402
import tfkfac  # noqa: E402
from tfkfac import grafting  # noqa: E402

LR = 2.0 ** -7  # exact in the inner optimizer's float32 learning rate
BATCH, STEPS, DECOMPOSITION_FREQ, DAMPING = 16, 3, 2, 1e-2
KL_CLIP = 1e-8
# With the graft and v in float64: measured ≤ 5.5e-8 relative (≤ 1e-5 when they were
# float32 whatever the state dtype).
RTOL = 1e-6


class GraftingTest(parameterized.TestCase):

    @parameterized.named_parameters(("sgd", "eigen", "sgd"), ("adam", "eigen", "adam"),
                                    ("adam_over_eigen_adam", "eigen_adam", "adam"))
    def test_every_block_kind_matches_numpy(self, method, kind):
        model = net.every_block_net(dtype="float64")
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), method=method,
                                grafting=kind, kl_clip=KL_CLIP, damping=DAMPING,
                                state_dtype="float64", factor_update_freq=1,
                                decomposition_update_freq=DECOMPOSITION_FREQ,
                                xla=False).attach(model)
        reference = net.Reference(model, method, kind, decomposition_freq=DECOMPOSITION_FREQ,
                                  damping=DAMPING)
        checked = net.train_checked(model, optimizer,
                                    net.batches(STEPS, BATCH, dtype=np.float64), LR, reference)
        self.assertLen(checked, STEPS)
        moments = [v for v in optimizer.variables if "graft_v" in v.name]
        self.assertLen(moments, len(model.trainable_variables) if kind == "adam" else 0)
        self.assertTrue(all(v.dtype == "float64" for v in moments))
        for (step, expected, observed), history in zip(checked, reference.history):
            net.assert_updates_close(expected, observed, RTOL, RTOL, msg=f"step {step}")
            self.assertSameElements(history["directions"], net.MANAGED_KINDS)
            for layer, directions in history["directions"].items():
                self.assertAlmostEqual(norm(observed[layer]) / norm(directions), 1.0,
                                       delta=RTOL, msg=f"step {step} {layer}")
            # The clip K-FAC alone would apply: ν = sqrt(κ / (η² Σ|<P, ∇>|)).
            self.assertLess(np.sqrt(KL_CLIP / (LR ** 2 * history["kl_sum"])), 0.1)

    def test_zero_preconditioned_gradient_gets_the_direction(self):
        r = [tf.constant([3.0, -4.0]), tf.constant([[1.0]]), tf.constant([2.0]), None]
        p = [tf.zeros(2), tf.zeros((1, 1)), tf.constant([-0.5]), tf.constant([7.0])]
        # Blocks: variables 0 and 1 (P = 0), variable 2 alone; variable 3 has no block.
        got = grafting.Grafting("sgd", 0.999, 1e-7).graft(p, r, [[0, 1], [2]])
        for k in (0, 1):
            np.testing.assert_array_equal(got[k].numpy(), r[k].numpy())
        np.testing.assert_allclose(got[2].numpy(), [-2.0])
        self.assertIsNone(got[3])


def norm(arrays):
    return np.sqrt(sum(np.sum(np.square(a)) for a in arrays))


if __name__ == "__main__":
    absltest.main()
