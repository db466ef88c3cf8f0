"""The update as a chain of `tfkfac.Transform`s (tfkfac/chain.py): K-FAC's
preconditioning, the KL clip or grafting, the `transforms` setting's, then the inner
optimizer.

- The settings choose the chain: grafting when `grafting` is set (not the KL clip too:
  its one ν would cancel in the graft), else the KL clip when `kl_clip` is, else none;
  the momentum coupling before the inner optimizer and weight rescaling after it.
- A transform of a user's (`ScaleGradients`, one class passed in the `transforms`
  setting) runs in the step, before the inner optimizer, and its state is saved and
  loaded by its key.
- `KLClip` on a step's `Preconditioned` gradients: every managed block's P times
  ν = min(1, sqrt(κ / (η² Σ_blocks |<P, ∇>|))) in the state dtype, then cast to its
  variable's dtype; other gradients as they came; η read when the step runs.
- `Grafting` ("sgd") on the same: each block's P at its raw gradient's norm over the
  block's variables together, the raw gradient elsewhere.
Both against numpy on hand-made gradients of a two-block step.
"""

import dataclasses
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from tfkfac import chain, curvature, grafting, inner, state, transform  # noqa: E402

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


def applied(piece, preconditioned):
    """The gradients `piece` (a transform after the curvature) gives at step 0."""
    return piece.apply(transform.Step(preconditioned.grads(), preconditioned.variables, 0,
                                      preconditioned=preconditioned)).grads


@keras.saving.register_keras_serializable(package="test_chain")
class ScaleGradients(tfkfac.Transform):
    """Every gradient times `factor`, counting the steps it scaled (saved)."""

    name = "scale"

    def __init__(self, factor):
        self.factor, self.count = factor, None

    def create_state(self, context):
        self.count = context.add_variable((), "scaled_steps", "int64")

    def saved_variables(self):
        return [(state.key(self.name, "count"), self.count)]

    def apply(self, step):
        self.count.assign_add(1)
        return dataclasses.replace(step, grads=[None if g is None else g * self.factor
                                                for g in step.grads])

    def get_config(self):
        return {"factor": self.factor}


def trained(learning_rate, steps=3, **settings):
    """A small model after `steps` K-FAC steps into SGD at `learning_rate`, and its KFAC."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5, name="hidden"),
                              keras.layers.Dense(2, name="logits")])
    optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(learning_rate),
                            factor_update_freq=1, decomposition_update_freq=1,
                            **settings).attach(model)
    model.compile(optimizer=optimizer, loss="mse")
    x = np.random.default_rng(1).normal(size=(8 * steps, 4)).astype(np.float32)
    model.fit(x, x[:, :2], batch_size=8, shuffle=False, verbose=0)
    return model, optimizer


def saved_state(optimizer):
    """{key: value} of every variable `optimizer` saves."""
    return {key: variable.numpy()
            for (key, _), variable in zip(optimizer.saved_keys(), optimizer.variables)}


class UpdateChainTest(absltest.TestCase):

    def test_settings_choose_the_transforms(self):
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        first = object()  # the curvature
        for settings, kinds in [
                (dict(grafting="sgd", kl_clip=1e-3), [grafting.Grafting]),
                (dict(kl_clip=1e-3), [chain.KLClip]),
                (dict(kl_clip=None), []),
                (dict(couple_momentum_to_lr=True, transforms=(ScaleGradients(2.0),)),
                 [ScaleGradients, inner.MomentumCoupling])]:
            transforms = chain.transforms(tfkfac.KFACConfig(**settings), first, optimizer,
                                          dict)
            self.assertIs(transforms[0], first)
            self.assertEqual([type(t) for t in transforms[1:]],
                             kinds + [chain.InnerOptimizer], settings)
        clip = chain.transforms(tfkfac.KFACConfig(kl_clip=2e-3), first, optimizer, dict)[1]
        self.assertEqual(clip.kappa, 2e-3)

    def test_a_users_transform_runs_in_the_step_and_saves_its_state_by_key(self):
        # Gradients halved into SGD at 0.1: the steps SGD at 0.05 takes, exactly (a
        # halving is exact), with the count of steps scaled saved under its key.
        model, optimizer = trained(0.1, transforms=[ScaleGradients(0.5)])
        reference, _ = trained(0.05)
        for weight, expected in zip(model.get_weights(), reference.get_weights()):
            np.testing.assert_array_equal(weight, expected)
        self.assertEqual(saved_state(optimizer)["scale:count"], 3)
        path = os.path.join(tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir()),
                            "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        loaded.optimizer.attach(loaded)
        self.assertEqual(loaded.optimizer.transforms[0].factor, 0.5)
        self.assertEqual(saved_state(loaded.optimizer)["scale:count"], 3)

    def test_a_transform_must_be_registered_and_named(self):
        class Unregistered(tfkfac.Transform):
            name = "unregistered"

        with self.assertRaisesRegex(ValueError, "register_keras_serializable"):
            tfkfac.KFAC(transforms=(Unregistered(),))
        with self.assertRaisesRegex(ValueError, "no `name`"):
            tfkfac.KFAC(transforms=(tfkfac.Transform(),))

    def test_kl_clip_scales_every_block_by_one_nu(self):
        step = two_block_step()
        learning_rate, kappa = tf.Variable(0.5, dtype=tf.float32), 1e-3
        clip = chain.KLClip(kappa, lambda: learning_rate)
        for eta in (0.5, 0.05):
            learning_rate.assign(eta)  # read when the step runs
            clipped = applied(clip, step)
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
        grafted = applied(grafting.Grafting("sgd", 0.999, 1e-7, "float64"), step)
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
