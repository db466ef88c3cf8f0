"""The phases of an SGD and a K-FAC step on p workers, and what each costs.

Per phase: its time on the slowest rank when it runs, how often it runs (factor phases
every factor interval, decomposition phases every decomposition interval, the rest every
step), and for collectives the bytes each rank hands to the communicator (its counters'
unit: the test checks them against a real 2-rank job). The work is the library's:
`Workload`'s kernels, `packing.packed_size` for the factor buffer, `placement.owners`
for who decomposes and who preconditions, the Horovod communicator's bfloat16 mean as an
allgather (`horovod_comm.GATHERED_MEAN_DTYPES`), a float21 mean as the reduce-scatter and
allgather of `Communicator.float21_mean`, wire bytes as `packing.wire_bytes` (float21:
three values to a 64-bit word) and, for the gather of preconditioned gradients with the
method's state (`EigenAdam`'s moments, sent bit-exactly), `exchange.gathered_bytes`. Not modelled: Horovod's negotiation, input pipelines.

The factor statistics read `factor_batch_fraction` of the batch in the blocks that take
that share (`BlockCost.statistics_kernels`); the sampled Fisher adds, on factor steps,
its second backward pass (SAMPLED_BACKWARD_SHARE of forward/backward). The settings no
`Configuration` field prices are named by `unpriced_settings`.

`overlap_reduction` runs factor reduction beside computation that does not read it: in
tfkfac (`collective` "allreduce") the preconditioning of the blocks whose method reads no
factors, at factor steps with no decomposition due (docs/design.md §6); in the papers'
system the A factors' ReduceScatterV beside the backward pass (Ueno et al. §3.3.4), taken
as BACKWARD_SHARE of the forward/backward. The two contend for the same device: what
that hides is the device's `overlap_hides` of it, nothing in any profile, and what it
costs the computation beside it is its `overlap_slows` of it (a GPU's backward pass
runs without the streaming multiprocessors NCCL's channels hold, Ueno et al. §4.1). `hierarchical_reduction` sums in two levels
(`collectives.hierarchical_allreduce`, `hierarchical_v`) every floating-point mean of
the K-FAC step (tfkfac: factors, gradients, metrics; allgathers stay flat) and, in the
papers' system, the V collectives.

`collective` "allreduce" is what tfkfac runs. "reduce_scatter_v" is the papers' system
(Osawa et al. CVPR'19 §3, Ueno et al. KDD'20 Algorithm 1), which tfkfac does not run: the
factors ReduceScatterV'd to their owners (under "owner" with the gradients, each block's
to its owner), the decompositions or preconditioned gradients AllGatherV'd from them;
what every rank needs (diagonal factors under "replicated", parameters without a block,
running statistics) still allreduced. "kfac_pytorch" is Pauloski et al.'s (SC'20), as
its code runs it: each factor allreduced whole (n² elements, not its triangle), and the
decompositions shared by an allreduce-sum of every factor's eigenvectors and eigenvalues,
zero on the ranks that do not own it (its `_allreduce_eigendecomp`, "to simulate an
allgather"): twice an allgather's bytes.
"""

import dataclasses
import typing

from tfkfac import config as config_lib, methods as methods_lib, placement as placement_lib
from tfkfac.config import KFACConfig
from tfkfac.distributed import exchange, packing
from tfkfac.distributed.horovod_comm import GATHERED_MEAN_DTYPES
from trainers.planning import floor_model
from trainers.planning import collectives

PHASES = ("forward_backward", "factor_statistics", "factor_reduction", "decomposition",
          "decomposition_sharing", "preconditioning", "preconditioned_sharing",
          "gradient_reduction", "update")
# The methods the planner prices by name; a `tfkfac.Method` object is priced by what it
# says its work costs (`Method.decomposition_kernels`, `Method.precondition_kernels`).
METHODS = methods_lib.NAMES
PLACEMENTS = placement_lib.PLACEMENTS
WIRE_DTYPES = tuple(d for d in packing.WIRE_DTYPES if d != "float64")  # float64: checks only
STATE_ITEMSIZE = 4  # float32 factors, decompositions and gradients
COLLECTIVES = ("allreduce", "reduce_scatter_v", "kfac_pytorch")
# The backward pass's share of forward/backward (twice the forward's products).
BACKWARD_SHARE = 2 / 3
# The sampled Fisher's second backward pass, on factor steps, from the predictions to the
# layer outputs: the backward pass without its weight gradients, half of its products.
SAMPLED_BACKWARD_SHARE = BACKWARD_SHARE / 2


_LIBRARY = KFACConfig()  # the library's defaults


