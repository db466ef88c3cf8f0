"""A small image model holding one layer of every kind of modern architectures.

Shared by the 2-rank job (distributed_kfac_worker.py) and the single-process checks of
mixed precision and save/restore (test_kfac_modern_layers.py). On 28x28x1 inputs:
grouped Conv2D, DepthwiseConv2D, GroupNormalization, SeparableConv2D, Conv2DTranspose,
then the 6x6 feature map as a sequence of 36 tokens with a learned position Embedding,
LayerNormalization, self-attention (MultiHeadAttention: four EinsumDense projections),
a causal Conv1D, a Dense on the sequence and a Dense head.
"""

import keras
import tensorflow as tf

TOKENS, WIDTH = 36, 8

# Layer name -> block kind K-FAC must manage it with.
MANAGED_KINDS = {
    "stem": "conv2d", "grouped": "conv2d", "depthwise": "depthwise_conv",
    "separable": "separable_conv", "transpose": "conv_transpose",
    "position_embedding/positions": "embedding",
    "layer_norm": "layer_norm", "group_norm": "group_norm", "conv1d": "conv1d",
    "token_mlp": "dense", "logits": "dense", "attention/query": "einsum_dense",
    "attention/key": "einsum_dense", "attention/value": "einsum_dense",
    "attention/attention_output": "einsum_dense",
}


@keras.saving.register_keras_serializable(package="tfkfac_tests")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each token's position (an Embedding of the positions)."""

    def __init__(self, initializer="uniform", **kwargs):
        super().__init__(**kwargs)
        self.embedding = keras.layers.Embedding(TOKENS, WIDTH, name="positions",
                                                embeddings_initializer=initializer)

    def get_config(self):
        return {**super().get_config(), "initializer": keras.initializers.serialize(
            self.embedding.embeddings_initializer)}

    def call(self, tokens):
        positions = tf.broadcast_to(tf.range(TOKENS), tf.shape(tokens)[:2])
        return tokens + self.embedding(positions)


def modern_net(seed):
    seeds = iter(range(1000 * seed, 1000 * seed + 20))
    init = lambda: keras.initializers.GlorotUniform(next(seeds))
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(8, 3, strides=2, activation="relu", name="stem",
                            kernel_initializer=init())(inputs)                 # 13x13x8
    x = keras.layers.Conv2D(8, 3, padding="same", groups=2, name="grouped",
                            kernel_initializer=init())(x)
    x = keras.layers.DepthwiseConv2D(3, padding="same", activation="relu", name="depthwise",
                                     depthwise_initializer=init())(x)
    x = keras.layers.GroupNormalization(groups=2, name="group_norm")(x)
    x = keras.layers.SeparableConv2D(8, 3, strides=2, activation="relu", name="separable",
                                     depthwise_initializer=init(),
                                     pointwise_initializer=init())(x)           # 6x6x8
    x = keras.layers.Conv2DTranspose(WIDTH, 3, padding="same", name="transpose",
                                     kernel_initializer=init())(x)
    x = keras.layers.Reshape((TOKENS, WIDTH))(x)
    x = PositionEmbedding(init(), name="position_embedding")(x)
    x = keras.layers.LayerNormalization(name="layer_norm")(x)
    attention = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, name="attention",
                                                kernel_initializer=init())
    x = x + attention(x, x)
    x = keras.layers.Conv1D(WIDTH, 3, padding="causal", activation="relu", name="conv1d",
                            kernel_initializer=init())(x)
    x = keras.layers.Dense(16, activation="relu", name="token_mlp", kernel_initializer=init())(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(10, name="logits", kernel_initializer=init(),
                                 dtype="float32")(x)
    return keras.Model(inputs, outputs, name="modern_net")
