"""Models the trainer and the benchmarks train.

Every weight lives in a standard Keras layer, so K-FAC's per-layer blocks can find it:
Dense, Conv2D and BatchNormalization in the MLP, CNN, ResNet-20 and autoencoder; the ViT
adds Embedding (positions), LayerNormalization and MultiHeadAttention (whose weights are
in EinsumDense sublayers). Pooling, activations, reshapes and adds have none. Which of
these K-FAC preconditions is in docs/design.md; bench/coverage.py measures it.
Classifiers return float32 logits (losses use `from_logits=True`); the autoencoder
returns float32 sigmoid probabilities. Every initializer gets its own seed derived from
`seed`, so a model is a pure function of its arguments and does not depend on global
random state. Every layer is named, so the names (which K-FAC's saved state is keyed by)
are the same however many models the process built before.
"""

import keras

CLASSIFIERS = ("mlp", "cnn", "resnet20", "vit")
AUTOENCODERS = ("autoencoder",)
MODEL_NAMES = CLASSIFIERS + AUTOENCODERS

# Martens & Grosse (2015), after Hinton & Salakhutdinov (2006).
AUTOENCODER_WIDTHS = (1000, 500, 250, 30, 250, 500, 1000)
AUTOENCODER_CODE_WIDTH = 30

# The ViT scaled to 28x28 images on 2 CPU cores: 4x4 patches (49 tokens at 28x28),
# tokens of width 64 in 4 heads of 16, MLPs of width 128, 3 blocks.
VIT_PATCH_SIZE = 4
VIT_WIDTH = 64
VIT_HEADS = 4
VIT_MLP_WIDTH = 128
VIT_DEPTH = 3


def is_autoencoder(name):
    """True when `name` is a reconstruction model (target = input), not a classifier."""
    _check_name(name)
    return name in AUTOENCODERS


def build_model(name, input_shape, num_classes, seed=0):
    """Builds the model `name` for inputs of `input_shape` (H, W, C).

    `num_classes` sizes the classifier head; the autoencoder ignores it and reconstructs
    its flattened input.
    """
    _check_name(name)
    input_shape = tuple(int(d) for d in input_shape)
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise ValueError(f"input_shape must be (height, width, channels), got {input_shape}")
    if name in CLASSIFIERS and int(num_classes) < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    seeds = _SeedSequence(seed)
    inputs = keras.Input(shape=input_shape, name="image")
    builder = {
        "mlp": _mlp,
        "cnn": _cnn,
        "resnet20": _resnet20,
        "vit": _vit,
        "autoencoder": _autoencoder,
    }[name]
    if name in AUTOENCODERS:
        outputs = builder(inputs, seeds)
    else:
        features = builder(inputs, seeds)
        outputs = keras.layers.Dense(
            int(num_classes), kernel_initializer=seeds.glorot(), dtype="float32", name="logits"
        )(features)
    return keras.Model(inputs, outputs, name=name)


def _check_name(name):
    if name not in MODEL_NAMES:
        raise ValueError(f"model must be one of {', '.join(MODEL_NAMES)}; got {name!r}")


class _SeedSequence:
    """Hands out initializers with distinct, reproducible seeds."""

    def __init__(self, seed):
        self._next = int(seed) * 1000

    def _seed(self):
        self._next += 1
        return self._next

    def glorot(self):
        return keras.initializers.GlorotUniform(seed=self._seed())

    def he(self):
        return keras.initializers.HeNormal(seed=self._seed())

    def truncated_normal(self, stddev):
        return keras.initializers.TruncatedNormal(stddev=stddev, seed=self._seed())


def _mlp(x, seeds):
    x = keras.layers.Flatten(name="flat_image")(x)
    for i, width in enumerate((256, 256), 1):
        x = keras.layers.Dense(width, activation="relu", kernel_initializer=seeds.he(),
                               name=f"hidden_{i}")(x)
    return x


def _cnn(x, seeds):
    for i, filters in enumerate((32, 64), 1):
        x = keras.layers.Conv2D(filters, 3, activation="relu", kernel_initializer=seeds.he(),
                                name=f"conv_{i}")(x)
        x = keras.layers.MaxPooling2D(2, name=f"pool_{i}")(x)
    x = keras.layers.Flatten(name="flat_features")(x)
    return keras.layers.Dense(128, activation="relu", kernel_initializer=seeds.he(),
                              name="hidden")(x)


def _conv_bn(x, filters, seeds, name, strides=1, kernel_size=3, relu=True):
    x = keras.layers.Conv2D(
        filters, kernel_size, strides=strides, padding="same", use_bias=False,
        kernel_initializer=seeds.he(), name=f"{name}_conv",
    )(x)
    x = keras.layers.BatchNormalization(name=f"{name}_bn")(x)
    return keras.layers.Activation("relu", name=f"{name}_relu")(x) if relu else x


