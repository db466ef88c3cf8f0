"""The published measurements bench/plan_validation.py checks the planner against, each
with the table, figure or section it comes from, and the inputs derived from them.

kfac_pytorch's factor layout and its assignment of decompositions to workers are
re-implemented here because Pauloski et al.'s Table V times the slowest worker's
eigendecompositions under that round-robin: the V100 profile's eigh rate is fitted to its
ResNet-50 rows and checked on its ResNet-101 and ResNet-152 rows with the same assignment.
"""

# Ueno et al. 2020 (KDD'20), Table 1 (128 V100s, ResNet-50, 32 images per GPU; ms per
# step) and §3.2.4 (one GPU's throughput without communication, all SGD optimizations).
UENO = {"gpus": 128, "batch": 32, "sgd_ms": 57.0, "images_per_s_one_gpu": 744.8,
        "rows_ms": {"distributed inverse": 251.0, "+ symmetric": 199.0, "+ float21": 182.0,
                    "+ overlap": 221.0, "+ hierarchical": 192.0, "+ stale": 108.0}}
# An ABCI compute node (both papers' cluster): 4 V100s, 2 InfiniBand EDR links.
ABCI_GPUS_PER_NODE, ABCI_LINKS_PER_NODE = 4, 2
# Ueno et al. §3.3.1: ResNet-34's factors inverted in 384 ms on one V100, its largest
# layer (factors 4608 and 512) in about 36 ms.
UENO_CHOLESKY = {"all_factors_s": 0.384, "largest_layer_s": 0.036,
                 "largest_layer_dims": (4608, 512)}
# Ueno et al. Table 3: the 128-GPU run, 10,920 updates at a global batch of 4,096.
UENO_RUN = {"updates": 10920, "global_batch": 4096, "imagenet_examples": 1281167}


def forward_backward_ms(images_per_second, batch):
    """One GPU's step at `batch` from its throughput: what --forward_backward_ms takes."""
    return 1e3 * batch / images_per_second


# Osawa et al. 2019 §5.4: the factors are refreshed every step for the first 500
# iterations ("the FIM changes rapidly"), then at the interval of eq. 20.
OSAWA_EVERY_STEP_ITERATIONS = 500


def osawa_refresh_interval(run=UENO_RUN):
    """The mean refresh interval of Osawa et al. 2019's schedule over `run` (Ueno et al.'s
    128-GPU run by default): every step for its first 500 iterations, then eq. 20,
    min(20, 5·floor(e/5) + 1) at epoch e (factors refreshed on 1/interval of the steps):
    the published schedule nearest to the stale row's adaptive one. Steps over refreshes."""
    per_epoch = run["imagenet_examples"] / run["global_batch"]
    warm = min(run["updates"], OSAWA_EVERY_STEP_ITERATIONS)
    refreshed = float(warm)
    for e in range(int(run["updates"] / per_epoch) + 1):  # eq. 20 over each epoch's rest
        start, end = max(e * per_epoch, warm), min((e + 1) * per_epoch, run["updates"])
        refreshed += max(0.0, end - start) / min(20, 5 * (e // 5) + 1)
    return run["updates"] / refreshed


# Pauloski et al. 2020 (SC'20): Table IV (K-FAC-opt's improvement over SGD in time to
# solution, 55 vs 90 epochs), Table V (ms per K-FAC update: factor computation and
# communication, eigendecomposition computation and communication; ResNet-50, -101, -152),
# §VI-C3 intervals (2000 iterations between eigendecompositions on 16 GPUs, scaled with
# the batch; factors 10x as often). Frontera's GPU nodes: 4 V100s, one InfiniBand EDR link.
PAULOSKI = {
    "gpus": (16, 32, 64, 128, 256),
    "improvement": {"resnet50": (0.209, 0.197, 0.252, 0.235, 0.177),
                    "resnet101": (0.184, 0.111, 0.151, 0.195, 0.097),
                    "resnet152": (0.082, 0.076, 0.060, 0.049, -0.111)},
    "epochs": (55, 90),
    "eigen_interval_16": 2000, "factor_per_eigen": 10,
    "table_v_eigen_ms": {"resnet50": {16: 2256.64, 32: 1668.19, 64: 1497.96},
                         "resnet101": {16: 3271.72, 32: 2280.38, 64: 2410.24},
                         "resnet152": {16: 4067.69, 32: 2758.42, 64: 2212.24}},
    # Table V's factor computation (T_comp of "Factor") and communication: the factors'
    # (T_comm of "Factor") and the eigendecompositions' (T_comm of "Eigen
    # Decomposition"), ms per K-FAC update.
    "table_v_factor_comp_ms": {"resnet50": {16: 36.83, 32: 43.30, 64: 44.90},
                               "resnet101": {16: 125.23, 32: 126.14, 64: 126.95},
                               "resnet152": {16: 218.36, 32: 219.00, 64: 219.12}},
    "table_v_factor_comm_ms": {"resnet50": {16: 155.79, 32: 171.57, 64: 154.63},
                               "resnet101": {16: 224.15, 32: 267.08, 64: 239.33},
                               "resnet152": {16: 276.83, 32: 313.17, 64: 312.52}},
    "table_v_eigen_comm_ms": {"resnet50": {16: 117.28, 32: 149.60, 64: 142.93},
                              "resnet101": {16: 199.69, 32: 265.57, 64: 253.23},
                              "resnet152": {16: 279.08, 32: 329.05, 64: 347.99}}}
FRONTERA_GPUS_PER_NODE = 4


def pauloski_ratio(gpus, model="resnet50"):
    """K-FAC's step over SGD's in Table IV: time to solution (1 - improvement) over the
    epochs' ratio (55 / 90)."""
    kfac_epochs, sgd_epochs = PAULOSKI["epochs"]
    improvement = PAULOSKI["improvement"][model][PAULOSKI["gpus"].index(gpus)]
    return (1 - improvement) * sgd_epochs / kfac_epochs


def pauloski_intervals(gpus):
    """(factor, eigendecomposition) intervals on `gpus` (§VI-C3), each rounded to an
    integer the library accepts (the decomposition interval a multiple of the factor's)."""
    eigen = PAULOSKI["eigen_interval_16"] * 16 / gpus
    factor = int(eigen / PAULOSKI["factor_per_eigen"])
    return factor, factor * int(eigen // factor)


# Osawa et al. 2019 (CVPR'19): Figure 4 (factor data of ResNet-50: 587 MiB with
# BatchNorm's diagonal Fisher), §5.2 (64 GPUs 131.1% faster per iteration than 1).
# Table 2: 1024 V100s, 32,768 a step, 1,760 iterations in 10 minutes (a validation
# after each of the 45 epochs included), the stale factors of §4 (eq. 20).
OSAWA = {"mib_diagonal_bn": 587.0, "speedup_64": 2.311,
         "run_1024": {"gpus": 1024, "updates": 1760, "global_batch": 32768,
                      "imagenet_examples": 1281167, "minutes": 10.0}}


def osawa_1024_step_ms():
    """Osawa et al.'s step on 1024 GPUs: 10 minutes over 1,760 iterations."""
    run = OSAWA["run_1024"]
    return run["minutes"] * 60e3 / run["updates"]


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
