"""Saves written by tfkfac 0.1.0 (commit cd5b761) still load and resume exactly.

tests/testdata/saved_v0_1 holds, per method, a `.keras` file and a `tf.train.Checkpoint`
of a Conv2D + BatchNorm + Dense model after 2 K-FAC steps, the optimizer variables at that
point and the weights after 2 more steps, all written by the old code. Loading them with
today's code must give the same optimizer variables in the same order, and the same
weights after the same 2 more steps: variable creation order and config keys (including
since-renamed arguments) are part of the save format.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

import tfkfac  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata", "saved_v0_1")
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def model_fn():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6, 6, 1)), keras.layers.Conv2D(3, 3, activation="relu", name="conv"),
        keras.layers.BatchNormalization(name="bn"), keras.layers.Flatten(),
        keras.layers.Dense(8, activation="relu", name="hidden"),
        keras.layers.Dense(4, name="logits")])


class SavedStateCompatTest(parameterized.TestCase):

    def check_resumes(self, model, optimizer, expected):
        paths = [str(p) for p in expected["optimizer_paths"]]
        # 0.1's KFAC was its own momentum SGD: its iterations, learning rate and momenta
        # are now the inner SGD's, first and in the same order, under the inner
        # optimizer's names; K-FAC's own names must not change.
        inner = len(optimizer.inner_optimizer.variables)
        self.assertEqual(paths[:2], ["kfac/iteration", "kfac/learning_rate"])
        self.assertTrue(all(p.endswith("_momentum") for p in paths[2:inner]))
        self.assertLen(optimizer.variables, len(paths))
        self.assertEqual([v.path for v in optimizer.variables][inner:], paths[inner:])
        for i, variable in enumerate(optimizer.variables):
            np.testing.assert_array_equal(variable.numpy(), expected[f"optimizer{i:03d}"],
                                          err_msg=paths[i])
        model.fit(expected["x"][32:], expected["y"][32:], batch_size=16, epochs=1,
                  shuffle=False, verbose=0)
        for i, weight in enumerate(model.get_weights()):
            np.testing.assert_allclose(weight, expected[f"next_weight{i:03d}"], rtol=0,
                                       atol=1e-6, err_msg=f"weight {i}")

    @parameterized.parameters("eigen", "inverse")
    def test_keras_file_loads_and_resumes(self, method):
        expected = np.load(os.path.join(DATA, f"{method}_expected.npz"))
        model = keras.models.load_model(os.path.join(DATA, f"{method}.keras"))
        self.assertIsInstance(model.optimizer, tfkfac.KFAC)
        self.assertEqual(model.optimizer.method, method)
        model.optimizer.attach(model)
        self.check_resumes(model, model.optimizer, expected)

    @parameterized.parameters("eigen", "inverse")
    def test_tf_checkpoint_restores_and_resumes(self, method):
        expected = np.load(os.path.join(DATA, f"{method}_expected.npz"))
        model = model_fn()
        optimizer = tfkfac.KFAC(learning_rate=0.05, damping=1e-2, factor_update_freq=1,
                                decomposition_update_freq=2, method=method).attach(model)
        model.compile(optimizer=optimizer, loss=LOSS)
        optimizer.build(model.trainable_variables)
        tf.train.Checkpoint(model=model, optimizer=optimizer).read(
            os.path.join(DATA, f"{method}_ckpt")).assert_existing_objects_matched()
        self.check_resumes(model, optimizer, expected)


if __name__ == "__main__":
    absltest.main()