@dataclasses.dataclass(frozen=True)
class Configuration:
    """The K-FAC settings the planner compares (tfkfac.KFAC's arguments of the same
    meaning, `LIBRARY_SETTINGS`); `method` a built-in's name or a `tfkfac.Method`."""

    placement: str = _LIBRARY.placement
    factor_wire: str = _LIBRARY.factor_wire_dtype
    decomposition_wire: str = _LIBRARY.decomposition_wire_dtype
    factor_interval: int = _LIBRARY.factor_update_freq
    decomposition_interval: int = _LIBRARY.decomposition_update_freq
    weight_sharing: str = _LIBRARY.weight_sharing
    method: typing.Any = _LIBRARY.method
    overlap_reduction: bool = _LIBRARY.overlap_reduction
    hierarchical_reduction: bool = _LIBRARY.hierarchical_reduction
    kl_clip: float = _LIBRARY.kl_clip  # None: no clip, so none of its cost
    factor_batch_fraction: float = _LIBRARY.factor_batch_fraction
    fisher: str = _LIBRARY.fisher

    def library_config(self):
        """The `tfkfac.KFACConfig` of these settings; a ValueError when the library
        refuses them (e.g. a decomposition interval not a multiple of the factor one)."""
        return KFACConfig(**{setting: getattr(self, field)
                             for field, setting in LIBRARY_SETTINGS.items()})

    def preconditioning_method(self):
        """The `tfkfac.Method` whose work is priced."""
        return floor_model.as_method(self.method)

    def label(self):
        options = "".join(f" {name}" for name, on in (
            ("overlap", self.overlap_reduction),
            ("hierarchical", self.hierarchical_reduction),
            (f"kl_clip={self.kl_clip}", self.kl_clip is not None),
            (f"fraction={self.factor_batch_fraction}", self.factor_batch_fraction != 1),
            (f"fisher={self.fisher}", self.fisher != _LIBRARY.fisher)) if on)
        return (f"{self.placement} {self.factor_wire}/{self.decomposition_wire} "
                f"f={self.factor_interval} d={self.decomposition_interval} "
                f"{self.weight_sharing} {self.method}{options}")


# `Configuration`'s fields, as the `tfkfac.KFACConfig` settings they are.
LIBRARY_SETTINGS = {
    "placement": "placement", "factor_wire": "factor_wire_dtype",
    "decomposition_wire": "decomposition_wire_dtype", "factor_interval": "factor_update_freq",
    "decomposition_interval": "decomposition_update_freq", "weight_sharing": "weight_sharing",
    "method": "method", "overlap_reduction": "overlap_reduction",
    "hierarchical_reduction": "hierarchical_reduction", "kl_clip": "kl_clip",
    "factor_batch_fraction": "factor_batch_fraction", "fisher": "fisher"}
LIBRARY_DEFAULTS = Configuration()


def unpriced_settings():
    """The `tfkfac.KFACConfig` settings that change a step's work (their field's
    `changes_work`) but that no `Configuration` field prices: every step is priced at
    their library defaults."""
    priced = set(LIBRARY_SETTINGS.values())
    return tuple(field.name for field in config_lib.settings()
                 if field.metadata["changes_work"] and field.name not in priced)


@dataclasses.dataclass(frozen=True)
class Phase:
    """`seconds` on the slowest rank each time the phase runs, every `every` steps;
    `payload`: bytes each rank hands to the communicator's `category` counter each time."""

    seconds: float
    every: int = 1
    category: str = None
    payload: tuple = ()

    @property
    def per_step(self):
        return self.seconds / self.every


def fabric(device, network, ranks_per_node=1, links_per_node=1):
    """Where the ranks run; ranks sharing the local machine never leave it."""
    if device.cores:
        if device.intra_node is None:
            raise ValueError("device local: collectives between its ranks need "
                             "bench/results/loopback.json (bench/plan_validation.py --measure)")
        return collectives.Fabric(device.intra_node, device.intra_node, device.cores, 1)
    return collectives.Fabric(network.link, device.intra_node, ranks_per_node, links_per_node,
                              network.base_latency)


def _mean(payload, ranks, fabric_, wire="float32", hierarchical=False):
    """Time of the communicator's mean of `payload` bytes per rank."""
    if wire == packing.FLOAT21:
        return (collectives.reduce_scatter(payload, ranks, fabric_)
                + collectives.allgather(payload, ranks, fabric_))
    if wire in GATHERED_MEAN_DTYPES:
        return collectives.allgather(payload * ranks, ranks, fabric_)
    if hierarchical:
        return collectives.hierarchical_allreduce(payload, ranks, fabric_)
    return collectives.allreduce(payload, ranks, fabric_)


