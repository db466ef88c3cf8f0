"""KFAC is a preconditioner in front of a Keras optimizer (docs/guide.md §3): the inner
optimizer applies every update, its learning rate is the one Keras users set — through
KFAC's `learning_rate`, schedules and callbacks — and its Keras options (clipping, weight
decay, EMA, loss scale, accumulation) act as docs/guide.md §3 states."""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(3)])


def data(n=64):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


class LearningRateLog(keras.callbacks.Callback):
    """The inner optimizer's learning rate at the start of each epoch's first step (after
    the scheduler), and the weights at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.rates, self.weights = [], []

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.rates.append(float(self.model.optimizer.inner_optimizer.learning_rate))

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([w.copy() for w in self.model.get_weights()])


class InnerOptimizerTest(absltest.TestCase):

    def test_scheduler_callback_drives_the_inner_adamw(self):
        model = mlp()
        inner = keras.optimizers.AdamW(1e-3, weight_decay=0.0)
        optimizer = tfkfac.KFAC(inner_optimizer=inner, damping=1e-2).attach(model)
        model.compile(optimizer=optimizer, loss=LOSS)
        log = LearningRateLog()
        # Epoch 2 at 2.5e-4 as in the report; epoch 3 at 0: the weights must then stay.
        schedule = keras.callbacks.LearningRateScheduler(
            lambda epoch, lr: [1e-3, 2.5e-4, 0.0][epoch])
        x, y = data()
        model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                  callbacks=[schedule, log])
        np.testing.assert_allclose(log.rates, [1e-3, 2.5e-4, 0.0], rtol=1e-6)
        self.assertIs(model.optimizer.inner_optimizer, inner)
        self.assertEqual(float(model.optimizer.learning_rate), 0.0)
        # Epochs 1 and 2 moved the weights, epoch 3 (rate 0, no decay) did not.
        self.assertGreater(np.abs(log.weights[1][0] - log.weights[0][0]).max(), 0)
        for before, after in zip(log.weights[1], log.weights[2]):
            np.testing.assert_array_equal(before, after)
        # One step counter, the inner optimizer's: 4 steps an epoch.
        self.assertIs(optimizer.iterations, inner.iterations)
        self.assertEqual(int(inner.iterations), 12)
        self.assertEqual(optimizer.counters()["steps"], 12)

    def test_default_inner_is_schedule_free_adamw_from_kfacs_arguments(self):
        optimizer = tfkfac.KFAC(learning_rate=0.2, momentum=0.5, weight_decay=1e-4)
        inner = optimizer.inner_optimizer
        self.assertIs(type(inner), tfkfac.ScheduleFreeAdamW)
        self.assertEqual((float(inner.learning_rate), inner.beta_1, inner.weight_decay,
                          inner.warmup_steps), (np.float32(0.2), 0.5, 1e-4, 0))
        optimizer.learning_rate = 0.05  # what ReduceLROnPlateau does
        self.assertAlmostEqual(float(inner.learning_rate), 0.05)

    def test_default_rule_momentum_is_beta_1_in_the_open_unit_interval(self):
        for momentum in (0.0, 1.0, -0.1, float("nan")):
            with self.assertRaisesRegex(ValueError, r"^`momentum` must be a finite number "
                                        r"in \(0, 1\); received .* \(β1 of KFAC's default "
                                        r"inner optimizer, ScheduleFreeAdamW; for SGD, pass "
                                        r"inner_optimizer=keras.optimizers.SGD"):
                tfkfac.KFAC(momentum=momentum)

    def test_update_is_the_inner_rule_on_the_preconditioned_gradient(self):
        # One step of KFAC over plain SGD (no momentum, no KL clip) moves every weight by
        # -η P, P what `precondition` gives for the step's gradient with the curvature
        # the step computed.
        model = mlp()
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.1), kl_clip=None,
                                damping=1e-2, xla=False).attach(model)
        variables = model.trainable_variables
        x, y = data(16)
        before = [v.numpy().copy() for v in variables]
        with optimizer.record() as tape:
            loss = LOSS(y, model(x, training=True))
        optimizer.minimize(loss, tape=tape)
        after = [v.numpy().copy() for v in variables]
        for variable, value in zip(variables, before):
            variable.assign(value)
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        preconditioned = optimizer.precondition(tape.gradient(loss, variables), variables)
        for moved, start, p in zip(after, before, preconditioned):
            np.testing.assert_allclose(moved, start - 0.1 * p.numpy(), rtol=0, atol=1e-6)
        self.assertGreater(max(np.abs(m - s).max() for m, s in zip(after, before)), 1e-4)


# K-FAC manages no layer: every gradient reaches the inner optimizer as it is, so KFAC in
# front of an optimizer must train exactly as that optimizer alone.
IDENTITY = dict(skip_layers=[".*"], kl_clip=None)


def fit_weights(optimizer, epochs=2):
    """The weights of `mlp()` after `fit` with `optimizer` (a KFAC attached first)."""
    model = mlp()
    if isinstance(optimizer, tfkfac.KFAC):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the warning naming the skipped layers
            optimizer.attach(model)
    model.compile(optimizer=optimizer, loss=LOSS)
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def preconditioned(optimizer, model, x, y):
    """`optimizer.precondition` of the loss gradient on (x, y) at the current weights."""
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x, training=True))
    variables = model.trainable_variables
    return [p.numpy() for p in optimizer.precondition(tape.gradient(loss, variables),
                                                      variables)]


class InnerOptionsTest(absltest.TestCase):
    """The inner optimizer's Keras options under KFAC (docs/guide.md §3)."""

    def test_options_train_as_the_plain_optimizer_when_kfac_manages_no_layer(self):
        sgd = lambda **options: keras.optimizers.SGD(0.1, momentum=0.5, **options)
        cases = {  # name: (the inner optimizer, `exclude_from_weight_decay` var_names)
            "use_ema": (lambda: sgd(use_ema=True, ema_momentum=0.9), None),
            "ema_overwrite_frequency": (
                lambda: sgd(use_ema=True, ema_overwrite_frequency=3), None),
            "loss_scale_factor": (lambda: sgd(loss_scale_factor=128.0), None),
            "gradient_accumulation_steps": (lambda: sgd(gradient_accumulation_steps=2), None),
            "clipvalue": (lambda: sgd(clipvalue=0.01), None),
            "clipnorm": (lambda: sgd(clipnorm=0.01), None),
            "global_clipnorm": (lambda: sgd(global_clipnorm=0.01), None),
            "weight_decay": (lambda: sgd(weight_decay=0.1), None),
            "sgd_exclusion": (lambda: sgd(weight_decay=0.5), ["bias"]),
            "adamw_exclusion": (lambda: keras.optimizers.AdamW(0.01, weight_decay=0.5),
                                ["kernel"]),
        }
        for name, (make, excluded) in cases.items():
            with self.subTest(option=name):
                plain, kfac = make(), tfkfac.KFAC(inner_optimizer=make(), **IDENTITY)
                if excluded:
                    plain.exclude_from_weight_decay(var_names=excluded)
                    kfac.exclude_from_weight_decay(var_names=excluded)
                for got, want in zip(fit_weights(kfac), fit_weights(plain)):
                    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)

    def test_loss_scale_and_clipping_act_on_the_unscaled_preconditioned_gradient(self):
        # One `fit` step moves the weights by -η clip(P): P, the preconditioned gradient,
        # from the gradients and factors with the inner optimizer's loss scale undone,
        # then clipped by the inner optimizer.
        x, y = data(16)
        clipped = {
            "clipvalue": lambda p, c: [np.clip(t, -c, c) for t in p],
            "clipnorm": lambda p, c: [t * min(1.0, c / np.linalg.norm(t)) for t in p],
            "global_clipnorm": lambda p, c: [
                t * min(1.0, c / np.sqrt(sum(np.sum(u * u) for u in p))) for t in p],
        }
        for clip, rule in clipped.items():
            with self.subTest(clip=clip):
                model = mlp()
                inner = keras.optimizers.SGD(0.1, loss_scale_factor=128.0, **{clip: 0.02})
                optimizer = tfkfac.KFAC(inner_optimizer=inner, kl_clip=None, damping=1e-2,
                                        xla=False).attach(model)
                model.compile(optimizer=optimizer, loss=LOSS)
                before = model.get_weights()
                model.fit(x, y, batch_size=16, epochs=1, verbose=0)
                after = model.get_weights()
                model.set_weights(before)
                p = preconditioned(optimizer, model, x, y)
                self.assertGreater(max(np.abs(t).max() for t in p), 0.02)  # clipping acts
                for moved, start, q in zip(after, before, rule(p, 0.02)):
                    np.testing.assert_allclose(moved, start - 0.1 * q, rtol=0, atol=1e-6)

    def test_gradient_accumulation_applies_the_mean_preconditioned_gradient(self):
        # Two batches, one update: the inner optimizer applies the mean of the two
        # preconditioned gradients. K-FAC's step is the inner optimizer's `iterations`,
        # which counts updates: the one factor update is the first batch's.
        settings = dict(kl_clip=None, damping=1e-2, factor_update_freq=1,
                        decomposition_update_freq=1, xla=False)
        x, y = data(32)
        model = mlp()
        inner = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        optimizer = tfkfac.KFAC(inner_optimizer=inner, **settings).attach(model)
        model.compile(optimizer=optimizer, loss=LOSS)
        before = model.get_weights()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        after = model.get_weights()
        self.assertEqual((optimizer.counters()["steps"],
                          optimizer.counters()["factor_updates"]), (1, 1))
        first = mlp()
        first_only = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                                 **settings).attach(first)
        first.compile(optimizer=first_only, loss=LOSS)
        first.fit(x[:16], y[:16], batch_size=16, epochs=1, verbose=0)
        for layer, first_layer in zip(model.layers, first.layers):
            for factor, expected in zip(optimizer.factors(layer).values(),
                                        first_only.factors(first_layer).values()):
                np.testing.assert_allclose(factor, expected, rtol=1e-6, atol=1e-7)
        model.set_weights(before)
        mean = [(a + b) / 2 for a, b in zip(preconditioned(optimizer, model, x[:16], y[:16]),
                                            preconditioned(optimizer, model, x[16:], y[16:]))]
        for moved, start, p in zip(after, before, mean):
            np.testing.assert_allclose(moved, start - 0.1 * p, rtol=0, atol=1e-6)
        # A checkpoint holds the step count's variable, of which `iterations` is the
        # quotient under accumulation.
        path = tf.train.Checkpoint(optimizer=optimizer).save(
            os.path.join(self.create_tempdir().full_path, "ckpt"))
        restored_model = mlp()
        restored = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(
            0.1, gradient_accumulation_steps=2), **settings).attach(restored_model)
        restored.build(restored_model.trainable_variables)
        tf.train.Checkpoint(optimizer=restored).restore(path)
        self.assertEqual(restored.counters(), optimizer.counters())
        self.assertEqual(int(restored.inner_optimizer.iterations), 1)

    def test_weight_decay_exclusion_without_a_decay_is_refused(self):
        with self.assertRaisesRegex(ValueError, r"exclude_from_weight_decay: the inner "
                                    r"optimizer \(ScheduleFreeAdamW\) applies no weight "
                                    "decay"):
            tfkfac.KFAC().exclude_from_weight_decay(var_names=["bias"])


