"""EinsumDense and Embedding blocks against float64 numpy, by docs/design.md §2.

Every case runs one custom-loop step (momentum 0, no KL clip) of a one-layer model with
the mean squared error, so the update is -lr * P. The reference computes dL/ds in numpy
from the layer's weights (np.einsum forward, tanh where the layer has it), builds the
rows ā (plus 1 for the bias) and g = N dL/ds by explicit slicing, the gradient ∇ by
np.einsum, A = (1/N) Σ ā āᵀ, G = (1/(N T)) Σ g gᵀ, and solves with np.kron (eigen) or
the π-corrected factored inverse (inverse):
- "abc,cde->abde" (MultiHeadAttention's query/key/value, bias "de") equals Dense(d·e)
  on (N, T, c) with its kernel reshaped: same A, G and update, both against numpy;
- the output projection "abcd,cde->abe" and a kernel listing its contracted letters in
  another order than the input ("abcd,dce->abe": A flattened in kernel order);
- a letter in input, kernel and output ("abcd,dce->abce"): one pair per index, each the
  pair of that slice (factors (q, n, n));
- MultiHeadAttention's projection of a 4-D input ("abcd,def->abcef", two position
  letters) under weight_sharing "expand" and "reduce";
- Embedding is a bias-free Dense on one-hot tokens: A = diag(counts / N) as a length-V
  vector, solved against the dense diag(A) ⊗ G, with and without mask_zero (the masked
  loss zeroes those positions' dL/ds; their tokens still count, as for the Dense);
- two MultiHeadAttention layers (a 4-D and a 3-D one, whose sublayers share names) have
  all eight projections managed, each with its own factors, and train finite;
- equations outside the rule get the plain gradient, with the reason in summary().
The Embedding state test with a 50,000-token vocabulary is in
test_kfac_layer_equivalences.py.

Tolerance: float32 TF against float64 numpy, rtol 1e-4 with an absolute floor of
1e-5 * max|ref| (kfac_reference.assert_close).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import (DAMPING, LR, N, assert_close,  # noqa: E402
                            factored_inverse_precondition, kron_precondition, loop_step)

MSE = keras.losses.MeanSquaredError()
RNG = np.random.default_rng(0)
METHODS = ("eigen", "inverse")


# ------------------------------------------------------------------ numpy reference
def output_grad(s, y, mask=None, tanh=False):
    """dL/ds of the (masked) mean squared error of tanh(s) or s, in float64."""
    out = np.tanh(s) if tanh else s
    mask = np.ones(s.shape[:-1]) if mask is None else mask.astype(np.float64)
    # Keras: mean over the last axis, then a mean over the unmasked positions.
    ds = 2.0 * (out - y) * mask[..., None] / (s.shape[-1] * mask.sum())
    return ds * (1.0 - out ** 2) if tanh else ds


def with_ones(rows):
    return np.concatenate([rows, np.ones(rows.shape[:-1] + (1,))], axis=-1)


def solve(A, G, grad, method):
    """(A ⊗ G + λI)⁻¹ vec(∇) explicitly, or the π-corrected factored inverse."""
    if method == "eigen":
        return kron_precondition(A, G, grad, DAMPING)
    return factored_inverse_precondition(A, G, grad, DAMPING)


def pair(a_rows, g_rows, grad, positions, method):
    """A, G and P of one Kronecker pair from its rows (ā, g = N dL/ds) and ∇."""
    A = a_rows.T @ a_rows / N
    G = g_rows.T @ g_rows / (N * positions)
    return A, G, solve(A, G, grad, method)


def weights(layer):
    return [w.astype(np.float64) for w in layer.get_weights()]


# ------------------------------------------------------------------------- helpers
def kfac(model, method="eigen", **kwargs):
    return tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING, kl_clip=None,
                       method=method, xla=False, **kwargs).attach(model)


def one_layer_step(layer, x, method="eigen", **kwargs):
    """(optimizer, weight deltas, float64 weights before the step, targets) of one step."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input(x.shape[1:], dtype=x.dtype)
    model = keras.Model(inputs, layer(inputs))
    for variable in layer.trainable_variables:  # a random bias, not Keras's zeros
        variable.assign(RNG.normal(scale=0.5, size=variable.shape))
    y = RNG.normal(size=(N,) + tuple(model.output.shape[1:])).astype(np.float32)
    opt = kfac(model, method, **kwargs)
    params = weights(layer)
    deltas = loop_step(model, opt, MSE, x, y)
    return opt, deltas, params, y


