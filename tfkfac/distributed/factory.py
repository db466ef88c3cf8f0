"""Choosing the communicator: Horovod when launched as one of several ranks, the
tf.distribute strategy in scope when it has several replicas, else one process."""

import os

import tensorflow as tf

from tfkfac.distributed.base import SingleProcess
from tfkfac.distributed.strategy_comm import StrategyCommunicator, check_supported

KINDS = ("auto", "single", "horovod", "strategy")

# World-size variables set by the launchers: horovodrun (Gloo), Open MPI, MPICH/Intel MPI.
WORLD_SIZE_VARIABLES = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def launched_world_size():
    """Number of ranks the launcher started, from its environment (1 when not launched)."""
    for variable in WORLD_SIZE_VARIABLES:
        if os.environ.get(variable, "").isdigit():
            return int(os.environ[variable])
    return 1


def get_communicator(kind="auto", hierarchical=False):
    """A communicator of `kind`: `single`, `horovod`, `strategy`, or `auto`.

    `strategy` serves the replicas of the `tf.distribute` strategy in scope
    (`MirroredStrategy`, `MultiWorkerMirroredStrategy`). `auto` picks Horovod when the
    launcher started several ranks and `hvd.size() > 1`, else the strategy in scope when
    it has several replicas, otherwise `SingleProcess`. Several launched ranks without an
    importable Horovod is an error rather than a silent fallback: every rank would train
    alone; so is a strategy tfkfac cannot run under.

    `hierarchical`: means in two levels, within each node (host) then across nodes
    (Horovod, or MultiWorkerMirroredStrategy over several hosts; a ValueError otherwise).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "single":
        return _not_hierarchical(SingleProcess(), hierarchical)
    if kind == "strategy" or (kind == "auto" and launched_world_size() == 1):
        return _strategy_communicator(kind, hierarchical)
    try:
        from tfkfac.distributed.horovod_comm import HorovodCommunicator

        communicator = HorovodCommunicator(hierarchical)
    except ImportError as error:
        raise ImportError(
            f"communicator {kind!r} needs horovod.tensorflow (launched world size "
            f"{launched_world_size()}): {error}") from error
    if kind == "auto" and communicator.size == 1:
        return SingleProcess()
    return communicator


def communicator_for(communicator, hierarchical):
    """`communicator`, or `get_communicator("auto", hierarchical)` when None; ValueError
    when a given one does not reduce as `hierarchical` asks (its node groups are made
    with it)."""
    if communicator is None:
        return get_communicator("auto", hierarchical)
    if communicator.hierarchical != hierarchical:
        raise ValueError(
            f"hierarchical_reduction={hierarchical} but the communicator given "
            f"({type(communicator).__name__}) was made with hierarchical="
            f"{communicator.hierarchical}: make it with "
            f"tfkfac.distributed.get_communicator(kind, hierarchical={hierarchical})")
    return communicator


def _not_hierarchical(communicator, hierarchical):
    """`communicator` (one process); ValueError if `hierarchical`."""
    if hierarchical:
        raise ValueError("hierarchical reduction sums within nodes then across them; this "
                         "job is one process, with nothing to reduce: set "
                         "hierarchical_reduction=False")
    return communicator


def _strategy_communicator(kind, hierarchical):
    strategy = tf.distribute.get_strategy()
    if check_supported(strategy) == 1 and kind == "auto":
        return _not_hierarchical(SingleProcess(), hierarchical)
    return StrategyCommunicator(strategy, hierarchical)
