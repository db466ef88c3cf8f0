"""The reduction options (`overlap_reduction`, `hierarchical_reduction`) on several ranks:
one process of the jobs of tests/test_reduction_options.py, on both engines: a Horovod
rank that is also a MultiWorkerMirroredStrategy worker (one start-up of each process for
both engines' runs).

Each run fits the model of tests/plan_worker.py (a convolution with BatchNorm, whose
diagonal factor `Eigen` and `Inverse` precondition with, a grouped convolution, two Dense
layers) for STEPS steps on global batches of `ranks` x BATCH examples (each rank its
part): factors every step, decompositions every DECOMPOSITION_INTERVAL steps, so that the
steps between take the overlapped path. It saves the weights, the factors and the
communicator's bytes and calls per category after the fit.
- Overlap jobs (`horovodrun -np 2`, the 2 processes also 2 MultiWorkerMirroredStrategy
  workers): OVERLAP_RUNS, each placement and method with the option off and on.
- The hierarchical jobs (`horovodrun -np 4` as 2 nodes of 2 ranks: HOSTS; the
  MultiWorkerMirroredStrategy workers 2 and 3 on host 127.0.0.1): `exchange`
  (`exchange_flat` without the option), a mean of `rank_vector`s in float32 and float64
  (counted as "factors"), and HIERARCHICAL_RUNS.
The MultiWorkerMirroredStrategy workers listen on the ports in $REDUCTION_OPTIONS_PORTS.
`main` saves `<engine>_<run>.rank<r>.npz` (ENGINES) to $REDUCTION_OPTIONS_OUT_DIR.
"""

import contextlib
import json
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)
sys.path.insert(0, os.path.dirname(TESTS_DIR))

import plan_worker  # noqa: E402
import tfkfac  # noqa: E402
from tfkfac import distributed  # noqa: E402
from trainers.launch import tf_config  # noqa: E402

OUT_DIR_VARIABLE = "REDUCTION_OPTIONS_OUT_DIR"
JOB_VARIABLE = "REDUCTION_OPTIONS_JOB"  # "overlap" or "hierarchical"
PORTS_VARIABLE = "REDUCTION_OPTIONS_PORTS"  # "port0,port1,...": one per worker
ENGINES = ("horovod", "multi_worker")
HOSTS = "localhost:2,127.0.0.1:2"  # two "nodes" of 2 ranks for horovodrun -H
STEPS, BATCH, DECOMPOSITION_INTERVAL = 3, 8, 2
# name: (placement, method, overlap_reduction).
OVERLAP_RUNS = {f"{placement}_{method}_{'overlap' if overlap else 'plain'}":
                (placement, method, overlap)
                for placement, method in (("replicated", "eigen"), ("owner", "inverse"),
                                          ("owner", "eigen_adam"))
                for overlap in (False, True)}
HIERARCHICAL_RUNS = {"flat": False, "hierarchical": True}
EXCHANGE_DTYPES = ("float32", "float64")
FACTOR_NAME = re.compile(r"_factor\d+$")


def rank_vector(rank, dtype):
    """Rank `rank`'s input to the exchange (37 values: not a multiple of 2 ranks per node)."""
    values = np.random.default_rng(rank).standard_normal(37) * 100
    return values.astype(dtype)


def examples(ranks):
    """STEPS global batches of `ranks` x BATCH inputs and labels (the same on every rank)."""
    rng = np.random.default_rng(0)
    count = STEPS * ranks * BATCH
    return (rng.standard_normal((count,) + plan_worker.INPUT_SHAPE).astype(np.float32),
            rng.integers(0, 5, count))


def run_fit(comm, strategy, **settings):
    """What this process holds after a K-FAC fit with `settings`: weights, factors, and
    the bytes and calls counted per category during the fit."""
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    with scope:
        keras.utils.set_random_seed(0)
        model = plan_worker.build_model()
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                                damping=0.1, kl_clip=1e-3, factor_update_freq=1,
                                decomposition_update_freq=DECOMPOSITION_INTERVAL,
                                communicator=comm, **settings).attach(model)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = examples(comm.size)
    comm.reset_counters()  # after attach's broadcast
    if strategy is not None:  # the strategy gives each replica its part
        model.fit(x, y, batch_size=comm.size * BATCH, shuffle=False, verbose=0)
    else:
        part = lambda a: a.reshape((STEPS, comm.size, BATCH) + a.shape[1:])[
            :, comm.rank].reshape((-1,) + a.shape[1:])
        model.fit(part(x), part(y), batch_size=BATCH, shuffle=False, verbose=0)
    held = lambda variables: [np.asarray(v.numpy()) for v in variables]
    saved = {f"weight{i}": w for i, w in enumerate(held(model.trainable_variables))}
    saved.update({f"factor{i}": f for i, f in enumerate(held(
        [v for v in optimizer.variables if FACTOR_NAME.search(v.path)]))})
    saved["bytes"] = np.asarray([comm.bytes_sent()[c] for c in distributed.CATEGORIES])
    saved["calls"] = np.asarray([comm.collective_calls()[c] for c in distributed.CATEGORIES])
    saved["kfac_counters"] = np.asarray([optimizer.counters()[k] for k in (
        "factor_updates", "decomposition_updates")])
    return saved


