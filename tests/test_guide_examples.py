"""docs/guide.md's Python blocks run as written.

Each block runs on a fresh small model of the kinds it names (a Dense layer "dense_1" and
a MultiHeadAttention "mha"), with the glue a reader supplies (datasets, a loss, a step)
from this file; the blocks' lines are the guide's, unedited. Every block must be claimed
by one test here, so a new example cannot go unrun. The tf.distribute block runs in a
process of its own: MultiWorkerMirroredStrategy must be made before TensorFlow's runtime
starts.
"""

import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

import tfkfac  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(REPO_ROOT, "docs", "guide.md")
BATCH = 32

# What a reader has before a block: this file's text runs in a fresh process too.
PRELUDE = '''
import numpy as np, tensorflow as tf, keras, tfkfac

def build_model():
    inputs = keras.Input((6, 4))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="mha")(inputs, inputs)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(16, activation="relu", name="dense_1")(h)
    outputs = keras.layers.Dense(2, activation="softmax", name="probabilities")(h)
    return keras.Model(inputs, outputs)

x = np.random.default_rng(0).normal(size=(256, 6, 4)).astype("float32")
y = (x[:, 0, 0] + x[:, 1, 1] > 0).astype("int32")
train_dataset = val_dataset = test_dataset = dataset = (
    tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
loss_fn = keras.losses.SparseCategoricalCrossentropy()
model = build_model()
'''


def guide_block(marker):
    """The one Python block of the guide that contains `marker`."""
    with open(GUIDE, encoding="utf-8") as f:
        found = [b for b in re.findall(r"```python\n(.*?)```", f.read(), re.S) if marker in b]
    if len(found) != 1:
        raise AssertionError(f"{len(found)} guide blocks contain {marker!r}; expected 1")
    return found[0]


def run(block, namespace=None):
    namespace = namespace if namespace is not None else {}
    if not namespace:
        exec(PRELUDE, namespace)  # pylint: disable=exec-used
    exec(compile(block, GUIDE, "exec"), namespace)  # pylint: disable=exec-used
    return namespace


MARKERS = {
    "first model": "callbacks=[tfkfac.AveragedWeights(optimizer)]",
    "custom loop": "def train_step(x, y):",
    "looking inside": 'optimizer.factors("dense_1")',
    "averaged weights": "averaged.applied(model)",
    "momentum SGD inside": "damping=0.1, kl_clip=1e-3",
    "Osawa's recipe": "PolynomialDecay(0.05, decay_steps=5000, power=11.0)",
    "tf.distribute": "tf.distribute.MultiWorkerMirroredStrategy()",
}


class GuideExamplesTest(absltest.TestCase):

    def test_every_block_is_run_here(self):
        with open(GUIDE, encoding="utf-8") as f:
            blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
        for block in blocks:
            self.assertLen([m for m in MARKERS.values() if m in block], 1, msg=block)
        self.assertLen(blocks, len(MARKERS))

    def test_a_first_model_trains(self):
        namespace = run(guide_block(MARKERS["first model"]))
        self.assertTrue(np.isfinite(namespace["model"].history.history["val_loss"][-1]))

    def test_the_custom_loop_steps_and_the_curvature_can_be_read(self):
        namespace = run(guide_block(MARKERS["custom loop"]))
        model, x, y = namespace["model"], namespace["x"][:BATCH], namespace["y"][:BATCH]
        self.assertTrue(np.isfinite(float(namespace["train_step"](x, y))))
        with tf.GradientTape() as tape:
            loss = namespace["loss_fn"](y, model(x, training=True))
        namespace["grads"] = tape.gradient(loss, model.trainable_variables)
        run(guide_block(MARKERS["looking inside"]), namespace)
        factors = namespace["optimizer"].factors("dense_1")
        self.assertEqual((factors["A"].shape, factors["G"].shape), ((25, 25), (16, 16)))
        self.assertEqual([tuple(p.shape) for p in namespace["p"]],
                         [tuple(v.shape) for v in model.trainable_variables])

    def test_averaged_weights_evaluate_and_export(self):
        namespace = {}
        exec(PRELUDE, namespace)  # pylint: disable=exec-used
        optimizer = namespace["optimizer"] = tfkfac.KFAC()
        namespace["model"].compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
        namespace["model"].fit(namespace["train_dataset"], epochs=1, verbose=0)
        cwd = os.getcwd()
        os.chdir(tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir()))
        try:
            run(guide_block(MARKERS["averaged weights"]), namespace)
            self.assertTrue(os.path.isfile(os.path.join("served", "saved_model.pb")))
        finally:
            os.chdir(cwd)

    def test_the_settings_examples_train(self):
        for name in ("momentum SGD inside", "Osawa's recipe"):
            namespace = run(guide_block(MARKERS[name]))
            model = namespace["model"]
            model.compile(optimizer=namespace["optimizer"],
                          loss="sparse_categorical_crossentropy")
            history = model.fit(namespace["train_dataset"], epochs=1, verbose=0).history
            self.assertTrue(np.isfinite(history["loss"][-1]), msg=name)

    def test_the_distributed_example_trains_in_a_process_of_its_own(self):
        # Without TF_CONFIG the strategy is one worker: the code path a user's first try takes.
        env = dict(os.environ, PYTHONPATH=REPO_ROOT)
        env.pop("TF_CONFIG", None)
        script = (PRELUDE.replace("model = build_model()\n", "")
                  + guide_block(MARKERS["tf.distribute"])
                  + "\nprint('final loss', model.history.history['loss'][-1])\n")
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=600, check=False)
        self.assertEqual(done.returncode, 0, msg=done.stderr[-3000:])
        self.assertRegex(done.stdout, r"final loss \d")


if __name__ == "__main__":
    absltest.main()
