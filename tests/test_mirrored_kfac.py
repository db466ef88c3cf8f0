"""K-FAC under MirroredStrategy on 2 logical CPU devices of this process, against one
process with the global batch (checks: tests/strategy_kfac_checks.py), and which
strategies K-FAC runs under (one process under OneDeviceStrategy and the default one,
one clear error for the others). Horovod is unimportable in this process
(tests/no_horovod.py), as where it is not built."""

import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import no_horovod  # noqa: E402

no_horovod.install()  # before anything else is imported: this engine may not need it

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402
from absl.testing import absltest  # noqa: E402

# Two logical CPU devices, before TensorFlow initializes its devices.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

import distributed_kfac_worker as horovod_suite  # noqa: E402
import strategy_kfac_checks as checks  # noqa: E402
import strategy_kfac_worker as worker  # noqa: E402
import tfkfac  # noqa: E402
from tfkfac import distributed  # noqa: E402


class MirroredKfacTest(checks.StrategyChecks, absltest.TestCase):
    ranks = [0]  # the counters read are replica 0's

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        cls.saved, timings = {}, {}
        with tempfile.TemporaryDirectory() as directory:
            for name, run in worker.scenarios(strategy, directory).items():
                start = time.time()
                cls.saved[name] = [run()]
                timings[name] = round(time.time() - start, 1)
        logging.info("MirroredStrategy scenario seconds: %s", timings)
        cls.references = checks.references()

    def test_trains_where_horovod_cannot_be_imported(self):
        # Every scenario trained (setUpClass) with Horovod unimportable in this process.
        self.assertLen(self.saved, len(worker.scenarios(None, None)))
        self.assertEqual(no_horovod.ATTEMPTS, [])
        self.assertNotIn("horovod", sys.modules)


class StrategySupportTest(absltest.TestCase):

    def test_one_device_and_default_strategies_are_one_process(self):
        for strategy in (tf.distribute.OneDeviceStrategy("/cpu:0"), tf.distribute.get_strategy()):
            with self.subTest(strategy=type(strategy).__name__), strategy.scope():
                model = horovod_suite.small_cnn(seed=7, batch_norm=False)
                optimizer = tfkfac.KFAC(
                    inner_optimizer=keras.optimizers.SGD(0.05, momentum=0.9)).attach(model)
                self.assertIsInstance(optimizer.communicator, distributed.SingleProcess)
                model.compile(optimizer=optimizer, loss=worker.LOSS)
                x, y = horovod_suite.fixed_examples(2 * worker.BATCH)
                model.fit(x, y, batch_size=worker.BATCH, verbose=0)
                self.assertEqual(optimizer.counters()["steps"], 2)

    def test_unsupported_strategy_is_one_clear_error(self):
        strategy = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
        with strategy.scope():
            with self.assertRaisesRegex(
                    ValueError, "tfkfac does not support CentralStorageStrategy: K-FAC runs "
                    "under MirroredStrategy or MultiWorkerMirroredStrategy"):
                tfkfac.KFAC()
        with strategy.scope():
            with self.assertRaisesRegex(ValueError, "does not support CentralStorageStrategy"):
                tfkfac.KFAC(communicator=distributed.SingleProcess()).attach(
                    _built_under(strategy))

    def test_model_and_optimizer_must_share_the_strategy(self):
        mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        with mirrored.scope():
            model = horovod_suite.small_cnn(seed=7, batch_norm=False)
        with self.assertRaisesRegex(ValueError, "The model was built under MirroredStrategy "
                                    r"\(2 replicas\) but this KFAC optimizer was made for 1 "
                                    "rank"):
            tfkfac.KFAC().attach(model)
        with mirrored.scope():
            optimizer = tfkfac.KFAC()
        with self.assertRaisesRegex(ValueError, "built outside any tf.distribute strategy"):
            optimizer.attach(horovod_suite.small_cnn(seed=7, batch_norm=False))


def _built_under(strategy):
    with strategy.scope():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])


if __name__ == "__main__":
    absltest.main()
