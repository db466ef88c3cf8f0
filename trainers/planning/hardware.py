"""Device and network profiles: what a phase's kernels cost, and what a byte costs.

A phase's time is its floor (`Kernel.seconds`, tfkfac/costs.py: products and elementwise
work at the roofline, decompositions at an effective rate) divided by the fraction of the
floor a real step achieves. Every number is either measured on this machine by the
project's benchmarks or published, and each profile names its sources:

- "local": this machine. Rates from bench/results/step_floor.json (matmul, bandwidth,
  LAPACK eigh and Cholesky inverse, measured by bench/linalg_benchmark.py's `rates()`);
  fractions per phase from the same run's measured phases against their floors (the
  planned model's own row when step_floor measured it, else the median of its models);
  ranks on this machine share its cores. Collectives: bench/results/loopback.json
  (2-rank Gloo allreduce timed by bench/plan_validation.py).
- GPUs ("v100", "a100-40gb", "a100-80gb", "h100", "h200"): the peaks, memory and
  NVLink of NVIDIA's datasheets (`GpuSpec`). A forward/backward takes the device's own
  floor (its Tensor Core rate and memory bandwidth) divided by the fraction of the floor
  NVIDIA's published single-GPU ResNet-50 training throughput achieves
  (DeepLearningExamples): measured on V100 and A100 40 GB; A100 80 GB, H100 and H200,
  absent from that README, take A100 40 GB's fraction (an estimate). K-FAC's own
  phases (a few large float32 GEMMs, streaming updates) run at their roofline, a lower
  bound that the validation measures. Decomposition rates come from the papers' own
  measurements on V100 (Pauloski et al. 2020 Table V for eigh, Ueno et al. 2020 §3.3.1
  for the Cholesky inverse), scaled to the other GPUs by memory bandwidth (eigh) and
  FP32 peak (Cholesky), with V100's per-call latencies (an estimate). Every output lists
  the sources and, separately, the estimates.
"""

import dataclasses
import functools
import json
import os
import statistics

from trainers.planning import floor_model
from trainers.planning import collectives, workloads

RESULTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench", "results")
STEP_FLOOR_JSON = os.path.join(RESULTS_DIR, "step_floor.json")
LOOPBACK_JSON = os.path.join(RESULTS_DIR, "loopback.json")
# Phases whose time is a fraction of their floor; "sgd" is SGD's forward/backward + update.
PHASES = ("sgd", "forward_backward", "factor_statistics", "decomposition", "preconditioning",
          "update")
# bench/step_floor.py's phase names for the same work.
STEP_FLOOR_PHASES = {"forward_backward": "forward_backward", "factor_statistics": "factors",
                     "decomposition": "decomposition", "preconditioning": "precondition",
                     "update": "update"}


@dataclasses.dataclass(frozen=True)
class Device:
    """A worker's rates (FLOP/s per precision of the forward/backward, bytes/s, LAPACK-
    style decomposition FLOP/s at the floor's nominal counts) and the fraction of its floor
    each phase achieves. `cores`: ranks on this machine share it and its `memory` (bytes;
    the local profile). `estimates`: the figures that are not published for this device
    and how they were derived (every output lists them)."""

    name: str
    matmul: dict
    bandwidth: float
    eigh: float
    cholesky_inverse: float
    fractions: dict
    intra_node: collectives.Link
    sources: tuple
    cores: int = 0
    decomposition_latency: dict = dataclasses.field(default_factory=dict)
    memory: float = None
    estimates: tuple = ()
    # The share of an overlappable collective that running it beside computation hides
    # (`overlap_reduction`). None in any profile: the two contend for the same device.
    # On V100s NCCL's reduction ran on the streaming multiprocessors the backward pass
    # needed, and the overlapped step was slower (Ueno et al. 2020 §4.1: 182 to 221 ms);
    # on this machine's 2 CPU ranks tfkfac's overlap was slower in 3 of 4 configurations
    # (docs/benchmarks.md, "Distributed").
    overlap_hides: float = 0.0
    # What running a collective beside computation costs the computation, as a share of
    # the overlapped time: NCCL's kernel holds one streaming multiprocessor per channel
    # for as long as it runs, so the computation beside it has sms - channels of them,
    # channels / (sms - channels) slower (Ueno et al. 2020 §4.1: NCCL used 4 rings, and
    # the backward pass beside it slowed). 0 where nothing is taken (this machine).
    overlap_slows: float = 0.0

    def seconds(self, kernels, phase, precision="float32", ranks=1):
        """Time of `kernels` in `phase` on one of `ranks` workers; a decomposition call
        also costs its latency (`decomposition_latency` by kind)."""
        share = 1.0 / ranks if self.cores else 1.0
        rates = {"matmul": self.matmul[precision] * share, "bandwidth": self.bandwidth * share,
                 "eigh": self.eigh * share, "cholesky_inverse": self.cholesky_inverse * share}
        latency = sum(self.decomposition_latency.get(k.kind, 0.0) for k in kernels)
        return (floor_model.floor_seconds(kernels, rates) / self.fractions[phase][precision]
                + latency)

    def max_ranks(self):
        return self.cores or None

    def memory_per_worker(self, ranks):
        """Bytes one of `ranks` workers may use (None: not known)."""
        if self.memory is None:
            return None
        return self.memory / ranks if self.cores else self.memory