def _forward_backward(work, device, ranks, precision, phase, measured):
    if measured is not None:
        return measured
    return _memo(("forward_backward", precision, phase, ranks), (work, device),
                 lambda: device.seconds(work.forward_backward(precision), phase, precision,
                                        ranks))


def sgd_step(work, ranks, device, fabric_, precision="float32", forward_backward_s=None):
    """{phase: Phase} of data-parallel SGD with momentum (gradients: one grouped allreduce)."""
    gradients = STATE_ITEMSIZE * work.trainable_parameters
    return {
        "forward_backward": Phase(_forward_backward(work, device, ranks, precision, "sgd",
                                                    forward_backward_s)),
        "gradient_reduction": Phase(_mean(gradients, ranks, fabric_), 1, "gradients",
                                    (gradients,) * ranks),
        "update": Phase(device.seconds(work.update(), "sgd", "float32", ranks)),
    }


def decomposition_units(work, config):
    """Per unit of work an owner takes under `config`, in `placement.owners` order (a
    symmetric factor for "replicated", a block for "owner"): (its decomposition kernels,
    the elements of its stored decompositions)."""
    blocks = work.blocks[config.weight_sharing]
    elements = work.decomposition_elements(config.method)
    if config.placement == "owner":
        return list(zip(work.decompositions(config.method), elements))
    kernels = [floor_model.decomposition_kernels(g, config.method)
               for g in work.geometries["expand"].values()]
    position = lambda b, j: blocks[b].symmetric_factors().index(j)
    return [(kernels[b][position(b, j)], [elements[b][position(b, j)]])
            for b, j in placement_lib.factor_items(blocks)]


_MEMO = {}


def _memo(key, objects, compute):
    """`compute()`, once per `key` and the identities of `objects` (kept alive with the
    result, so their ids are not reused): a full plan prices thousands of configurations
    from the same owners, per-block times and payloads."""
    key = tuple(id(o) for o in objects) + tuple(key)
    if key not in _MEMO:
        _MEMO[key] = (objects, compute())
    return _MEMO[key][1]


def owners_of(blocks, placement, ranks):
    """`placement.owners(placement, blocks, ranks)`, once per blocks, placement and rank
    count (its LPT over 1024 ranks, run for every configuration, took most of a plan)."""
    return _memo(("owners", placement, ranks), (blocks,),
                 lambda: placement_lib.owners(placement, blocks, ranks))


def by_rank(values, owners, ranks):
    """Per rank, the concatenation of the lists in `values` it owns."""
    owned = [[] for _ in range(ranks)]
    for value, owner in zip(values, owners):
        owned[owner] += value
    return owned


def _factor_elements(shapes, whole=False):
    """Elements of `shapes` on the wire: packed triangles of the matrices (`whole`: the
    n² of each), diagonals whole."""
    matrices = [s for s in shapes if len(s) >= 2]
    return ((sum(s[0] * s[1] for s in matrices) if whole else packing.packed_size(matrices))
            + sum(s[0] for s in shapes if len(s) == 1))


def _owned(counts, owners, ranks, wire):
    """Per rank, the wire bytes of the element `counts` it owns."""
    return [packing.wire_bytes(wire, sum(c)) for c in by_rank([[c] for c in counts], owners,
                                                               ranks)]


def _reduce_scatter_v(work, config, owners, ranks, fabric_):
    """(factor reduction, gradient reduction) seconds with ReduceScatterV to the owners."""
    hierarchical = config.hierarchical_reduction
    v = collectives.hierarchical_v if hierarchical else collectives.reduce_scatter_v
    mean = lambda payload, wire="float32": _mean(payload, ranks, fabric_, wire, hierarchical)
    shapes = [g.factor_shapes() for g in work.geometries["expand"].values()]
    metrics = mean(STATE_ITEMSIZE)
    if config.placement == "owner":  # a block's factors and gradients to its owner
        factors = v(_owned([_factor_elements(s) for s in shapes], owners, ranks,
                           config.factor_wire), fabric_)
        managed = work.managed_parameters()
        rest = work.trainable_parameters - sum(managed) + work.running_statistics
        gradients = (v(_owned(managed, owners, ranks, "float32"), fabric_)
                     + mean(STATE_ITEMSIZE * rest))
        return factors, gradients + metrics
    counts = [packing.packed_size([shapes[b][j]])  # a symmetric factor to its owner
              for b, j in placement_lib.factor_items(work.blocks[config.weight_sharing])]
    diagonals = packing.wire_bytes(config.factor_wire, sum(s[0] for block in shapes
                                                           for s in block if len(s) == 1))
    factors = (v(_owned(counts, owners, ranks, config.factor_wire), fabric_)
               + mean(diagonals, config.factor_wire))
    gradients = STATE_ITEMSIZE * (work.trainable_parameters + work.running_statistics)
    return factors, mean(gradients) + metrics


