"""Sample and class weights in the factor statistics (docs/design.md §2).

With per-example weights w_i the loss is L = (1/N) Σ_i w_i l_i, so g_i = N dL/ds_i =
w_i e_i with e_i = dl_i/ds_i, and the factors are those of the Fisher of that loss:
A = Σ_i w_i Σ_t ā_it ā_itᵀ / Σ_i w_i and G = (1/(N T)) Σ_i w_i Σ_t e_it e_itᵀ. Checked
against a float64 numpy forward/backward of a Conv2D + Dense model (im2col patches),
after one `fit` step with `sample_weight`, with `class_weight` and in a custom loop; with
w ≡ 1 the factors are bit-identical to those without weights; with fresh flags
(`tfkfac.fresh_flags(flags, sample_weight=w)`) they are the weighted factors of the fresh
examples alone, and the loss is still the weighted loss of the whole batch. A user's
`(x, y, sample_weight)` is never read as fresh flags, and `class_weight` under
factor_examples="fresh" is refused before any step.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import assert_close  # noqa: E402

N, CLASSES, KERNEL = 10, 4, 3
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N, 6, 6, 2)).astype(np.float32)
Y = RNG.integers(0, CLASSES, N)
# One example weighs nothing: it must contribute nothing (no 0/0).
WEIGHTS = np.array([0.5, 2.0, 1.0, 0.0, 3.0, 1.5, 0.25, 1.0, 2.5, 0.75], np.float32)
CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 1.0, 3: 3.0}


def conv_dense(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(3, KERNEL, activation="relu", name="conv"),
        keras.layers.Flatten(),
        keras.layers.Dense(CLASSES, name="logits"),
    ])


def kfac(**settings):
    return tfkfac.KFAC(**dict(dict(learning_rate=0.1, damping=1e-2, state_dtype="float64",
                                   xla=False), **settings))


def reference_factors(model_weights, x, y, w):
    """{layer/factor: value} of the Fisher of L = (1/N) Σ w_i l_i, in float64 numpy."""
    kernel, bias, dense_kernel, dense_bias = (np.asarray(v, np.float64) for v in model_weights)
    x = np.asarray(x, np.float64)
    n, size = len(x), x.shape[1] - KERNEL + 1
    positions = size * size
    patches = np.stack([x[:, r:r + KERNEL, c:c + KERNEL, :].reshape(n, -1)
                        for r in range(size) for c in range(size)], axis=1)  # (n, T, 18)
    patches = np.concatenate([patches, np.ones((n, positions, 1))], axis=2)
    conv_out = patches[..., :-1] @ kernel.reshape(-1, kernel.shape[-1]) + bias
    hidden = np.maximum(conv_out, 0).reshape(n, -1)  # Flatten of (n, r, c, channel)
    hidden_bar = np.concatenate([hidden, np.ones((n, 1))], axis=1)
    logits = hidden @ dense_kernel + dense_bias
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    e_dense = p - np.eye(CLASSES)[y]  # dl_i/ds_i, unweighted
    e_conv = ((e_dense @ dense_kernel.T).reshape(n, positions, -1)
              * (conv_out > 0))  # dl_i/ds_it
    w = np.asarray(w, np.float64)
    return {
        "conv/A": np.einsum("i,ita,itb->ab", w, patches, patches) / w.sum(),
        "conv/G": np.einsum("i,ita,itb->ab", w, e_conv, e_conv) / (n * positions),
        "logits/A": np.einsum("i,ia,ib->ab", w, hidden_bar, hidden_bar) / w.sum(),
        "logits/G": np.einsum("i,ia,ib->ab", w, e_dense, e_dense) / n,
    }


def factors(optimizer):
    return {f"{layer}/{name}": value.numpy() for layer in ("conv", "logits")
            for name, value in optimizer.factors(layer).items()}


def fit_once(model, optimizer, *args, **kwargs):
    """One `fit` step on the whole batch; returns its loss."""
    model.compile(optimizer=optimizer, loss=LOSS)
    history = model.fit(*args, batch_size=N, epochs=1, verbose=0, shuffle=False, **kwargs)
    return history.history["loss"][0]


class WeightedStatisticsTest(absltest.TestCase):

    def assert_reference(self, got, expected):
        for key, value in expected.items():
            assert_close(got[key], value, msg=key)

    def test_sample_weight_through_fit(self):
        model = conv_dense()
        initial = model.get_weights()
        optimizer = kfac()
        fit_once(model, optimizer, X, Y, sample_weight=WEIGHTS)
        self.assert_reference(factors(optimizer), reference_factors(initial, X, Y, WEIGHTS))

    def test_class_weight_through_fit(self):
        model = conv_dense()
        initial = model.get_weights()
        optimizer = kfac()
        fit_once(model, optimizer, X, Y, class_weight=CLASS_WEIGHT)
        weights = np.array([CLASS_WEIGHT[c] for c in Y])
        self.assert_reference(factors(optimizer), reference_factors(initial, X, Y, weights))

    def test_sample_weight_in_a_custom_loop(self):
        model = conv_dense()
        initial = model.get_weights()
        optimizer = kfac().attach(model)
        with optimizer.record() as tape:
            loss = LOSS(Y, model(X, training=True), sample_weight=WEIGHTS)
        optimizer.minimize(loss, tape=tape, sample_weight=WEIGHTS)
        self.assert_reference(factors(optimizer), reference_factors(initial, X, Y, WEIGHTS))

    def test_unit_weights_change_nothing(self):
        results = []
        for weights in (None, np.ones(N, np.float32)):
            model = conv_dense()
            optimizer = kfac()
            fit_once(model, optimizer, X, Y, sample_weight=weights)
            results.append((factors(optimizer), model.get_weights()))
        for key, value in results[0][0].items():
            np.testing.assert_array_equal(results[1][0][key], value, err_msg=key)
        for before, after in zip(results[0][1], results[1][1]):
            np.testing.assert_array_equal(after, before)

    def test_fresh_flags_with_sample_weights(self):
        flags = np.array([1, 0, 1, 1, 0, 1, 1, 0, 1, 1], np.float32)
        model = conv_dense()
        initial = model.get_weights()
        expected_loss = float(LOSS(Y, model(X), sample_weight=WEIGHTS))
        optimizer = kfac(factor_examples="fresh")
        loss = fit_once(model, optimizer, X, Y,
                        sample_weight=tfkfac.fresh_flags(flags, sample_weight=WEIGHTS))
        # The loss is the whole batch's, weighted; the factors the fresh examples' alone.
        self.assertAlmostEqual(loss, expected_loss, places=5)
        fresh = flags == 1
        self.assert_reference(factors(optimizer),
                              reference_factors(initial, X[fresh], Y[fresh], WEIGHTS[fresh]))

    def test_a_users_sample_weight_is_never_read_as_fresh_flags(self):
        mask = (np.arange(N) % 2).astype(np.float32)  # 0/1, as fresh flags would be
        dataset = tf.data.Dataset.from_tensor_slices((X, Y, mask)).batch(N)
        model = conv_dense()
        before = model.get_weights()
        with self.assertRaisesRegex(ValueError, r"tfkfac\.fresh_flags\(flags\).*this batch "
                                    "has a sample weight there"):
            fit_once(model, kfac(factor_examples="fresh"), dataset)
        for old, new in zip(before, model.get_weights()):
            np.testing.assert_array_equal(new, old)
        # Without the option the same batch trains with its weights.
        model = conv_dense()
        loss = fit_once(model, kfac(), dataset)
        self.assertAlmostEqual(loss, float(LOSS(Y, conv_dense()(X), sample_weight=mask)),
                               places=5)

    def test_class_weight_with_fresh_flags_is_refused_before_any_step(self):
        flags = np.ones(N, np.float32)
        for data in (dict(x=X, y=Y),
                     dict(x=X, y=Y, sample_weight=tfkfac.fresh_flags(flags))):
            model = conv_dense()
            before = model.get_weights()
            with self.assertRaisesRegex(ValueError, r"^KFAC\(factor_examples='fresh'\) "
                                        "cannot take `class_weight`"):
                fit_once(model, kfac(factor_examples="fresh"), class_weight=CLASS_WEIGHT,
                         **data)
            for old, new in zip(before, model.get_weights()):
                np.testing.assert_array_equal(new, old)

    def test_negative_weights_stop_fit_in_one_line(self):
        weights = WEIGHTS.copy()
        weights[2] = -1.0
        model = conv_dense()
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    r"^KFAC: `sample_weight` must be >= 0 \([^\n]*\)\.?$"):
            fit_once(model, kfac(), X, Y, sample_weight=weights)

    def test_weights_per_position_are_refused_naming_sample_weight(self):
        # Keras takes weights per output position; they give no weight per example.
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((5, 3)), keras.layers.Dense(CLASSES)])
        x = RNG.normal(size=(N, 5, 3)).astype(np.float32)
        y = RNG.integers(0, CLASSES, (N, 5))
        with self.assertRaisesRegex(ValueError, r"^KFAC weighs each example's factor "
                                    r"statistics by its sample weight: `sample_weight` must "
                                    r"hold one weight per example, shape \(N,\) or \(N, 1\); "
                                    r"received shape \(10, 5\)$"):
            fit_once(model, kfac(), x, y, sample_weight=np.ones((N, 5), np.float32))

if __name__ == "__main__":
    absltest.main()
