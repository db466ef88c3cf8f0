"""tfkfac.KFAC on BatchNormalization: the diagonal Fisher of Osawa et al.

docs/design.md: F_c = (1/N) Σ_i (dl_i/dθ_c)² over θ = (γ, β) concatenated, and the
gradient is preconditioned as ∇ / (F + ρ_BN λ). The reference takes the per-example
gradients dl_i/dθ independently of the optimizer: one training-mode forward of the full
batch under a persistent tape, then N separate `tape.gradient(l_i, [γ, β])` calls, l_i
the i-th example's loss. ∇ is their mean (and equals the gradient of the mean loss,
checked). One step with momentum=0, kl_clip=None must change γ, β by
-lr ∇ / (F + ρ_BN λ).

Tolerances: rtol 1e-4 with an absolute floor of 1e-5 * max|ref| (all float32; the
reference gradients are exact per-example backprops, the optimizer's come from the
captured output gradient and x̂).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import DAMPING, LR, N, assert_close  # noqa: E402

RHO_BN = 3.0


def loss_fn(reduction="sum_over_batch_size"):
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      reduction=reduction)


def per_example_bn_grads(model, bn, x, labels):
    """(N, |θ|) per-example gradients of (γ, β) and the mean-loss gradient."""
    variables = [v for v in (bn.gamma, bn.beta) if v is not None]
    with tf.GradientTape(persistent=True) as tape:
        losses = loss_fn(reduction=None)(labels, model(x, training=True))
        per_example_losses = [losses[i] for i in range(len(x))]  # l_i, on the tape
        mean_loss = tf.reduce_mean(losses)
    rows = []
    for l_i in per_example_losses:
        grads = tape.gradient(l_i, variables)
        rows.append(np.concatenate([g.numpy().astype(np.float64) for g in grads]))
    mean_grad = np.concatenate([g.numpy() for g in tape.gradient(mean_loss, variables)])
    del tape
    return np.stack(rows), mean_grad


def dense_bn_model(center=True, scale=True):
    keras.utils.set_random_seed(31)
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(4),
        keras.layers.BatchNormalization(center=center, scale=scale,
                                        gamma_initializer="random_uniform",
                                        beta_initializer="random_normal"),
        keras.layers.Activation("tanh"),
        keras.layers.Dense(2),
    ])


def conv_bn_model():
    keras.utils.set_random_seed(32)
    return keras.Sequential([
        keras.Input((5, 5, 2)),
        keras.layers.Conv2D(3, 3, padding="same"),
        keras.layers.BatchNormalization(gamma_initializer="random_uniform",
                                        beta_initializer="random_normal"),
        keras.layers.Activation("tanh"),
        keras.layers.Flatten(),
        keras.layers.Dense(2),
    ])


class BatchNormTest(parameterized.TestCase):

    def check_one_step(self, model, x, labels, use_fit):
        bn = next(l for l in model.layers if isinstance(l, keras.layers.BatchNormalization))
        per_example, mean_grad = per_example_bn_grads(model, bn, x, labels)
        fisher = np.mean(per_example ** 2, axis=0)
        grad = per_example.mean(axis=0)
        assert_close(grad, mean_grad, msg="mean of per-example grads vs grad of mean")

        opt = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING, kl_clip=None,
                          diagonal_damping_multiplier=RHO_BN, xla=False)
        opt.attach(model)
        variables = [v for v in (bn.gamma, bn.beta) if v is not None]
        before = np.concatenate([v.numpy() for v in variables])
        if use_fit:
            model.compile(optimizer=opt, loss=loss_fn())
            model.fit(x, labels, batch_size=N, epochs=1, shuffle=False, verbose=0)
        else:
            with opt.record() as tape:
                loss = loss_fn()(labels, model(x, training=True))
            opt.minimize(loss, tape=tape)
        delta = np.concatenate([v.numpy() for v in variables]) - before

        kinds = {m["layer"]: m["kind"] for m in opt.summary()["managed"]}
        self.assertEqual(kinds[bn.name], "batch_norm")  # its path in the model
        stored = opt.factors(bn)["F"].numpy()
        self.assertEqual(stored.shape, fisher.shape)
        assert_close(stored, fisher, msg="diagonal Fisher")
        expected = -LR * grad / (fisher + RHO_BN * DAMPING)
        assert_close(delta, expected, msg="BN update")
        # ρ_BN matters here: with ρ_BN = 1 the update would be clearly different.
        other = -LR * grad / (fisher + DAMPING)
        self.assertGreater(np.max(np.abs(other - expected)), 0.01 * np.max(np.abs(expected)))

    @parameterized.named_parameters(("fit", True), ("custom_loop", False))
    def test_dense_bn(self, use_fit):
        model = dense_bn_model()
        rng = np.random.default_rng(33)
        x = rng.normal(size=(N, 3)).astype(np.float32)
        labels = rng.integers(0, 2, size=N)
        self.check_one_step(model, x, labels, use_fit)

    def test_dense_bn_without_center(self):
        model = dense_bn_model(center=False)
        rng = np.random.default_rng(34)
        x = rng.normal(size=(N, 3)).astype(np.float32)
        labels = rng.integers(0, 2, size=N)
        self.check_one_step(model, x, labels, use_fit=False)

    def test_stacked_bn_holds_later_batch_statistics_fixed(self):
        # Dense -> BN -> tanh -> Dense -> BN -> tanh -> Dense. The second BN's batch
        # statistics couple the examples, so the exact dl_i/dθ of the first BN would need
        # N backward passes. Like g_i = N dL/ds_i for Kronecker factors, the contract's
        # per-example gradient is N dL/dy_i ⊙ x̂_i (later batch statistics held fixed);
        # the reference builds it from a separate tape and numpy's x̂.
        keras.utils.set_random_seed(40)
        model = keras.Sequential([
            keras.Input((3,)),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(name="bn1"),
            keras.layers.Activation("tanh"),
            keras.layers.Dense(4),
            keras.layers.BatchNormalization(name="bn2"),
            keras.layers.Activation("tanh"),
            keras.layers.Dense(2),
        ])
        rng = np.random.default_rng(1)
        x = rng.normal(size=(N, 3)).astype(np.float32)
        labels = rng.integers(0, 2, size=N)
        bn = model.get_layer("bn1")
        with tf.GradientTape() as tape:
            h = x
            for layer in model.layers:
                if layer is bn:
                    bn_input = h.numpy().astype(np.float64)
                h = layer(h, training=True)
                if layer is bn:
                    bn_output = h
            loss = loss_fn()(labels, h)
        dy = tape.gradient(loss, bn_output).numpy().astype(np.float64)
        x_hat = (bn_input - bn_input.mean(0)) / np.sqrt(bn_input.var(0) + bn.epsilon)
        per_example = N * np.concatenate([dy * x_hat, dy], axis=1)
        fisher = np.mean(per_example ** 2, axis=0)
        grad = per_example.mean(axis=0)

        opt = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING, kl_clip=None,
                          diagonal_damping_multiplier=RHO_BN, xla=False).attach(model)
        before = np.concatenate([bn.gamma.numpy(), bn.beta.numpy()])
        with opt.record() as tape:
            loss = loss_fn()(labels, model(x, training=True))
        opt.minimize(loss, tape=tape)
        delta = np.concatenate([bn.gamma.numpy(), bn.beta.numpy()]) - before
        assert_close(opt.factors("bn1")["F"].numpy(), fisher,
                     msg="diagonal Fisher, later statistics fixed")
        assert_close(delta, -LR * grad / (fisher + RHO_BN * DAMPING), msg="BN update")

    def test_conv_bn_sums_over_positions(self):
        model = conv_bn_model()
        rng = np.random.default_rng(35)
        x = rng.normal(size=(N, 5, 5, 2)).astype(np.float32)
        labels = rng.integers(0, 2, size=N)
        self.check_one_step(model, x, labels, use_fit=False)


if __name__ == "__main__":
    absltest.main()