def einsum_grad(layer, x, params, y):
    """dL/ds at the layer's pre-activation, forward by np.einsum."""
    kernel, *bias = params
    s = np.einsum(layer.equation, x.astype(np.float64), kernel) + sum(bias)
    return output_grad(s, y, tanh=layer.activation.__name__ == "tanh")


def einsum_dense(equation, output_shape, bias_axes, **kwargs):
    return keras.layers.EinsumDense(equation, output_shape=output_shape,
                                    bias_axes=bias_axes, **kwargs)


class EinsumDenseTest(parameterized.TestCase):

    def assert_pair(self, opt, layer, deltas, reference, kernel_of, bias_of):
        """Factors equal the reference (A, G, P), the update is -lr * P split back."""
        A, G, P = reference
        factors = opt.factors(layer)
        assert_close(factors["A"], A, msg="A")
        assert_close(factors["G"], G, msg="G")
        assert_close(deltas[0], -LR * kernel_of(P), msg="kernel")
        assert_close(deltas[1], -LR * bias_of(P), msg="bias")
        self.assertGreater(np.max(np.abs(deltas[0])), 1e-4)

    @parameterized.parameters(*METHODS)
    def test_projection_equals_dense_with_reshaped_kernel(self, method):
        t, c, d, e = 4, 3, 2, 3
        x = RNG.normal(size=(N, t, c)).astype(np.float32)
        layer = einsum_dense("abc,cde->abde", (t, d, e), "de", activation="tanh")
        opt, deltas, (kernel, bias), y = one_layer_step(layer, x, method)
        ds = einsum_grad(layer, x, (kernel, bias), y)
        grad = np.concatenate([np.einsum("abc,abde->cde", x, ds).reshape(c, d * e),
                               ds.sum(axis=(0, 1)).reshape(1, d * e)])
        reference = pair(with_ones(x.reshape(-1, c)), N * ds.reshape(-1, d * e), grad, t,
                         method)
        self.assert_pair(opt, layer, deltas, reference,
                         lambda p: p[:-1].reshape(c, d, e), lambda p: p[-1].reshape(d, e))

        dense = keras.layers.Dense(d * e, activation="tanh")
        dense_model = keras.Sequential([keras.Input((t, c)), dense])
        dense.set_weights([kernel.reshape(c, d * e), bias.reshape(d * e)])
        dense_opt = kfac(dense_model, method)
        dense_deltas = loop_step(dense_model, dense_opt, MSE, x, y.reshape(N, t, d * e))
        for name in ("A", "G"):
            assert_close(opt.factors(layer)[name], dense_opt.factors(dense)[name], msg=name)
        assert_close(deltas[0].reshape(c, d * e), dense_deltas[0], rtol=1e-3)
        assert_close(deltas[1].reshape(d * e), dense_deltas[1], rtol=1e-3)

    @parameterized.product(method=METHODS, kernel_order=("cde", "dce"))
    def test_output_projection_flattens_a_in_kernel_order(self, method, kernel_order):
        t, heads, width, e = 3, 2, 3, 4
        x = RNG.normal(size=(N, t, heads, width)).astype(np.float32)
        layer = einsum_dense(f"abcd,{kernel_order}->abe", (t, e), "e")
        opt, deltas, params, y = one_layer_step(layer, x, method)
        kernel_shape = params[0].shape
        ds = einsum_grad(layer, x, params, y)
        # The kernel's first two letters are contracted, in the kernel's order.
        rows = x if kernel_order == "cde" else x.transpose(0, 1, 3, 2)
        grad = np.einsum(f"abcd,abe->{kernel_order}", x, ds).reshape(-1, e)
        grad = np.concatenate([grad, ds.sum(axis=(0, 1))[None]])
        reference = pair(with_ones(rows.reshape(-1, heads * width)), N * ds.reshape(-1, e),
                         grad, t, method)
        self.assert_pair(opt, layer, deltas, reference,
                         lambda p: p[:-1].reshape(kernel_shape), lambda p: p[-1])

    @parameterized.parameters(*METHODS)
    def test_letter_in_all_three_gives_one_pair_per_index(self, method):
        t, q, c, o = 3, 2, 3, 4
        x = RNG.normal(size=(N, t, q, c)).astype(np.float32)
        layer = einsum_dense("abcd,dce->abce", (t, q, o), "ce")
        opt, deltas, params, y = one_layer_step(layer, x, method)
        ds = einsum_grad(layer, x, params, y)
        references = []
        for j in range(q):
            grad = np.concatenate([np.einsum("abd,abe->de", x[:, :, j], ds[:, :, j]),
                                   ds[:, :, j].sum(axis=(0, 1))[None]])
            references.append(pair(with_ones(x[:, :, j].reshape(-1, c)),
                                   N * ds[:, :, j].reshape(-1, o), grad, t, method))
        A, G, P = (np.stack(parts) for parts in zip(*references))
        self.assertEqual(opt.factors(layer)["A"].shape, (q, c + 1, c + 1))
        self.assert_pair(opt, layer, deltas, (A, G, P),
                         lambda p: p[:, :-1].transpose(1, 0, 2), lambda p: p[:, -1])

    @parameterized.parameters("expand", "reduce")
    def test_weight_sharing_rules_over_two_position_letters(self, weight_sharing):
        h, w, c, heads, width = 2, 3, 4, 2, 3
        x = RNG.normal(size=(N, h, w, c)).astype(np.float32)
        layer = einsum_dense("abcd,def->abcef", (h, w, heads, width), "ef")
        opt, deltas, params, y = one_layer_step(layer, x, weight_sharing=weight_sharing)
        ds = einsum_grad(layer, x, params, y)
        a_rows = with_ones(x.reshape(N, h * w, c))
        g_rows = N * ds.reshape(N, h * w, heads * width)
        grad = np.concatenate([np.einsum("abcd,abcef->def", x, ds).reshape(c, -1),
                               ds.sum(axis=(0, 1, 2)).reshape(1, -1)])
        if weight_sharing == "expand":
            reference = pair(a_rows.reshape(-1, c + 1), g_rows.reshape(-1, heads * width),
                             grad, h * w, "eigen")
        else:  # ā_i the mean over positions, ĝ_i the sum, each example counted once
            reference = pair(a_rows.mean(axis=1), g_rows.sum(axis=1), grad, 1, "eigen")
        self.assert_pair(opt, layer, deltas, reference,
                         lambda p: p[:-1].reshape(c, heads, width),
                         lambda p: p[-1].reshape(heads, width))

    def test_multi_head_attention_projections_are_managed(self):
        keras.utils.set_random_seed(6)
        inputs = keras.Input((2, 3, 4))
        first = keras.layers.MultiHeadAttention(2, 3, attention_axes=(1, 2), name="first")
        second = keras.layers.MultiHeadAttention(2, 3, name="second")
        hidden = keras.layers.Reshape((6, 4))(first(inputs, inputs))
        hidden = keras.layers.Flatten()(second(hidden, hidden))
        model = keras.Model(inputs, keras.layers.Dense(3, name="head")(hidden))
        opt = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                          factor_update_freq=1, xla=False).attach(model)
        projections = [layer.query_dense for layer in (first, second)]
        self.assertEqual([p.equation for p in projections], ["abcd,def->abcef",
                                                             "abc,cde->abde"])
        summary = opt.summary()
        self.assertEmpty(summary["skipped"])
        kinds = [m["kind"] for m in summary["managed"]]
        self.assertEqual(kinds.count("einsum_dense"), 8)

        x = RNG.normal(size=(4 * N, 2, 3, 4)).astype(np.float32)
        y = RNG.normal(size=(4 * N, 3)).astype(np.float32)
        loop_step(model, opt, MSE, x[:N], y[:N])
        # The two "query" sublayers keep their own statistics: A of the first is its input's.
        rows = with_ones(x[:N].reshape(-1, 4).astype(np.float64))
        assert_close(opt.factors(projections[0])["A"], rows.T @ rows / N)
        # Names repeat across attention layers; paths do not.
        self.assertEqual([m["layer"] for m in summary["managed"]].count("first/query"), 1)
        assert_close(opt.factors("first/query")["A"], rows.T @ rows / N)
        with self.assertRaisesRegex(ValueError, r"'query' names 2 managed layers.*first/query"):
            opt.factors("query")

        before = [v.numpy().copy() for v in model.trainable_variables]
        model.compile(optimizer=opt, loss=MSE)
        losses = model.fit(x[N:], y[N:], batch_size=N, verbose=0).history["loss"]
        self.assertTrue(np.all(np.isfinite(losses)), losses)
        for variable, old in zip(model.trainable_variables, before):
            self.assertTrue(np.all(np.isfinite(variable.numpy())), variable.path)
            self.assertFalse(np.array_equal(variable.numpy(), old), variable.path)
        self.assertEqual(opt.summary()["counters"]["factor_updates"], 4)

    @parameterized.named_parameters(
        ("ellipsis", "...b,bc->...c", (2,), None, (4, 3), "ellipsis"),
        ("summed_input_letter", "abc,cd->ad", (2,), None, (4, 3), "summed outside"),
        ("bias_over_positions", "abc,cd->abd", (4, 2), "bd", (4, 3), "bias over 'bd'"),
        ("bias_not_per_index", "abc,bcd->abd", (4, 2), "d", (4, 3), "bias over 'd'"),
    )
    def test_other_layouts_get_the_plain_gradient(self, equation, output_shape, bias_axes,
                                                  input_shape, reason):
        inputs = keras.Input(input_shape)
        layer = einsum_dense(equation, output_shape, bias_axes, name="other")
        hidden = keras.layers.Flatten()(layer(inputs))
        opt = kfac(keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden)))
        summary = opt.summary()
        self.assertEqual([m["layer"] for m in summary["managed"]], ["head"])
        (skipped,) = summary["skipped"]
        self.assertEqual(skipped["layer"], "other")
        self.assertStartsWith(skipped["reason"], f"EinsumDense equation {equation!r}: ")
        self.assertIn(reason, skipped["reason"])


