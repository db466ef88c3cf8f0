"""The gradient noise scale measured during training (tfkfac.GradientNoiseScale; docs/
design.md §13), on linear regression where the truth is known
(tests/noise_scale_reference.py), at learning rate 0 so every step sees the same weights.

- On each step's own batch, the callback's B_simple equals numpy's, computed from the
  per-example gradients with the contract's formulas (b_small = N/2 halves, b_big = N):
  Keras's SGD, and K-FAC's plain and preconditioned gradients (P from the factors of the
  first batch, numpy's eigen formula), every step and every other step (`interval=2`).
- Over many steps it agrees with the population's tr(Σ)/|G|² within four of its
  standard errors, measured from the per-step estimates (delta method on the ratio).
- On 2 Horovod ranks (each rank the half of every global batch that the one process
  takes as a half), K-FAC's per-rank and all-reduced gradients give the numbers one
  process gets from its halves (tests/noise_scale_worker.py); under placement="owner"
  the preconditioned one is refused. The same on 2 MirroredStrategy replicas.
- The trainer's --noise_scale puts them in metrics.csv and summary.json.
- Bad arguments are refused, naming them.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

# Two logical CPU devices for MirroredStrategy, before TensorFlow initializes its devices.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import job_results  # noqa: E402
import noise_scale_reference as reference  # noqa: E402
import tfkfac  # noqa: E402
import trainer_testing  # noqa: E402
from trainers import config as config_lib, runner  # noqa: E402
from trainers.launch import run_horovod_job  # noqa: E402

JOB_TIMEOUT_SECONDS = 300
DAMPING = 1e-2
# One factor and decomposition update, at step 0: P is then the first batch's throughout.
KFAC_SETTINGS = dict(method="eigen", damping=DAMPING, factor_update_freq=10 ** 6,
                     decomposition_update_freq=10 ** 6, kl_clip=None)


def fit(optimizer, x, y, batch, interval=1, strategy=None, callbacks=(), **callback_options):
    """The epoch logs of one epoch of `fit` with a GradientNoiseScale (and `callbacks`
    after it), weights fixed."""
    with (strategy or tf.distribute.get_strategy()).scope():
        model = reference.model()
        if optimizer == "kfac":
            optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.0),
                                    **KFAC_SETTINGS).attach(model)
        model.compile(optimizer=optimizer, loss="mean_squared_error")
    callback = tfkfac.GradientNoiseScale(interval=interval, **callback_options)
    history = model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                        callbacks=[callback, *callbacks])
    np.testing.assert_allclose(model.layers[0].kernel.numpy()[:, 0], reference.W_START,
                               rtol=0, atol=0)
    return {name: values[0] for name, values in history.history.items()}


class OnEachBatchTest(absltest.TestCase):
    """The callback against numpy on the very batches it saw."""

    STEPS, BATCH = 6, 16

    def setUp(self):
        super().setUp()
        self.x, self.y = reference.data(self.STEPS, self.BATCH, seed=1)
        self.gradients = reference.per_example_gradients(self.x, self.y)

    def expected(self, interval=1, transform=None):
        estimates = reference.step_estimates(self.gradients, self.BATCH, transform)
        return reference.noise_scale(estimates[::interval])

    def test_keras_sgd_every_step_and_every_other(self):
        for interval in (1, 2):
            with self.subTest(interval=interval):
                logs = fit(keras.optimizers.SGD(0.0), self.x, self.y, self.BATCH, interval)
                self.assertNotIn("preconditioned_noise_scale", logs)
                np.testing.assert_allclose(logs["noise_scale"], self.expected(interval),
                                           rtol=1e-4)

    def test_kfac_plain_and_preconditioned(self):
        preconditioner = reference.kfac_preconditioner(
            self.x[:self.BATCH], self.y[:self.BATCH], DAMPING)
        for interval in (1, 2):
            with self.subTest(interval=interval):
                logs = fit("kfac", self.x, self.y, self.BATCH, interval)
                np.testing.assert_allclose(logs["noise_scale"], self.expected(interval),
                                           rtol=1e-4)
                np.testing.assert_allclose(logs["preconditioned_noise_scale"],
                                           self.expected(interval, preconditioner), rtol=1e-4)
        logs = fit("kfac", self.x, self.y, self.BATCH, preconditioned=False)
        self.assertNotIn("preconditioned_noise_scale", logs)

    def test_batches_of_one_example_are_refused_after_the_first_step(self):
        # One process measures from each batch's halves: one example has none, which
        # would report NaN at the epoch's end without a word.
        for optimizer in (keras.optimizers.SGD(0.0), "kfac"):
            with self.subTest(optimizer=getattr(optimizer, "name", optimizer)):
                steps = []
                with self.assertRaisesRegex(ValueError, r"^GradientNoiseScale: on one "
                                            r"process .* a batch of 1 example has no two "
                                            r"halves.*`batch_size` >= 2"):
                    fit(optimizer, self.x[:3], self.y[:3], 1,
                        callbacks=[keras.callbacks.LambdaCallback(
                            on_train_batch_begin=lambda batch, logs: steps.append(batch))])
                self.assertLen(steps, 1)  # stopped after the first step
        # A last batch of one example after measured ones is simply not measured.
        logs = fit(keras.optimizers.SGD(0.0), self.x[:self.BATCH + 1],
                   self.y[:self.BATCH + 1], self.BATCH)
        np.testing.assert_allclose(
            logs["noise_scale"],
            reference.noise_scale(reference.step_estimates(self.gradients, self.BATCH)[:1]),
            rtol=1e-4)

    def test_bad_arguments_are_refused(self):
        with self.assertRaisesRegex(ValueError, "interval"):
            tfkfac.GradientNoiseScale(interval=0)
        with self.assertRaisesRegex(ValueError, "preconditioned"):
            tfkfac.GradientNoiseScale(preconditioned="yes")
        with self.assertRaisesRegex(ValueError, r"preconditioned=True.*tfkfac.KFAC.*SGD"):
            fit(keras.optimizers.SGD(0.0), self.x, self.y, self.BATCH, preconditioned=True)


class AgainstTheTruthTest(absltest.TestCase):
    """Over many steps, the population's B_simple within the estimate's statistical
    error."""

    STEPS, BATCH = 400, 32

    def test_keras_sgd_estimate_within_four_standard_errors(self):
        x, y = reference.data(self.STEPS, self.BATCH, seed=2)
        logs = fit(keras.optimizers.SGD(0.0), x, y, self.BATCH)
        square, trace = reference.true_values()
        truth = trace / square
        # The ratio of two means: its standard error by the delta method from the
        # per-step estimates (the same batches the callback saw).
        estimates = reference.step_estimates(reference.per_example_gradients(x, y), self.BATCH)
        ratio = reference.noise_scale(estimates)
        residuals = estimates[:, 1] - ratio * estimates[:, 0]
        error = residuals.std(ddof=1) / np.sqrt(self.STEPS) / estimates[:, 0].mean()
        self.assertLess(error, 0.1 * truth)  # a test that can fail: the error is small
        self.assertLess(abs(logs["noise_scale"] - truth), 4 * error,
                        f"estimate {logs['noise_scale']}, truth {truth}, error {error}")


class TrainerTest(absltest.TestCase):
    """`--noise_scale` puts the estimates in the run's epoch rows."""

    def test_rows_hold_the_noise_scales(self):
        for optimizer, names in (("sgd", ["noise_scale"]),
                                 ("kfac", ["noise_scale", "preconditioned_noise_scale"])):
            with self.subTest(optimizer=optimizer):
                model_dir = self.create_tempdir().full_path
                summary = runner.run(config_lib.TrainConfig(
                    model_dir=model_dir, model="mlp", optimizer=optimizer, steps=20,
                    learning_rate=0.01, noise_scale=True, noise_scale_interval=2,
                    **trainer_testing.SMALL))
                row = trainer_testing.read_csv(os.path.join(model_dir, "metrics.csv"))[-1]
                for name in names:
                    self.assertTrue(np.isfinite(float(row[name])), name)
                    np.testing.assert_allclose(summary["history"][-1][name], float(row[name]),
                                               rtol=1e-6)
                self.assertEqual("preconditioned_noise_scale" in row, optimizer == "kfac")

    def test_interval_without_noise_scale_is_refused(self):
        config, given = trainer_testing.config_from_argv("--noise_scale_interval=2")
        with self.assertRaisesRegex(ValueError, "noise_scale_interval applies to noise_scale"):
            config.validate(given)
        config, given = trainer_testing.config_from_argv("--noise_scale",
                                                         "--noise_scale_interval=0")
        with self.assertRaisesRegex(ValueError, "noise_scale_interval"):
            config.validate(given)


