"""Osawa et al.'s (CVPR'19) large-batch recipe pieces in one process (docs/design.md §5):
weight rescaling (§4.4) and the momentum coupled to the learning rate (§4.3).

- Against a float64 numpy replay of K-FAC (eigen method: (A ⊗ G + λI)⁻¹ vec(∇) on the
  running factors, tests/kfac_reference.py) feeding momentum SGD, on an MLP whose output
  layer is skipped (plain gradient): after every step the weights and SGD's velocities
  equal the replay's, where the replay rescales each managed kernel to
  √(2·d_out) · W / (‖W‖_F + 1e-9) after the update (biases and the skipped layer not),
  and uses the momentum m(t) = m(0)·η(t)/η_max(t) under a decaying schedule (η_max =
  η(0)) and under one that rises first (m stays m(0) up to the peak).
- On a CNN, one step with and without rescaling from the same start: exactly the Conv2D
  and Dense kernels change, to the rescaled kernels; BatchNorm, biases, a managed
  DepthwiseConv2D and a skipped Dense layer are bit-identical.
- The coupling's peak learning rate is saved: a run saved and loaded halfway ends as the
  uninterrupted one.
- Settings that are wrong or would be ignored are errors naming the setting, in the
  library and in the trainer's config.

Tolerances: the replayed MLP, its loss and K-FAC's state are float64: rtol 1e-5 with a
floor of 1e-5 x max|ref|, 7x the largest difference measured (a wrong momentum, e.g.
m(0) where m(0)·0.7^t is due, is off by far more). The CNN is float32: a rescaled
kernel's norm is √(2·d_out) to 1e-6.
"""

import math
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from kfac_reference import (DAMPING, N, assert_close, dense_layers,  # noqa: E402
                            kron_precondition, loop_step, mlp_reference)
from trainers import config as config_lib  # noqa: E402

STEPS, MOMENTUM, FACTOR_DECAY = 6, 0.9, 0.8
# The MLP, its loss and K-FAC's state are float64 and the replay takes the schedule's
# float32 rates: after 6 steps they agree to 1.3e-6 x max|ref| (measured, at η = 0.4).
RTOL = 1e-5
MSE = keras.losses.MeanSquaredError(dtype="float64")
# η(t) = 0.3 · 0.7^t, and one that rises from 0.1 to 0.4 at step 2, then falls to 0.2.
DECAYING = keras.optimizers.schedules.ExponentialDecay(0.3, 1, 0.7)
RISING = keras.optimizers.schedules.PiecewiseConstantDecay([1, 3], [0.1, 0.4, 0.2])


def rates(schedule):
    """η(0), ..., η(STEPS - 1) as the schedule gives them (in float32)."""
    return [float(schedule(t)) for t in range(STEPS)]


def mlp():
    """Two managed tanh Dense layers and an output layer `skip_layers` leaves unmanaged, in
    float64."""
    keras.utils.set_random_seed(0)
    dense = lambda units, **kwargs: keras.layers.Dense(
        units, bias_initializer="random_normal", dtype="float64", **kwargs)
    return keras.Sequential([
        keras.Input((5,), dtype="float64"), dense(6, activation="tanh", name="hidden1"),
        dense(4, activation="tanh", name="hidden2"), dense(3, name="out")])


def batches():
    rng = np.random.default_rng(1)
    return rng.normal(size=(STEPS, N, 5)), rng.normal(size=(STEPS, N, 3))


def kfac(schedule, **settings):
    return tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(schedule, momentum=MOMENTUM),
                       damping=DAMPING,
                       kl_clip=None, method="eigen", factor_decay=FACTOR_DECAY,
                       factor_update_freq=1, decomposition_update_freq=1,
                       skip_layers=("out",), state_dtype="float64", **settings)


def rescaled(kernel):
    return kernel * math.sqrt(2 * kernel.shape[-1]) / (np.linalg.norm(kernel) + 1e-9)


