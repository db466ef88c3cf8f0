"""tfkfac.KFAC on Dense layers, eigen method, against a float64 numpy reference.

docs/design.md: one step with momentum=0, kl_clip=None and no inner optimizer changes every
managed kernel/bias by exactly -lr * P, P = (A ⊗ G + λI)⁻¹ vec(∇) split back into kernel
and bias. The reference runs the tiny network's forward and backward in numpy
(float64, from the float32 weights), builds A = (1/N) Σ ā āᵀ and G = (1/N) Σ g gᵀ with
g_i = N dL/ds_i at the pre-activation, and solves with an explicit dense Kronecker
product (np.kron), never with the eigen formula the optimizer uses; it lives in
kfac_reference.py, shared with the other K-FAC tests.

Tolerances: the problems are small and well conditioned (λ = 1e-2, N = 8); float32 TF
against float64 numpy agrees to rtol 1e-4 (observed <= 4e-6), with an absolute floor of
1e-5 * max|ref|. A 5% change of λ moves the update by 2-3%, far outside it.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import (DAMPING, LR, N, assert_close, dense_layers,  # noqa: E402
                            kron_precondition, loop_step, loss_and_output_grad,
                            mlp_reference)


# ------------------------------------------------------------------------ models
def make_model(spec, seed=0):
    """spec: list of (units, use_bias, activation); input dim 5."""
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((5,))]
    for i, (units, use_bias, act) in enumerate(spec):
        layers.append(keras.layers.Dense(units, use_bias=use_bias, activation=act,
                                         bias_initializer="random_normal",
                                         name=f"layer{i}"))
    return keras.Sequential(layers)


def data(loss, classes, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 5)).astype(np.float32)
    if loss == "mse":
        y = rng.normal(size=(N, classes)).astype(np.float32)
    else:
        y = rng.integers(0, classes, size=(N,)).astype(np.int32)
    return x, y


def keras_loss(loss):
    if loss == "mse":
        return keras.losses.MeanSquaredError()
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def weights_of(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def one_fit_step(model, opt, x, y, loss):
    opt.attach(model)
    model.compile(optimizer=opt, loss=keras_loss(loss))
    before = weights_of(model)
    model.fit(x, y, batch_size=N, epochs=1, shuffle=False, verbose=0)
    return [a - b for a, b in zip(weights_of(model), before)]


def one_loop_step(model, opt, x, y, loss):
    opt.attach(model)
    # reduction sum_over_batch_size: L = (1/N) Σ l_i
    return loop_step(model, opt, keras_loss(loss), x, y)


def plain_kfac(xla):
    return tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING, kl_clip=None,
                       method="eigen", xla=xla)


def expected_deltas(reference, spec):
    """-lr * P per variable, in model.trainable_variables order (kernel, bias, ...)."""
    out = []
    for ref, (_, use_bias, _) in zip(reference, spec):
        p = kron_precondition(ref["A"], ref["G"], ref["grad"], DAMPING)
        if use_bias:
            out += [-LR * p[:-1], -LR * p[-1]]
        else:
            out += [-LR * p]
    return out


CASES = [
    # name, spec, loss
    ("tanh_bias_mse", [(4, True, "tanh"), (3, True, None)], "mse"),
    ("tanh_nobias_ce", [(4, False, "tanh"), (3, False, None)], "ce"),
    ("sigmoid_mixed_bias_ce", [(4, True, "sigmoid"), (3, False, None)], "ce"),
    ("linear_output_bias_tanh_mse", [(4, False, None), (3, True, "tanh")], "mse"),
]


class DenseEigenTest(parameterized.TestCase):

    @parameterized.named_parameters(*CASES)
    def test_one_fit_step_equals_kron_reference(self, spec, loss):
        model = make_model(spec)
        x, y = data(loss, spec[-1][0])
        reference = mlp_reference(dense_layers(model), x, y, loss)
        opt = plain_kfac(xla=False)
        deltas = one_fit_step(model, opt, x, y, loss)

        # Factors stored after the first update equal the batch factors.
        self.assertEqual([m["layer"] for m in opt.summary()["managed"]],
                         [layer.name for layer in model.layers])
        for layer, ref in zip(model.layers, reference):
            factors = opt.factors(layer)
            assert_close(factors["A"].numpy(), ref["A"], msg=f"A of {layer.name}")
            assert_close(factors["G"].numpy(), ref["G"], msg=f"G of {layer.name}")
        # The update is -lr * P, split into kernel and bias.
        expected = expected_deltas(reference, spec)
        self.assertLen(deltas, len(expected))
        for var, got, want in zip(model.trainable_variables, deltas, expected):
            assert_close(got, want, msg=var.path)
        self.assertEqual(opt.summary()["counters"]["factor_updates"], 1)
        self.assertEqual(opt.summary()["counters"]["decomposition_updates"], 1)

    def test_gradient_uses_pre_activation(self):
        # A strongly saturating tanh makes G at the pre-activation very different from
        # G at the post-activation; the reference uses the pre-activation.
        spec = [(4, True, "tanh"), (3, True, None)]
        model = make_model(spec)
        model.layers[0].kernel.assign(model.layers[0].kernel * 4.0)
        x, y = data("mse", 3)
        reference = mlp_reference(dense_layers(model), x, y, "mse")
        g_pre, g_post = reference[0]["G"], reference[0]["G_post"]
        self.assertGreater(np.max(np.abs(g_post - g_pre)), 0.2 * np.max(np.abs(g_pre)))
        opt = plain_kfac(xla=False)
        deltas = one_loop_step(model, opt, x, y, "mse")
        assert_close(opt.factors(model.layers[0])["G"].numpy(), reference[0]["G"])
        for got, want in zip(deltas, expected_deltas(reference, spec)):
            assert_close(got, want)

    def test_custom_loop_equals_reference(self):
        spec, loss = [(4, True, "tanh"), (3, True, None)], "ce"
        model = make_model(spec, seed=3)
        x, y = data(loss, 3, seed=4)
        reference = mlp_reference(dense_layers(model), x, y, loss)
        deltas = one_loop_step(model, plain_kfac(xla=False), x, y, loss)
        for got, want in zip(deltas, expected_deltas(reference, spec)):
            assert_close(got, want)

    def test_dense_on_sequence_input_counts_positions(self):
        # Documented in tfkfac/blocks/kronecker.py: extra leading axes are positions,
        # so (as for Conv2D) A = (1/N) Σ_i Σ_t ā ā^T and G = (1/(N T)) Σ_i Σ_t g g^T.
        keras.utils.set_random_seed(13)
        t_len = 3
        model = keras.Sequential([
            keras.Input((t_len, 5)),
            keras.layers.Dense(4, activation="tanh", bias_initializer="random_normal"),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ])
        rng = np.random.default_rng(14)
        x = rng.normal(size=(N, t_len, 5)).astype(np.float32)
        y = rng.normal(size=(N, 3)).astype(np.float32)
        first, _, head = model.layers
        w, b = first.kernel.numpy().astype(np.float64), first.bias.numpy().astype(np.float64)
        w2, b2 = head.kernel.numpy().astype(np.float64), head.bias.numpy().astype(np.float64)
        s = x.astype(np.float64) @ w + b                      # (N, T, 4)
        out = np.tanh(s).reshape(N, -1) @ w2 + b2
        _, d_out = loss_and_output_grad(out, y, "mse")
        ds = (d_out @ w2.T).reshape(s.shape) * (1 - np.tanh(s) ** 2)
        rows = np.concatenate([x.reshape(-1, 5), np.ones((N * t_len, 1))], 1)
        g_rows = (N * ds).reshape(-1, 4)
        A = rows.T @ rows / N
        G = g_rows.T @ g_rows / (N * t_len)
        p = kron_precondition(A, G, rows.T @ ds.reshape(-1, 4), DAMPING)
        opt = plain_kfac(xla=False)
        deltas = one_loop_step(model, opt, x, y, "mse")
        a, g = (opt.factors(first)[name].numpy() for name in ("A", "G"))
        assert_close(a, A, msg="A")
        assert_close(g, G, msg="G")
        assert_close(deltas[0], -LR * p[:-1], msg="kernel")
        assert_close(deltas[1], -LR * p[-1], msg="bias")

    def test_xla_and_non_xla_give_the_same_update(self):
        spec, loss = [(4, True, "tanh"), (3, True, None)], "mse"
        x, y = data(loss, 3, seed=5)
        results = {}
        for xla in (True, False):
            model = make_model(spec, seed=7)
            reference = mlp_reference(dense_layers(model), x, y, loss)
            opt = plain_kfac(xla=xla)
            self.assertEqual(opt.xla, xla)
            results[xla] = one_fit_step(model, opt, x, y, loss)
            for got, want in zip(results[xla], expected_deltas(reference, spec)):
                assert_close(got, want, msg=f"xla={xla}")
        for with_xla, without in zip(results[True], results[False]):
            assert_close(with_xla, without, rtol=1e-5)


if __name__ == "__main__":
    absltest.main()
