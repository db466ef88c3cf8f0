"""A `tf.train.Checkpoint` restored into a KFAC that is not built yet resumes as the
uninterrupted run, as with Keras's own optimizers (docs/design.md §10).

Both documented flows, each with Keras's SGD and Adam as controls done the same way:
- `fit`: `model.compile(optimizer=...)`, `tf.train.Checkpoint(model=, optimizer=)
  .restore(path)`, `fit`;
- the custom loop: `KFAC(...).attach(model)`, restore, steps of `record()` / `minimize`
  in a `tf.function` (for the controls, `apply_gradients`).
A run of 2 steps is saved and goes on for 2 more; a fresh model (another seed) and a
fresh optimizer restore the save and take the same 2 steps, which must end on the
uninterrupted run's weights (to float32 rounding; measured bit-identical). The KFAC
configurations together take in every method, both placements, adaptive stale
statistics, the sampled Fisher, weight rescaling with the momentum coupled to the
learning rate, grafting, and ScheduleFreeAdamW and Lamb as inner optimizers.
Decompositions fall at steps 0 and 3, so the resumed steps first precondition with the
restored ones. A save of other K-FAC settings restored before the build is refused by
the first step, naming the variables, or with fewer variables, they are named in a
warning.
"""

import os
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402

BATCH, SAVED_AFTER, STEPS = 8, 2, 4
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
_RNG = np.random.default_rng(0)
X = _RNG.normal(size=(STEPS * BATCH, 6, 6, 2)).astype("float32")
Y = _RNG.integers(0, 3, size=(STEPS * BATCH,))


def small_model(seed):
    """Conv2D, BatchNormalization and two Dense layers, named (the keys hold names)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 2)), keras.layers.Conv2D(3, 3, name="conv"),
        keras.layers.BatchNormalization(name="norm"), keras.layers.Flatten(name="flat"),
        keras.layers.Dense(5, activation="tanh", name="hidden"),
        keras.layers.Dense(3, name="logits")], name="net")


def sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def kfac(inner, **settings):
    """A maker of a KFAC in front of `inner()`; factors every step, decompositions at
    steps 0 and 3."""
    return lambda: tfkfac.KFAC(inner_optimizer=inner(), damping=0.01, kl_clip=None,
                               factor_update_freq=1, decomposition_update_freq=3,
                               **settings)


CONTROLS = (("keras_sgd", sgd), ("keras_adam", lambda: keras.optimizers.Adam(0.01)))
# Each option where a flow takes it (the sampled Fisher only under `fit`).
FIT_CONFIGURATIONS = CONTROLS + (
    ("eigen_owner_staleness_sampled_rescaling", kfac(
        sgd, method="eigen", placement="owner", stale_threshold=0.1, fisher="sampled",
        weight_rescaling=True, couple_momentum_to_lr=True)),
    ("inverse_schedule_free_grafting", kfac(
        lambda: keras.optimizers.ScheduleFreeAdamW(0.01), method="inverse",
        grafting="adam")),
    ("eigen_adam_lamb", kfac(lambda: keras.optimizers.Lamb(0.01), method="eigen_adam")),
)
LOOP_CONFIGURATIONS = CONTROLS + (
    ("eigen_adam_owner_staleness_rescaling", kfac(
        sgd, method="eigen_adam", placement="owner", stale_threshold=0.1,
        weight_rescaling=True, couple_momentum_to_lr=True)),
    ("inverse_schedule_free", kfac(lambda: keras.optimizers.ScheduleFreeAdamW(0.01),
                                   method="inverse")),
    ("eigen_lamb", kfac(lambda: keras.optimizers.Lamb(0.01), method="eigen")),
)


def fitted(model, optimizer, first, last):
    """`fit` on batches first..last-1 (a `model` not compiled yet is compiled first)."""
    if not model.compiled:
        model.compile(optimizer=optimizer, loss=LOSS)
    model.fit(X[first * BATCH:last * BATCH], Y[first * BATCH:last * BATCH],
              batch_size=BATCH, shuffle=False, verbose=0)


def looped(model, optimizer):
    """The custom loop's step on `model`: KFAC's `record`/`minimize` (attached first),
    Keras's `apply_gradients` for another optimizer."""
    if isinstance(optimizer, tfkfac.KFAC):
        optimizer.attach(model)

        @tf.function
        def step(x, y):
            with optimizer.record() as tape:
                loss = LOSS(y, model(x, training=True))
            optimizer.minimize(loss, tape=tape)
    else:
        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x, training=True))
            variables = model.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))

    def run(first, last):
        for i in range(first, last):
            step(X[i * BATCH:(i + 1) * BATCH], Y[i * BATCH:(i + 1) * BATCH])
    return run