class MirroredTest(absltest.TestCase):
    """K-FAC on 2 MirroredStrategy replicas (each the half of every global batch that
    one process takes as a half): per-replica and averaged gradients give the numbers of
    one process."""

    def test_two_replicas_equal_one_process(self):
        x, y = reference.data(4, 16, seed=4)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        replicas = fit("kfac", x, y, 16, strategy=strategy)
        one_process = fit("kfac", x, y, 16)
        for name in ("noise_scale", "preconditioned_noise_scale"):
            self.assertTrue(np.isfinite(replicas[name]), name)
            np.testing.assert_allclose(replicas[name], one_process[name], rtol=1e-4,
                                       err_msg=name)


class TwoRanksTest(absltest.TestCase):
    """K-FAC on 2 Horovod ranks against one process on the same global batches."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        import noise_scale_worker as worker
        cls.worker = worker
        cls.returncode, cls.output, _, cls.saved = job_results.run_and_load(
            lambda: run_horovod_job(os.path.join(TESTS_DIR, "noise_scale_worker.py"),
                                    num_ranks=2, timeout=JOB_TIMEOUT_SECONDS),
            worker.OUT_DIR_VARIABLE, ["logs"])

    def test_job_exits_cleanly(self):
        self.assertEqual(self.returncode, 0, self.output[-4000:])

    def test_two_ranks_equal_one_process_and_numpy(self):
        worker = self.worker
        x, y = worker.global_data()
        one_process = fit("kfac", x, y, 2 * worker.BATCH)
        gradients = reference.per_example_gradients(x, y)
        preconditioner = reference.kfac_preconditioner(
            x[:2 * worker.BATCH], y[:2 * worker.BATCH], DAMPING)
        expected = {"noise_scale": reference.noise_scale(
                        reference.step_estimates(gradients, 2 * worker.BATCH)),
                    "preconditioned_noise_scale": reference.noise_scale(
                        reference.step_estimates(gradients, 2 * worker.BATCH, preconditioner))}
        for rank, arrays in enumerate(self.saved["logs"]):
            for name, value in expected.items():
                with self.subTest(rank=rank, name=name):
                    np.testing.assert_allclose(arrays[name], one_process[name], rtol=1e-4)
                    np.testing.assert_allclose(arrays[name], value, rtol=1e-4)

    def test_owner_placement_refuses_the_preconditioned_estimate(self):
        for arrays in self.saved["logs"]:
            self.assertIn("placement='replicated'", str(arrays["owner_error"]))


if __name__ == "__main__":
    absltest.main()
