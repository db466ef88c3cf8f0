"""The communicator interface K-FAC talks to, and its single-process implementation.

A communicator moves tensors between processes; it knows nothing about layers or
Kronecker factors. Every collective is tagged with a category, and per-category byte and
call counters (tf.Variables, incremented in-graph) let benchmarks and tests see the
traffic even when the collectives run inside a `tf.function` executed many times.
"""

import tensorflow as tf

from tfkfac.distributed import float21

CATEGORIES = (
    "gradients",
    "factors",
    "decompositions",
    "preconditioned",
    "metrics",
    "broadcast",
    "allgather",
)

# What every communicator carries: Horovod's ops take these, and bfloat16 travels as its
# bits where a transport refuses it. A mean takes no bool, int16 or uint16 (Horovod's
# allreduce does not).
COPY_DTYPES = tuple(tf.as_dtype(name) for name in (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64"))
MEAN_DTYPES = tuple(dtype for dtype in COPY_DTYPES
                    if dtype.name not in ("bool", "int16", "uint16"))


class Communicator:
    """Collective operations on lists of tensors, usable inside a (non-XLA) `tf.function`.

    Subclasses implement `_grouped_allreduce_mean`, `_broadcast`, `_allgather` and
    `_alltoall`; the public methods validate the category and count what goes on the
    wire. Bytes counted are the payload this rank hands to the collective (elements x
    dtype size): the tensors for an allreduce or broadcast, this rank's own part for an
    allgather, the float21 words of a float21 mean. The
    transport's own overhead (a ring allreduce moves about 2(size-1)/size of that) is
    not included. Create a communicator outside any `tf.function`: it owns variables.
    """

    rank = 0
    size = 1
    # Whether means are taken in two levels, within nodes then across them
    # (`get_communicator(hierarchical=True)`).
    hierarchical = False

    @property
    def local_ranks(self):
        """The ranks this process runs: its own (all of this process's replicas under a
        multi-device tf.distribute strategy)."""
        return (self.rank,)

    @property
    def state_ranks(self):
        """The ranks whose rank-specific state (an owner's decompositions) this process
        creates: its own (every rank's under tf.distribute, see StrategyCommunicator)."""
        return (self.rank,)

    def __init__(self):
        with tf.device("/CPU:0"):
            self._bytes = {c: _counter(f"comm_bytes_{c}") for c in CATEGORIES}
            self._calls = {c: _counter(f"comm_calls_{c}") for c in CATEGORIES}

    def grouped_allreduce_mean(self, tensors, category="gradients"):
        """Average each tensor across ranks in one fused call (one per dtype)."""
        tensors = self._checked(category, tensors, MEAN_DTYPES)
        if not tensors:
            return []
        return self._counted(category, tensors, self._grouped_allreduce_mean(tensors))

    def float21_mean(self, tensor, category="factors"):
        """Mean over ranks of the 1-D float32 `tensor`, sent as float21 (float21.py).

        A packed buffer cannot be summed by the transport, so this is a reduce-scatter
        and an allgather, as a ring allreduce is: every rank's words are cut into one
        chunk per rank, rank r receives everyone's chunk r (an all-to-all) and sums them
        in float32 in rank order, divides by the number of ranks, rounds that to float21
        again, and the chunks are gathered. Each rank moves a ring allreduce's bytes at 2/3 of
        float32's, and every rank decodes the same words: the same bits everywhere.
        """
        (tensor,) = self._checked(category, [tensor], (tf.float32,))
        if self.size == 1:
            return tensor
        count = tf.size(tensor)
        packed = float21.encode(tensor)
        chunk = -(-tf.size(packed) // self.size)  # words per rank, the last padded
        scattered = tf.reshape(tf.pad(packed, [[0, chunk * self.size - tf.size(packed)]]),
                               [self.size, chunk])
        received = tf.reshape(float21.decode(
            self._alltoall(scattered), self.size * chunk * float21.VALUES_PER_WORD),
            [self.size, -1])
        total = received[0]
        for rank in range(1, self.size):
            total += received[rank]
        mean = float21.decode(self._allgather(float21.encode(total / self.size)), count)
        return self._counted(category, [packed], [mean])[0]

    def broadcast(self, tensors, root_rank=0, category="broadcast"):
        """Return each tensor as held by `root_rank`."""
        if not 0 <= root_rank < self.size:
            raise ValueError(f"root_rank must be in [0, {self.size}), got {root_rank}")
        tensors = self._checked(category, tensors, COPY_DTYPES)
        if not tensors:
            return []
        return self._counted(category, tensors, self._broadcast(tensors, root_rank))

    def allgather(self, tensor, category="allgather"):
        """Concatenate `tensor` from every rank along axis 0 (sizes may differ)."""
        (tensor,) = self._checked(category, [tensor], COPY_DTYPES)
        return self._counted(category, [tensor], [self._allgather(tensor)])[0]

    def broadcast_variables(self, variables, root_rank=0):
        """Overwrite every variable (tf or Keras) with its value on `root_rank`."""
        if self.size == 1:
            return
        variables = list(variables)
        values = self.broadcast([tf.convert_to_tensor(v) for v in variables],
                                root_rank=root_rank, category="broadcast")
        for variable, value in zip(variables, values):
            variable.assign(value)

    def bytes_sent(self):
        """Bytes handed to collectives so far, per category (Python ints)."""
        return {c: int(v.numpy()) for c, v in self._bytes.items()}

    def collective_calls(self):
        """Number of collective calls so far, per category (Python ints)."""
        return {c: int(v.numpy()) for c, v in self._calls.items()}

    def reset_counters(self):
        for counter in (*self._bytes.values(), *self._calls.values()):
            counter.assign(0)

    @staticmethod
    def _checked(category, tensors, dtypes):
        """`tensors` as tensors; ValueError for an unknown category or a dtype not in
        `dtypes` (what every communicator can send for this collective)."""
        if category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {category!r}")
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        for tensor in tensors:
            if tensor.dtype not in dtypes:
                raise ValueError(f"communicators do not send {tensor.dtype.name} tensors in this "
                                 f"collective; it takes {', '.join(d.name for d in dtypes)}")
        return tensors

    def _counted(self, category, sent, received):
        """Count a collective once it has completed; returns `received`.

        The counters' updates wait for the results, which makes every collective part of
        the stateful work a `tf.function` (or one iteration of Keras's
        `steps_per_execution` loop) finishes before the next one starts. Horovod ops
        are not stateful: without this, a collective whose result only feeds `fit`'s
        logs could still be in flight when the next step issues the same op, and
        Horovod rejects a name that is in flight.
        """
        if self.size == 1:
            return received
        with tf.control_dependencies(received):
            nbytes = tf.add_n([tf.size(t, out_type=tf.int64) * t.dtype.size for t in sent])
            self._bytes[category].assign_add(nbytes)
            self._calls[category].assign_add(1)
        return received

    def _grouped_allreduce_mean(self, tensors):
        raise NotImplementedError

    def _broadcast(self, tensors, root_rank):
        raise NotImplementedError

    def _allgather(self, tensor):
        raise NotImplementedError

    def _alltoall(self, tensor):
        """Row r of `tensor` (shape [size, ...]) to rank r; row r of the result from
        rank r."""
        raise NotImplementedError


class SingleProcess(Communicator):
    """One process: every collective is the identity and sends nothing."""

    def _grouped_allreduce_mean(self, tensors):
        return list(tensors)

    def _broadcast(self, tensors, root_rank):
        return list(tensors)

    def _allgather(self, tensor):
        return tensor


def _counter(name):
    return tf.Variable(0, dtype=tf.int64, trainable=False, name=name)
