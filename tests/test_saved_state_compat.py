"""Saves written by tfkfac 0.1.0 (commit cd5b761) still load and resume exactly; a
.keras file holds K-FAC's state by name, and a save that does not match fails naming
the keys.

tests/testdata/saved_v0_1 holds, per method, a `.keras` file and a `tf.train.Checkpoint`
of a Conv2D + BatchNorm + Dense model after 2 K-FAC steps, the optimizer variables at that
point and the weights after 2 more steps, all written by the old code. Loading them with
today's code must give the same optimizer variables in the same order, and the same
weights after the same 2 more steps: variable creation order and config keys (including
since-renamed arguments) are part of the save format of tf.train.Checkpoint and of .keras
files written before the keys of tfkfac/state.py.
"""

import io
import os
import sys
import zipfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import h5py  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from kfac_reference import sgd_kfac  # noqa: E402
import saved_fixtures  # noqa: E402
import tfkfac  # noqa: E402

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
DATA = os.path.join(TESTDATA, "saved_v0_1")
sys.path.insert(0, TESTDATA)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# model_fn's blocks and their factors, and its variables ("<layer>.<name>"), in order.
FACTORS = {"conv": "AG", "bn": "F", "hidden": "AG", "logits": "AG"}
MODEL_VARIABLES = ["conv.kernel", "conv.bias", "bn.gamma", "bn.beta", "hidden.kernel",
                   "hidden.bias", "logits.kernel", "logits.bias"]
COUNTERS = ["skipped_steps", "factor_updates", "skipped_factor_updates",
            "decomposition_updates", "failed_decompositions", "next_factor_step",
            "next_decomposition_step"]
# Each method, the settings that ask for it, and the tensors of a full factor's
# decomposition; "grafted" and "scheduled" add the post-transform and the other pieces
# with state (adaptive stale statistics, momentum coupling).
METHODS = {"eigen": (dict(method="eigen"), 2), "inverse": (dict(method="inverse"), 1),
           "eigen_adam": (dict(method="eigen_adam"), 2),
           "grafted": (dict(method="eigen", grafting="adam"), 2),
           "scheduled": (dict(method="inverse", stale_threshold=0.1,
                              couple_momentum_to_lr=True), 1)}
STEP_SETTINGS = dict(learning_rate=0.05, damping=1e-2, factor_update_freq=1,
                     decomposition_update_freq=2, xla=False)


def model_fn(hidden_units=8):
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6, 6, 1)), keras.layers.Conv2D(3, 3, activation="relu", name="conv"),
        keras.layers.BatchNormalization(name="bn"), keras.layers.Flatten(),
        keras.layers.Dense(hidden_units, activation="relu", name="hidden"),
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
        model = saved_fixtures.load(self, os.path.join(DATA, f"{method}.keras"))
        self.assertIsInstance(model.optimizer, tfkfac.KFAC)
        self.assertEqual(model.optimizer.method, method)
        model.optimizer.attach(model)
        self.check_resumes(model, model.optimizer, expected)

    @parameterized.parameters("eigen", "inverse")
    def test_tf_checkpoint_restores_and_resumes(self, method):
        expected = np.load(os.path.join(DATA, f"{method}_expected.npz"))
        model = model_fn()
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                                damping=1e-2, kl_clip=1e-3, factor_update_freq=1,
                                decomposition_update_freq=2, method=method).attach(model)
        model.compile(optimizer=optimizer, loss=LOSS)
        optimizer.build(model.trainable_variables)
        tf.train.Checkpoint(model=model, optimizer=optimizer).read(
            os.path.join(DATA, f"{method}_ckpt")).assert_existing_objects_matched()
        self.check_resumes(model, optimizer, expected)


