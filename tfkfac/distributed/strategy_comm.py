"""Communicator over the replicas of a `tf.distribute` strategy (TensorFlow's own engine).

`MirroredStrategy` (several devices of one process) and `MultiWorkerMirroredStrategy`
(processes over gRPC, `TF_CONFIG`) run K-FAC's step once per replica inside
`strategy.run`; each replica is one rank. Three facts shape this file:
- K-FAC issues its collectives inside `tf.cond` branches (factor and decomposition steps)
  and inner `tf.function` calls. The strategies' own `ReplicaContext.all_reduce` goes through
  `merge_call` on CPUs (TF 2.21: it avoids it only for XLA on GPUs), and `merge_call` is
  refused there ("merge_call called while defining a new graph"). So the collectives
  here are TensorFlow's collective ops (`tf.raw_ops.CollectiveReduceV2`,
  `CollectiveGatherV2`, `CollectiveBcastSend/RecvV2`, `CollectiveAllToAllV2`), the ops
  the strategies themselves launch, issued by each replica on its own device.
- Collective ops of one group are matched across replicas by an instance key: each
  replica numbers its collectives in the order it traces them (every rank issues the
  same sequence, as with Horovod), from a counter shared by every communicator of the
  process. The ops take an ordering token (a variable on the replica's device): without
  one, the V2 ops wait forever for their peers (measured).
- A gather needs the same shape on every replica: ranks first gather their sizes, then
  pad to the largest; the counters count the unpadded payload, like the transport's
  other overheads (base.py).
- The ops take fewer dtypes than Horovod's (`_OP_DTYPES`); the others a communicator
  carries (base.py) travel widened, exactly (transport.py): bool and the small integers
  as int32, and bfloat16, which only the reduction takes, as its bits in float16.
Every collective op takes the strategy's own `CommunicationOptions` (implementation as
its hint, timeout), as the strategy's collectives do (`collective_options`).
With `hierarchical` (MultiWorkerMirroredStrategy over several hosts), every floating-point
mean is taken in two levels (`_hierarchical_mean`), in collective groups of its own: the
replicas of one host, and those at the same position on every host.
With more than one replica per process (MirroredStrategy), one Python object serves all
of them: `rank` is read from the replica context while tracing, and every variable is a
mirrored one, so each replica updates its own copy. Rank-specific state (the "owner"
placement's decompositions) exists on every replica: every process must create the same
variables, which MultiWorkerMirroredStrategy initializes with collectives; each replica
computes and reads only its own.
"""

import collections
import itertools

import tensorflow as tf

from tfkfac.distributed import transport
from tfkfac.distributed.base import Communicator

SUPPORTED = "MirroredStrategy or MultiWorkerMirroredStrategy (one process: OneDeviceStrategy "\
            "or no strategy)"
# Far above the group keys the strategies allocate for themselves (from 1 upwards).
GROUP_KEY_BASE = 1 << 30

# The dtypes TensorFlow's collective ops take (TF 2.21's op definitions).
_OP_DTYPES = {
    "reduce": (tf.bfloat16, tf.float16, tf.float32, tf.float64, tf.int32, tf.int64),
    "gather": (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64),
    "broadcast": (tf.bool, tf.float16, tf.float32, tf.float64, tf.int32, tf.int64),
}

_GROUP_KEYS = {}  # replica layout -> group key, in order of first use (same on every worker)
_INSTANCE_KEYS = collections.defaultdict(lambda: itertools.count(1))  # (group, replica) ->


def is_default(strategy):
    """Whether `strategy` is TensorFlow's default (no strategy): one process, one replica."""
    with tf.Graph().as_default():  # a new graph has no strategy in scope
        return strategy is tf.distribute.get_strategy()


