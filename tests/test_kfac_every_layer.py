"""Every Keras layer with weights trains under K-FAC, with a block or on the plain gradient.

For each layer below a tiny model `Input -> layer -> Flatten -> Dense` is trained for three
`fit` steps with factors and decompositions updated every step. The check is the fallback
promise of docs/design.md: training never fails because a layer has no block. So for every
layer: the loss stays finite, every trainable variable moves and stays finite, and the
layer is either managed (`summary()["managed"]`) or listed in `summary()["skipped"]` with a
reason, the unmanaged ones named in the single warning given at attach.

The cases cover the layers of today's architectures (convolutions of every kind, attention,
normalizations, recurrent layers, PReLU, a custom layer that calls `add_weight`), so the
same test keeps guarding each layer when its block arrives. A mixed_float16 case and an
inner-optimizer case run the update paths that wrap Keras's own.
"""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

from kfac_reference import sgd_kfac  # noqa: E402
import tfkfac  # noqa: E402

N = 8
CLASSES = 3


class Scale(keras.layers.Layer):
    """A custom layer outside Keras: one trainable vector via `add_weight`."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones")

    def call(self, inputs):
        return inputs * self.scale


class Attention(keras.layers.Layer):
    """Self-attention through MultiHeadAttention, which takes (query, value)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)

    def call(self, inputs):
        return self.attention(inputs, inputs)


SEQUENCE, IMAGE, VOLUME, TOKENS, VECTOR = (6, 4), (6, 6, 4), (4, 4, 4, 2), (6,), (5,)

# name -> (input shape, layer factory)
LAYERS = {
    "dense": (VECTOR, lambda: keras.layers.Dense(4, activation="relu")),
    "dense_on_sequence": (SEQUENCE, lambda: keras.layers.Dense(4)),
    "batch_normalization": (IMAGE, keras.layers.BatchNormalization),
    "conv1d": (SEQUENCE, lambda: keras.layers.Conv1D(4, 3, activation="relu")),
    "conv2d": (IMAGE, lambda: keras.layers.Conv2D(4, 3, padding="same")),
    "conv3d": (VOLUME, lambda: keras.layers.Conv3D(3, 2)),
    "grouped_conv2d": (IMAGE, lambda: keras.layers.Conv2D(4, 3, groups=2)),
    "depthwise_conv1d": (SEQUENCE, lambda: keras.layers.DepthwiseConv1D(3, depth_multiplier=2)),
    "depthwise_conv2d": (IMAGE, lambda: keras.layers.DepthwiseConv2D(3)),
    "separable_conv1d": (SEQUENCE, lambda: keras.layers.SeparableConv1D(4, 3)),
    "separable_conv2d": (IMAGE, lambda: keras.layers.SeparableConv2D(4, 3)),
    "conv1d_transpose": (SEQUENCE, lambda: keras.layers.Conv1DTranspose(3, 3, strides=2)),
    "conv2d_transpose": (IMAGE, lambda: keras.layers.Conv2DTranspose(3, 3)),
    "conv3d_transpose": (VOLUME, lambda: keras.layers.Conv3DTranspose(2, 2)),
    "embedding": (TOKENS, lambda: keras.layers.Embedding(10, 4)),
    "einsum_dense": (SEQUENCE, lambda: keras.layers.EinsumDense(
        "abc,cde->abde", output_shape=(6, 2, 3), bias_axes="de")),
    "multi_head_attention": (SEQUENCE, Attention),
    "layer_normalization": (SEQUENCE, keras.layers.LayerNormalization),
    "group_normalization": (IMAGE, lambda: keras.layers.GroupNormalization(groups=2)),
    "rms_normalization": (SEQUENCE, keras.layers.RMSNormalization),
    "lstm": (SEQUENCE, lambda: keras.layers.LSTM(3, return_sequences=True)),
    "gru": (SEQUENCE, lambda: keras.layers.GRU(3)),
    "simple_rnn": (SEQUENCE, lambda: keras.layers.SimpleRNN(3)),
    "bidirectional_lstm": (SEQUENCE, lambda: keras.layers.Bidirectional(keras.layers.LSTM(2))),
    "conv_lstm1d": ((3, 6, 2), lambda: keras.layers.ConvLSTM1D(2, 3)),
    "prelu": (SEQUENCE, keras.layers.PReLU),
    "time_distributed_dense": (SEQUENCE, lambda: keras.layers.TimeDistributed(
        keras.layers.Dense(3))),
    "custom_add_weight": (SEQUENCE, Scale),
}