def replay(model, step_rates, rescale, couple):
    """Per step, [W; b] of every layer and its velocity, from `model`'s initial weights:
    K-FAC on the managed layers (all but the last), momentum SGD at `step_rates`."""
    layers = dense_layers(model)
    activations = [act for _, _, act in layers]
    params = [np.concatenate([w, b[None]]) for w, b, _ in layers]
    velocity = [np.zeros_like(p) for p in params]
    factors = [None] * (len(layers) - 1)
    peak, history = 0.0, []
    for x, y, rate in zip(*batches(), step_rates):
        per_layer = mlp_reference([(p[:-1], p[-1], act) for p, act in zip(params, activations)],
                                  x, y, "mse")
        peak = max(peak, rate)
        momentum = MOMENTUM * rate / peak if couple else MOMENTUM
        for k, ref in enumerate(per_layer):
            update = ref["grad"]
            if k < len(factors):
                batch = [ref["A"], ref["G"]]
                factors[k] = batch if factors[k] is None else [
                    FACTOR_DECAY * f + (1 - FACTOR_DECAY) * b for f, b in zip(factors[k], batch)]
                update = kron_precondition(*factors[k], update, DAMPING)
            velocity[k] = momentum * velocity[k] - rate * update
            params[k] = params[k] + velocity[k]
            if rescale and k < len(factors):
                params[k][:-1] = rescaled(params[k][:-1])
        history.append(([p.copy() for p in params], [v.copy() for v in velocity]))
    return history


def split(matrices):
    """[W; b] matrices as Keras's (kernel, bias) variables, in order."""
    return [part for m in matrices for part in (m[:-1], m[-1])]


class ReplayTest(absltest.TestCase):
    """The weights and velocities after every step against the numpy replay."""

    def check_against_replay(self, schedule, **settings):
        model = mlp()
        optimizer = kfac(schedule, **settings).attach(model)
        expected = replay(model, rates(schedule), settings.get("weight_rescaling", False),
                          settings.get("couple_momentum_to_lr", False))
        for step, (x, y) in enumerate(zip(*batches())):
            loop_step(model, optimizer, MSE, x, y)
            params, velocity = expected[step]
            for name, got, want in zip(("weights", "velocities"),
                                       (model.trainable_variables,
                                        optimizer.inner_optimizer.momentums),
                                       (split(params), split(velocity))):
                for i, (g, w) in enumerate(zip(got, want)):
                    assert_close(g.numpy(), w, rtol=RTOL, atol_scale=RTOL,
                                 msg=f"step {step}: {name}[{i}]")
        return model

    def test_rescaled_managed_kernels_after_every_update(self):
        model = self.check_against_replay(DECAYING, weight_rescaling=True)
        for layer in model.layers[:2]:
            self.assertAlmostEqual(float(np.linalg.norm(layer.kernel.numpy())),
                                   math.sqrt(2 * layer.units), delta=1e-6 * layer.units)
        self.assertNotAlmostEqual(float(np.linalg.norm(model.layers[2].kernel.numpy())),
                                  math.sqrt(6), places=2)

    def test_momentum_follows_a_decaying_learning_rate(self):
        self.check_against_replay(DECAYING, couple_momentum_to_lr=True)

    def test_momentum_stays_until_the_peak_then_follows_it(self):
        self.check_against_replay(RISING, couple_momentum_to_lr=True)

    def test_both_together(self):
        self.check_against_replay(DECAYING, weight_rescaling=True, couple_momentum_to_lr=True)


def cnn():
    keras.utils.set_random_seed(2)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(3, 3, activation="relu", name="conv"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.DepthwiseConv2D(2, name="depthwise"),
        keras.layers.Flatten(),
        keras.layers.Dense(5, activation="relu", name="dense"),
        keras.layers.Dense(2, name="skipped")], name="cnn")


