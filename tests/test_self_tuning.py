"""Self-tuning K-FAC's core (docs/design.md §14) against an independent numpy reference
(tests/self_tuning_reference.py: a tiny MLP's explicit Jacobian, each loss's Hessian by
central differences of the loss written in numpy).

- The exact curvature products F v = Jᵀ H_L J v (`tfkfac.ggn.products`) and the Gram
  matrix vᵢᵀ F vⱼ (`ggn.quadratic_forms`) equal the explicit F for softmax and sigmoid
  cross-entropy (from logits and from probabilities: the latter's F is the logits' GGN)
  and mean squared error, to float32 rounding on a float32 model and to the reference's
  differencing error on a float64 one; with per-example sample weights; inside a
  tf.function; and calling them leaves a model with BatchNorm and Dropout as it was.
- The 2×2 solve equals numpy.linalg.solve, with its first-step and parallel cases; one
  whole self-tuning update (α, μ, δ, M(δ)) equals the numpy quadratic model with the
  explicit C = F + (λ + η) I (M from its definition ½ δᵀ C δ + ∇hᵀ δ, not the closed
  form), and ρ the numpy losses' ratio.
- λ's trajectory over a scripted sequence of ρ replays the rule step by step, bounds and
  NaN included; the constants are the paper's.
- Bad settings are refused naming the argument.
"""

import math
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import self_tuning_reference as ref  # noqa: E402
import tfkfac  # noqa: E402
from tfkfac import ggn, self_tuning, transform  # noqa: E402

X, LABELS, ONE_HOT, BINARY, REAL = ref.data()
# name: (output activation, Keras loss, numpy per-example loss of z, targets for numpy,
#        labels for Keras)
CASES = {
    "softmax_logits": (None, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       ref.cross_entropy, LABELS, LABELS),
    "softmax_probabilities": ("softmax", keras.losses.CategoricalCrossentropy(),
                              ref.cross_entropy, LABELS, ONE_HOT),
    "sigmoid_logits": (None, keras.losses.BinaryCrossentropy(from_logits=True),
                       ref.binary_cross_entropy, BINARY, BINARY),
    "sigmoid_probabilities": ("sigmoid", "binary_crossentropy", ref.binary_cross_entropy,
                              BINARY, BINARY),
    "mean_squared_error": (None, "mse", ref.squared_error, REAL, REAL),
}
# Measured worst |product − float64 reference| / max |reference| over the cases: 1.2e-7
# on the float32 model (one float32 ulp, 2^-23 = 1.2e-7), 8e-10 on the float64 one (the
# reference's differencing error).
FLOAT32_RTOL, FLOAT64_RTOL = 5e-7, 1e-8


def random_vectors(count, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=ref.PARAMS) for _ in range(count)]


def zeros_variable(shape, name, dtype, initializer="zeros"):
    """The update chain's `add_variable` (tfkfac/transform.py)."""
    return keras.Variable(initializer, shape=shape, dtype=dtype, name=name, trainable=False)


def state_of(variables):
    """What `SelfTuning.create_state` makes its state with, for `variables`."""
    return transform.StateContext(zeros_variable, variables, [v.path for v in variables])


def assert_close(actual, expected, rtol, message=""):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    np.testing.assert_allclose(actual, expected, rtol=0,
                               atol=rtol * np.max(np.abs(expected)), err_msg=message)


