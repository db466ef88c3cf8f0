"""Kronecker-factor sizes of ResNets, in layer order [A_1, G_1, A_2, G_2, ...].

A conv layer (kh, kw, c_in -> c_out) has A of size kh*kw*c_in (+1 with a bias) and G of
size c_out; a dense layer d_in -> d_out has A of size d_in (+1) and G of size d_out.
"""


def resnet20_factor_dims():
    """CIFAR ResNet-20 (He et al. 2016), convs without bias, 1x1 projection shortcuts."""
    layers = [(3, 3, 16, False)]
    c_in = 16
    for width in (16, 32, 64):
        for block in range(3):
            layers.append((3, c_in, width, False))
            layers.append((3, width, width, False))
            if c_in != width:
                layers.append((1, c_in, width, False))
            c_in = width
    return _factor_dims(layers) + [64 + 1, 10]


def resnet50_factor_dims():
    """ImageNet ResNet-50 as in keras.applications: bottleneck blocks, convs with bias."""
    layers = [(7, 3, 64, True)]
    c_in = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            if block == 0:
                layers.append((1, c_in, 4 * width, True))
            layers.append((1, c_in, width, True))
            layers.append((3, width, width, True))
            layers.append((1, width, 4 * width, True))
            c_in = 4 * width
    return _factor_dims(layers) + [2048 + 1, 1000]


def _factor_dims(layers):
    dims = []
    for kernel, c_in, c_out, bias in layers:
        dims += [kernel * kernel * c_in + int(bias), c_out]
    return dims
