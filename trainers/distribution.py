"""The engine a training run is distributed over (`--distribution`): its tf.distribute
strategy, its communicator, and this process's part of the data.

- none: one process.
- horovod: one rank per process under horovodrun (tfkfac's Horovod communicator).
- mirrored: `tf.distribute.MirroredStrategy` over this machine's GPUs (one replica on a
  machine without one).
- multi_worker: `tf.distribute.MultiWorkerMirroredStrategy`, one process per worker, each
  with its `TF_CONFIG` (`python -m trainers.launch --engine=multi_worker` writes them on
  one host).
- auto: horovod when launched by horovodrun or mpirun, multi_worker when `TF_CONFIG` is
  set, else none.
A rank is one replica; a process feeds its replicas from its own shard of the data,
`replicas_per_process` batches per step, as a Horovod rank feeds itself.
"""

import functools
import os

import tensorflow as tf

from tfkfac import distributed, validation

DISTRIBUTIONS = ("auto", "none", "horovod", "mirrored", "multi_worker")
_COMMUNICATORS = {"none": "single", "horovod": "horovod", "mirrored": "strategy",
                  "multi_worker": "strategy"}


def resolve(distribution):
    """The engine `distribution` names here ("auto" resolved from the environment)."""
    if distribution != "auto":
        return distribution
    if distributed.launched_world_size() > 1:
        return "horovod"
    return "multi_worker" if os.environ.get("TF_CONFIG") else "none"


def check(distribution, optimizer):
    """ValueError for a combination that cannot train."""
    if resolve(distribution) == "multi_worker" and optimizer != "kfac":
        raise ValueError(
            f"distribution=multi_worker trains optimizer=kfac only: Keras 3's own fit fails "
            f"under MultiWorkerMirroredStrategy (keras-team/keras#20585), which K-FAC's "
            f"train step works around; for optimizer={optimizer} use distribution=horovod, "
            "or a custom training loop")


@functools.lru_cache(maxsize=None)
def _strategy(name):
    """One strategy per process (MultiWorkerMirroredStrategy may be created only once)."""
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


class Engine:
    """The run's strategy (the default one for none/horovod) and communicator; build the
    model and optimizer inside `strategy.scope()`."""

    def __init__(self, distribution):
        validation.one_of(DISTRIBUTIONS)("distribution", distribution)
        self.name = resolve(distribution)
        self.strategy = _strategy(self.name)
        with self.strategy.scope():
            self.communicator = distributed.get_communicator(_COMMUNICATORS[self.name])
        local = len(self.communicator.local_ranks)
        self.replicas_per_process = local
        self.process_index = self.communicator.local_ranks[0] // local
        self.processes = self.communicator.size // local

    def distribute(self, dataset, per_replica_batch):
        """`dataset` (this process's batches, `replicas_per_process` x `per_replica_batch`
        examples each) as `fit` takes it: each replica gets its part of every batch."""
        if self.name in ("none", "horovod"):
            return dataset
        # Batches stay on the host until a step takes them: fetched ahead to the devices,
        # they would be counted as trained (pipelines.counters) before they are.
        return self.strategy.distribute_datasets_from_function(
            lambda context: dataset.rebatch(per_replica_batch)
            if self.replicas_per_process > 1 else dataset,
            options=tf.distribute.InputOptions(experimental_fetch_to_device=False))