class ProductsTest(parameterized.TestCase):

    def setup_case(self, name, dtype):
        activation, loss, numpy_loss, targets, _ = CASES[name]
        model = ref.mlp(dtype, activation)
        x = tf.constant(X, dtype)
        reference = ref.ggn(ref.weights(model), X, numpy_loss, targets)
        curvature = ggn.output_curvature(loss)
        return model, x, reference, curvature

    @parameterized.product(name=sorted(CASES), dtype=["float32", "float64"])
    def test_products_are_the_explicit_ggn_times_the_vectors(self, name, dtype):
        model, x, reference, curvature = self.setup_case(name, dtype)
        variables = model.trainable_variables
        vectors = random_vectors(2)
        products = ggn.products(lambda: model(x, training=True), variables,
                                [ref.unflat(v, variables) for v in vectors], curvature)
        rtol = FLOAT32_RTOL if dtype == "float32" else FLOAT64_RTOL
        for vector, product in zip(vectors, products):
            self.assertEqual([p.dtype for p in product], [v.dtype for v in variables])
            assert_close(ref.flat(product), reference @ vector, rtol, name)

    @parameterized.product(name=sorted(CASES), dtype=["float32", "float64"])
    def test_quadratic_forms_are_the_explicit_gram_matrix(self, name, dtype):
        model, x, reference, curvature = self.setup_case(name, dtype)
        variables = model.trainable_variables
        vectors = random_vectors(2, seed=4)
        gram = ggn.quadratic_forms(lambda: model(x, training=True), variables,
                                   [ref.unflat(v, variables) for v in vectors], curvature)
        self.assertEqual(gram.dtype, tf.float64)
        matrix = np.stack(vectors)
        rtol = FLOAT32_RTOL if dtype == "float32" else FLOAT64_RTOL
        assert_close(gram, matrix @ reference @ matrix.T, rtol, name)

    def test_sample_weights_weigh_each_example(self):
        model, x, _, curvature = self.setup_case("softmax_logits", "float64")
        weights = np.linspace(0.0, 2.0, ref.N)
        reference = ref.ggn(ref.weights(model), X, ref.cross_entropy, LABELS, weights)
        vector = random_vectors(1)[0]
        variables = model.trainable_variables
        (product,) = ggn.products(lambda: model(x, training=True), variables,
                                  [ref.unflat(vector, variables)], curvature,
                                  sample_weight=tf.constant(weights))
        assert_close(ref.flat(product), reference @ vector, FLOAT64_RTOL)

    def test_traced_products_equal_eager_ones(self):
        model, x, _, curvature = self.setup_case("softmax_logits", "float32")
        variables = model.trainable_variables
        vectors = [ref.unflat(v, variables) for v in random_vectors(2)]

        def run():
            return ggn.products(lambda: model(x, training=True), variables, vectors,
                                curvature)

        eager, traced = run(), tf.function(run)()
        for a, b in zip(tf.nest.flatten(eager), tf.nest.flatten(traced)):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)

    def test_model_state_is_left_as_it_was(self):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((ref.D_IN,)), keras.layers.Dense(8, name="a"),
            keras.layers.BatchNormalization(name="bn"), keras.layers.Dropout(0.5),
            keras.layers.Dense(ref.D_OUT, name="b")])
        x = tf.constant(X, tf.float32)
        before = [v.numpy() for v in model.non_trainable_variables]
        curvature = ggn.output_curvature("mse")
        variables = model.trainable_variables
        vectors = [[tf.ones_like(v) for v in variables]]
        predict = lambda: model(x, training=True)  # noqa: E731
        state = model.non_trainable_variables
        first = ggn.products(predict, variables, vectors, curvature, state=state)
        second = ggn.products(predict, variables, vectors, curvature, state=state)
        for a, b in zip(before, model.non_trainable_variables):
            np.testing.assert_array_equal(a, b.numpy())
        for a, b in zip(first[0], second[0]):  # the same dropout masks
            np.testing.assert_array_equal(a.numpy(), b.numpy())

    def test_the_products_agree_with_the_quadratic_forms(self):
        model, x, _, curvature = self.setup_case("sigmoid_logits", "float64")
        variables = model.trainable_variables
        vectors = [ref.unflat(v, variables) for v in random_vectors(2)]
        predict = lambda: model(x, training=True)  # noqa: E731
        products = ggn.products(predict, variables, vectors, curvature)
        gram = ggn.quadratic_forms(predict, variables, vectors, curvature)
        expected = [[ref.flat(v) @ ref.flat(p) for p in products] for v in vectors]
        np.testing.assert_allclose(gram.numpy(), expected, rtol=1e-12)