def _reads_factors(work, config):
    """Per block, whether its method's preconditioning reads its factors
    (`Method.reads_factors`), so cannot run beside their reduction."""
    method = config.preconditioning_method()
    return _memo(("reads_factors", config.weight_sharing, config.method), (work,),
                 lambda: [any(method.reads_factors(p) for p in block.pieces())
                          for block in work.blocks[config.weight_sharing]])


def refusal(work, config, ranks, fabric_):
    """Why tfkfac refuses `config` on `ranks` workers of `fabric_` (None: it runs it):
    the checks its communicators and curvature make once the job's ranks are known."""
    if config.overlap_reduction:
        if ranks == 1:
            return "overlap_reduction with 1 worker, where nothing is reduced"
        if all(_reads_factors(work, config)):
            return (f"overlap_reduction under method {config.method}: every layer's "
                    "preconditioning reads its factors")
    if config.hierarchical_reduction:
        try:
            collectives.hierarchical_allreduce(1, ranks, fabric_)
        except ValueError as error:
            return f"hierarchical_reduction: {error}"
    return None


def _rank_sums(values, owners, ranks):
    """Per rank, the sum of the `values` (one per unit of work) it owns."""
    return [sum(owned) for owned in by_rank([[v] for v in values], owners, ranks)]


def _overlapped(work, config, owners, ranks, block_s, factor_s, forward_backward_s,
                collective, device):
    """Seconds of each factor reduction that `overlap_reduction` saves, averaged over
    the factor steps (module docstring): `Device.overlap_hides` of what could run beside
    it less `Device.overlap_slows` of it (negative: the overlapped step is slower);
    `block_s`: each block's preconditioning."""
    net = device.overlap_hides - device.overlap_slows
    if not config.overlap_reduction or not net:
        return 0.0
    return net * _overlappable(work, config, owners, ranks, block_s, factor_s,
                               forward_backward_s, collective)


def _overlappable(work, config, owners, ranks, block_s, factor_s, forward_backward_s,
                  collective):
    """Seconds of each factor reduction that computation not reading it could hide."""
    if collective == "reduce_scatter_v":  # A's factors during the backward pass
        shapes = [g.factor_shapes() for g in work.geometries["expand"].values()]
        share = (_factor_elements([s[0] for s in shapes if len(s) == 2])
                 / _factor_elements([s for block in shapes for s in block]))
        return min(share * factor_s, BACKWARD_SHARE * forward_backward_s)
    early = [0.0 if late else s for late, s in zip(_reads_factors(work, config), block_s)]
    if config.placement == "replicated":
        early_s = sum(early)
    else:
        early_s = max(_rank_sums(early, owners, ranks))
    # No overlap at factor steps that decompose (one in d/f of them).
    return min(factor_s, early_s) * (1 - config.factor_interval
                                     / config.decomposition_interval)