class IndexKeysTest(parameterized.TestCase):
    """.keras files with index keys, as tfkfac wrote them just before the keys, with every
    piece that holds state (tests/testdata/index_keys_save.py wrote them): they load in
    `KFAC.variables` order, and go on bit for bit as the same state saved under today's
    keys and loaded again does.

    The weights that tfkfac's loaded run reached (`next_weight<i>` in the data) are not
    compared: its eigen_adam moments live in the factors' eigenbases, which within the
    near-degenerate eigenspaces of this small random problem LAPACK's CPU kernels choose
    differently (after the 2 steps, 0.025-0.14 apart with OpenBLAS's SkylakeX kernels
    against the machine that wrote them, 3e-6-0.014 with its Haswell ones), so a
    continuation is comparable only on one machine."""

    @parameterized.parameters("replicated", "owner")
    def test_keras_file_with_index_keys_loads_in_order_and_goes_on(self, placement):
        # Here, not at the top: it imports this module's model_fn.
        import index_keys_save as older  # pylint: disable=import-outside-toplevel
        directory = os.path.join(TESTDATA, "index_keys")
        expected = np.load(os.path.join(directory, f"{placement}_expected.npz"))
        model = saved_fixtures.load(self, os.path.join(directory, f"{placement}.keras"))
        model.optimizer.attach(model)
        variables = model.optimizer.variables
        self.assertLen([k for k in expected if k.startswith("optimizer")], len(variables))
        for i, variable in enumerate(variables):
            np.testing.assert_array_equal(variable.numpy(), expected[f"optimizer{i:03d}"],
                                          err_msg=variable.path)
        keyed_path = os.path.join(self.create_tempdir().full_path, "keyed.keras")
        model.save(keyed_path)
        keyed = keras.models.load_model(keyed_path)
        keyed.optimizer.attach(keyed)
        rest = slice(older.SAVED_AFTER * older.BATCH, None)
        for run in (model, keyed):
            older.fit(run, expected["x"][rest], expected["y"][rest])
        for i, (weight, again) in enumerate(zip(model.get_weights(), keyed.get_weights())):
            np.testing.assert_array_equal(weight, again, err_msg=f"weight {i}")


def expected_keys(method, placement):
    """The keys tfkfac/state.py documents for model_fn's KFAC of `method` (a METHODS key)
    and `placement`, written out here from that list."""
    settings, parts = METHODS[method]
    name = settings["method"]
    full = {layer: factors for layer, factors in FACTORS.items() if factors != "F"}
    keys = {f"inner:{i}" for i in range(2 + len(MODEL_VARIABLES))}  # SGD: + momenta
    keys |= {f"counters:{c}" for c in COUNTERS}
    keys |= {f"block:{layer}:factor:{f}" for layer, fs in FACTORS.items() for f in fs}
    moments = ({f"method:eigen_adam:{layer}:moment0" for layer in FACTORS}
               if name == "eigen_adam" else set())
    if placement == "replicated":
        keys |= {f"method:{name}:{layer}:decomposition:{f}:{k}"
                 for layer, fs in full.items() for f in fs for k in range(parts)}
    else:
        keys |= {f"block:{layer}:decomposed:{f}" for layer, fs in full.items() for f in fs}
        keys.add("curvature:decomposed_damping")
    keys |= moments
    if settings.get("grafting") == "adam":
        keys |= {f"grafting:adam_v:{v}" for v in MODEL_VARIABLES}
    if "stale_threshold" in settings:
        keys |= {f"adaptive_staleness:{n}" for n in ("factor_intervals", "next_factor_steps",
                                                      "undecomposed")}
        if placement == "owner":
            keys.add("adaptive_staleness:decomposed_dampings")
    if settings.get("couple_momentum_to_lr"):
        keys.add("momentum_coupling:peak_learning_rate")
    return keys


def trained(steps=2, **settings):
    """model_fn's model, compiled with a KFAC of `settings`, after `steps` steps."""
    model = model_fn()
    optimizer = sgd_kfac(**dict(STEP_SETTINGS, **settings)).attach(model)
    model.compile(optimizer=optimizer, loss=LOSS)
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(16 * steps, 6, 6, 1)).astype(np.float32),
              rng.integers(0, 4, size=16 * steps), batch_size=16, verbose=0)
    return model, optimizer


def saved_optimizer_state(path):
    """{key: array} of the optimizer's own variables in the .keras file `path`."""
    with zipfile.ZipFile(path) as archive:
        with h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as weights:
            return {key: value[...] for key, value in weights["optimizer/vars"].items()}


