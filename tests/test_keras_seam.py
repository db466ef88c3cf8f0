"""The private Keras and TensorFlow names tfkfac uses (docs/design.md §15), against the
installed Keras and TensorFlow: each still exists and does what tfkfac relies on. A failure
names the private name and the versions, so that a new Keras release that changes one
says which, instead of failing somewhere inside a training step.

Also: every private name of another library that tfkfac/ reads, calls or overrides is in
the design notes' list, whose count the notes state; and the public seams tfkfac reaches
by convention (the optimizer's own variables by name, a loss's arguments in its config, a
layer carrying a mask, `keras.name_scope`'s caller) still hold. Fast (no training), so
that it also runs against the oldest supported Keras (tools/wheel_check.sh).
"""

import ast
import contextlib
import os
import re
import tempfile
import tokenize

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402
from tfkfac import keras_integration  # noqa: E402
from tfkfac.distributed import strategy_comm  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO_ROOT, "tfkfac")
DESIGN = os.path.join(REPO_ROOT, "docs", "design.md")
SECTION = "## 15. Private Keras and TensorFlow names"
# Classes whose private attributes a private name of tfkfac's own could shadow.
FOREIGN = (keras.Model, keras.optimizers.Optimizer, keras.layers.Layer, keras.losses.Loss,
           keras.callbacks.Callback, keras.Variable, tf.Module, tf.Variable)


@contextlib.contextmanager
def relied_on(name):
    """Re-raise a failure inside as one naming `name` and the installed versions."""
    try:
        yield
    except Exception as error:  # pylint: disable=broad-except
        raise AssertionError(
            f"Keras {keras.__version__} / TensorFlow {tf.__version__} changed `{name}`, "
            f"which tfkfac relies on (docs/design.md §15): {type(error).__name__}: "
            f"{error}") from error


def listed_names():
    """The names docs/design.md §15 lists, and the count it states."""
    with open(DESIGN, encoding="utf-8") as f:
        text = f.read()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    names = [name for heads in re.findall(r"^- (`[^\n]*?):\s", section, re.M)
             for name in re.findall(r"`([^`]+)`", heads)]
    stated = re.search(r"uses (\d+) private names", section)
    return names, int(stated.group(1)) if stated else None


def code_tokens(path):
    """The source of `path` with comments and strings blanked (names and operators only)."""
    with open(path, encoding="utf-8") as f:
        tokens = list(tokenize.generate_tokens(f.readline))
    return " ".join(t.string for t in tokens
                    if t.type not in (tokenize.COMMENT, tokenize.STRING))


def foreign(name):
    return any(hasattr(cls, name) for cls in FOREIGN)


def private_uses():
    """{private name: files} of the names of other libraries that tfkfac/ touches: attributes
    read (also by getattr) that tfkfac never defines or assigns, its definitions and
    assignments of a name Keras's or TensorFlow's classes already have (overrides), and
    `keras.src` or `tf.__internal__` paths. Read by name only: another library's private
    attribute that tfkfac also gives objects of its own goes unseen (a read of
    `Optimizer._learning_rate` would, beside self-tuning's own `_learning_rate`)."""
    trees, stored, loaded = {}, {}, {}
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path, encoding="utf-8") as f:
                    trees[os.path.relpath(path, REPO_ROOT)] = ast.parse(f.read())
    for path, tree in trees.items():
        for node in ast.walk(tree):
            name, target = None, loaded
            if isinstance(node, ast.Attribute):
                name = node.attr
                target = stored if isinstance(node.ctx, ast.Store) else loaded
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name, target = node.name, stored
            elif (isinstance(node, ast.Call) and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str)):
                function = ast.unparse(node.func)
                name = node.args[1].value
                if function in ("getattr", "hasattr"):
                    target = loaded
                elif function.endswith(("set_untracked", "__setattr__", "__delattr__")):
                    target = stored
                else:
                    name = None
            if name and name.startswith("_") and not name.startswith("__"):
                target.setdefault(name, set()).add(path)
    uses = {name: files for name, files in loaded.items() if name not in stored}
    uses.update({name: files for name, files in stored.items() if foreign(name)})
    for path in trees:
        code = code_tokens(os.path.join(REPO_ROOT, path)).replace(" . ", ".")
        for module in re.findall(r"\b(?:keras\.src|tf\.__internal__)(?:\.\w+)+", code):
            uses.setdefault(module, set()).add(path)
    return uses


