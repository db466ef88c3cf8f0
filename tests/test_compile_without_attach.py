"""`model.compile(optimizer=tfkfac.KFAC(...))` without `attach` (docs/guide.md §2): KFAC finds
its model when `compile` takes it (a built model), or where Keras builds the optimizer on
the model's variables before the first step — under a tf.distribute strategy (one device,
or two logical CPUs mirrored) and in `keras.models.load_model` — and then trains exactly
as if attached. A model unbuilt at `compile` outside a strategy shows the optimizer
nothing before the first forward pass, and `fit` says to build it or attach, and why."""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

# Two logical CPU devices for MirroredStrategy, before TensorFlow initializes its devices.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import tfkfac  # noqa: E402
from kfac_reference import sgd_kfac  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
SETTINGS = dict(learning_rate=0.1, damping=1e-2, factor_update_freq=2,
                decomposition_update_freq=2)


class Subclassed(keras.Model):
    """A subclassed model: unbuilt until it first sees a batch."""

    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(8, activation="tanh", name="d1")
        self.d2 = keras.layers.Dense(3, name="d2")

    def call(self, x):
        return self.d2(self.d1(x))


def sequential():
    return keras.Sequential([keras.Input((6,)),
                             keras.layers.Dense(8, activation="tanh", name="d1"),
                             keras.layers.Dense(3, name="d2")])


def functional():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh", name="d1")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="d2")(hidden))


MODELS = dict(sequential=sequential, functional=functional, subclassed=Subclassed)


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


def fit(model, epochs=2):
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)


def trained(make_model, attach, build=False):
    """(weights, optimizer) after `fit` with KFAC compiled on `make_model()`, attached
    by hand (the model built on a batch first) or not (built first if `build`)."""
    keras.utils.set_random_seed(0)
    model = make_model()
    optimizer = sgd_kfac(**SETTINGS)
    if attach or build:
        model(data(1)[0])
    if attach:
        optimizer.attach(model)
    model.compile(optimizer=optimizer, loss=LOSS)
    fit(model)
    return model.get_weights(), optimizer


class CompileWithoutAttachTest(parameterized.TestCase):

    @parameterized.named_parameters(*MODELS.items())
    def test_strategy_fit_trains_with_kfac_as_if_attached(self, make_model):
        with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
            expected, _ = trained(make_model, attach=True)
            weights, optimizer = trained(make_model, attach=False)
        self.assertEqual([m["layer"] for m in optimizer.summary()["managed"]], ["d1", "d2"])
        self.assertEqual(optimizer.counters()["steps"], 8)
        self.assertEqual(optimizer.counters()["factor_updates"], 4)
        for got, want in zip(weights, expected):
            np.testing.assert_array_equal(got, want)

    def test_mirrored_fit_trains_with_kfac_as_if_attached(self):
        results = {}
        for attach in (True, False):
            with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
                results[attach] = trained(sequential, attach)
        (expected, _), (weights, optimizer) = results[True], results[False]
        self.assertEqual(optimizer.counters()["factor_updates"], 4)
        for got, want in zip(weights, expected):
            np.testing.assert_array_equal(got, want)

    def test_mixed_float16_strategy_fit_trains_with_kfac_as_if_attached(self):
        keras.mixed_precision.set_global_policy("mixed_float16")
        try:
            with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
                expected, _ = trained(sequential, attach=True)
                weights, optimizer = trained(sequential, attach=False)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        self.assertEqual(optimizer.counters()["factor_updates"], 4)
        for got, want in zip(weights, expected):
            np.testing.assert_array_equal(got, want)

    def test_loaded_model_resumes_without_attach(self):
        keras.utils.set_random_seed(0)
        model = sequential()
        model.compile(optimizer=sgd_kfac(**SETTINGS).attach(model), loss=LOSS)
        fit(model, epochs=1)
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        fit(model, epochs=1)
        fit(loaded, epochs=1)
        for got, want in zip(loaded.get_weights(), model.get_weights()):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        self.assertEqual(loaded.optimizer.counters(), model.optimizer.counters())
        # Attaching by hand as before changes nothing.
        self.assertIs(loaded.optimizer.attach(loaded), loaded.optimizer)

    @parameterized.named_parameters(("sequential", sequential, "float32"),
                                    ("functional", functional, "float32"),
                                    ("subclassed_built", Subclassed, "float32"),
                                    ("sequential_mixed", sequential, "mixed_float16"))
    def test_built_model_compiled_outside_a_strategy_trains_as_if_attached(self, make_model,
                                                                           policy):
        keras.mixed_precision.set_global_policy(policy)
        try:
            expected, _ = trained(make_model, attach=True)
            weights, optimizer = trained(make_model, attach=False, build=True)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        self.assertEqual([m["layer"] for m in optimizer.summary()["managed"]], ["d1", "d2"])
        self.assertEqual(optimizer.counters()["factor_updates"], 4)
        for got, want in zip(weights, expected):
            np.testing.assert_array_equal(got, want)

    def test_recompiled_with_a_new_kfac_after_freezing_it_takes_over(self):
        model = sequential()
        first = sgd_kfac(**SETTINGS)
        model.compile(optimizer=first, loss=LOSS)
        fit(model, epochs=1)
        model.get_layer("d1").trainable = False  # Keras asks for a new optimizer
        frozen = sgd_kfac(**SETTINGS)
        model.compile(optimizer=frozen, loss=LOSS)
        before = model.get_layer("d1").get_weights()
        fit(model, epochs=1)
        model.get_layer("d1").trainable = True
        last = sgd_kfac(**SETTINGS)
        model.compile(optimizer=last, loss=LOSS)
        fit(model, epochs=1)
        for optimizer in (first, frozen, last):
            self.assertEqual(optimizer.counters()["steps"], 4)
            self.assertEqual(optimizer.counters()["factor_updates"], 2)
        self.assertRaisesRegex(ValueError, "was detached", first.attach, model)
        self.assertFalse(any(np.array_equal(a, b) for a, b in zip(
            before, model.get_layer("d1").get_weights())))

    def test_unbuilt_model_outside_a_strategy_says_to_build_or_attach_and_why(self):
        model = Subclassed()
        optimizer = tfkfac.KFAC()
        model.compile(optimizer=optimizer, loss=LOSS)
        with self.assertRaisesRegex(RuntimeError, r"`optimizer\.attach\(model\)`.*"
                                    r"minimize\(loss, tape=tape\).*too late to record.*"
                                    r"build the model"):
            fit(model, epochs=1)
        optimizer.attach(model)  # the failed `fit` built it
        fit(model, epochs=1)  # not the train step the failed `fit` made
        self.assertEqual(optimizer.counters()["steps"], 4)


if __name__ == "__main__":
    absltest.main()