@dataclasses.dataclass(frozen=True)
class Network:
    """A network link class and the base latency of a collective over it."""

    name: str
    link: collectives.Link
    sources: tuple
    base_latency: float = 0.0


# NCCL's tuner (NVIDIA/nccl src/graph/tuning.cc at 01afd20a, Simple protocol): latency of
# one ring step and one tree level over the network and over NVLink, and a collective's
# base latency.
NCCL_SOURCE = "NCCL src/graph/tuning.cc (01afd20a), Simple protocol latencies"
NCCL_BASE_LATENCY = 8.4e-6
NET_RING_STEP, NET_TREE_LEVEL = 9.6e-6, 50e-6
NVLINK_RING_STEP, NVLINK_TREE_LEVEL = 3.4e-6, 28e-6


def _nccl_network(name, bandwidth, source):
    return Network(name, collectives.Link(bandwidth, NET_RING_STEP, NET_TREE_LEVEL),
                   (source, NCCL_SOURCE), NCCL_BASE_LATENCY)


IBTA = "(InfiniBand Trade Association roadmap)"
NETWORKS = {net.name: net for net in (
    _nccl_network("ib-edr", 12.5e9, f"InfiniBand EDR 4x: 100 Gb/s per direction {IBTA}"),
    _nccl_network("ib-hdr", 25e9, f"InfiniBand HDR 4x: 200 Gb/s per direction {IBTA}"),
    _nccl_network("ib-ndr", 50e9, f"InfiniBand NDR 4x: 400 Gb/s per direction {IBTA}"),
    _nccl_network("eth-10g", 1.25e9, "10 Gb/s Ethernet (IEEE 802.3ae); the TCP stack's own "
                  "latency is not modelled"),
    _nccl_network("eth-100g", 12.5e9, "100 Gb/s Ethernet (IEEE 802.3ba); the TCP stack's own "
                  "latency is not modelled"),
)}


def network(name):
    """The network profile `name` (any case)."""
    name = name.lower()
    if name == "loopback":
        return Network("loopback", loopback_link(), (f"measured: {LOOPBACK_JSON}",))
    if name not in NETWORKS:
        raise ValueError(f"--network must be one of {', '.join(network_names())}; "
                         f"got {name!r}")
    return NETWORKS[name]


def network_names():
    return sorted(NETWORKS) + ["loopback"]