def check_supported(strategy):
    """`strategy`'s number of replicas; ValueError naming it if K-FAC cannot run under it."""
    if not (is_default(strategy) or isinstance(strategy, (
            tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy,
            tf.distribute.OneDeviceStrategy))):
        raise ValueError(f"tfkfac does not support {type(strategy).__name__}: K-FAC runs "
                         f"under {SUPPORTED}, or under Horovod.")
    return strategy.num_replicas_in_sync


def check_model_strategy(comm, strategy):
    """ValueError unless `comm` averages over the replicas of `strategy`, the strategy the
    model was built under: K-FAC (and its communicator) must be made in the same
    `strategy.scope()` as the model, or every replica would train alone."""
    replicas = check_supported(strategy)
    served = getattr(comm, "strategy", None)
    if served is strategy or (replicas == 1 and served is None):
        return
    where = ("outside any tf.distribute strategy" if is_default(strategy) else
             f"under {type(strategy).__name__} ({replicas} replicas)")
    raise ValueError(
        f"The model was built {where} but this KFAC optimizer was made "
        + (f"under {type(served).__name__}" if served is not None else
           f"for {comm.size} rank(s) ({type(comm).__name__})")
        + ": build the model and make the optimizer inside the same "
        "`with strategy.scope():`.")


class StrategyCommunicator(Communicator):
    """Collectives among the replicas of `strategy` (default: the current one).

    Create it in cross-replica context (inside or outside `strategy.scope()`). Its
    collectives run in replica context, inside `strategy.run`; called outside, they run
    in every replica of this process, each giving this process's tensors. `rank` is the
    current replica's `replica_id_in_sync_group`; outside a replica it is this process's
    first replica's, so `rank == 0` still picks one chief process.
    """

    def __init__(self, strategy=None, hierarchical=False):
        strategy = strategy or tf.distribute.get_strategy()
        self.size = check_supported(strategy)
        self.strategy = strategy
        self.hierarchical = hierarchical
        replica_ids = strategy.experimental_local_results(strategy.run(
            lambda: tf.distribute.get_replica_context().replica_id_in_sync_group))
        self._local_ranks = tuple(int(r) for r in replica_ids)
        layout = (type(strategy).__name__, self.size, tuple(
            tf.DeviceSpec.from_string(d).replace(job=None, replica=None, task=None).to_string()
            for d in strategy.extended.worker_devices))
        self._group_key = _group_key(layout)
        self._options = collective_options(strategy)
        # rank -> its (node group, cross-node group), each (group key, size, position).
        self._levels = _node_levels(strategy, layout) if hierarchical else None
        with strategy.scope():  # counters and ordering tokens: one copy per replica
            super().__init__()
            self._ordering_token = tf.Variable(0.0, trainable=False, name="collective_order")

    @property
    def rank(self):
        if not self._in_replica():
            return self._local_ranks[0]
        context = tf.distribute.get_replica_context()
        return int(tf.get_static_value(context.replica_id_in_sync_group))

    @property
    def local_ranks(self):
        return self._local_ranks

    @property
    def state_ranks(self):
        # A strategy creates every variable on every replica, and MultiWorkerMirrored-
        # Strategy initializes each with a collective that every worker must join.
        return tuple(range(self.size))

    # Called in cross-replica context (callbacks, checkpoints), each collective runs in
    # every replica of this process, each giving this process's value.
    def grouped_allreduce_mean(self, tensors, category="gradients"):
        return self._in_replicas(lambda: super(StrategyCommunicator, self)
                                 .grouped_allreduce_mean(tensors, category))

    def broadcast(self, tensors, root_rank=0, category="broadcast"):
        return self._in_replicas(lambda: super(StrategyCommunicator, self)
                                 .broadcast(tensors, root_rank, category))

    def allgather(self, tensor, category="allgather"):
        return self._in_replicas(lambda: super(StrategyCommunicator, self)
                                 .allgather(tensor, category))

    def broadcast_variables(self, variables, root_rank=0):
        """Overwrite every variable with its value on `root_rank`, on every replica."""
        variables = list(variables)
        if self.size > 1 and variables:
            self._in_replicas(lambda: super(StrategyCommunicator, self)
                              .broadcast_variables(variables, root_rank))

    def _in_replicas(self, collective):
        """`collective()` here in a replica context, else run by every local replica
        (`strategy.run` in a `tf.function`), returning the first one's result."""
        if self._in_replica():
            return collective()
        results = tf.function(lambda: self.strategy.run(collective))()
        return tf.nest.map_structure(
            lambda value: self.strategy.experimental_local_results(value)[0], results)

    # ------------------------------------------------------------ collectives
    def _grouped_allreduce_mean(self, tensors):
        def mean(flat, keys):
            if self._levels is not None and flat.dtype.is_floating:
                return self._hierarchical_mean(flat)
            return transport.from_wire(tf.raw_ops.CollectiveReduceV2(
                input=_to_wire(flat, "reduce"), merge_op="Add", final_op="Div", **keys),
                flat.dtype)
        return self._per_dtype(tensors, mean)

    def _hierarchical_mean(self, flat):
        """Mean of a 1-D tensor in two levels: the node's sum (an allreduce among its L
        replicas; TensorFlow's reduce-scatter runs on NCCL only), of which each replica
        sums its 1/L part across nodes with the replicas at its position, gathered
        within the node and divided by the number of ranks. Each element is summed within
        its node, then the node sums are summed, as in the Horovod communicator."""
        (node, node_size, position), (cross, cross_size, _) = self._levels[self.rank]
        part = -(-tf.size(flat) // node_size)  # elements per replica of the node
        total = tf.raw_ops.CollectiveReduceV2(
            input=tf.pad(flat, [[0, part * node_size - tf.size(flat)]]), merge_op="Add",
            final_op="Id", **self._keys(node, node_size))
        mine = tf.raw_ops.CollectiveReduceV2(
            input=total[position * part:(position + 1) * part], merge_op="Add",
            final_op="Id", **self._keys(cross, cross_size))
        # Each part behind its position: a gather's order is TensorFlow's order of the
        # group's devices, not necessarily the ranks'.
        rows = tf.reshape(transport.from_wire(tf.raw_ops.CollectiveGatherV2(
            input=_to_wire(tf.concat([[tf.cast(position, flat.dtype)], mine], axis=0),
                           "gather"), **self._keys(node, node_size)), flat.dtype),
            [node_size, -1])
        ordered = tf.reshape(tf.gather(rows[:, 1:], tf.argsort(rows[:, 0])), [-1])
        return ordered[:tf.size(flat)] / tf.cast(self.size, flat.dtype)

    def _broadcast(self, tensors, root_rank):
        def broadcast(flat, keys):
            wire = _to_wire(flat, "broadcast")
            if self.rank == root_rank:
                wire = tf.raw_ops.CollectiveBcastSendV2(input=wire, **_unordered(keys))
            else:
                wire = tf.raw_ops.CollectiveBcastRecvV2(shape=tf.shape(wire), T=wire.dtype,
                                                        **_unordered(keys))
            return transport.from_wire(wire, flat.dtype)
        return self._per_dtype(tensors, broadcast)

    def _allgather(self, tensor):
        if not tensor.shape[1:].is_fully_defined():
            raise ValueError(f"allgather needs a static shape beyond axis 0, got {tensor.shape}")
        size = tf.shape(tensor, out_type=tf.int32)[:1]
        flat = tf.reshape(tensor, [-1])
        row = tensor.shape[1:].num_elements()  # elements per entry of axis 0
        sizes = tf.raw_ops.CollectiveGatherV2(input=size, **self._keys())
        padded = _to_wire(tf.pad(flat, [[0, (tf.reduce_max(sizes) - size[0]) * row]]), "gather")
        gathered = tf.reshape(transport.from_wire(tf.raw_ops.CollectiveGatherV2(
            input=padded, **self._keys()), tensor.dtype), [self.size, -1])
        kept = tf.sequence_mask(sizes * row, tf.shape(gathered)[1])
        return tf.reshape(tf.boolean_mask(gathered, kept),
                          tf.concat([[-1], tf.shape(tensor)[1:]], axis=0))

    def _alltoall(self, tensor):
        return tf.raw_ops.CollectiveAllToAllV2(input=tensor, **self._keys())

    def _per_dtype(self, tensors, collective):
        """`collective(flat, keys)` once per dtype on the concatenation of its tensors."""
        return transport.per_dtype(tensors, lambda group: transport.concatenated(
            group, lambda flat: collective(flat, self._keys())))

    def _in_replica(self):
        context = tf.distribute.get_replica_context()
        return context is not None and context.strategy is self.strategy

    def _keys(self, group_key=None, group_size=None):
        """Group (default: every replica) and next instance key of the current replica,
        and its ordering token."""
        group_key = group_key or self._group_key
        return {"group_size": group_size or self.size, "group_key": group_key,
                "instance_key": next(_INSTANCE_KEYS[group_key, self.rank]),
                "ordering_token": [self._ordering_token.handle], **self._options}


def collective_options(strategy):
    """The strategy's own `tf.distribute.experimental.CommunicationOptions` as the
    collective ops' attributes, so that K-FAC's collectives run as the strategy's do: its
    implementation (AUTO, RING, NCCL) as their hint, its timeout (none: wait forever)."""
    options = getattr(strategy.extended, "_communication_options", None)  # no public getter
    if options is None:  # the default strategy, OneDeviceStrategy: one replica
        return {}
    return {"communication_hint": options.implementation.value.lower(),
            "timeout_seconds": float(options.timeout_seconds or 0)}


def _group_key(name):
    """The group key of `name`, in order of first use (the same on every worker)."""
    return _GROUP_KEYS.setdefault(name, GROUP_KEY_BASE + len(_GROUP_KEYS))


def _node_levels(strategy, layout):
    """{rank: ((node group key, size, position in it), (cross-node group key, size,
    position))}: a node is a host of the cluster (MultiWorkerMirroredStrategy's workers
    by the host of their address; a worker's replicas are on its host), ranks numbered as
    the strategy does, chief first. ValueError where two levels would be one: a single
    host, one replica per host, or hosts with different numbers of replicas."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    addresses = [address for job in ("chief", "worker") for address in spec.get(job, [])]
    per_worker = len(strategy.extended.worker_devices)
    hosts = [address.rsplit(":", 1)[0] for address in addresses for _ in range(per_worker)]
    nodes = list(dict.fromkeys(hosts))
    counts = {node: hosts.count(node) for node in nodes}
    if len(nodes) < 2 or len(set(counts.values())) != 1 or min(counts.values()) < 2:
        raise ValueError(
            "hierarchical reduction sums within each host, then across hosts: it needs "
            "several hosts with the same number of replicas, more than one each; this "
            f"{type(strategy).__name__} has {strategy.num_replicas_in_sync} replica(s) on "
            f"hosts {counts or '(one process)'}, where it would be the flat mean: set "
            "hierarchical_reduction=False")
    ranks = {node: [r for r, host in enumerate(hosts) if host == node] for node in nodes}
    positions = range(counts[nodes[0]])
    node_groups = {node: _group_key((layout, "node", node)) for node in nodes}
    cross_groups = {p: _group_key((layout, "cross", p)) for p in positions}
    return {rank: ((node_groups[node], len(members), p),
                   (cross_groups[p], len(nodes), nodes.index(node)))
            for node, members in ranks.items() for p, rank in enumerate(members)}


def _unordered(keys):
    """Broadcast ops take no ordering token."""
    return {k: v for k, v in keys.items() if k != "ordering_token"}


def _to_wire(tensor, op):
    """`tensor` in a dtype the collective `op` takes (bfloat16 as its bits in float16)."""
    return transport.to_wire(tensor, _OP_DTYPES[op], bfloat16_bits=tf.float16)
