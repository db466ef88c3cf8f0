"""A trainer checkpoint holds K-FAC's variables by key (`KFAC.state_by_key`) and restores
them by key: a restore into an optimizer whose variables are not those (here: the same
shapes under other layer names, where a restore by position would load every value into
the wrong layer's variable) is refused naming the keys, before anything is assigned.
Checkpoints written before the keys hold K-FAC's variables by position and name them in
`optimizer_keys.json`: they restore by position, and one of other keys is refused by that
file; one without the file (written before it) is restored by position as before."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
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
        self.path = checkpoints.CheckpointStore(self.model_dir, model, optimizer).save(
            STEP, {"counters": reporting.RunCounters(steps=STEP).to_dict(),
                   "epoch_metrics": None})
        self.keys_file = os.path.join(self.path, checkpoints.OPTIMIZER_KEYS_FILE)
        self.model, self.optimizer = model, optimizer

    def store(self, names):
        model, optimizer = trained(names, seed=1)
        return model, optimizer, checkpoints.CheckpointStore(self.model_dir, model, optimizer)

    def variables(self, model, optimizer):
        return [v.numpy() for v in model.variables + optimizer.variables]

    def write_by_position(self, keys_file=True):
        """The checkpoint written again as before the keys: K-FAC's variables by position
        only, with an `optimizer_keys.json` if `keys_file`."""
        prefix = os.path.join(self.path, checkpoints.VARIABLES_PREFIX)
        for name in os.listdir(self.path):
            if name.startswith(checkpoints.VARIABLES_PREFIX):
                os.remove(os.path.join(self.path, name))
        tf.train.Checkpoint(model=self.model, optimizer=self.optimizer).write(prefix)
        if keys_file:
            with open(self.keys_file, "w", encoding="utf-8") as f:
                json.dump({"keys": self.optimizer.saved_keys()}, f)
        elif os.path.exists(self.keys_file):
            os.remove(self.keys_file)

    def test_the_checkpoint_holds_every_kfac_variable_under_its_key(self):
        saved = {name for name, _ in tf.train.list_variables(
            os.path.join(self.path, checkpoints.VARIABLES_PREFIX))}
        keys = [key for key, _ in self.optimizer.saved_keys()
                if not key.startswith("inner:")]
        for key in keys:
            self.assertIn(f"{checkpoints.KFAC_STATE}/{key}/.ATTRIBUTES/VARIABLE_VALUE", saved)
        self.assertIn("block:first:factor:A", keys)
        self.assertFalse(os.path.exists(self.keys_file))

    def test_same_names_restore_every_variable(self):
        model, optimizer, store = self.store(("first", "second"))
        state = store.restore()
        self.assertEqual(state["counters"]["steps"], STEP)
        for got, want in zip(self.variables(model, optimizer), self.saved):
            np.testing.assert_array_equal(got, want)

    def test_other_layers_of_the_same_shapes_are_refused_by_name(self):
        for by_position in (False, True):
            with self.subTest(by_position=by_position):
                if by_position:
                    self.write_by_position()
                model, optimizer, store = self.store(("hidden", "logits"))
                before = self.variables(model, optimizer)
                with self.assertRaises(checkpoints.CheckpointError) as raised:
                    store.restore(report=False)
                message = str(raised.exception)
                for key in ("block:hidden:factor:A", "block:first:factor:A"):
                    self.assertIn(key, message)
                if by_position:
                    self.assertIn(self.keys_file, message)
                for got, want in zip(self.variables(model, optimizer), before):
                    np.testing.assert_array_equal(got, want)  # nothing was assigned

    def test_a_checkpoint_by_position_restores_by_position(self):
        for keys_file in (True, False):
            with self.subTest(keys_file=keys_file):
                self.write_by_position(keys_file)
                names = ("first", "second") if keys_file else ("hidden", "logits")
                model, optimizer, store = self.store(names)
                store.restore()
                for got, want in zip(self.variables(model, optimizer), self.saved):
                    np.testing.assert_array_equal(got, want)

    def test_a_damaged_keys_file_is_named(self):
        self.write_by_position()
        with open(self.keys_file, "w", encoding="utf-8") as f:
            f.write("{not json")
        _, _, store = self.store(("first", "second"))
        with self.assertRaisesRegex(checkpoints.CheckpointError, self.keys_file):
            store.restore(report=False)

    def test_the_same_keys_in_another_order_are_refused_by_position(self):
        keys = self.optimizer.saved_keys()
        swapped = keys[:-2] + [keys[-1], keys[-2]]
        with self.assertRaisesRegex(ValueError, "another order"):
            self.optimizer.check_saved_keys(swapped)
        self.optimizer.check_saved_keys(keys)


if __name__ == "__main__":
    absltest.main()