class MultiOptimizer(keras.optimizers.Optimizer):
    """A Keras optimizer that hands each layer's gradients to an optimizer of its own (as
    tf.keras's MultiOptimizer did): no one update rule K-FAC could precede."""

    def __init__(self, pairs):
        super().__init__(learning_rate=0.0)
        self.pairs = pairs

    def apply(self, grads, trainable_variables=None):
        for optimizer, _ in self.pairs:
            optimizer.apply(grads, trainable_variables)


class RefusedInnerOptimizerTest(absltest.TestCase):
    """What K-FAC cannot precede is refused in its constructor, in one line naming
    `inner_optimizer`, by the library as by the trainer (`--kfac_inner_optimizer`)."""

    def test_muon_is_refused_with_the_trainers_reason(self):
        from trainers import config as trainer_config  # pylint: disable=import-outside-toplevel
        reason = tfkfac.inner.refused_reason(keras.optimizers.Muon)
        self.assertRegex(reason, "orthogonal polar factor.*discards the singular values")
        with self.assertRaisesRegex(ValueError, r"^`inner_optimizer` Muon is refused: "
                                    r"Muon replaces each 2-D update .*; use Muon alone, or "
                                    r"KFAC with another inner optimizer"):
            tfkfac.KFAC(inner_optimizer=keras.optimizers.Muon())
        self.assertTrue(trainer_config.KFAC_REFUSED_INNER_OPTIMIZERS["muon"].startswith(
            reason + "; "))

    def test_an_optimizer_holding_others_is_refused(self):
        multi = MultiOptimizer([(keras.optimizers.SGD(0.1), ["dense"]),
                                (keras.optimizers.Adam(1e-3), ["dense_1"])])
        said = (r"^`inner_optimizer` must be one Keras optimizer that applies every update: "
                r"received MultiOptimizer, which holds other optimizers \(Adam, SGD\)")
        with self.assertRaisesRegex(ValueError, said):
            tfkfac.KFAC(inner_optimizer=multi)

    def test_an_object_without_keras_optimizers_interface_is_refused(self):
        class Wrapper:  # looks like an optimizer, is none
            learning_rate = 0.1
            inner_optimizer = keras.optimizers.SGD(0.1)

        unmade = keras.optimizers.SGD.__new__(keras.optimizers.SGD)  # no constructor run
        for received, said in ((Wrapper(), r"must be a Keras 3 optimizer \(a "
                                           r"keras.optimizers.Optimizer\).*received "
                                           r".*Wrapper$"),
                               (unmade, r"^`inner_optimizer` SGD is not a usable Keras "
                                        r"optimizer: reading its `learning_rate` fails")):
            with self.assertRaisesRegex(ValueError, said):
                tfkfac.KFAC(inner_optimizer=received)


if __name__ == "__main__":
    absltest.main()