def resumed(flow, make_optimizer):
    """(weights at the save, after the uninterrupted run, after the resumed run) in
    `flow` ("fit" or "loop"); the resumed run restores into an unbuilt optimizer."""
    def start(seed):
        model, optimizer = small_model(seed), make_optimizer()
        if flow == "fit":
            model.compile(optimizer=optimizer, loss=LOSS)
            return model, optimizer, lambda first, last: fitted(model, optimizer, first, last)
        return model, optimizer, looped(model, optimizer)

    model, optimizer, run = start(seed=1)
    run(0, SAVED_AFTER)
    saved = [w.numpy() for w in model.weights]
    path = tf.train.Checkpoint(model=model, optimizer=optimizer).write(
        os.path.join(tempfile.mkdtemp(), "ckpt"))
    run(SAVED_AFTER, STEPS)
    model2, optimizer2, run2 = start(seed=2)
    assert not optimizer2.built
    tf.train.Checkpoint(model=model2, optimizer=optimizer2).restore(path)
    run2(SAVED_AFTER, STEPS)
    return saved, [w.numpy() for w in model.weights], [w.numpy() for w in model2.weights]


class RestoreBeforeBuildTest(parameterized.TestCase):

    def check_resumes(self, flow, make_optimizer):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # nothing said about missing values
            saved, uninterrupted, restored = resumed(flow, make_optimizer)
        moved = max(np.max(np.abs(a - b)) for a, b in zip(saved, uninterrupted))
        self.assertGreater(moved, 1e-4)  # the steps after the save changed the weights
        for want, got in zip(uninterrupted, restored):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * moved)

    @parameterized.named_parameters(*FIT_CONFIGURATIONS)
    def test_fit_resumes_as_uninterrupted(self, make_optimizer):
        self.check_resumes("fit", make_optimizer)

    @parameterized.named_parameters(*LOOP_CONFIGURATIONS)
    def test_custom_loop_resumes_as_uninterrupted(self, make_optimizer):
        self.check_resumes("loop", make_optimizer)

    def test_save_of_other_settings_is_named(self):
        def saved(**settings):
            model, optimizer = small_model(1), kfac(sgd, **settings)()
            fitted(model, optimizer, 0, SAVED_AFTER)
            return tf.train.Checkpoint(model=model, optimizer=optimizer).write(
                os.path.join(tempfile.mkdtemp(), "ckpt"))

        def restored_and_fitted(path, **settings):
            model, optimizer = small_model(2), kfac(sgd, **settings)()
            model.compile(optimizer=optimizer, loss=LOSS)
            tf.train.Checkpoint(model=model, optimizer=optimizer).restore(path)
            fitted(model, optimizer, SAVED_AFTER, STEPS)

        eigen, grafted = saved(method="eigen"), saved(method="eigen", grafting="adam")
        with self.assertRaisesRegex(ValueError, "shapes differ for method:inverse:conv"):
            restored_and_fitted(eigen, method="inverse")
        with self.assertRaisesRegex(ValueError, "holds optimizer variables at positions"):
            restored_and_fitted(grafted, method="eigen")
        # More variables here than saved: they start anew, named in a warning.
        with self.assertWarnsRegex(UserWarning, "holds no value for grafting:adam_v:conv"):
            restored_and_fitted(eigen, method="eigen", grafting="adam")

if __name__ == "__main__":
    absltest.main()