class ListTest(absltest.TestCase):

    def test_every_private_name_in_tfkfac_is_listed_and_counted(self):
        names, stated = listed_names()
        short = {name.rsplit(".", 1)[-1] if not name.startswith(("keras.", "tf.")) else name
                 for name in names}
        uses = private_uses()
        unlisted = {name: sorted(files) for name, files in uses.items() if name not in short}
        self.assertEqual(unlisted, {}, msg="private names used but not listed in "
                         "docs/design.md §15 (add each, with why, and a check here)")
        self.assertEqual(sorted(short - set(uses)), [],
                         msg="listed in docs/design.md §15 but no longer used: remove them")
        self.assertEqual(stated, len(names), msg="the count docs/design.md §15 states")
        self.assertLessEqual(len(names), 13)  # lower it as names go

    def test_every_listed_name_has_a_check_here(self):
        names, _ = listed_names()
        checks = {n for n in dir(SeamTest) if n.startswith("test_")}
        for name in names:
            method = "test_" + re.sub(r"\W+", "_", name.rsplit(".", 1)[-1]).strip("_")
            self.assertIn(method, checks, msg=f"`{name}` has no {method} in SeamTest")


def tiny_model():
    inputs = keras.Input((3,))
    return keras.Model(inputs, keras.layers.Dense(2, name="d")(inputs))


class SeamTest(absltest.TestCase):
    """One check per name of docs/design.md §15 (`test_` and the name's last part)."""

    def test_no_automatic_dependency_tracking(self):
        with relied_on("keras.src.utils.tracking.no_automatic_dependency_tracking"):
            optimizer = keras.optimizers.SGD()
            keras_integration.no_tracking(
                lambda: setattr(optimizer, "held", [keras.Variable(1.0)]))()
            # Keras's tracking would add the variable to the optimizer's (which .keras
            # files save in order).
            self.assertEqual(len(optimizer.variables), 2)  # iteration, learning_rate

    def test_flatten_layers(self):
        with relied_on("Layer._flatten_layers"):
            inputs = keras.Input((4, 6))
            outputs = keras.layers.MultiHeadAttention(2, 3, name="attention")(inputs, inputs)
            paths = keras_integration.leaf_layers(keras.Model(inputs, outputs))
            self.assertLessEqual({"attention/query", "attention/key", "attention/value",
                                  "attention/attention_output"}, set(paths))

    def test_all_reduce_sum_gradients(self):
        with relied_on("Optimizer._all_reduce_sum_gradients"):
            optimizer, seen = keras.optimizers.SGD(1.0), []
            keras_integration.set_untracked(
                optimizer, "_all_reduce_sum_gradients",
                lambda grads_and_vars: seen.append(len(grads_and_vars)) or grads_and_vars)
            variable = keras.Variable([1.0, 2.0])
            optimizer.apply([tf.constant([1.0, 1.0])], [variable])
            self.assertEqual(seen, [1])
            np.testing.assert_array_equal(variable.numpy(), [0.0, 1.0])

    def momentum_slot(self, name):
        with relied_on(name):
            optimizer = keras.optimizers.Adam()
            variable = keras.Variable([1.0, 2.0], name="w")
            optimizer.build([variable])
            for seen in (variable, variable.value):  # `update_step` receives the latter
                slot = keras_integration.momentum_slot(optimizer, seen)
                self.assertTrue(any(slot is v for v in optimizer.variables))
                self.assertTrue(slot.name.endswith("_momentum"), slot.name)

    def test_momentums(self):
        self.momentum_slot("Optimizer._momentums")

    def test_get_variable_index(self):
        self.momentum_slot("Optimizer._get_variable_index")

    def symbolic_build(self, name):
        """`fit` calls `_maybe_symbolic_build(iterator=...)` before the first step, with
        Keras's epoch iterator, whose `_get_iterator()` has the batches' element spec;
        `_symbolic_build(data_batch=...)` builds the compiled metrics and the optimizer."""
        with relied_on(name):
            model, seen = tiny_model(), []
            model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
            keras_integration.set_untracked(
                model, "_maybe_symbolic_build", lambda iterator=None, data_batch=None:
                seen.append(iterator._get_iterator().element_spec))
            dataset = tf.data.Dataset.from_tensors((tf.zeros([2, 3]), tf.zeros([2, 2])))
            model.fit(dataset, verbose=0)
            self.assertEqual([tuple(spec.shape) for spec in seen[0]], [(2, 3), (2, 2)])
            model = tiny_model()
            model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
            model._symbolic_build(data_batch=(tf.zeros([2, 3]), tf.zeros([2, 2])))
            self.assertTrue(model.optimizer.built)
            self.assertTrue(all(m.variables for m in model.metrics))

    def test_maybe_symbolic_build(self):
        self.symbolic_build("Model._maybe_symbolic_build")

    def test_symbolic_build(self):
        self.symbolic_build("Model._symbolic_build")

    def test_get_iterator(self):
        self.symbolic_build("TFEpochIterator._get_iterator")

    def test_trackable_children(self):
        with relied_on("Trackable._trackable_children"):
            optimizer = tfkfac.KFAC(learning_rate=0.1)
            children = optimizer._trackable_children()
            self.assertIn("_iterations", children)
            self.assertIn("_variables", children)
            self.assertNotIn("inner_optimizer", children)

    def waiting(self, name):
        """A restore into an empty list wrapper leaves its values waiting by position,
        and each goes to the variable appended at its position."""
        with relied_on(name):
            saved = tf.train.Checkpoint(values=[tf.Variable(3.0), tf.Variable([4.0, 5.0])])
            path = saved.write(os.path.join(tempfile.mkdtemp(), "ckpt"))
            wrapper = tf.__internal__.tracking.wrap([])
            tf.train.Checkpoint(values=wrapper).read(path)
            self.assertEqual(keras_integration.waiting_shapes(wrapper), {0: {()}, 1: {(2,)}})
            variable = tf.Variable(0.0)
            keras_integration.grow_checkpoint_list(wrapper, [variable])
            self.assertEqual(float(variable.numpy()), 3.0)

    def test_deferred_dependencies(self):
        self.waiting("Trackable._deferred_dependencies")

    def test_wrap(self):
        self.waiting("tf.__internal__.tracking.wrap")

    def test_maybe_initialize_trackable(self):
        """`compile` tracks its optimizer, which calls the optimizer's
        `_maybe_initialize_trackable` with `compile` on the stack."""
        self.waiting("Trackable._maybe_initialize_trackable")
        with relied_on("Trackable._maybe_initialize_trackable"):
            model, found = tiny_model(), []

            class Recording(keras.optimizers.SGD):
                def _maybe_initialize_trackable(self):
                    found.append(keras_integration.model_compiling(self))
                    return super()._maybe_initialize_trackable()

            model.compile(optimizer=Recording(), loss="mse")
            self.assertIn(model, found)

    def test_communication_options(self):
        with relied_on("StrategyExtended._communication_options"):
            strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
            options = strategy_comm.collective_options(strategy)
            self.assertEqual(set(options), {"communication_hint", "timeout_seconds"})


