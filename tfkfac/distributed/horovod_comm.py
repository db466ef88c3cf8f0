"""Horovod communicator built on the low-level `horovod.tensorflow` tensor ops.

Horovod's Keras layer fails under Keras 3 (horovod#4290); its tensor collectives work
inside a non-XLA `tf.function`. Two Horovod 0.28 facts shape this file:
- A grouped allreduce needs one dtype, and allreduce/broadcast/allgather reject
  bfloat16. Tensors are therefore reduced in one grouped call per dtype, and bfloat16
  travels as its int16 bit pattern: broadcast and allgather bit-exactly, the mean as an
  allgather followed by a float32 sum on every rank (same bytes as a ring allreduce on
  2 ranks, size/2 times more beyond).
- Horovod matches collectives across ranks by op name, and inside a `tf.function` its
  default name comes from the input tensor's graph name, which differs between ranks as
  soon as their graphs differ (e.g. owners computing different eigendecompositions).
  Every op here is named by its position among the tfkfac collectives of the graph
  being traced (and of the graphs it is nested in), without name scope: ranks that
  issue the same sequence of collectives always match, whatever else their graphs hold.
  One op may not be in flight twice: a collective in a `tf.while_loop` body needs
  `parallel_iterations=1` (or a data dependency between iterations), otherwise Horovod
  fails with "a tensor with the same name as another tensor that is currently being
  processed".
With `hierarchical`, every floating-point mean Horovod can sum is taken in two levels
(`_node_levels`): Horovod's own hierarchical allreduce and allgather
(HOROVOD_HIERARCHICAL_ALLREDUCE/ALLGATHER) exist only in GPU builds (NCCL, or MPI with
GPUs); a CPU build (Gloo or MPI) turns them off.
"""

import functools
import itertools
import os
import weakref

import tensorflow as tf

from tfkfac.distributed import transport
from tfkfac.distributed.base import COPY_DTYPES, Communicator


# dtypes whose mean travels as an allgather of every rank's tensor (see above): a cost
# model of this communicator counts their "allreduce" as an allgather.
GATHERED_MEAN_DTYPES = ("bfloat16",)
# Horovod's ops take every dtype a communicator carries but bfloat16.
_HOROVOD_DTYPES = tuple(dtype for dtype in COPY_DTYPES if dtype != tf.bfloat16)


class HorovodCommunicator(Communicator):
    """Collectives over every Horovod rank; calls `hvd.init()` (idempotent).

    `hierarchical`: means in two levels, within each node then across nodes (see
    `_hierarchical_mean`), through Horovod process sets that this constructor adds on
    every rank (Horovod initialized here with dynamic process sets, or by the caller with
    `hvd.init(process_sets="dynamic")`).
    """

    def __init__(self, hierarchical=False):
        import horovod.tensorflow as hvd  # Lazy: tfkfac imports without Horovod.

        if hierarchical and not hvd.is_initialized():
            hvd.init(process_sets="dynamic")
        else:
            hvd.init()
        self._hvd = hvd
        self.rank = hvd.rank()
        self.size = hvd.size()
        super().__init__()
        self.hierarchical = hierarchical
        self._levels = _node_levels(hvd) if hierarchical else None

    def _grouped_allreduce_mean(self, tensors):
        def mean(group):
            dtype = group[0].dtype
            if dtype.name in GATHERED_MEAN_DTYPES:
                return transport.concatenated(group, self._bfloat16_mean)
            if self._levels is not None and dtype.is_floating:
                return transport.concatenated(group, self._hierarchical_mean)
            return self._hvd.grouped_allreduce(
                group, op=self._hvd.Average,
                name=_collective_name(f"allreduce_{dtype.name}"), ignore_name_scope=True)
        return transport.per_dtype(tensors, mean)

    def _broadcast(self, tensors, root_rank):
        return [
            transport.from_wire(self._hvd.broadcast(_to_wire(t), root_rank,
                                                    name=_collective_name("broadcast"),
                                                    ignore_name_scope=True), t.dtype)
            for t in tensors
        ]

    def _allgather(self, tensor):
        gathered = self._hvd.allgather(_to_wire(tensor), name=_collective_name("allgather"),
                                       ignore_name_scope=True)
        return transport.from_wire(gathered, tensor.dtype)

    def _alltoall(self, tensor):
        return self._hvd.alltoall(tensor, name=_collective_name("alltoall"),
                                  ignore_name_scope=True)

    def _hierarchical_mean(self, flat):
        """Mean of a 1-D tensor in two levels, as NCCL's hierarchical allreduce: a
        reduce-scatter (sum) within the node gives each of its L ranks 1/L of the node's
        sum, the ranks with the same local rank sum their parts across nodes, and an
        allgather within the node reassembles the total, divided by the number of ranks.
        Each element is summed within its node, then the node sums are summed."""
        node, cross = self._levels
        part = self._hvd.reducescatter(flat, op=self._hvd.Sum, process_set=node,
                                       name=_collective_name("node_reducescatter"),
                                       ignore_name_scope=True)
        part = self._hvd.allreduce(part, op=self._hvd.Sum, process_set=cross,
                                   name=_collective_name("cross_allreduce"),
                                   ignore_name_scope=True)
        total = self._hvd.allgather(part, process_set=node,
                                    name=_collective_name("node_allgather"),
                                    ignore_name_scope=True)
        return total / tf.cast(self.size, flat.dtype)

    def _bfloat16_mean(self, flat):
        """Mean of a 1-D bfloat16 tensor: gather every rank's bits, average in float32."""
        gathered = self._hvd.allgather(_to_wire(flat),
                                       name=_collective_name("allreduce_bfloat16"),
                                       ignore_name_scope=True)
        per_rank = tf.reshape(transport.from_wire(gathered, tf.bfloat16), [self.size, -1])
        return tf.cast(tf.reduce_mean(tf.cast(per_rank, tf.float32), axis=0), tf.bfloat16)