def run_exchange(comm):
    """The mean of every rank's `rank_vector` in each of EXCHANGE_DTYPES, in one call."""
    comm.reset_counters()
    means = tf.function(lambda: comm.grouped_allreduce_mean(
        [tf.constant(rank_vector(comm.rank, dtype)) for dtype in EXCHANGE_DTYPES],
        category="factors"))()
    saved = {dtype: m.numpy() for dtype, m in zip(EXCHANGE_DTYPES, means)}
    saved["bytes"] = np.asarray([comm.bytes_sent()[c] for c in distributed.CATEGORIES])
    saved["calls"] = np.asarray([comm.collective_calls()[c] for c in distributed.CATEGORIES])
    return saved


def as_two_hosts(tf_config):
    """`tf_config` (JSON) with its second half of workers on host 127.0.0.1: the same
    machine under another name, a second node to the communicator."""
    config = json.loads(tf_config)
    workers = config["cluster"]["worker"]
    config["cluster"]["worker"] = [
        address if i < len(workers) // 2 else "127.0.0.1:" + address.rsplit(":", 1)[1]
        for i, address in enumerate(workers)]
    return json.dumps(config)


def overlap_runs(comm, strategy):
    return {name: (lambda p=placement, m=method, o=overlap: run_fit(
        comm, strategy, placement=p, method=m, overlap_reduction=o))
        for name, (placement, method, overlap) in OVERLAP_RUNS.items()}


def hierarchical_runs(make_comm, strategy):
    """The exchange on a hierarchical and a flat communicator, then a fit on each; each
    fit makes its own: a second hierarchical one in the process shares the first one's
    groups."""
    comms = {hierarchical: make_comm(hierarchical) for hierarchical in (True, False)}
    return {"exchange": lambda: run_exchange(comms[True]),
            "exchange_flat": lambda: run_exchange(comms[False]), **{
                name: (lambda h=hierarchical: run_fit(make_comm(h), strategy,
                                                      hierarchical_reduction=h))
                for name, hierarchical in HIERARCHICAL_RUNS.items()}}


def multi_worker_strategy(rank, job):
    """This process's MultiWorkerMirroredStrategy, as worker `rank` of the localhost
    workers on $REDUCTION_OPTIONS_PORTS (hierarchical: the second half on 127.0.0.1).
    Made before TensorFlow runs anything, as the strategy must be."""
    ports = [int(port) for port in os.environ[PORTS_VARIABLE].split(",")]
    config = tf_config(ports, rank)
    os.environ["TF_CONFIG"] = as_two_hosts(config) if job == "hierarchical" else config
    return tf.distribute.MultiWorkerMirroredStrategy()


def runs():
    """(rank, {engine: {run: function returning what this process saves}}) of this
    process's job."""
    job = os.environ[JOB_VARIABLE]
    rank = int(os.environ["HOROVOD_RANK"])
    strategy = multi_worker_strategy(rank, job)

    def strategy_comm(hierarchical=False):
        with strategy.scope():
            return distributed.StrategyCommunicator(strategy, hierarchical)

    horovod_comm = lambda hierarchical=False: distributed.get_communicator("horovod",
                                                                          hierarchical)
    assert strategy_comm().local_ranks == (rank,), "worker index is not the Horovod rank"
    if job == "overlap":
        return rank, {"horovod": overlap_runs(horovod_comm(), None),
                      "multi_worker": overlap_runs(strategy_comm(), strategy)}
    # The hierarchical communicator first: it initializes Horovod with dynamic sets.
    return rank, {"horovod": hierarchical_runs(horovod_comm, None),
                  "multi_worker": hierarchical_runs(strategy_comm, strategy)}


def main(out_dir):
    rank, engines = runs()
    for engine, scheduled in engines.items():
        for name, run in scheduled.items():
            np.savez(os.path.join(out_dir, f"{engine}_{name}.rank{rank}.npz"), **run())
            print(f"rank {rank}: {engine} {name} saved", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