class SavedByNameTest(parameterized.TestCase):

    @parameterized.product(method=list(METHODS), placement=["replicated", "owner"])
    def test_keras_file_holds_every_variable_under_its_key_and_loads_it_back(
            self, method, placement):
        model, optimizer = trained(placement=placement, **METHODS[method][0])
        path = os.path.join(self.create_tempdir().full_path, "model.keras")
        model.save(path)
        saved = saved_optimizer_state(path)
        self.assertEqual(set(saved), expected_keys(method, placement))
        self.assertEqual(saved["counters:factor_updates"], 2)
        np.testing.assert_array_equal(saved["block:hidden:factor:A"],
                                      optimizer.factors("hidden")["A"])
        loaded = keras.models.load_model(path)
        loaded.optimizer.attach(loaded)
        self.assertLen(loaded.optimizer.variables, len(saved))
        for got, want in zip(loaded.optimizer.variables, optimizer.variables):
            np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=got.path)

    def test_a_save_of_another_model_or_setting_fails_naming_the_keys(self):
        _, optimizer = trained(method="eigen")
        store = {}
        optimizer.save_own_variables(store)

        def mismatch(model, **settings):
            """The error that loading `store` into `model`'s KFAC of `settings` raises,
            having assigned nothing."""
            other = sgd_kfac(**{**STEP_SETTINGS, "method": "eigen", **settings}).attach(
                model)
            model.compile(optimizer=other, loss=LOSS)
            other.build(model.trainable_variables)
            before = [v.numpy() for v in other.variables]
            with self.assertRaisesRegex(ValueError, "does not match this KFAC's") as raised:
                other.load_own_variables(store)
            for variable, value in zip(other.variables, before):
                np.testing.assert_array_equal(variable.numpy(), value, err_msg=variable.path)
            return str(raised.exception)

        def keys_named(message):
            """{clause: its keys} of a message naming keys missing or not expected."""
            clauses = message.split(": ", 1)[1].split(". Load")[0].split("; ")
            return {clause.split(": ")[0]: set(clause.split(": ")[1].split(", "))
                    for clause in clauses}

        def decompositions(method, layer, parts=2):
            return {f"method:{method}:{layer}:decomposition:{f}:{k}"
                    for f in "AG" for k in range(parts)}

        without_hidden = keras.Sequential([
            keras.Input((6, 6, 1)), keras.layers.Conv2D(3, 3, name="conv"),
            keras.layers.BatchNormalization(name="bn"), keras.layers.Flatten(),
            keras.layers.Dense(4, name="logits")])
        self.assertEqual(keys_named(mismatch(without_hidden)), {"in the save but not here": {
            "inner:8", "inner:9", "block:hidden:factor:A", "block:hidden:factor:G",
            *decompositions("eigen", "hidden")}})
        with_extra = model_fn()
        with_extra.add(keras.layers.Dense(4, name="extra"))
        self.assertEqual(keys_named(mismatch(with_extra)), {"missing from the save": {
            "inner:10", "inner:11", "block:extra:factor:A", "block:extra:factor:G",
            *decompositions("eigen", "extra")}})
        layers = ("conv", "hidden", "logits")
        self.assertEqual(keys_named(mismatch(model_fn(), method="eigen_adam")), {
            "missing from the save": {
                *[k for layer in layers for k in decompositions("eigen_adam", layer)],
                *[f"method:eigen_adam:{layer}:moment0" for layer in FACTORS]},
            "in the save but not here": {
                k for layer in layers for k in decompositions("eigen", layer)}})
        self.assertEqual(keys_named(mismatch(model_fn(), placement="owner")), {
            "missing from the save": {"curvature:decomposed_damping", *[
                f"block:{layer}:decomposed:{f}" for layer in layers for f in "AG"]},
            "in the save but not here": {
                k for layer in layers for k in decompositions("eigen", layer)}})
        self.assertEqual(keys_named(mismatch(model_fn(), grafting="adam")), {
            "missing from the save": {f"grafting:adam_v:{v}" for v in MODEL_VARIABLES}})
        message = mismatch(model_fn(hidden_units=9))
        self.assertIn("shapes differ for inner:6 (saved (48, 8), here (48, 9)), ", message)
        for shapes in ["inner:7 (saved (8,), here (9,))", "inner:8 (saved (8, 4), here (9, 4))",
                       "block:hidden:factor:G (saved (8, 8), here (9, 9))",
                       "block:logits:factor:A (saved (9, 9), here (10, 10))",
                       "method:eigen:hidden:decomposition:G:0 (saved (8, 8), here (9, 9))",
                       "method:eigen:logits:decomposition:A:1 (saved (9,), here (10,))"]:
            self.assertIn(shapes, message)


if __name__ == "__main__":
    absltest.main()