# --------------------------------------------------------------------------- GPUs
@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU's published figures, from `datasheet`: dense peaks in FLOP/s (None where
    the GPU has no such Tensor Core mode), memory in bytes and bytes/s, NVLink in bytes/s
    one way, streaming multiprocessors (`sms`, the architecture's whitepaper). `reference`: {precision: (batch, images/s)} of ResNet-50 training on one such
    GPU, from which its forward/backward's achieved fraction of the floor is taken; without
    one, `calibrated_on` names the profile whose fraction it takes (an estimate)."""

    datasheet: str
    fp16: float
    bf16: float
    tf32: float
    fp32: float
    memory: float
    bandwidth: float
    nvlink: float
    sms: int
    reference: dict = None
    calibrated_on: str = None

    @property
    def matmul(self):
        """Rates of the forward/backward's products: float32 on TF32 Tensor Cores where
        the GPU has them (TensorFlow's default), mixed precision in float16."""
        return {"float32": self.tf32 or self.fp32, "mixed": self.fp16}

    def figures(self):
        tera = lambda rate: "-" if rate is None else f"{rate / 1e12:g}"
        return (f"{self.datasheet}: dense FP16 {tera(self.fp16)}, BF16 {tera(self.bf16)}, "
                f"TF32 {tera(self.tf32)}, FP32 {tera(self.fp32)} TFLOP/s; "
                f"{self.memory / 1e9:g} GB at {self.bandwidth / 1e9:g} GB/s; NVLink "
                f"{2 * self.nvlink / 1e9:g} GB/s both directions; {self.sms} SMs")


V100_EIGH_SOURCE = (
    "eigh: 99.4 ms per call + 9n³ at 0.688 TFLOP/s, fitted to Pauloski et al. SC'20 Table V "
    "(ResNet-50, slowest worker's eigendecompositions on 16 and 64 V100s: 2256.64 and "
    "1497.96 ms under kfac_pytorch's round-robin; PyTorch 1.1's symeig); "
    "bench/plan_validation.py fits it and checks it on Table V's ResNet-101 and ResNet-152 "
    "rows")
V100_CHOLESKY_SOURCE = (
    "Cholesky inverse: 2.38 ms per call + n³ at 3.14 TFLOP/s, solved from Ueno et al. "
    "KDD'20 §3.3.1 (ResNet-34 on one V100: all factors 384 ms, its largest layer, factors "
    "4608 and 512, about 36 ms); bench/plan_validation.py solves it, its ResNet-50 rows "
    "check it")
# NCCL's channels (rings) beside a backward pass on a node of 4 V100s and InfiniBand:
# Ueno et al. 2020 §4.1 ("NCCL automatically uses four rings").
NCCL_CHANNELS = 4
NVIDIA_RESNET50 = ("forward/backward fraction: NVIDIA DeepLearningExamples TensorFlow "
                   "ResNet-50 v1.5 README (1d4211fe), one GPU, XLA")
# bench/plan_validation.py derives these four from the papers' figures and prints them.
V100_EIGH, V100_EIGH_LATENCY = 0.688e12, 99.4e-3
V100_CHOLESKY, V100_CHOLESKY_LATENCY = 3.14e12, 2.38e-3
# Dense peaks: the H100 and H200 datasheets give Tensor Core rates with sparsity, twice
# the dense ones (their footnote); the figures below are half of theirs.
V100 = GpuSpec(
    "NVIDIA Tesla V100 GPU Accelerator datasheet (SXM2 16 GB)", fp16=125e12, bf16=None,
    tf32=None, fp32=15.7e12, memory=16e9, bandwidth=900e9, nvlink=150e9, sms=80,
    reference={"float32": (128, 412.0), "mixed": (256, 1270.0)})
A100_40GB = GpuSpec(
    "NVIDIA A100 Tensor Core GPU datasheet (SXM4 40 GB)", fp16=312e12, bf16=312e12,
    tf32=156e12, fp32=19.5e12, memory=40e9, bandwidth=1555e9, nvlink=300e9, sms=108,
    reference={"float32": (256, 909.0), "mixed": (256, 2375.0)})
A100_80GB = dataclasses.replace(
    A100_40GB, datasheet="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80 GB)", memory=80e9,
    bandwidth=2039e9, reference=None, calibrated_on="a100-40gb")
H100 = GpuSpec(
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5 80 GB)", fp16=989.5e12, bf16=989.5e12,
    tf32=494.5e12, fp32=67e12, memory=80e9, bandwidth=3350e9, nvlink=450e9, sms=132,
    calibrated_on="a100-40gb")
H200 = dataclasses.replace(
    H100, datasheet="NVIDIA H200 Tensor Core GPU datasheet (SXM 141 GB)", memory=141e9,
    bandwidth=4800e9)
GPUS = {"v100": V100, "a100-40gb": A100_40GB, "a100-80gb": A100_80GB, "h100": H100,
        "h200": H200}


def device_names():
    return sorted(GPUS) + ["local"]


def device(name, model_name=None):
    """The profile `name` (any case); the local one is calibrated on `model_name` when
    step_floor measured it."""
    name = name.lower()
    if name == "local":
        return _local(model_name)
    if name not in GPUS:
        raise ValueError(f"--device must be one of {', '.join(device_names())}; got {name!r}")
    spec = GPUS[name]
    measured = GPUS[spec.calibrated_on] if spec.calibrated_on else spec
    fractions = _measured_fractions(measured)
    sources = [spec.figures(), NVIDIA_RESNET50 + ": " + ", ".join(
        f"{spec.calibrated_on or name} {p} {images:g} img/s at batch {batch}"
        for p, (batch, images) in sorted(measured.reference.items())),
        V100_EIGH_SOURCE, V100_CHOLESKY_SOURCE, NCCL_SOURCE]
    estimates = []
    if spec.calibrated_on:
        known = [_measured_fractions(gpu) for gpu in GPUS.values() if gpu.reference]
        spans = ", ".join(f"{min(f[p] for f in known):.2f}-{max(f[p] for f in known):.2f} "
                          f"{p}" for p in ("float32", "mixed"))
        estimates.append(
            f"forward/backward on {name}: {spec.calibrated_on}'s achieved fraction of its "
            f"floor ({fractions['float32']:.2f} float32, {fractions['mixed']:.2f} mixed) "
            f"applied to {name}'s own floor; that README has no {name} figure; range "
            f"assumed: the measured GPUs' fractions, {spans}")
    if spec is not V100:
        estimates.append(
            f"decompositions on {name}: V100's eigh rate scaled by memory bandwidth "
            f"({spec.bandwidth / V100.bandwidth:.2f}x) and its Cholesky-inverse rate by FP32 "
            f"peak ({spec.fp32 / V100.fp32:.2f}x), V100's per-call latencies kept "
            f"({V100_EIGH_LATENCY * 1e3:g} and {V100_CHOLESKY_LATENCY * 1e3:g} ms); no "
            f"published decomposition timing for {name}; range assumed: from V100's rates "
            f"(1x) to those scaled ones")
        estimates.append(
            f"overlap on {name}: NCCL's {NCCL_CHANNELS} channels beside the computation, as "
            f"on Ueno et al.'s V100 nodes, slow it {NCCL_CHANNELS / (spec.sms - NCCL_CHANNELS):.1%}"
            f"; range assumed: 2-16 channels (NCCL's choice by topology), "
            f"{2 / (spec.sms - 2):.1%}-{16 / (spec.sms - 16):.1%}")
    return Device(
        name=name, matmul=spec.matmul, bandwidth=spec.bandwidth,
        eigh=V100_EIGH * spec.bandwidth / V100.bandwidth,
        cholesky_inverse=V100_CHOLESKY * spec.fp32 / V100.fp32,
        fractions={phase: (dict(fractions) if phase in ("sgd", "forward_backward")
                           else {"float32": 1.0, "mixed": 1.0}) for phase in PHASES},
        intra_node=collectives.Link(spec.nvlink, NVLINK_RING_STEP, NVLINK_TREE_LEVEL),
        sources=tuple(sources), memory=spec.memory, estimates=tuple(estimates),
        overlap_slows=NCCL_CHANNELS / (spec.sms - NCCL_CHANNELS),
        decomposition_latency={"eigh": V100_EIGH_LATENCY,
                               "cholesky_inverse": V100_CHOLESKY_LATENCY})


def _measured_fractions(spec):
    """{precision: the achieved fraction of its floor} of a GPU with a `reference`."""
    return _gpu_fractions(spec.matmul["float32"], spec.matmul["mixed"], spec.bandwidth,
                          tuple(sorted(spec.reference.items())))


@functools.lru_cache(maxsize=None)
def _gpu_fractions(float32_rate, mixed_rate, bandwidth, reference):
    """{precision: floor / measured} of ResNet-50's SGD step at the reference throughput."""
    fractions = {}
    for precision, (batch, images_per_second) in reference:
        work = workloads.named("resnet50").at_batch(batch)
        rate = {"float32": float32_rate, "mixed": mixed_rate}[precision]
        floor = floor_model.floor_seconds(
            work.forward_backward(precision) + work.update(),
            {"matmul": rate, "bandwidth": bandwidth})
        fractions[precision] = floor / (batch / images_per_second)
    return fractions


# ---------------------------------------------------------------- this machine
def _read(path, how):
    if not os.path.isfile(path):
        raise ValueError(f"device/network 'local'/'loopback' needs {path}: {how}")
    with open(path) as f:
        return json.load(f)


def loopback_link():
    """Collectives between ranks on this machine, measured (bench/plan_validation.py)."""
    fit = _read(LOOPBACK_JSON, "run bench/plan_validation.py --measure")["fit"]
    return collectives.Link(fit["bandwidth"], fit["ring_step_latency"], fit["ring_step_latency"])


def _local(model_name):
    report = _read(STEP_FLOOR_JSON, "run bench/step_floor.py")
    measured = report["models"]
    rows = [measured[model_name]] if model_name in measured else list(measured.values())
    ratios = {"sgd": [row["sgd"]["step"]["floor_s"] / row["sgd"]["step"]["measured_s"]
                      for row in rows]}
    for phase, name in STEP_FLOOR_PHASES.items():
        ratios[phase] = [method["phases"][name]["floor_s_per_step"]
                         / method["phases"][name]["measured_s_per_step"]
                         for row in rows for method in row["methods"].values()]
    fraction = {phase: statistics.median(values) for phase, values in ratios.items()}
    rates = report["rates"]
    calibrated_on = model_name if model_name in measured else "median of " + ", ".join(measured)
    return Device(
        name="local", matmul={"float32": rates["matmul"], "mixed": rates["matmul"]},
        bandwidth=rates["bandwidth"], eigh=rates["eigh"],
        cholesky_inverse=rates["cholesky_inverse"],
        fractions={phase: {"float32": f, "mixed": f} for phase, f in fraction.items()},
        intra_node=loopback_link() if os.path.isfile(LOOPBACK_JSON) else None,
        sources=(f"rates and phase fractions: {STEP_FLOOR_JSON} (library "
                 f"{report.get('library_commit')}, fractions of {calibrated_on})",
                 f"collectives: {LOOPBACK_JSON}",
                 "memory: this machine's physical memory (sysconf), shared by its ranks"),
        cores=report["machine"]["cpus"],
        memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
