"""The update as a chain (tfkfac/chain.py): K-FAC's preconditioning, then one
post-transform, then the inner optimizer.

- The settings choose the one post-transform: grafting when `grafting` is set (not the
  KL clip too: its one ν would cancel in the graft), else the KL clip when `kl_clip` is,
  else none.
- `KLClip` on a step's `Preconditioned` gradients: every managed block's P times
  ν = min(1, sqrt(κ / (η² Σ_blocks |<P, ∇>|))) in the state dtype, then cast to its
  variable's dtype; other gradients as they came; η read when the step runs.
- `Grafting` ("sgd") on the same: each block's P at its raw gradient's norm over the
  block's variables together, the raw gradient elsewhere.
Both against numpy on hand-made gradients of a two-block step.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from tfkfac import chain, curvature, grafting  # noqa: E402

RNG = np.random.default_rng(0)


def two_block_step():
    """A `Preconditioned` of variables (kernel, bias | kernel | unmanaged), float32, with
    float64 state: blocks [kernel, bias] and [kernel]; the third has no block."""
    shapes = [(3, 2), (2,), (2, 2), (4,)]
    variables = [tf.Variable(np.zeros(s, np.float32)) for s in shapes]
    raw = [tf.constant(RNG.normal(size=s), tf.float32) for s in shapes]
    slots = [[0, 1], [2]]
    blocks = [[tf.constant(RNG.normal(size=shapes[i])) for i in s] for s in slots]
    block_grads = [[tf.cast(raw[i], tf.float64) for i in s] for s in slots]
    return curvature.Preconditioned(raw, variables, slots, blocks, block_grads)


class UpdateChainTest(absltest.TestCase):

    def test_settings_choose_one_post_transform(self):
        learning_rate = lambda: 0.1
        for settings, kind in [(dict(grafting="sgd", kl_clip=1e-3), grafting.Grafting),
                               (dict(kl_clip=1e-3), chain.KLClip),
                               (dict(kl_clip=None), type(None))]:
            post = chain.post_transform(tfkfac.KFACConfig(**settings), learning_rate)
            self.assertIsInstance(post, kind, settings)
        self.assertEqual(chain.post_transform(tfkfac.KFACConfig(kl_clip=2e-3),
                                              learning_rate).kappa, 2e-3)

    def test_kl_clip_scales_every_block_by_one_nu(self):
        step = two_block_step()
        learning_rate, kappa = tf.Variable(0.5, dtype=tf.float32), 1e-3
        clip = chain.KLClip(kappa, lambda: learning_rate)
        for eta in (0.5, 0.05):
            learning_rate.assign(eta)  # read when the step runs
            clipped = clip.update(step, 0)
            inner = sum(abs(sum(np.sum(p.numpy() * g.numpy()) for p, g in zip(ps, gs)))
                        for ps, gs in zip(step.blocks, step.block_grads))
            nu = min(1.0, np.sqrt(kappa / inner) / np.float32(eta))
            self.assertLess(nu, 1.0)
            for i, p in zip([0, 1, 2], [p for ps in step.blocks for p in ps]):
                self.assertEqual(clipped[i].dtype, tf.float32)
                np.testing.assert_allclose(clipped[i].numpy(), (p.numpy() * nu), rtol=1e-6)
            np.testing.assert_array_equal(clipped[3].numpy(), step.raw[3].numpy())

    def test_sgd_grafting_gives_each_block_its_gradients_norm(self):
        step = two_block_step()
        grafted = grafting.Grafting("sgd", 0.999, 1e-7, "float64").update(step, 0)
        for slots in step.slots:
            p = [step.grads()[i].numpy().astype(np.float64) for i in slots]
            g = [step.raw[i].numpy().astype(np.float64) for i in slots]
            ratio = norm(g) / norm(p)
            for i, p_i in zip(slots, p):
                np.testing.assert_allclose(grafted[i].numpy(), ratio * p_i, rtol=1e-6)
        np.testing.assert_array_equal(grafted[3].numpy(), step.raw[3].numpy())


def norm(arrays):
    return np.sqrt(sum(np.sum(a ** 2) for a in arrays))


if __name__ == "__main__":
    absltest.main()
