"""A trainer checkpoint holds K-FAC's variables by position (`tf.train.Checkpoint`, the
layout of every earlier checkpoint) and names them in `optimizer_keys.json`: a restore
into an optimizer whose variables are not those (here: the same shapes under other layer
names, where a restore by position would load every value into the wrong layer's
variable) is refused naming the keys, before anything is assigned; one without the file
(written before it) is restored by position as before."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from trainers import checkpoints, reporting  # noqa: E402

STEP = 4


def trained(names, seed=0):
    """A 2-layer model (layers named `names`) and its KFAC after STEP steps."""
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, name=names[0]),
                              keras.layers.Dense(3, name=names[1])])
    optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                            factor_update_freq=1,
                            decomposition_update_freq=2).attach(model)
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
    x = np.random.default_rng(seed).normal(size=(STEP * 8, 6)).astype("float32")
    model.fit(x, x[:, :3], batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model, optimizer


class CheckpointKeysTest(absltest.TestCase):

    def setUp(self):
        super().setUp()
        self.model_dir = self.create_tempdir().full_path
        model, optimizer = trained(("first", "second"))
        self.saved = [v.numpy() for v in model.variables + optimizer.variables]
        state = {"counters": reporting.RunCounters(steps=STEP).to_dict(),
                 "epoch_metrics": None}
        self.path = checkpoints.CheckpointStore(self.model_dir, model, optimizer).save(
            STEP, state)
        self.keys_file = os.path.join(self.path, checkpoints.OPTIMIZER_KEYS_FILE)

    def store(self, names):
        model, optimizer = trained(names, seed=1)
        return model, optimizer, checkpoints.CheckpointStore(self.model_dir, model, optimizer)

    def variables(self, model, optimizer):
        return [v.numpy() for v in model.variables + optimizer.variables]

    def test_the_keys_file_names_every_optimizer_variable(self):
        _, optimizer, _ = self.store(("first", "second"))
        with open(self.keys_file, encoding="utf-8") as f:
            keys = json.load(f)["keys"]
        self.assertEqual([tuple(pair) for pair in keys], optimizer.saved_keys())
        self.assertLen(keys, len(optimizer.variables))
        self.assertIn(["block:first:factor:A", [7, 7]], keys)  # 6 inputs and the bias

    def test_same_names_restore_every_variable(self):
        model, optimizer, store = self.store(("first", "second"))
        state = store.restore()
        self.assertEqual(state["counters"]["steps"], STEP)
        for got, want in zip(self.variables(model, optimizer), self.saved):
            np.testing.assert_array_equal(got, want)

    def test_other_layers_of_the_same_shapes_are_refused_by_name(self):
        model, optimizer, store = self.store(("hidden", "logits"))
        before = self.variables(model, optimizer)
        with self.assertRaises(checkpoints.CheckpointError) as raised:
            store.restore(report=False)
        message = str(raised.exception)
        for key in ("block:hidden:factor:A", "block:first:factor:A"):
            self.assertIn(key, message)
        self.assertIn(self.keys_file, message)
        for got, want in zip(self.variables(model, optimizer), before):
            np.testing.assert_array_equal(got, want)  # nothing was assigned

    def test_a_checkpoint_without_the_file_restores_by_position(self):
        os.remove(self.keys_file)
        model, optimizer, store = self.store(("hidden", "logits"))
        store.restore()
        for got, want in zip(self.variables(model, optimizer), self.saved):
            np.testing.assert_array_equal(got, want)

    def test_a_damaged_keys_file_is_named(self):
        with open(self.keys_file, "w", encoding="utf-8") as f:
            f.write("{not json")
        _, _, store = self.store(("first", "second"))
        with self.assertRaisesRegex(checkpoints.CheckpointError, self.keys_file):
            store.restore(report=False)

    def test_the_same_keys_in_another_order_are_refused(self):
        _, optimizer, _ = self.store(("first", "second"))
        keys = optimizer.saved_keys()
        swapped = keys[:-2] + [keys[-1], keys[-2]]
        with self.assertRaisesRegex(ValueError, "another order"):
            optimizer.check_saved_keys(swapped)
        optimizer.check_saved_keys(keys)


if __name__ == "__main__":
    absltest.main()