class RescaledLayersTest(absltest.TestCase):

    def one_step(self, weight_rescaling):
        model = cnn()
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                                damping=DAMPING, kl_clip=1e-3, factor_update_freq=1,
                                skip_layers=("skipped",), weight_rescaling=weight_rescaling)
        model.compile(optimizer=optimizer.attach(model),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(3)
        model.fit(rng.normal(size=(N, 6, 6, 2)).astype(np.float32), rng.integers(0, 2, N),
                  batch_size=N, epochs=1, shuffle=False, verbose=0)
        return {v.path: v.numpy() for v in model.variables}

    def test_only_conv_and_dense_kernels_change_to_their_rescaled_values(self):
        plain, rescaled_run = self.one_step(False), self.one_step(True)
        self.assertEqual(plain.keys(), rescaled_run.keys())
        kernels = {"cnn/conv/kernel": 3, "cnn/dense/kernel": 5}
        for path, value in rescaled_run.items():
            if path in kernels:
                np.testing.assert_allclose(value, rescaled(plain[path]), rtol=1e-6, atol=1e-7,
                                           err_msg=path)
                self.assertAlmostEqual(float(np.linalg.norm(value)),
                                       math.sqrt(2 * kernels[path]), places=5)
            else:
                np.testing.assert_array_equal(value, plain[path], err_msg=path)
        self.assertTrue(all(path in plain for path in kernels))


class ResumeTest(absltest.TestCase):

    def test_a_run_saved_halfway_ends_as_the_uninterrupted_one(self):
        x, y = (a.reshape((-1,) + a.shape[2:]) for a in batches())
        half = STEPS // 2 * N

        def compiled():
            model = mlp()
            optimizer = kfac(DECAYING, couple_momentum_to_lr=True, weight_rescaling=True)
            model.compile(optimizer=optimizer.attach(model), loss=MSE)
            return model

        fit = lambda model, part: model.fit(x[part], y[part], batch_size=N, epochs=1,
                                            shuffle=False, verbose=0)
        uninterrupted = compiled()
        fit(uninterrupted, slice(None))
        interrupted = compiled()
        fit(interrupted, slice(None, half))
        path = os.path.join(tempfile.mkdtemp(), "model.keras")
        interrupted.save(path)
        loaded = keras.models.load_model(path)
        loaded.optimizer.attach(loaded)
        (peak,) = [v for v in loaded.optimizer.variables if v.name == "peak_learning_rate"]
        self.assertEqual(float(peak.numpy()), rates(DECAYING)[0])
        fit(loaded, slice(half, None))
        for got, want in zip(loaded.get_weights(), uninterrupted.get_weights()):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


class ErrorsTest(absltest.TestCase):

    def test_coupling_needs_a_heavy_ball_sgd(self):
        for inner, said in [
                (keras.optimizers.Adam(), "Adam, whose β1 also enters the bias correction"),
                (keras.optimizers.Lamb(), "Lamb"),
                (keras.optimizers.SGD(momentum=0.0), "momentum 0"),
                (keras.optimizers.SGD(momentum=0.9, nesterov=True), "nesterov=True"),
                (keras.optimizers.SGD(momentum=0.9, gradient_accumulation_steps=2),
                 "accumulates gradients over 2 steps")]:
            with self.subTest(inner=type(inner).__name__, said=said):
                with self.assertRaisesRegex(ValueError, "`couple_momentum_to_lr`.*" + said):
                    tfkfac.KFAC(inner_optimizer=inner, couple_momentum_to_lr=True)
        with self.assertRaisesRegex(ValueError, "momentum 0"):
            tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.05), couple_momentum_to_lr=True)

    def test_settings_are_booleans(self):
        for name in ("weight_rescaling", "couple_momentum_to_lr"):
            with self.subTest(name=name):
                with self.assertRaisesRegex(ValueError, f"`{name}` must be True or False"):
                    tfkfac.KFAC(**{name: 1})

    def test_rescaling_a_model_without_dense_or_conv_layers_is_refused(self):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="only")])
        optimizer = tfkfac.KFAC(weight_rescaling=True, skip_layers=("only",))
        with self.assertRaisesRegex(ValueError, "weight_rescaling=True .* has none"):
            optimizer.attach(model)

    def test_trainer_refuses_what_the_library_would(self):
        with self.assertRaisesRegex(ValueError, "couple_momentum_to_lr.*kfac_inner_optimizer=adam"):
            config_lib.TrainConfig(couple_momentum_to_lr=True,
                                   kfac_inner_optimizer="adam").validate()
        with self.assertRaisesRegex(ValueError, "couple_momentum_to_lr.*momentum=0.0"):
            config_lib.TrainConfig(couple_momentum_to_lr=True, kfac_inner_optimizer="sgd",
                                   momentum=0.0).validate()
        with self.assertRaisesRegex(ValueError, "couple_momentum_to_lr.*with nesterov"):
            config_lib.TrainConfig(couple_momentum_to_lr=True, kfac_inner_optimizer="sgd",
                                   nesterov=True).validate()
        with self.assertRaisesRegex(ValueError, "couple_momentum_to_lr.*received "
                                    "kfac_inner_optimizer=schedule_free_adamw; pass "
                                    "kfac_inner_optimizer=sgd"):  # K-FAC's default
            config_lib.TrainConfig(couple_momentum_to_lr=True).validate()
        with self.assertRaisesRegex(ValueError, "weight_rescaling only applies to optimizer=kfac"):
            config_lib.TrainConfig(optimizer="sgd", weight_rescaling=True).validate(
                explicitly_set=("weight_rescaling",))
        settings = config_lib.TrainConfig(weight_rescaling=True,
                                          couple_momentum_to_lr=True).kfac_config()
        self.assertTrue(settings.weight_rescaling and settings.couple_momentum_to_lr)


if __name__ == "__main__":
    absltest.main()