def build_model(input_shape, make_layer):
    keras.utils.set_random_seed(0)
    dtype = "int32" if input_shape == TOKENS else "float32"
    inputs = keras.Input(input_shape, dtype=dtype)
    hidden = make_layer()(inputs)
    hidden = keras.layers.Flatten()(hidden)
    outputs = keras.layers.Dense(CLASSES, name="head")(hidden)
    return keras.Model(inputs, outputs)


def batches(input_shape, steps):
    rng = np.random.default_rng(1)
    if input_shape == TOKENS:
        x = rng.integers(0, 10, size=(steps * N,) + input_shape).astype(np.int32)
    else:
        x = rng.normal(size=(steps * N,) + input_shape).astype(np.float32)
    return x, rng.integers(0, CLASSES, size=steps * N)


def train(model, optimizer, steps=3):
    """Attach, compile, fit `steps` batches; (loss history, warnings about KFAC)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.attach(model)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = batches(tuple(model.inputs[0].shape[1:]), steps)
    history = model.fit(x, y, batch_size=N, epochs=1, verbose=0)
    return history.history["loss"], [str(w.message) for w in caught if "KFAC" in str(w.message)]


class EveryLayerTrainsTest(parameterized.TestCase):

    def check_trains(self, model, optimizer, steps=3):
        before = [v.numpy().copy() for v in model.trainable_variables]
        losses, messages = train(model, optimizer, steps)
        self.assertTrue(np.all(np.isfinite(losses)), losses)
        for variable, old in zip(model.trainable_variables, before):
            new = variable.numpy()
            self.assertTrue(np.all(np.isfinite(new)), variable.path)
            self.assertFalse(np.array_equal(new, old), f"{variable.path} did not move")
        summary = optimizer.summary()
        self.assertEqual(summary["counters"]["skipped_steps"], 0)
        return summary, messages

    @parameterized.named_parameters(*[(name, name) for name in LAYERS])
    def test_trains_with_block_or_plain_gradient(self, name):
        input_shape, make_layer = LAYERS[name]
        model = build_model(input_shape, make_layer)
        optimizer = sgd_kfac(0.05, factor_update_freq=1, decomposition_update_freq=1,
                             xla=False)
        summary, messages = self.check_trains(model, optimizer)

        managed = {m["layer"] for m in summary["managed"]}
        skipped = {s["layer"]: s["reason"] for s in summary["skipped"]}
        self.assertIn("head", managed)
        weighted = [layer.name for layer in model._flatten_layers(include_self=False)
                    if layer.trainable_weights and not layer._layers]
        # Each weighted layer once, by its path (its name after its parents' names).
        paths = sorted(managed | set(skipped))
        self.assertEqual(sorted(path.split("/")[-1] for path in paths), sorted(weighted))
        self.assertTrue(all(skipped.values()), skipped)
        if skipped:
            self.assertLen(messages, 1)
            for layer, reason in skipped.items():
                self.assertIn(f"{layer} ({reason})", messages[0])
        else:
            self.assertEmpty(messages)

    def test_mixed_float16_with_unmanaged_layer(self):
        keras.mixed_precision.set_dtype_policy("mixed_float16")
        self.addCleanup(keras.mixed_precision.set_dtype_policy, "float32")
        model = build_model(*LAYERS["layer_normalization"])
        self.check_trains(model, sgd_kfac(0.05, xla=False))

    def test_inner_optimizer_with_unmanaged_layer(self):
        model = build_model(*LAYERS["prelu"])
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.Adam(1e-2), damping=0.1,
                                kl_clip=1e-3, xla=False)
        self.check_trains(model, optimizer)

    def test_every_layer_unmanaged(self):
        model = build_model(*LAYERS["layer_normalization"])
        optimizer = sgd_kfac(0.05, skip_layers=[".*"], xla=False)
        summary, _ = self.check_trains(model, optimizer)
        self.assertEmpty(summary["managed"])


if __name__ == "__main__":
    absltest.main()
