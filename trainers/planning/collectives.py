"""Time of a collective on p ranks: the α-β model as NCCL's tuner states it.

A collective of n bytes costs a base latency, a latency per step of its algorithm, and
its bytes over the bus bandwidth (Thakur et al. 2005; NCCL src/graph/tuning.cc, whose
per-step latencies the network profiles quote). With several workers per node a ring
crosses the network 2(nodes - 1) times and NVLink the rest; a tree has log2(nodes)
network levels. The bus bandwidth of a job spanning nodes is the node's network links;
within one node it is the intra-node link. Allreduce takes the faster of ring and tree,
as NCCL does; the other collectives are rings.

    ring allreduce    2(p-1) steps,        2(p-1)/p · n / B
    tree allreduce    2·log2(nodes) levels, 2 n / B  (pipelined double binary tree)
    allgather         p-1 steps,            (p-1)/p · N / B   (N: all ranks' bytes)
    reduce-scatter    p-1 steps,            (p-1)/p · n / B
    broadcast         one pipelined chain,  n / B
    ReduceScatterV    p-1 network steps,    (N - smallest piece) / (B / ranks per node)
    AllGatherV        p-1 network steps,    (N - smallest piece) / (B / ranks per node)

ReduceScatterV and AllGatherV are the collectives of Osawa et al. (CVPR'19 §3) and Ueno et
al. (KDD'20 Algorithm 1): each rank's piece of N bytes has its own size (a layer's factors
summed onto its owner; an owner's results gathered from it). On a ring every piece but
one crosses each link (reduce-scatter: the piece its sender ends with stays; allgather:
the piece its receiver started with is not sent back), so the busiest link carries N
less the smallest piece; with equal pieces that is (p-1)/p · N, the formulas above. NCCL
has no V collective, and the papers' ran rank to rank: every step crosses the network and
a node's ranks share its links (B / ranks per node), as Ueno et al.'s Table 1 measures
it: packing the factors (308 MB less per rank) saved 52 ms and float21 (103 MB less) 17
ms, 6 GB/s each, a quarter of ABCI's two EDR links for its 4 GPUs a node.

Hierarchical (two levels, L ranks on each of `nodes` nodes), as tfkfac's
`hierarchical_reduction` and NCCL's hierarchical allreduce run it (Ueno & Yokota,
CCGRID'19): within each node a reduce-scatter leaves each rank 1/L of the node's sum; the
L ranks with the same local rank reduce their parts across nodes at once (L rings sharing
the node's links); within each node an allgather reassembles the result:

    hierarchical allreduce    2(L-1)/L · n / B_node + allreduce of n/L over nodes at B / L
    hierarchical V collective (L-1)/L · N / B_node + (N - smallest node's pieces) / B
                              + (L-1)/L · largest piece / B_node

The V collective's middle term is the rank-to-rank one above with the node, not the rank,
as the unit: the node's pieces leave it once, over all its links.
"""

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Link:
    """A class of link: bandwidth (bytes/s, one direction) and latencies (s)."""

    bandwidth: float
    ring_step_latency: float
    tree_level_latency: float


@dataclasses.dataclass(frozen=True)
class Fabric:
    """Where p ranks run: `ranks_per_node` share one node's `links_per_node` network links."""

    network: Link
    intra_node: Link
    ranks_per_node: int = 1
    links_per_node: int = 1
    base_latency: float = 0.0

    def nodes(self, ranks):
        return math.ceil(ranks / self.ranks_per_node)

    def bandwidth(self, ranks):
        if self.nodes(ranks) == 1:
            return self.intra_node.bandwidth
        return self.network.bandwidth * self.links_per_node

    def _steps_latency(self, steps, network_steps):
        return (self.base_latency + network_steps * self.network.ring_step_latency
                + (steps - network_steps) * self.intra_node.ring_step_latency)


def ring_allreduce(n, ranks, fabric):
    if ranks == 1:
        return 0.0
    nodes = fabric.nodes(ranks)
    latency = fabric._steps_latency(2 * (ranks - 1), 2 * (nodes - 1))
    return latency + 2.0 * (ranks - 1) / ranks * n / fabric.bandwidth(ranks)


def tree_allreduce(n, ranks, fabric):
    if ranks == 1:
        return 0.0
    nodes = fabric.nodes(ranks)
    per_node = min(ranks, fabric.ranks_per_node)
    latency = 2.0 * ((per_node - 1) * fabric.intra_node.tree_level_latency
                     + math.ceil(math.log2(nodes)) * fabric.network.tree_level_latency)
    return fabric.base_latency + latency + 2.0 * n / fabric.bandwidth(ranks)