@functools.lru_cache(maxsize=None)
def _node_levels(hvd):
    """(this rank's node, the ranks with its local rank on every node) as Horovod process
    sets, added on every rank in the same order, once per process (Horovod refuses a set
    twice). ValueError where two levels would be one: a single node, one rank per node,
    or nodes with different numbers of ranks."""
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") != "1":
        raise ValueError(
            "hierarchical reduction adds Horovod process sets after initialization: Horovod "
            "was initialized without dynamic process sets; call "
            "hvd.init(process_sets='dynamic') first, or let tfkfac initialize Horovod")
    nodes, local = hvd.cross_size(), hvd.local_size()
    if not hvd.is_homogeneous() or nodes == 1 or local == 1:
        raise ValueError(
            "hierarchical reduction sums within each node, then across nodes: it needs "
            "several nodes with the same number of ranks, more than one each; this Horovod "
            f"job has {hvd.size()} ranks on {nodes} node(s), {local} on this one "
            f"({'the same' if hvd.is_homogeneous() else 'not the same'} on every node), "
            "where it would be the flat mean: set hierarchical_reduction=False")
    layout = hvd.allgather_object((hvd.cross_rank(), hvd.local_rank()))
    node_sets = [hvd.add_process_set([r for r, (c, _) in enumerate(layout) if c == node])
                 for node in range(nodes)]
    cross_sets = [hvd.add_process_set([r for r, (_, l) in enumerate(layout) if l == position])
                  for position in range(local)]
    return node_sets[hvd.cross_rank()], cross_sets[hvd.local_rank()]


_GRAPH_NAMING = weakref.WeakKeyDictionary()  # graph -> (name prefix, collective counter)


def _collective_name(kind):
    """`<prefix>_<n>_<kind>`: n counts the collectives and nested graphs of this graph.

    A nested graph (a `tf.cond` branch, a `tf.while_loop` body, an inner `tf.function`)
    takes the next number of its outer graph as its prefix, so its collectives never
    share a name with the outer graph's, which may run at the same time.
    """
    if tf.executing_eagerly():
        return f"tfkfac_{kind}"
    prefix, counter = _graph_naming(tf.compat.v1.get_default_graph())
    return f"{prefix}_{next(counter)}_{kind}"


def _graph_naming(graph):
    if graph not in _GRAPH_NAMING:
        outer = getattr(graph, "outer_graph", None)
        if outer is not None and outer.building_function:
            outer_prefix, outer_counter = _graph_naming(outer)
            prefix = f"{outer_prefix}_{next(outer_counter)}"
        else:
            prefix = "tfkfac"
        _GRAPH_NAMING[graph] = (prefix, itertools.count())
    return _GRAPH_NAMING[graph]


def _to_wire(tensor):
    """Horovod rejects bfloat16: send its bit pattern as int16."""
    return transport.to_wire(tensor, _HOROVOD_DTYPES, bfloat16_bits=tf.int16)
