"""Models the trainer and the benchmarks train.

Only Dense, Conv2D and BatchNormalization carry weights, so K-FAC manages every
parameter; pooling, activations, flatten and add have none. Classifiers return float32
logits (losses use `from_logits=True`); the autoencoder returns float32 sigmoid
probabilities. Every initializer gets its own seed derived from `seed`, so a model is a
pure function of its arguments and does not depend on global random state.
"""

import keras

CLASSIFIERS = ("mlp", "cnn", "resnet20")
AUTOENCODERS = ("autoencoder",)
MODEL_NAMES = CLASSIFIERS + AUTOENCODERS

# Martens & Grosse (2015), after Hinton & Salakhutdinov (2006).
AUTOENCODER_WIDTHS = (1000, 500, 250, 30, 250, 500, 1000)
AUTOENCODER_CODE_WIDTH = 30


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


def _mlp(x, seeds):
    x = keras.layers.Flatten()(x)
    for width in (256, 256):
        x = keras.layers.Dense(width, activation="relu", kernel_initializer=seeds.he())(x)
    return x


def _cnn(x, seeds):
    for filters in (32, 64):
        x = keras.layers.Conv2D(filters, 3, activation="relu", kernel_initializer=seeds.he())(x)
        x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.Flatten()(x)
    return keras.layers.Dense(128, activation="relu", kernel_initializer=seeds.he())(x)


def _conv_bn(x, filters, seeds, strides=1, kernel_size=3, relu=True):
    x = keras.layers.Conv2D(
        filters, kernel_size, strides=strides, padding="same", use_bias=False,
        kernel_initializer=seeds.he(),
    )(x)
    x = keras.layers.BatchNormalization()(x)
    return keras.layers.Activation("relu")(x) if relu else x


def _resnet20(x, seeds):
    """He et al. (2016) CIFAR ResNet-20: 3 stages x 3 basic blocks, 16/32/64 filters.

    Down-sampling shortcuts are 1x1 convolutions with BatchNorm (option B), so they carry
    K-FAC-managed weights instead of a weightless zero-padding trick. Inputs of 28x28 end
    in 7x7 maps, 32x32 in 8x8; global average pooling removes the difference.
    """
    x = _conv_bn(x, 16, seeds)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(3):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            if strides != 1 or shortcut.shape[-1] != filters:
                shortcut = _conv_bn(x, filters, seeds, strides=strides, kernel_size=1, relu=False)
            y = _conv_bn(x, filters, seeds, strides=strides)
            y = _conv_bn(y, filters, seeds, relu=False)
            x = keras.layers.Activation("relu")(keras.layers.Add()([shortcut, y]))
    return keras.layers.GlobalAveragePooling2D()(x)


def _autoencoder(x, seeds):
    """784-1000-500-250-30-250-500-1000-784, sigmoid units, linear 30-unit code layer."""
    flat_size = x.shape[1] * x.shape[2] * x.shape[3]
    x = keras.layers.Flatten(name="flat_image")(x)
    for width in AUTOENCODER_WIDTHS:
        activation = None if width == AUTOENCODER_CODE_WIDTH else "sigmoid"
        x = keras.layers.Dense(width, activation=activation, kernel_initializer=seeds.glorot())(x)
    return keras.layers.Dense(
        flat_size, activation="sigmoid", kernel_initializer=seeds.glorot(), dtype="float32",
        name="reconstruction",
    )(x)