def kfac_step(work, config, ranks, device, fabric_, precision="float32",
              forward_backward_s=None, collective="allreduce"):
    """{phase: Phase} of a K-FAC step under `config` on `ranks` workers, its collectives
    `collective` (COLLECTIVES). "factor_reduction" is the part not overlapped."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}; "
                         f"got {collective!r}")
    gather = {"reduce_scatter_v": collectives.allgather_v,
              "kfac_pytorch": lambda pieces, fabric: collectives.allreduce(
                  sum(pieces), ranks, fabric)}.get(
        collective, lambda pieces, fabric: collectives.allgather(sum(pieces), ranks, fabric))
    # What each rank hands to a gather: its piece, or the zero-filled whole (kfac_pytorch).
    handed = lambda pieces: ((sum(pieces),) * ranks if collective == "kfac_pytorch"
                             else tuple(pieces))
    seconds = lambda kernels, phase: device.seconds(kernels, phase, "float32", ranks)
    # Per unit of work on this device (a rank's time is the sum of its units'), and
    # what depends on the rank count only, once per plan (`_memo`).
    timed = lambda name, phase, kernels, *key: _memo(
        (name, phase, ranks) + key, (work, device),
        lambda: [seconds(ks, phase) for ks in kernels()])
    rule, method = config.weight_sharing, config.method
    owners = owners_of(work.blocks[rule], config.placement, ranks)
    units = _memo(("units", config.placement, rule, method), (work,),
                  lambda: decomposition_units(work, config))
    unit_s = timed("units", "decomposition", lambda: [k for k, _ in units],
                   config.placement, rule, method)
    block_s = timed("blocks", "preconditioning", lambda: work.preconditioning(method), method)
    slowest = lambda name, values: _memo(  # the slowest rank's sum of its units' `values`
        ("slowest", name, config.placement, rule, method, ranks), (work, device),
        lambda: max(_rank_sums(values, owners, ranks)))
    clip_s = 0.0 if config.kl_clip is None else timed(
        "clip", "preconditioning",
        lambda: [floor_model.kl_clip_kernels(sum(work.managed_parameters()))])[0]
    wire_bytes = lambda count: packing.wire_bytes(config.decomposition_wire, count)
    if config.placement == "replicated":  # owners decompose, every rank preconditions all
        shared = _memo(("shared", rule, method, ranks, config.decomposition_wire), (work,),
                       lambda: [wire_bytes(sum(e)) for e in
                                by_rank([e for _, e in units], owners, ranks)])
        sharing = Phase(gather(shared, fabric_), config.decomposition_interval,
                        "decompositions", handed(shared))
        precondition_s = sum(block_s) + clip_s
        preconditioned = Phase(0.0)
    else:  # a block's owner decomposes and preconditions it; the results are gathered
        sharing = Phase(0.0, config.decomposition_interval)
        precondition_s = slowest("blocks", block_s) + clip_s
        sent = _memo(("sent", rule, method, ranks, config.decomposition_wire), (work,),
                     lambda: [exchange.gathered_bytes(config.decomposition_wire, g, s)
                              for g, s in zip(_rank_sums(work.managed_parameters(), owners,
                                                         ranks),
                                              _rank_sums(work.method_state(method), owners,
                                                         ranks))])
        preconditioned = Phase(gather(sent, fabric_), 1, "preconditioned", handed(sent))

    whole = collective == "kfac_pytorch"
    factors = packing.wire_bytes(config.factor_wire, _memo(
        ("factor_elements", whole), (work,),
        lambda: _factor_elements(work.factor_shapes(), whole)))
    gradients = STATE_ITEMSIZE * (work.trainable_parameters + work.running_statistics)
    metrics = STATE_ITEMSIZE  # the loss, averaged over ranks for `fit`'s logs
    if collective == "reduce_scatter_v":
        factor_s, gradient_s = _reduce_scatter_v(work, config, owners, ranks, fabric_)
    else:
        mean = lambda payload, wire="float32": _mean(payload, ranks, fabric_, wire,
                                                     config.hierarchical_reduction)
        factor_s = mean(factors, config.factor_wire)
        gradient_s = mean(gradients) + mean(metrics)
    forward_backward = _forward_backward(work, device, ranks, precision, "forward_backward",
                                         forward_backward_s)
    factor_s -= _overlapped(work, config, owners, ranks, block_s, factor_s, forward_backward,
                            collective, device)
    fraction = config.factor_batch_fraction  # of the examples the statistics read
    statistics_s = timed("statistics", "factor_statistics", lambda: [
        [k for ks in work.statistics(rule, fraction) for k in ks]], rule, fraction)[0]
    if config.fisher == "sampled":  # its own backward pass, over the whole batch
        statistics_s += SAMPLED_BACKWARD_SHARE * forward_backward
    return {
        "forward_backward": Phase(forward_backward),
        "factor_statistics": Phase(statistics_s, config.factor_interval),
        "factor_reduction": Phase(factor_s, config.factor_interval, "factors",
                                  (factors,) * ranks),
        "decomposition": Phase(slowest("units", unit_s), config.decomposition_interval),
        "decomposition_sharing": sharing,
        "preconditioning": Phase(precondition_s),
        "preconditioned_sharing": preconditioned,
        "gradient_reduction": Phase(gradient_s, 1, "gradients", (gradients,) * ranks),
        "update": Phase(timed("update", "update", lambda: [work.update()])[0]),
    }


def step_seconds(phases):
    """Time per step, amortized over the intervals."""
    return sum(phase.per_step for phase in phases.values())


def payload_per_step(phases, rank):
    """{category: bytes rank `rank` hands to the communicator per step, amortized}."""
    totals = {}
    for phase in phases.values():
        if phase.category and phase.payload:
            totals[phase.category] = totals.get(phase.category, 0.0) + (
                phase.payload[rank] / phase.every)
    return totals