def _resnet20(x, seeds):
    """He et al. (2016) CIFAR ResNet-20: 3 stages x 3 basic blocks, 16/32/64 filters.

    Down-sampling shortcuts are 1x1 convolutions with BatchNorm (option B), so they carry
    K-FAC-managed weights instead of a weightless zero-padding trick. Inputs of 28x28 end
    in 7x7 maps, 32x32 in 8x8; global average pooling removes the difference.
    """
    x = _conv_bn(x, 16, seeds, "stem")
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            name = f"stage{stage + 1}_block{block + 1}"
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            if strides != 1 or shortcut.shape[-1] != filters:
                shortcut = _conv_bn(x, filters, seeds, f"{name}_shortcut", strides=strides,
                                    kernel_size=1, relu=False)
            y = _conv_bn(x, filters, seeds, f"{name}_a", strides=strides)
            y = _conv_bn(y, filters, seeds, f"{name}_b", relu=False)
            x = keras.layers.Activation("relu", name=f"{name}_out")(
                keras.layers.Add(name=f"{name}_add")([shortcut, y]))
    return keras.layers.GlobalAveragePooling2D(name="pool")(x)


def _vit(x, seeds):
    """Dosovitskiy et al. (2021) Vision Transformer, pre-norm, at the VIT_* sizes above.

    Patches are embedded by a Conv2D with kernel = stride = patch size (a Dense layer on
    each flattened patch), positions by an Embedding looked up with the token index, and
    the class comes from the mean token instead of a class token, so every weight sits
    in a standard Keras layer. Inputs whose sides are not multiples of the patch size
    lose the remainder.
    """
    patches = keras.layers.Conv2D(
        VIT_WIDTH, VIT_PATCH_SIZE, strides=VIT_PATCH_SIZE, kernel_initializer=seeds.glorot(),
        name="patch_embedding",
    )(x)
    num_tokens = patches.shape[1] * patches.shape[2]
    tokens = keras.layers.Reshape((num_tokens, VIT_WIDTH), name="tokens")(patches)
    # (batch, num_tokens) token indices, built from `tokens` so the lookup is in the graph.
    positions = keras.ops.zeros_like(tokens[:, :, 0], dtype="int32") + keras.ops.arange(
        num_tokens, dtype="int32")
    position_embedding = keras.layers.Embedding(
        num_tokens, VIT_WIDTH, embeddings_initializer=seeds.truncated_normal(0.02),
        name="position_embedding",
    )(positions)
    x = keras.layers.Add(name="add_positions")([tokens, position_embedding])
    for block in range(VIT_DEPTH):
        prefix = f"block{block}_"
        y = keras.layers.LayerNormalization(epsilon=1e-6, name=prefix + "attention_norm")(x)
        y = _self_attention(y, seeds, prefix + "attention")
        x = keras.layers.Add(name=prefix + "attention_residual")([x, y])
        y = keras.layers.LayerNormalization(epsilon=1e-6, name=prefix + "mlp_norm")(x)
        y = keras.layers.Dense(VIT_MLP_WIDTH, activation="gelu",
                               kernel_initializer=seeds.glorot(), name=prefix + "mlp_hidden")(y)
        y = keras.layers.Dense(VIT_WIDTH, kernel_initializer=seeds.glorot(),
                               name=prefix + "mlp_output")(y)
        x = keras.layers.Add(name=prefix + "mlp_residual")([x, y])
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="final_norm")(x)
    return keras.layers.GlobalAveragePooling1D(name="mean_token")(x)


def _self_attention(x, seeds, name):
    attention = keras.layers.MultiHeadAttention(
        VIT_HEADS, VIT_WIDTH // VIT_HEADS, kernel_initializer=seeds.glorot(), name=name)
    output = attention(x, x)
    # MultiHeadAttention clones its one initializer for every projection, so seeded query,
    # key and value kernels (all the same shape) would start equal: reseed each.
    for projection in (attention.query_dense, attention.key_dense, attention.value_dense):
        kernel = projection.kernel
        kernel.assign(seeds.glorot()(kernel.shape, dtype=kernel.dtype))
    return output


def _autoencoder(x, seeds):
    """784-1000-500-250-30-250-500-1000-784, sigmoid units, linear 30-unit code layer."""
    flat_size = x.shape[1] * x.shape[2] * x.shape[3]
    x = keras.layers.Flatten(name="flat_image")(x)
    for i, width in enumerate(AUTOENCODER_WIDTHS, 1):
        activation = None if width == AUTOENCODER_CODE_WIDTH else "sigmoid"
        x = keras.layers.Dense(width, activation=activation, kernel_initializer=seeds.glorot(),
                               name=f"layer_{i}")(x)
    return keras.layers.Dense(
        flat_size, activation="sigmoid", kernel_initializer=seeds.glorot(), dtype="float32",
        name="reconstruction",
    )(x)