class PublicConventionTest(absltest.TestCase):
    """Public API that tfkfac uses in a way Keras does not spell out in a signature."""

    def test_an_optimizer_names_its_own_variables(self):
        optimizer = keras.optimizers.SGD(0.5)
        with relied_on('variables named "iteration" and "learning_rate"'):
            self.assertIs(keras_integration.own_variable(optimizer, "iteration"),
                          optimizer.iterations)
            self.assertIs(keras_integration.own_variable(optimizer, "learning_rate"),
                          optimizer.learning_rate)
            schedule = keras.optimizers.schedules.ExponentialDecay(0.5, 10, 0.9)
            scheduled = keras.optimizers.SGD(schedule)
            self.assertIsNone(keras_integration.own_variable(scheduled, "learning_rate"))

    def test_a_loss_config_holds_its_function_arguments(self):
        with relied_on("Loss.get_config"):
            config = keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, ignore_class=3).get_config()
            self.assertEqual((config["from_logits"], config["ignore_class"]), (True, 3))
            config = keras.losses.CategoricalCrossentropy(axis=1).get_config()
            self.assertEqual(config["axis"], 1)

    def test_a_layer_carries_the_mask_to_an_unfused_copy(self):
        with relied_on("keras.layers.Lambda(mask=...)"):
            inputs = keras.Input((3,), dtype="int32")
            embedded = keras.layers.Embedding(5, 4, mask_zero=True)(inputs)
            probabilities = keras.layers.Dense(2, activation="softmax")(embedded)
            model = keras.Model(inputs, probabilities)
            copy = keras_integration.unfused(model(tf.constant([[1, 2, 0]])))
            mask = getattr(copy, "_keras_mask", None)
            np.testing.assert_array_equal(np.asarray(mask), [[True, True, False]])
            self.assertFalse(hasattr(copy, "_keras_logits"))

    def test_name_scope_takes_a_caller(self):
        with relied_on("keras.name_scope(caller=)"):
            optimizer = keras.optimizers.SGD()
            with keras_integration.name_scope(optimizer):
                variable = keras.Variable(1.0, name="v")
            self.assertEqual(variable.path, f"{optimizer.name}/v")


if __name__ == "__main__":
    absltest.main()
