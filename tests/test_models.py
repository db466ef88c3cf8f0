"""trainers.models: architectures, parameter counts from the papers' layer sizes, seeding,
output dtypes under mixed precision, and errors for unknown names. Which of these layers
K-FAC preconditions is tested with the blocks (tests/test_kfac_*.py)."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl.testing import absltest, parameterized
import keras
import numpy as np

from tfkfac import keras_integration
from trainers import models

# The standard Keras layers the models keep their weights in (MultiHeadAttention keeps
# its weights in EinsumDense sublayers).
WEIGHTED_LAYERS = (keras.layers.Dense, keras.layers.Conv2D, keras.layers.BatchNormalization,
                   keras.layers.Embedding, keras.layers.LayerNormalization,
                   keras.layers.EinsumDense)


def dense_params(widths):
    """Parameters of a chain of Dense layers with biases: sum of (n_in + 1) * n_out."""
    return sum((n_in + 1) * n_out for n_in, n_out in zip(widths[:-1], widths[1:]))


def resnet20_params(channels, num_classes):
    """ResNet-20 (He et al. 2016, CIFAR) with 1x1 projection shortcuts, counted by hand:
    3x3 convs without bias, BatchNorm with gamma/beta/mean/variance, Dense head."""
    def conv_bn(k, c_in, c_out):
        return k * k * c_in * c_out + 4 * c_out

    total = conv_bn(3, channels, 16)
    c_in = 16
    for width in (16, 32, 64):
        for block in range(3):
            total += conv_bn(3, c_in, width) + conv_bn(3, width, width)
            if c_in != width:
                total += conv_bn(1, c_in, width)
            c_in = width
    return total + (64 + 1) * num_classes


def vit_params(channels, num_tokens, num_classes):
    """The ViT counted by hand: 4x4 patches embedded to width 64, a position per token,
    3 blocks of [LayerNorm, 4-head attention (query, key, value and output projections,
    64x64 with biases), LayerNorm, MLP 64-128-64], a final LayerNorm and the head."""
    layer_norm = 2 * 64
    attention = 4 * (64 * 64 + 64)
    block = layer_norm + attention + layer_norm + dense_params([64, 128, 64])
    patches = (4 * 4 * channels + 1) * 64
    return patches + num_tokens * 64 + 3 * block + layer_norm + (64 + 1) * num_classes


class ModelsTest(parameterized.TestCase):

    def tearDown(self):
        keras.mixed_precision.set_global_policy("float32")
        super().tearDown()

    def test_cnn_parameter_count(self):
        model = models.build_model("cnn", (28, 28, 1), 10, seed=0)
        # conv 3x3x1x32, conv 3x3x32x64, 28->26->13->11->5: dense 5*5*64 -> 128 -> 10.
        expected = (9 * 1 * 32 + 32) + (9 * 32 * 64 + 64) + dense_params([5 * 5 * 64, 128, 10])
        self.assertEqual(model.count_params(), expected)

    def test_mlp_parameter_count(self):
        model = models.build_model("mlp", (28, 28, 1), 10, seed=0)
        self.assertEqual(model.count_params(), dense_params([784, 256, 256, 10]))

    def test_autoencoder_is_martens_grosse_architecture(self):
        model = models.build_model("autoencoder", (28, 28, 1), 10, seed=0)
        widths = [784, 1000, 500, 250, 30, 250, 500, 1000, 784]
        self.assertEqual(model.count_params(), dense_params(widths))
        dense = [layer for layer in model.layers if isinstance(layer, keras.layers.Dense)]
        self.assertEqual([layer.units for layer in dense], widths[1:])
        activations = [layer.activation.__name__ for layer in dense]
        self.assertEqual(activations[3], "linear")  # the 30-unit code layer
        self.assertEqual(activations[:3] + activations[4:], ["sigmoid"] * 7)
        output = model(np.random.default_rng(0).random((4, 28, 28, 1), dtype=np.float32))
        self.assertEqual(output.shape, (4, 784))
        self.assertTrue(np.all((output >= 0) & (output <= 1)))

    @parameterized.parameters(((28, 28, 1), 7), ((32, 32, 3), 8))
    def test_resnet20_for_both_input_sizes(self, input_shape, final_map):
        model = models.build_model("resnet20", input_shape, 10, seed=0)
        self.assertEqual(model.count_params(), resnet20_params(input_shape[-1], 10))
        convs = [layer for layer in model.layers if isinstance(layer, keras.layers.Conv2D)]
        # 19 3x3 convolutions + the Dense head = 20 weighted layers on the main path.
        self.assertLen([c for c in convs if c.kernel_size == (3, 3)], 19)
        self.assertLen([c for c in convs if c.kernel_size == (1, 1)], 2)
        pooling = next(layer for layer in model.layers
                       if isinstance(layer, keras.layers.GlobalAveragePooling2D))
        self.assertEqual(tuple(pooling.input.shape[1:3]), (final_map, final_map))
        self.assertTrue(any(isinstance(layer, keras.layers.BatchNormalization)
                            for layer in model.layers))

    @parameterized.parameters(((28, 28, 1), 49), ((32, 32, 3), 64))
    def test_vit_for_both_input_sizes(self, input_shape, num_tokens):
        model = models.build_model("vit", input_shape, 10, seed=0)
        self.assertEqual(model.count_params(), vit_params(input_shape[-1], num_tokens, 10))
        self.assertEqual(model.output.shape, (None, 10))
        patches = model.get_layer("patch_embedding")
        self.assertEqual((patches.kernel_size, patches.strides), ((4, 4), (4, 4)))
        self.assertEqual(model.get_layer("position_embedding").input_dim, num_tokens)
        attention = [layer for layer in model.layers
                     if isinstance(layer, keras.layers.MultiHeadAttention)]
        self.assertLen(attention, 3)
        self.assertLen([layer for layer in model.layers
                        if isinstance(layer, keras.layers.LayerNormalization)], 7)
        output = model(np.random.default_rng(0).random((2, *input_shape), dtype=np.float32))
        self.assertEqual(output.shape, (2, 10))

    def test_vit_parameter_count_is_about_105k(self):
        self.assertEqual(models.build_model("vit", (28, 28, 1), 10, seed=0).count_params(),
                         105_418)

    def test_vit_attention_projections_start_different(self):
        attention = models.build_model("vit", (28, 28, 1), 10, seed=0).get_layer(
            "block0_attention")
        query, key, value = (projection.kernel.numpy() for projection in (
            attention.query_dense, attention.key_dense, attention.value_dense))
        self.assertFalse(np.array_equal(query, key))
        self.assertFalse(np.array_equal(key, value))

    def test_vit_trains_with_sgd(self):
        model = models.build_model("vit", (28, 28, 1), 10, seed=0)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(0)
        images = rng.random((32, 28, 28, 1), dtype=np.float32)
        labels = rng.integers(0, 10, 32)
        before = model.get_layer("position_embedding").embeddings.numpy()
        history = model.fit(images, labels, batch_size=16, epochs=2, verbose=0)
        self.assertTrue(np.all(np.isfinite(history.history["loss"])))
        # Gradients reach the position lookup, so it is part of the trained graph.
        self.assertFalse(np.array_equal(
            before, model.get_layer("position_embedding").embeddings.numpy()))

    @parameterized.parameters(*models.MODEL_NAMES)
    def test_weights_live_in_standard_layers(self, name):
        model = models.build_model(name, (28, 28, 1), 10, seed=0)
        for layer in keras_integration.leaf_layers(model).values():
            if layer.weights:
                self.assertIsInstance(layer, WEIGHTED_LAYERS, layer.name)

    @parameterized.parameters(*models.CLASSIFIERS)
    def test_classifiers_return_logits(self, name):
        model = models.build_model(name, (32, 32, 3), 7, seed=0)
        self.assertEqual(model.output.shape, (None, 7))
        head = model.layers[-1]
        self.assertIsInstance(head, keras.layers.Dense)
        self.assertEqual(head.activation.__name__, "linear")

    @parameterized.parameters(*models.MODEL_NAMES)
    def test_same_seed_same_weights_other_seed_different(self, name):
        first = models.build_model(name, (28, 28, 1), 10, seed=3).get_weights()
        again = models.build_model(name, (28, 28, 1), 10, seed=3).get_weights()
        other = models.build_model(name, (28, 28, 1), 10, seed=4).get_weights()
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
        self.assertFalse(all(np.array_equal(a, b) for a, b in zip(first, other)))

    @parameterized.parameters(*models.MODEL_NAMES)
    def test_weighted_layers_have_the_same_names_in_every_build(self, name):
        # K-FAC's saved state is keyed by layer name: a resume in a process that built
        # other models first must find the same names (Keras numbers unnamed layers).
        def names():
            return [layer.name for layer in keras_integration.leaf_layers(
                models.build_model(name, (28, 28, 1), 10, seed=0)).values() if layer.weights]

        first = names()
        keras.layers.Dense(3)  # another unnamed layer in this process
        self.assertEqual(names(), first)

    @parameterized.parameters("mixed_float16", "mixed_bfloat16")
    def test_outputs_are_float32_under_mixed_precision(self, policy):
        keras.mixed_precision.set_global_policy(policy)
        for name in models.MODEL_NAMES:
            model = models.build_model(name, (28, 28, 1), 10, seed=0)
            self.assertEqual(model.output.dtype, "float32", name)
            self.assertEqual(model.layers[1].compute_dtype, policy.split("_")[1], name)

    def test_unknown_name_lists_allowed(self):
        with self.assertRaisesRegex(ValueError, "model must be one of mlp, cnn, resnet20, "
                                                "vit, autoencoder; got 'vgg'"):
            models.build_model("vgg", (28, 28, 1), 10)

    def test_bad_shapes(self):
        with self.assertRaisesRegex(ValueError, "input_shape"):
            models.build_model("cnn", (28, 28), 10)
        with self.assertRaisesRegex(ValueError, "num_classes"):
            models.build_model("cnn", (28, 28, 1), 1)


if __name__ == "__main__":
    absltest.main()
