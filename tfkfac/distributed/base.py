"""The communicator interface K-FAC talks to, and its single-process implementation.

A communicator moves tensors between processes; it knows nothing about layers or
Kronecker factors. Byte counters per category let benchmarks report traffic.
"""

import tensorflow as tf


class Communicator:
    """Collective operations on lists of tensors, usable inside `tf.function`."""

    rank = 0
    size = 1

    def grouped_allreduce_mean(self, tensors, category="gradients"):
        """Average each tensor across ranks in one fused call."""
        raise NotImplementedError

    def broadcast(self, tensors, root_rank=0, category="broadcast"):
        """Return each tensor as held by `root_rank`."""
        raise NotImplementedError

    def allgather(self, tensor, category="allgather"):
        """Concatenate `tensor` from every rank along axis 0 (sizes may differ)."""
        raise NotImplementedError


class SingleProcess(Communicator):
    """One process: every collective is the identity and sends nothing."""

    def grouped_allreduce_mean(self, tensors, category="gradients"):
        return list(tensors)

    def broadcast(self, tensors, root_rank=0, category="broadcast"):
        return list(tensors)

    def allgather(self, tensor, category="allgather"):
        return tensor