def allreduce(n, ranks, fabric):
    """The faster of ring and tree for `n` bytes on every rank."""
    return min(ring_allreduce(n, ranks, fabric), tree_allreduce(n, ranks, fabric))


def allgather(total, ranks, fabric):
    """`total` bytes over all ranks (each rank's piece may differ) reach every rank."""
    if ranks == 1:
        return 0.0
    latency = fabric._steps_latency(ranks - 1, fabric.nodes(ranks) - 1)
    return latency + (ranks - 1) / ranks * total / fabric.bandwidth(ranks)


def reduce_scatter(n, ranks, fabric):
    """`n` bytes on every rank, summed, each rank keeping 1/p of the result."""
    return allgather(n, ranks, fabric)


def broadcast(n, ranks, fabric):
    """`n` bytes from one rank to all, pipelined along a chain."""
    if ranks == 1:
        return 0.0
    network_steps = 1 if fabric.nodes(ranks) > 1 else 0
    return fabric._steps_latency(1, network_steps) + n / fabric.bandwidth(ranks)


def allgather_v(pieces, fabric):
    """Rank r's `pieces[r]` bytes reach every rank (one piece per rank), rank to rank
    over the network: each ring step crosses it, and a node's ranks share its links."""
    ranks = len(pieces)
    if ranks == 1:
        return 0.0
    if fabric.nodes(ranks) == 1:
        latency, bandwidth = fabric._steps_latency(ranks - 1, 0), fabric.intra_node.bandwidth
    else:
        latency = fabric._steps_latency(ranks - 1, ranks - 1)
        bandwidth = fabric.bandwidth(ranks) / min(ranks, fabric.ranks_per_node)
    return latency + (sum(pieces) - min(pieces)) / bandwidth


def reduce_scatter_v(pieces, fabric):
    """Every rank holds all of `pieces` (bytes, one per rank); rank r ends with piece r
    summed over the ranks: the same link load as `allgather_v`."""
    return allgather_v(pieces, fabric)


def _levels(ranks, fabric):
    """(ranks per node, nodes) of a two-level collective; ValueError where two levels
    would be one (the refusal of tfkfac's communicators)."""
    local, nodes = min(ranks, fabric.ranks_per_node), fabric.nodes(ranks)
    if nodes == 1 or local == 1 or ranks % local:
        raise ValueError(f"a hierarchical collective needs several nodes with the same "
                         f"number of ranks, more than one each; got {ranks} rank(s), "
                         f"{local} per node")
    return local, nodes


def _within_node(n, local, fabric):
    """A reduce-scatter (or allgather) of `n` bytes among a node's `local` ranks."""
    return (fabric.base_latency + (local - 1) * fabric.intra_node.ring_step_latency
            + (local - 1) / local * n / fabric.intra_node.bandwidth)


def _across_nodes(local, fabric):
    """One of the `local` concurrent cross-node collectives: one rank per node, a
    1/local share of the node's links."""
    network = fabric.network
    share = Link(network.bandwidth * fabric.links_per_node / local,
                 network.ring_step_latency, network.tree_level_latency)
    return Fabric(share, fabric.intra_node, 1, 1, fabric.base_latency)


def hierarchical_allreduce(n, ranks, fabric):
    """`n` bytes on every rank, summed in two levels (see the module's docstring)."""
    local, nodes = _levels(ranks, fabric)
    return (2 * _within_node(n, local, fabric)
            + allreduce(n / local, nodes, _across_nodes(local, fabric)))


def hierarchical_v(pieces, fabric):
    """ReduceScatterV (or AllGatherV) of `pieces` (bytes, one per rank, ranks numbered
    node by node) in two levels (see the module's docstring)."""
    ranks = len(pieces)
    local, nodes = _levels(ranks, fabric)
    node_pieces = [sum(pieces[i:i + local]) for i in range(0, ranks, local)]
    across = _across_nodes(local, fabric)
    network = (across._steps_latency(nodes - 1, nodes - 1)
               + (sum(pieces) - min(node_pieces)) / fabric.bandwidth(ranks))
    return (_within_node(sum(pieces), local, fabric) + network
            + _within_node(max(pieces), local, fabric))
