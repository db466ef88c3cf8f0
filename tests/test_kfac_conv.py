"""tfkfac.KFAC on Conv2D (KFC rule) against an explicit numpy im2col.

docs/design.md: ā_it is the im2col patch of output position t (the layer's strides,
padding and dilation; flattened in the kernel's (kh, kw, c_in) order) plus 1 for the
bias; A = (1/N) Σ_i Σ_t ā_it ā_itᵀ and G = (1/(N T)) Σ_i Σ_t g_it g_itᵀ with
g_it = N dL/ds_it. The reference extracts patches with Python loops over output
positions, computes TF's 'same' zero padding itself (pad_total = max((out-1) s +
(k-1) d + 1 - in, 0), the smaller half before), runs the whole network forward and
backward in float64 numpy, and checks its own conv output against Keras's before
trusting it. After one step (the first factor update sets F = F_batch) the stored A and
G must match, and the update must equal -lr (A ⊗ G + λI)⁻¹ vec(∇) (np.kron).

A 1x1 convolution on 1x1xC inputs must give the same update as the equivalent Dense.

Tolerances: rtol 1e-4 with an absolute floor of 1e-5 * max|ref| (float32 TF vs float64
numpy, N = 4, λ = 1e-2); the 1x1-conv/Dense comparison is float32 vs float32, rtol 1e-5
with a floor of 1e-6 * max|update|. Patch rows are compared exactly, also when the model
leaves height and width unknown.
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import (DAMPING, LR, assert_close, kron_precondition,  # noqa: E402
                            loop_step, managed_factors)

N = 4  # this file's batch size (kfac_reference.N, used elsewhere, is 8)
C_IN = 2
FILTERS = 3
CLASSES = 2
# The XLA path is compared with the non-XLA one in test_kfac_dense.py; compiling this
# conv net with XLA costs ~20 s on the shared 2-core machine, so the fit here runs without.
XLA_FIT = False


# ----------------------------------------------------------------- numpy reference
def output_size_and_pad(size, kernel, stride, dilation, padding):
    """Output length and zero padding before, as TensorFlow computes them."""
    effective = (kernel - 1) * dilation + 1
    if padding == "valid":
        return (size - effective) // stride + 1, 0
    out = math.ceil(size / stride)
    pad_total = max((out - 1) * stride + effective - size, 0)
    return out, pad_total // 2


def im2col(x, kernel_size, strides, dilation, padding):
    """(N, Ho, Wo, kh*kw*C) patches by explicit loops over output positions."""
    n, h, w, c = x.shape
    kh, kw = kernel_size
    ho, top = output_size_and_pad(h, kh, strides[0], dilation[0], padding)
    wo, left = output_size_and_pad(w, kw, strides[1], dilation[1], padding)
    patches = np.zeros((n, ho, wo, kh * kw * c))
    for oh in range(ho):
        for ow in range(wo):
            column = []
            for i in range(kh):
                for j in range(kw):
                    r = oh * strides[0] - top + i * dilation[0]
                    q = ow * strides[1] - left + j * dilation[1]
                    if 0 <= r < h and 0 <= q < w:
                        column.append(x[:, r, q, :])
                    else:
                        column.append(np.zeros((n, c)))
            patches[:, oh, ow, :] = np.concatenate(column, axis=1)
    return patches


def conv_net_reference(conv, dense, x, labels, use_bias):
    """Conv2D(tanh) -> Flatten -> Dense -> softmax CE, forward and backward in numpy."""
    w = conv.kernel.numpy().astype(np.float64)
    kh, kw, c_in, c_out = w.shape
    patches = im2col(x.astype(np.float64), conv.kernel_size, conv.strides,
                     conv.dilation_rate, conv.padding)
    n, ho, wo, _ = patches.shape
    s = patches @ w.reshape(kh * kw * c_in, c_out)
    if use_bias:
        s = s + conv.bias.numpy().astype(np.float64)
    hidden = np.tanh(s).reshape(n, -1)
    w2 = dense.kernel.numpy().astype(np.float64)
    logits = hidden @ w2 + dense.bias.numpy().astype(np.float64)
    z = logits - logits.max(1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    d_logits = (p - np.eye(CLASSES)[labels]) / n
    ds = (d_logits @ w2.T).reshape(s.shape) * (1.0 - np.tanh(s) ** 2)  # dL/ds

    t = ho * wo
    rows = patches.reshape(n * t, -1)
    if use_bias:
        rows = np.concatenate([rows, np.ones((n * t, 1))], 1)
    g_rows = (n * ds).reshape(n * t, c_out)
    return {
        "s": s,
        "A": rows.T @ rows / n,
        "G": g_rows.T @ g_rows / (n * t),
        "grad": rows.T @ ds.reshape(n * t, c_out),
    }


# ------------------------------------------------------------------------ models
def conv_model(input_hw, kernel_size, strides, padding, dilation, use_bias, seed=0):
    keras.utils.set_random_seed(seed)
    conv = keras.layers.Conv2D(FILTERS, kernel_size, strides=strides, padding=padding,
                               dilation_rate=dilation, use_bias=use_bias,
                               activation="tanh", bias_initializer="random_normal")
    dense = keras.layers.Dense(CLASSES, bias_initializer="random_normal")
    model = keras.Sequential([keras.Input(input_hw + (C_IN,)), conv,
                              keras.layers.Flatten(), dense])
    return model, conv, dense


def ce_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def plain_kfac(**kwargs):
    return tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(LR), damping=DAMPING, kl_clip=None,
                       **{"method": "eigen", "xla": False, **kwargs})


CASES = [
    # name, input (H, W), kernel, strides, padding, dilation, bias
    ("stride1_same_7x7", (7, 7), (3, 3), (1, 1), "same", (1, 1), True),
    ("stride1_valid_7x7_nobias", (7, 7), (3, 3), (1, 1), "valid", (1, 1), False),
    ("stride2_same_7x7", (7, 7), (3, 3), (2, 2), "same", (1, 1), True),
    ("stride2_valid_9x9", (9, 9), (3, 3), (2, 2), "valid", (1, 1), True),
    # pad_total = 3 rows (1 before, 2 after) and 2 columns: asymmetric 'same' padding
    ("stride2_same_asymmetric_7x9_k4x3", (7, 9), (4, 3), (2, 2), "same", (1, 1), True),
    ("dilation2_same_7x7", (7, 7), (3, 3), (1, 1), "same", (2, 2), True),
    ("dilation2_valid_9x9", (9, 9), (3, 3), (1, 1), "valid", (2, 2), True),
]


class Conv2DTest(parameterized.TestCase):

    @parameterized.named_parameters(*CASES)
    def test_factors_and_update_match_im2col(self, hw, kernel, strides, padding,
                                             dilation, use_bias):
        model, conv, dense = conv_model(hw, kernel, strides, padding, dilation, use_bias)
        rng = np.random.default_rng(sum(hw) + kernel[0] + strides[0] + dilation[0])
        x = rng.normal(size=(N,) + hw + (C_IN,)).astype(np.float32)
        labels = rng.integers(0, CLASSES, size=N)
        ref = conv_net_reference(conv, dense, x, labels, use_bias)
        # The numpy im2col convolution reproduces Keras's pre-activation output.
        keras_s = conv.convolution_op(x, conv.kernel).numpy()
        if use_bias:
            keras_s = keras_s + conv.bias.numpy()
        self.assertEqual(keras_s.shape, ref["s"].shape)
        assert_close(keras_s, ref["s"], msg="numpy conv forward vs Keras")

        opt = plain_kfac()
        opt.attach(model)
        deltas = loop_step(model, opt, ce_loss(), x, labels)
        self.assertEqual([m["kind"] for m in opt.summary()["managed"]], ["conv2d", "dense"])
        a, g = (opt.factors(conv)[name].numpy() for name in ("A", "G"))
        assert_close(a, ref["A"], msg="conv A")
        assert_close(g, ref["G"], msg="conv G")

        p = kron_precondition(ref["A"], ref["G"], ref["grad"], DAMPING)
        in_dim = kernel[0] * kernel[1] * C_IN
        assert_close(deltas[0], -LR * p[:in_dim].reshape(kernel + (C_IN, FILTERS)),
                     msg="conv kernel update")
        if use_bias:
            assert_close(deltas[1], -LR * p[in_dim], msg="conv bias update")

    def test_fit_path_matches_im2col(self):
        hw, kernel, strides, padding, dilation = (7, 7), (3, 3), (2, 2), "same", (1, 1)
        model, conv, dense = conv_model(hw, kernel, strides, padding, dilation, True, 5)
        rng = np.random.default_rng(6)
        x = rng.normal(size=(N,) + hw + (C_IN,)).astype(np.float32)
        labels = rng.integers(0, CLASSES, size=N)
        ref = conv_net_reference(conv, dense, x, labels, True)
        opt = plain_kfac(xla=XLA_FIT)
        opt.attach(model)
        model.compile(optimizer=opt, loss=ce_loss())
        before = conv.kernel.numpy().copy()
        model.fit(x, labels, batch_size=N, epochs=1, shuffle=False, verbose=0)
        a, g = (opt.factors(conv)[name].numpy() for name in ("A", "G"))
        assert_close(a, ref["A"])
        assert_close(g, ref["G"])
        p = kron_precondition(ref["A"], ref["G"], ref["grad"], DAMPING)
        assert_close(conv.kernel.numpy() - before,
                     -LR * p[:-1].reshape(kernel + (C_IN, FILTERS)))

    @parameterized.named_parameters(*CASES)
    def test_rows_with_unknown_spatial_size_match_im2col(self, hw, kernel, strides,
                                                         padding, dilation, use_bias):
        # A fully convolutional model (Input((None, None, C))) traces with dynamic
        # height and width: the patch geometry is then computed in the graph.
        del use_bias
        conv = keras.layers.Conv2D(FILTERS, kernel, strides=strides, padding=padding,
                                   dilation_rate=dilation)
        conv.build((None, None, None, C_IN))
        block = tfkfac.blocks.ConvBlock(conv)
        rows = tf.function(block.input_rows, input_signature=[
            tf.TensorSpec((None, None, None, C_IN), tf.float32)])
        x = np.random.default_rng(3).normal(size=(N,) + hw + (C_IN,)).astype(np.float32)
        expected = im2col(x, kernel, strides, dilation, padding).reshape(-1, block.in_dim)
        np.testing.assert_allclose(rows(x).numpy(), expected, rtol=0, atol=0)

    def test_1x1_conv_on_1x1_input_equals_dense(self):
        keras.utils.set_random_seed(21)
        conv_net = keras.Sequential([
            keras.Input((1, 1, 5)),
            keras.layers.Conv2D(4, 1, activation="tanh", bias_initializer="random_normal"),
            keras.layers.Flatten(),
            keras.layers.Dense(3, bias_initializer="random_normal"),
        ])
        dense_net = keras.Sequential([
            keras.Input((5,)),
            keras.layers.Dense(4, activation="tanh"),
            keras.layers.Dense(3),
        ])
        conv_layer, _, head = conv_net.layers
        dense_layer, dense_head = dense_net.layers
        dense_layer.kernel.assign(conv_layer.kernel.numpy().reshape(5, 4))
        dense_layer.bias.assign(conv_layer.bias.numpy())
        dense_head.kernel.assign(head.kernel.numpy())
        dense_head.bias.assign(head.bias.numpy())
        rng = np.random.default_rng(22)
        x = rng.normal(size=(8, 5)).astype(np.float32)
        labels = rng.integers(0, 3, size=8)

        results = []
        for model, inputs in ((conv_net, x.reshape(8, 1, 1, 5)), (dense_net, x)):
            opt = plain_kfac()
            opt.attach(model)
            deltas = loop_step(model, opt, ce_loss(), inputs, labels)
            factors = managed_factors(opt)
            results.append((deltas, factors))
        (conv_deltas, conv_factors), (dense_deltas, dense_factors) = results
        for got, want in zip(conv_factors, dense_factors):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        self.assertLen(conv_deltas, 4)
        # The factors agree to float32 round-off; the eigendecomposition carries that
        # into the update, so the floor is relative to the update's largest entry.
        for got, want in zip([conv_deltas[0].reshape(5, 4)] + conv_deltas[1:], dense_deltas):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
        self.assertGreater(np.max(np.abs(dense_deltas[0])), 1e-3)


if __name__ == "__main__":
    absltest.main()
