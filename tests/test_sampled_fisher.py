"""KFAC(fisher="sampled"): G from the loss at labels drawn from the model's predictive
distribution (docs/design.md §2, "Which Fisher").

The reference is the expectation over the draws, computed exactly in numpy (float64,
from the float32 weights) for a two-layer net (Dense tanh, then Dense outputs): per
example, the output gradient g = N dL̃/ds at the output layer is p − e_c with probability
p_c (softmax cross-entropy), (q − y)/d with probability Π_j q_j^y_j (1 − q_j)^(1 − y_j) for
each y in {0, 1}^d (binary cross-entropy over d sigmoid outputs q), or −(2/d) σ ε with
ε ~ N(0, I), σ² = d/2 (mean squared error over d outputs); the hidden layer's is J g,
J = diag(1 − h²) W₂. Then G = (1/N) Σ_i E[g_i g_iᵀ], which for the output layer is
(1/N) Σ_i (diag(p_i) − p_i p_iᵀ), (1/(N d²)) Σ_i diag(q_i (1 − q_i)), resp. (2/d) I. One step of N examples draws one label each: each entry of the sampled G
is a mean of N independent terms whose variances the reference also computes exactly,
and it must lie within 5 standard errors of the expectation (by the central limit
theorem, a 6e-7 chance per entry for a correct G; the draws are seeded, so the test is
deterministic). The empirical G (observed labels) must lie outside that band: the
tolerance separates the two Fishers.
"""

import itertools
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from kfac_reference import sgd_kfac  # noqa: E402
import tfkfac  # noqa: E402

D_IN, HIDDEN, OUTPUTS = 5, 4, 3
N = 4096
STANDARD_ERRORS = 5.0
EVERY_STEP = dict(factor_update_freq=1, decomposition_update_freq=1)
# name: (loss as compiled, output activation, the draws' distribution)
LOSSES = {
    "sparse_logits": (keras.losses.SparseCategoricalCrossentropy(from_logits=True), None,
                      "categorical"),
    "categorical_probabilities": ("categorical_crossentropy", "softmax", "categorical"),
    "binary_probabilities": ("binary_crossentropy", "sigmoid", "bernoulli"),
    "mse": (keras.losses.MeanSquaredError(), None, "normal"),
}


def two_layer_net(activation, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((D_IN,)), keras.layers.Dense(HIDDEN, activation="tanh", name="hidden"),
        keras.layers.Dense(OUTPUTS, activation=activation, name="out")])


def examples(name, count=N, seed=0):
    """Inputs, and observed labels unlike the model's draws (class 0 everywhere, or
    targets far from the outputs), so that the empirical Fisher differs."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, D_IN)).astype("float32")
    if name == "sparse_logits":
        return x, np.zeros(count, "int32")
    if name == "categorical_probabilities":
        return x, np.eye(OUTPUTS, dtype="float32")[np.zeros(count, "int32")]
    if name == "binary_probabilities":
        return x, np.ones((count, OUTPUTS), "float32")
    return x, np.full((count, OUTPUTS), 3.0, "float32")


def trained(name, steps=1, count=N, **settings):
    """(model, optimizer, weights before training) after `steps` fit steps of `count`
    examples each, factors and decompositions every step."""
    loss, activation, _ = LOSSES[name]
    model = two_layer_net(activation)
    optimizer = sgd_kfac(**dict(EVERY_STEP, **settings)).attach(model)
    model.compile(optimizer=optimizer, loss=loss)
    weights = [w.astype(np.float64) for w in model.get_weights()]
    x, y = examples(name, steps * count)
    model.fit(x, y, batch_size=count, epochs=1, shuffle=False, verbose=0)
    return model, optimizer, weights


def first_g(name, **settings):
    """Both layers' G after one step of N examples, and the weights it was taken at."""
    _, optimizer, weights = trained(name, **settings)
    return {layer: optimizer.factors(layer)["G"].numpy() for layer in ("hidden", "out")}, \
        weights