class QuadraticModelTest(absltest.TestCase):

    def test_solve_is_numpy_linalg_solve(self):
        rng = np.random.default_rng(5)
        for _ in range(20):
            root = rng.normal(size=(2, 2))
            matrix = root @ root.T + 0.1 * np.eye(2)
            b = rng.normal(size=2)
            alpha, mu, change = self_tuning.solve(tf.constant(matrix), tf.constant(b))
            expected = np.linalg.solve(matrix, -b)
            np.testing.assert_allclose([alpha.numpy(), mu.numpy()], expected, rtol=1e-12)
            w = expected
            np.testing.assert_allclose(change.numpy(), 0.5 * w @ matrix @ w + b @ w,
                                       rtol=1e-12)

    def test_first_step_takes_no_momentum(self):
        matrix = np.array([[2.0, 0.0], [0.0, 0.0]])  # δ₀ = 0
        alpha, mu, change = self_tuning.solve(tf.constant(matrix), tf.constant([-3.0, 0.0]))
        self.assertEqual(mu.numpy(), 0.0)
        self.assertAlmostEqual(alpha.numpy(), 1.5, places=15)
        self.assertAlmostEqual(change.numpy(), 0.5 * 1.5 * -3.0, places=15)

    def test_parallel_vectors_take_the_direction_alone(self):
        v = np.array([1.0, 2.0])  # δ₀ = 2Δ: a singular Gram matrix
        matrix = np.outer([1.0, 2.0], [1.0, 2.0]) * 3.0
        alpha, mu, _ = self_tuning.solve(tf.constant(matrix), tf.constant(-v))
        self.assertEqual(mu.numpy(), 0.0)
        self.assertAlmostEqual(alpha.numpy(), 1.0 / 3.0, places=15)

    def test_a_zero_direction_takes_no_step(self):
        alpha, mu, change = self_tuning.solve(tf.zeros((2, 2), tf.float64),
                                              tf.zeros(2, tf.float64))
        self.assertEqual((alpha.numpy(), mu.numpy(), change.numpy()), (0.0, 0.0, 0.0))

    def test_update_and_rho_match_the_numpy_quadratic_model(self):
        model = ref.mlp("float64")
        x = tf.constant(X)
        variables = model.trainable_variables
        params = ref.weights(model)
        damping, l2 = 0.3, 0.05
        fisher = ref.ggn(params, X, ref.cross_entropy, LABELS)
        curvature = ggn.output_curvature(
            keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        tuning = self_tuning.SelfTuning(initial_damping=damping, l2=l2)
        tuning.create_state(state_of(variables))
        rng = np.random.default_rng(6)
        previous = rng.normal(size=ref.PARAMS) * 0.1
        for variable, value in zip(tuning.previous, ref.unflat(previous, params)):
            variable.assign(value)
        gradient = ref.gradient(params, X, ref.cross_entropy, LABELS)
        preconditioned = rng.normal(size=ref.PARAMS)  # P; Δ = −P
        gram = lambda vectors: ggn.quadratic_forms(  # noqa: E731
            lambda: model(x, training=True), variables, vectors, curvature)
        delta, change = tuning.solve_step(ref.unflat(gradient, params),
                                      [tf.constant(p) for p in ref.unflat(preconditioned,
                                                                           params)],
                                      variables, gram)
        # numpy: C explicit, the 2×2 by np.linalg.solve, M by its definition.
        c = fisher + (damping + l2) * np.eye(ref.PARAMS)
        basis = np.stack([-preconditioned, previous], axis=1)
        w = np.linalg.solve(basis.T @ c @ basis, -basis.T @ gradient)
        step = basis @ w
        model_value = 0.5 * step @ c @ step + gradient @ step
        assert_close(ref.flat(delta), step, 1e-7)
        self.assertAlmostEqual(change.numpy() / model_value, 1.0, delta=1e-7)
        np.testing.assert_allclose(
            [tuning.scalars["learning_rate"].numpy(), tuning.scalars["momentum"].numpy()],
            w, rtol=1e-7)
        assert_close(ref.flat(tuning.previous), step, 1e-7)  # δ₀ ← δ
        # ρ from the losses before and after the step, on the same batch.
        old, new = (ref.loss_value(p, X, ref.cross_entropy, LABELS)
                    for p in (params, ref.unflat(ref.flat(params) + step, params)))
        rho = self_tuning.reduction_ratio(tf.constant(new), tf.constant(old), change)
        self.assertAlmostEqual(rho.numpy(), (new - old) / model_value, delta=1e-6)
        # After step 4 (the fifth) λ is adapted by the rule; after step 3 it is not.
        for variable, value in zip(variables, ref.unflat(ref.flat(params) + step, params)):
            variable.assign(value)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, dtype="float64")
        new_loss = lambda: loss(LABELS, model(x, training=True))  # noqa: E731
        tuning.adapt_with(3, new_loss, old)
        self.assertEqual(tuning.scalars["damping"].numpy(), damping)
        tuning.adapt_with(4, new_loss, old)
        expected = self_tuning.LevenbergMarquardt().adapted(damping, rho).numpy()
        self.assertEqual(tuning.scalars["damping"].numpy(), expected)
        self.assertEqual(tuning.scalars["factor_damping"].numpy(), expected + l2)
        self.assertAlmostEqual(tuning.scalars["rho"].numpy(), rho.numpy(), delta=1e-9)


    def test_a_nearly_parallel_previous_update_gives_the_spans_minimiser(self):
        """δ₀ at 2e-4 rad from Δ on a float32 model: δ is the float64 minimiser of M over
        the span of the two (solved in the basis (Δ, δ₀) itself, the float32 rounding of
        the near-singular system's terms gave a step several times too long)."""
        model = ref.mlp("float32")
        variables = model.trainable_variables
        params = ref.weights(model)
        damping = 1e-3
        fisher = ref.ggn(params, X, ref.cross_entropy, LABELS)
        curvature = ggn.output_curvature(
            keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        tuning = self_tuning.SelfTuning(initial_damping=damping)
        tuning.create_state(state_of(variables))
        rng = np.random.default_rng(7)
        preconditioned = rng.normal(size=ref.PARAMS).astype(np.float32)  # P; Δ = −P
        noise = rng.normal(size=ref.PARAMS)
        noise *= 2e-4 * np.linalg.norm(preconditioned) / np.linalg.norm(noise)
        previous = (-0.5 * preconditioned + 0.5 * noise).astype(np.float32)
        for variable, value in zip(tuning.previous, ref.unflat(previous, params)):
            variable.assign(value)
        gradient = ref.gradient(params, X, ref.cross_entropy, LABELS)
        x = tf.constant(X, tf.float32)
        gram = lambda vectors: ggn.quadratic_forms(  # noqa: E731
            lambda: model(x, training=True), variables, vectors, curvature)
        delta, _ = tuning.solve_step(
            [tf.constant(g, tf.float32) for g in ref.unflat(gradient, params)],
            [tf.constant(p) for p in ref.unflat(preconditioned, params)], variables, gram)
        basis = np.stack([-preconditioned, previous], axis=1).astype(np.float64)
        c = fisher + damping * np.eye(ref.PARAMS)
        step = basis @ np.linalg.solve(basis.T @ c @ basis, -basis.T @ gradient)
        assert_close(ref.flat(delta), step, 1e-3)


class DampingTest(absltest.TestCase):

    def test_constants_are_the_papers(self):
        self.assertEqual(self_tuning.ADAPTATION_INTERVAL, 5)
        self.assertEqual(self_tuning.DECAY, (19 / 20) ** 5)
        self.assertEqual((self_tuning.LOWER, self_tuning.UPPER), (0.25, 0.75))

    def test_trajectory_replays_the_rule(self):
        """λ after each of 60 steps with scripted ρ, against the rule in plain Python."""
        rng = np.random.default_rng(7)
        rhos = list(rng.choice([-1.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.2, math.nan], size=60))
        rhos[9:40] = [2.0] * 31  # six decreases: from 3e-8 to the lower bound, held
        rule = self_tuning.LevenbergMarquardt()
        tuning = self_tuning.SelfTuning(initial_damping=3e-8)
        tuning.create_state(state_of([]))
        expected, damping, trajectory = [], 3e-8, []
        for step, rho in enumerate(rhos):
            # M(δ) = −1 and h(θ) = 0, so h(θ + δ) = −ρ gives ρ.
            tuning.scalars["model_change"].assign(-1.0)
            tuning.adapt_with(step, lambda rho=rho: tf.constant(-rho, tf.float64), 0.0)
            trajectory.append(tuning.scalars["damping"].numpy())
            if (step + 1) % 5 == 0:
                if math.isnan(rho) or rho < 0.25:
                    damping = damping / (0.95 ** 5)
                elif rho > 0.75:
                    damping = damping * (0.95 ** 5)
                damping = min(max(damping, 1e-8), 1e8)
            expected.append(damping)
        np.testing.assert_allclose(trajectory, expected, rtol=1e-15)
        self.assertIn(1e-8, trajectory)  # the bound was reached and held
        self.assertGreater(len(set(trajectory)), 5)
        np.testing.assert_allclose(tuning.scalars["factor_damping"].numpy(), trajectory[-1])
        self.assertEqual(rule.interval, 5)

    def test_upper_bound(self):
        rule = self_tuning.LevenbergMarquardt()
        damping = tf.constant(0.9e8, tf.float64)
        for _ in range(3):
            damping = rule.adapted(damping, tf.constant(math.nan, tf.float64))
        self.assertEqual(damping.numpy(), 1e8)


class RefusalTest(parameterized.TestCase):

    @parameterized.parameters(
        (dict(interval=0), "`interval`"), (dict(interval=2.5), "`interval`"),
        (dict(decay=1.0), "`decay`"), (dict(decay=0.0), "`decay`"),
        (dict(lower=0.8, upper=0.5), "`upper`"), (dict(lower=math.nan), "`lower`"),
        (dict(min_damping=0.0), "`min_damping`"),
        (dict(min_damping=1.0, max_damping=0.5), "`max_damping`"))
    def test_rule_settings(self, settings, named):
        with self.assertRaisesRegex(ValueError, named):
            self_tuning.LevenbergMarquardt(**settings)

    @parameterized.parameters(
        (dict(initial_damping=0.0), "`initial_damping`"),
        (dict(initial_damping=1e9), "`initial_damping`"),
        (dict(initial_damping="1"), "`initial_damping`"),
        (dict(l2=-1.0), "`l2`"), (dict(l2=math.inf), "`l2`"))
    def test_state_settings(self, settings, named):
        with self.assertRaisesRegex(ValueError, named):
            self_tuning.SelfTuning(**settings)

    @parameterized.parameters(
        ("hinge", "'hinge'"), (keras.losses.Huber(), "loss Huber is not"),
        (keras.losses.SparseCategoricalCrossentropy(reduction="sum_over_batch_size",
                                                    ignore_class=0), "ignores class 0"),
        (keras.losses.MeanSquaredError(reduction=None), "`reduction`"),
        (None, "without a loss"))
    def test_losses_without_a_closed_form(self, loss, named):
        with self.assertRaisesRegex(ValueError, named) as raised:
            ggn.output_curvature(loss)
        self.assertIn("exact curvature", str(raised.exception))

    def test_vectors_of_another_length(self):
        model = ref.mlp()
        with self.assertRaisesRegex(ValueError, "one tensor per variable"):
            ggn.products(lambda: model(X), model.trainable_variables, [[1.0]],
                         ggn.output_curvature("mse"))


# KFAC(self_tuning=True) on the tiny MLP: exact eigen directions from factors of every step.
TRAINING = dict(self_tuning=True, method="eigen", factor_update_freq=1,
                decomposition_update_freq=1, damping=0.5, kl_clip=None)
STEPS = 7
TRAIN_X, TRAIN_LABELS = (np.concatenate([ref.data(seed)[i] for seed in range(STEPS)])
                         for i in (0, 1))


def compiled(**settings):
    model = ref.mlp("float32")
    optimizer = tfkfac.KFAC(**dict(TRAINING, **settings)).attach(model)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, optimizer


def fit(model, first, count):
    """Steps `first` .. `first + count - 1`, step k on batch k (ref.N examples)."""
    chosen = slice(first * ref.N, (first + count) * ref.N)
    model.fit(TRAIN_X[chosen].astype("float32"), TRAIN_LABELS[chosen], batch_size=ref.N,
              shuffle=False, verbose=0)


def batch(step):
    chosen = slice(step * ref.N, (step + 1) * ref.N)
    return TRAIN_X[chosen], TRAIN_LABELS[chosen]


class KFACSelfTuningTest(absltest.TestCase):
    """KFAC(self_tuning=True) under `model.fit` against the numpy quadratic model."""

    def test_first_step_is_the_quadratic_models_along_the_kfac_direction(self):
        model, optimizer = compiled()
        params = ref.weights(model)
        fit(model, 0, 1)
        x, labels = batch(0)
        gradient = ref.gradient(params, x, ref.cross_entropy, labels)
        variables = model.trainable_variables
        # The step's own direction: its decompositions (of step 0's factors) at γ, which
        # no adaptation has changed yet.
        direction = -ref.flat(optimizer.precondition(
            [tf.constant(g, tf.float32) for g in ref.unflat(gradient, params)], variables))
        gamma = optimizer.current_damping()
        self.assertEqual(gamma, TRAINING["damping"])
        c = ref.ggn(params, x, ref.cross_entropy, labels) + gamma * np.eye(ref.PARAMS)
        alpha = -(gradient @ direction) / (direction @ c @ direction)  # μ = 0 at first
        step = ref.flat(ref.weights(model)) - ref.flat(params)
        assert_close(step, alpha * direction, 1e-5)
        assert_close(ref.flat(optimizer._self_tuning.previous), step, 1e-6)  # δ₀ ← δ
        logged = optimizer._self_tuning.values()
        self.assertEqual(logged["momentum"], 0.0)
        self.assertAlmostEqual(logged["learning_rate"] / alpha, 1.0, delta=1e-5)
        self.assertAlmostEqual(logged["model_change"] / (0.5 * alpha * gradient @ direction),
                               1.0, delta=1e-5)
        self.assertAlmostEqual(logged["loss"], ref.loss_value(params, x, ref.cross_entropy,
                                                              labels), delta=1e-6)

    def test_later_steps_add_momentum_and_adapt_damping_on_the_fifth(self):
        model, optimizer = compiled()
        tuning = optimizer._self_tuning
        fit(model, 0, 4)
        self.assertEqual(tuning.values()["damping"], TRAINING["damping"])
        self.assertTrue(math.isnan(tuning.values()["rho"]))
        before = ref.flat(ref.weights(model))
        fit(model, 4, 1)  # step 4, the fifth: λ adapted after it
        after = ref.weights(model)
        logged = tuning.values()
        self.assertNotEqual(logged["momentum"], 0.0)
        assert_close(ref.flat(after) - before, ref.flat(tuning.previous), 1e-6)
        # ρ: the numpy loss after the step on the step's batch, against the logged h(θ)
        # (the first forward pass's, on the same batch) and M(δ).
        x, labels = batch(4)
        rho = ((ref.loss_value(after, x, ref.cross_entropy, labels) - logged["loss"])
               / logged["model_change"])
        self.assertAlmostEqual(logged["rho"], rho, delta=1e-4 * abs(rho))
        expected = self_tuning.LevenbergMarquardt().adapted(
            TRAINING["damping"], logged["rho"]).numpy()
        self.assertEqual(logged["damping"], expected)
        self.assertNotEqual(expected, TRAINING["damping"])
        self.assertEqual(optimizer.current_damping(), expected)  # γ = λ (η = 0)

    def test_exact_curvature_products_of_the_public_api(self):
        model, optimizer = compiled()
        x, labels = batch(0)
        reference = ref.ggn(ref.weights(model), x, ref.cross_entropy, labels)
        vectors = random_vectors(2)
        variables = model.trainable_variables
        products = optimizer.exact_curvature_products(
            tf.constant(x, tf.float32), [ref.unflat(v, variables) for v in vectors])
        for vector, product in zip(vectors, products):
            assert_close(ref.flat(product), reference @ vector, FLOAT32_RTOL)

    def test_resume_is_the_uninterrupted_run(self):
        model, optimizer = compiled()
        fit(model, 0, STEPS)
        saved, _ = compiled()
        fit(saved, 0, 3)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        saved.save(path)
        loaded = keras.models.load_model(path)
        self.assertTrue(loaded.optimizer.config.self_tuning)
        loaded.optimizer.attach(loaded)
        fit(loaded, 3, STEPS - 3)
        for a, b in zip(model.get_weights(), loaded.get_weights()):
            np.testing.assert_array_equal(a, b)
        self.assertEqual(optimizer._self_tuning.values(), loaded.optimizer._self_tuning.values())
        keys = [key for key, _ in optimizer.saved_keys()]
        self.assertIn("self_tuning:damping", keys)
        self.assertIn("self_tuning:previous_update:hidden.kernel", keys)

    def test_settings_that_make_no_sense_with_it_are_refused_by_name(self):
        refused = [
            (dict(learning_rate=0.1), "`learning_rate`"), (dict(momentum=0.9), "`momentum`"),
            (dict(weight_decay=1e-4), "`weight_decay`"),
            (dict(damping=tfkfac.WarmupDamping(1.0, 0.1, 10)), "`damping`"),
            (dict(damping=0.0), "`damping`"), (dict(kl_clip=1e-3), "`kl_clip`"),
            (dict(grafting="sgd"), "`grafting`"), (dict(method="eigen_adam"), "`method`"),
            (dict(weight_rescaling=True), "`weight_rescaling`"),
            (dict(inner_optimizer=keras.optimizers.Adam()), "`inner_optimizer` Adam"),
            (dict(inner_optimizer=keras.optimizers.SGD(momentum=0.9)), "momentum"),
            (dict(inner_optimizer=keras.optimizers.SGD(
                keras.optimizers.schedules.ExponentialDecay(1.0, 10, 0.5))), "schedule"),
            (dict(inner_optimizer=keras.optimizers.SGD(weight_decay=1e-4)), "weight decay"),
        ]
        for settings, named in refused:
            with self.subTest(settings=settings):
                with self.assertRaisesRegex(ValueError, named):
                    tfkfac.KFAC(**dict(TRAINING, **settings))
        sgd = keras.optimizers.SGD(learning_rate=1.0)
        self.assertIs(tfkfac.KFAC(inner_optimizer=sgd, **TRAINING).inner_optimizer, sgd)

    def test_a_custom_loop_and_a_loss_without_closed_form_are_refused(self):
        model, optimizer = compiled()
        with self.assertRaisesRegex(ValueError, "custom loop"):
            with optimizer.record() as tape:
                loss = keras.losses.mean_squared_error(
                    np.zeros((ref.N, ref.D_OUT)), model(X.astype("float32")))
            optimizer.minimize(tf.reduce_mean(loss), tape=tape)
        model.compile(optimizer=optimizer, loss="huber")
        with self.assertRaisesRegex(ValueError, "exact curvature"):
            model.fit(X.astype("float32"), ONE_HOT, batch_size=ref.N, verbose=0)


if __name__ == "__main__":
    absltest.main()
