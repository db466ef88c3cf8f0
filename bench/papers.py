"""The published measurements bench/plan_validation.py checks the planner against, each
with the table, figure or section it comes from, and what of the systems behind them a
prediction needs.

kfac_pytorch's factor layout and its assignment of decompositions to workers are
re-implemented here because the figures depend on them: Pauloski et al.'s Table V times
the slowest worker's eigendecompositions and Table VI the slowest and fastest workers'
speed-ups under that round-robin, so predicting those tables needs the same assignment
(the library's LPT assignment would give each worker other factors), and the LPT check
sets the two side by side.
"""

# Ueno et al. 2020 (KDD'20), Table 1 (128 V100s, ResNet-50, 32 images per GPU; ms per
# step) and §3.2.4 (one GPU's throughput).
UENO = {"gpus": 128, "batch": 32, "sgd_ms": 57.0, "images_per_s_one_gpu": 744.8,
        "rows_ms": {"distributed inverse": 251.0, "+ symmetric": 199.0, "+ float21": 182.0,
                    "+ overlap": 221.0, "+ hierarchical": 192.0, "+ stale": 108.0}}
ABCI_GPUS_PER_NODE = 4  # ABCI compute node: 4 V100s, 2 InfiniBand EDR links
FLOAT21_BYTES = 8 / 3  # three 21-bit values in 64 bits (Ueno et al. Figure 7)
# Ueno et al. §3.3.1: ResNet-34's factors inverted in 384 ms on one V100, its largest
# layer (factors 4608 and 512) in about 36 ms.
UENO_CHOLESKY = {"all_factors_s": 0.384, "largest_layer_s": 0.036,
                 "largest_layer_dims": (4608, 512)}
OSAWA_STALE_INTERVAL = 20  # Osawa et al. 2019 eq. 20's largest interval

# Pauloski et al. 2020 (SC'20): Table IV (K-FAC-opt's improvement over SGD in time to
# solution, 55 vs 90 epochs), Table V (ms per K-FAC update: factor computation and
# communication, eigendecomposition computation and communication), Table VI (slowest and
# fastest worker's eigendecomposition speed-up over 16 GPUs), §VI-C2 Table III (SGD 178
# min for 90 epochs on 64 GPUs at 32 per GPU), §VI-C3 intervals (2000 iterations between
# eigendecompositions on 16 GPUs, scaled with the batch; factors 10x as often).
PAULOSKI = {
    "gpus": (16, 32, 64, 128, 256), "batch": 32,
    "improvement": (0.209, 0.197, 0.252, 0.235, 0.177), "epochs": (55, 90),
    "sgd_minutes_64": 178.0, "imagenet_examples": 1281167,
    "eigen_interval_16": 2000, "factor_per_eigen": 10,
    "table_v": {16: (36.83, 155.79, 2256.64, 117.28), 32: (43.30, 171.57, 1668.19, 149.60),
                64: (44.90, 154.63, 1497.96, 142.93)},
    "table_vi": {32: (1.34, 2.88), 64: (1.55, 6.61)},
    "parameters_per_worker": {16: (1.46e6, 2.83e7), 64: (1.64e4, 2.26e7)}}
FRONTERA_GPUS_PER_NODE = 4  # Frontera's GPU nodes: 4 V100s, InfiniBand EDR

# Osawa et al. 2019 (CVPR'19): Figure 4 (factor data of ResNet-50: 1017 MiB with
# BatchNorm's full Fisher, 587 MiB with its diagonal), §5.2 (64 GPUs 131.1% faster per
# iteration than 1).
OSAWA = {"mib_full_bn": 1017.0, "mib_diagonal_bn": 587.0, "speedup_64": 2.311}

# An outside estimate of where keras ResNet50's decompositions stop speeding up: the
# bound (total / largest factor) and the rank count it said LPT reaches it at
# (docs/planner.md, "The one-factor bound").
LPT_OUTSIDE_ESTIMATE = {"bound": 4.63, "saturation_ranks": 16}


def torchvision_order(blocks):
    """The Kronecker blocks of keras ResNet50 in torchvision's module order: a first
    bottleneck's projection (keras `_0_conv`, built before `_1_conv`) after `_3_conv`."""
    from tfkfac.blocks import KroneckerBlock

    ordered, projection = [], None
    for block in (b for b in blocks if isinstance(b, KroneckerBlock)):
        if block.path.endswith("_0_conv"):
            projection = block
            continue
        ordered.append(block)
        if projection is not None and block.path.endswith("_3_conv"):
            ordered.append(projection)
            projection = None
    return ordered


def kfac_pytorch_factor_dims(blocks):
    """[A, G] dims per layer as kfac_pytorch (SC'20) keeps them: torchvision's
    convolutions have no bias, so A is kh·kw·c_in; the Linear layer's A has the bias row."""
    from tfkfac.blocks import ConvBlock

    return [n for block in blocks
            for n in (block.in_dim if isinstance(block, ConvBlock) else block.a_dim,
                      block.out_dim)]


def kfac_pytorch_owners(layers, size):
    """kfac_pytorch's round-robin (kfac_preconditioner.py, SC'20): ranks cycle over the
    layers in module order; A and G of a layer on one rank unless there are more ranks
    than layers, then each factor on the next rank."""
    distribute = size > layers
    owners, rank = [], 0
    for _ in range(layers):
        a = rank % size
        rank += 1
        g = rank % size if distribute else a
        rank += 1 if distribute else 0
        owners += [a, g]
    return owners


def resnet34_factor_dims():
    """ResNet-34 as Ueno et al. train it (torchvision's layout: convolutions without bias,
    1x1 projections, a Linear head with bias): [A, G] per layer."""
    layers, c_in = [(7, 3, 64)], 64
    for width, count in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(count):
            layers += [(3, c_in, width), (3, width, width)]
            if block == 0 and c_in != width:
                layers.append((1, c_in, width))
            c_in = width
    return [n for k, i, o in layers for n in (k * k * i, o)] + [512 + 1, 1000]