def expected_g(name, weights):
    """{layer: (E[G], standard error of each entry)} over the draws, in float64."""
    w1, b1, w2, b2 = weights
    x, _ = examples(name)
    h = np.tanh(x.astype(np.float64) @ w1 + b1)
    out = h @ w2 + b2
    jacobians = {"out": np.broadcast_to(np.eye(OUTPUTS), (N, OUTPUTS, OUTPUTS)),
                 "hidden": (1 - h ** 2)[:, :, None] * w2[None]}  # J_i: (N, HIDDEN, OUTPUTS)
    kind = LOSSES[name][2]
    if kind == "categorical":
        # Every possible draw c: g = p − e_c, with probability p_c.
        probabilities = np.exp(out - out.max(axis=1, keepdims=True))
        probabilities /= probabilities.sum(axis=1, keepdims=True)
        outcomes = probabilities[:, None, :] - np.eye(OUTPUTS)[None]
    elif kind == "bernoulli":
        # Every possible draw y in {0, 1}^d: g = (q − y)/d.
        q = 1 / (1 + np.exp(-out))
        ys = np.array(list(itertools.product((0.0, 1.0), repeat=OUTPUTS)))
        probabilities = np.prod(np.where(ys[None] == 1, q[:, None], 1 - q[:, None]), axis=2)
        outcomes = (q[:, None, :] - ys[None]) / OUTPUTS
    result = {}
    for layer, jacobian in jacobians.items():
        if kind != "normal":
            draws = np.einsum("iab,icb->ica", jacobian, outcomes)  # (N, outcome, a)
            products = draws[:, :, :, None] * draws[:, :, None, :]
            mean = np.einsum("ic,icab->iab", probabilities, products)
            second = np.einsum("ic,icab->iab", probabilities, products ** 2)
            variance = second - mean ** 2
        else:
            # g = M ε with M = −(2/d) σ J: E[g gᵀ] = M Mᵀ, and for a Gaussian
            # Var(g_a g_b) = (M Mᵀ)_aa (M Mᵀ)_bb + (M Mᵀ)_ab².
            sigma = np.sqrt(OUTPUTS / 2.0)
            m = -(2.0 / OUTPUTS) * sigma * jacobian
            mean = np.einsum("iac,ibc->iab", m, m)
            diagonal = np.einsum("iaa->ia", mean)
            variance = diagonal[:, :, None] * diagonal[:, None, :] + mean ** 2
        result[layer] = (mean.mean(axis=0), np.sqrt(variance.sum(axis=0)) / N)
    return result


class SampledGTest(parameterized.TestCase):

    @parameterized.named_parameters((name, name) for name in LOSSES)
    def test_sampled_g_is_the_expectation_over_the_predictive_distribution(self, name):
        sampled, weights = first_g(name, fisher="sampled")
        empirical, empirical_weights = first_g(name)
        np.testing.assert_array_equal(weights[0], empirical_weights[0])
        for layer, (mean, standard_error) in expected_g(name, weights).items():
            band = STANDARD_ERRORS * standard_error + 1e-6 * np.abs(mean).max()
            deviation = np.abs(sampled[layer] - mean)
            self.assertTrue(np.all(deviation <= band),
                            f"{name} {layer}: |G − E[G]| {deviation.max():.3g}, at most "
                            f"{(deviation / band).max():.3g} bands")
            self.assertTrue(np.any(np.abs(empirical[layer] - mean) > band),
                            f"{name} {layer}: the empirical G lies within the band too")

    def test_same_seed_draws_the_same_another_seed_other_labels(self):
        first, _ = first_g("sparse_logits", fisher="sampled", fisher_seed=5)
        again, _ = first_g("sparse_logits", fisher="sampled", fisher_seed=5)
        other, _ = first_g("sparse_logits", fisher="sampled", fisher_seed=6)
        np.testing.assert_array_equal(first["out"], again["out"])
        self.assertGreater(np.abs(first["out"] - other["out"]).max(), 0.0)

    def test_resumed_run_draws_what_the_uninterrupted_one_did(self):
        x, y = examples("sparse_logits", 64)
        uninterrupted, _, _ = trained("sparse_logits", steps=2, count=32, fisher="sampled")
        model, _, _ = trained("sparse_logits", steps=1, count=32, fisher="sampled")
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        resumed = keras.models.load_model(path)
        resumed.optimizer.attach(resumed)
        resumed.fit(x[32:], y[32:], batch_size=32, epochs=1, shuffle=False, verbose=0)
        for layer in ("hidden", "out"):
            np.testing.assert_array_equal(resumed.optimizer.factors(layer)["G"],
                                          uninterrupted.optimizer.factors(layer)["G"])
        for resumed_weight, weight in zip(resumed.get_weights(), uninterrupted.get_weights()):
            np.testing.assert_array_equal(resumed_weight, weight)