class EmbeddingTest(parameterized.TestCase):

    @parameterized.product(method=METHODS, mask_zero=(False, True))
    def test_embedding_is_dense_on_one_hot_tokens(self, method, mask_zero):
        vocabulary, width, t = 9, 3, 5
        tokens = RNG.integers(0, vocabulary - 1, size=(N, t)).astype(np.int32)
        tokens[0, :2] = 0  # token 0 present (masked when mask_zero); token V-1 absent
        layer = keras.layers.Embedding(vocabulary, width, mask_zero=mask_zero)
        opt, deltas, (table,), y = one_layer_step(layer, tokens, method)
        one_hot = np.eye(vocabulary)[tokens.reshape(-1)]
        ds = output_grad(table[tokens], y, mask=tokens != 0 if mask_zero else None)
        ds_rows = ds.reshape(-1, width)
        A = one_hot.T @ one_hot / N  # diagonal: the token counts / N
        G = (N * ds_rows).T @ (N * ds_rows) / (N * t)
        P = solve(A, G, one_hot.T @ ds_rows, method)
        factors = opt.factors(layer)
        self.assertEqual(factors["A"].shape, (vocabulary,))
        assert_close(factors["A"], np.diag(A), msg="A")
        assert_close(factors["G"], G, msg="G")
        assert_close(deltas[0], -LR * P, msg="embeddings")
        self.assertEqual(np.abs(deltas[0][-1]).max(), 0.0)


if __name__ == "__main__":
    absltest.main()