class MixedPrecisionTest(absltest.TestCase):

    def tearDown(self):
        keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    def test_mixed_float16_unscales_the_drawn_labels_output_gradients(self):
        """Keras's LossScaleOptimizer scales the loss (by 2^15 at first); the drawn
        labels' output gradients must be unscaled as the observed ones are: the same
        step then gives the float32 G up to float16 rounding (the same seeds draw the
        same labels but where rounding moves a logit across a draw's boundary)."""
        reference, _ = first_g("sparse_logits", fisher="sampled")
        keras.mixed_precision.set_global_policy("mixed_float16")
        model, optimizer, _ = trained("sparse_logits", fisher="sampled")
        self.assertIsInstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        for layer, g in reference.items():
            np.testing.assert_allclose(optimizer.factors(layer)["G"], g,
                                       atol=2e-2 * np.abs(g).max(), err_msg=layer)


class ObservedGradientTest(absltest.TestCase):

    def test_update_preconditions_the_observed_label_gradient(self):
        """One step from zero momentum moves the weights by −η P(∇), ∇ the observed
        labels' gradient, P this step's preconditioning (the decompositions of the
        sampled factors, read back with `precondition`)."""
        learning_rate = 0.1
        model, optimizer, weights = trained("sparse_logits", count=256, fisher="sampled",
                                            learning_rate=learning_rate, kl_clip=None,
                                            method="eigen")
        x, y = examples("sparse_logits", 256)
        reference = two_layer_net(None)
        reference.set_weights([w.astype("float32") for w in weights])
        with tf.GradientTape() as tape:
            loss = LOSSES["sparse_logits"][0](y, reference(x))
        observed = tape.gradient(loss, reference.trainable_variables)
        preconditioned = optimizer.precondition(observed, model.trainable_variables)
        for before, after, step, gradient in zip(weights, model.get_weights(),
                                                 preconditioned, observed):
            self.assertGreater(np.abs(step.numpy() - gradient.numpy()).max(), 1e-3)
            np.testing.assert_allclose(after - before, -learning_rate * step.numpy(),
                                       rtol=1e-4, atol=1e-6)


class RefusedTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("mean_absolute_error", "mae", "'mae'"),
        ("huber", keras.losses.Huber(), "Huber"),
        ("function", lambda y, p: tf.reduce_mean((y - p) ** 2), "lambda"),
        ("class_axis", keras.losses.CategoricalCrossentropy(axis=0), "axis 0"),
        ("ignore_class", keras.losses.SparseCategoricalCrossentropy(ignore_class=0),
         "ignores class 0"),
        ("several", ["mse"], "list or dict of losses"))
    def test_loss_without_known_predictive_distribution(self, loss, named):
        model = two_layer_net(None)
        model.compile(optimizer=tfkfac.KFAC(fisher="sampled").attach(model), loss=loss)
        x, _ = examples("mse", 8)
        y = np.zeros((8, OUTPUTS), "float32")
        with self.assertRaisesRegex(ValueError, "fisher='sampled'") as caught:
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        self.assertIn(named, str(caught.exception))
        self.assertIn("SparseCategoricalCrossentropy, CategoricalCrossentropy, "
                      "BinaryCrossentropy",
                      str(caught.exception))

    def test_unknown_fisher_and_an_ignored_seed(self):
        with self.assertRaisesRegex(ValueError, "fisher.*one of empirical, sampled"):
            tfkfac.KFAC(fisher="true")
        with self.assertRaisesRegex(ValueError, "fisher_seed=3 with fisher='empirical'"):
            tfkfac.KFAC(fisher_seed=3)

    def test_custom_loop(self):
        model = two_layer_net(None)
        optimizer = tfkfac.KFAC(fisher="sampled").attach(model)
        x, y = examples("sparse_logits", 8)
        with optimizer.record() as tape:
            loss = LOSSES["sparse_logits"][0](y, model(x))
        with self.assertRaisesRegex(ValueError, "custom loop"):
            optimizer.minimize(loss, tape=tape)


if __name__ == "__main__":
    absltest.main()
