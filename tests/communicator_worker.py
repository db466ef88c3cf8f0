"""One rank of the 2-rank job launched by tests/test_communicator.py.

Runs every communicator path inside `tf.function`, saves what this rank holds to
`$COMMUNICATOR_WORKER_OUT_DIR/rank<r>.npz` for the test to check against numpy, then rank 1 raises on
purpose while rank 0 waits in a collective: the launcher must end the job.
Inputs are functions of the rank only, so the test can rebuild them.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata"))

from resnet_factors import resnet50_factor_dims  # noqa: E402
from tfkfac import distributed  # noqa: E402

GRADIENT_SHAPES = {"float32": [(3,), (2, 4), (5, 1, 2)], "float16": [(4,)], "bfloat16": [(6,)]}
GRADIENT_REPEATS = 3
FACTOR_DIMS = [1, 5, 33]
WIRE_DTYPES = ["float32", "float16", "bfloat16"]
EIGEN_DIMS = [12, 7, 3, 20, 5]
CONDITIONAL_STEPS = [True, False, False, True]
FAILURE_MESSAGE = "rank 1 fails on purpose"
OUT_DIR_VARIABLE = "COMMUNICATOR_WORKER_OUT_DIR"


def rank_gradients(rank):
    rng = np.random.default_rng(100 + rank)
    return {dtype: [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
            for dtype, shapes in GRADIENT_SHAPES.items()}


def random_spd(n, rng):
    x = rng.standard_normal((n, n + 3)).astype(np.float32)
    return (x @ x.T / (n + 3)).astype(np.float32)


def rank_factors(rank):
    rng = np.random.default_rng(200 + rank)
    return [random_spd(n, rng) for n in FACTOR_DIMS]


def shared_eigen_inputs():
    rng = np.random.default_rng(7)
    return [random_spd(n, rng) for n in EIGEN_DIMS]


def check_gradient_allreduce(comm, saved):
    inputs = rank_gradients(comm.rank)
    tensors = [tf.cast(x, dtype) for dtype, xs in inputs.items() for x in xs]

    @tf.function
    def reduce(tensors):
        return comm.grouped_allreduce_mean(tensors, category="gradients")

    comm.reset_counters()
    for _ in range(GRADIENT_REPEATS):
        reduced = reduce(tensors)
    for i, (tensor, result) in enumerate(zip(tensors, reduced)):
        assert result.dtype == tensor.dtype, (result.dtype, tensor.dtype)
        saved[f"gradient_{i}"] = tf.cast(result, tf.float32).numpy()
    saved["gradient_bytes"] = comm.bytes_sent()["gradients"]
    saved["gradient_calls"] = comm.collective_calls()["gradients"]
    # A bfloat16 mean (an allgather on Horovod) of a tensor whose shape is known only
    # when it runs.
    unknown_shape = tf.function(lambda x: comm.grouped_allreduce_mean([x])[0],
                                input_signature=[tf.TensorSpec(None, tf.bfloat16)])
    saved["gradient_unknown_shape_bfloat16"] = tf.cast(
        unknown_shape(tf.cast(inputs["bfloat16"][0], tf.bfloat16)), tf.float32).numpy()


def check_conditional_collectives(comm, saved):
    """A collective inside `tf.cond` next to one outside it (factor vs stale steps)."""
    x = tf.fill([3], float(comm.rank + 1))

    @tf.function
    def step(x, factor_step):
        (gradient,) = comm.grouped_allreduce_mean([x], category="gradients")
        factor = tf.cond(factor_step,
                         lambda: comm.grouped_allreduce_mean([2.0 * x], category="factors")[0],
                         lambda: tf.zeros_like(x))
        return gradient, factor

    comm.reset_counters()
    for i, factor_step in enumerate(CONDITIONAL_STEPS):
        gradient, factor = step(x, tf.constant(factor_step))
        saved[f"conditional_gradient_{i}"] = gradient.numpy()
        saved[f"conditional_factor_{i}"] = factor.numpy()
    saved["conditional_calls"] = np.asarray(
        [comm.collective_calls()[c] for c in ("gradients", "factors")])


def check_factor_allreduce(comm, saved):
    factors = [tf.constant(m) for m in rank_factors(comm.rank)]
    for wire in WIRE_DTYPES:
        reduce = tf.function(lambda *matrices, wire=wire: distributed.allreduce_symmetric(
            comm, matrices, wire_dtype=wire, category="factors"))
        comm.reset_counters()
        for i, result in enumerate(reduce(*factors)):
            saved[f"factor_{wire}_{i}"] = result.numpy()
        saved[f"factor_{wire}_bytes"] = comm.bytes_sent()["factors"]
        saved[f"factor_{wire}_calls"] = comm.collective_calls()["factors"]


def lpt_owners(dims, size):
    """Owner rank of each dims[i] x dims[i] decomposition, as the placements assign them."""
    return distributed.lpt_assignment([distributed.eigen_cost(n) for n in dims], size)


def check_distributed_eigh(comm, saved):
    """Owners decompose their factors, under rank-specific graphs; all ranks get all."""
    owners = lpt_owners(EIGEN_DIMS, comm.size)
    item_owners = [owner for owner in owners for _ in range(2)]
    shapes = [shape for n in EIGEN_DIMS for shape in ((n,), (n, n))]

    @tf.function
    def distributed_eigh(matrices):
        local = []
        for i, matrix in enumerate(matrices):
            if owners[i] == comm.rank:
                with tf.name_scope(f"eigh_{i}"):
                    local += list(tf.linalg.eigh(matrix))
            else:
                local += [None, None]
        with tf.name_scope(f"share_on_rank_{comm.rank}"):
            return distributed.gather_from_owners(comm, local, shapes, item_owners,
                                                  category="decompositions")

    comm.reset_counters()
    results = distributed_eigh([tf.constant(m) for m in shared_eigen_inputs()])
    for i in range(len(EIGEN_DIMS)):
        saved[f"eigenvalues_{i}"] = results[2 * i].numpy()
        saved[f"eigenvectors_{i}"] = results[2 * i + 1].numpy()
    saved["eigen_owners"] = np.asarray(owners)
    saved["eigen_bytes"] = comm.bytes_sent()["decompositions"]

    # One item owned by rank 1: rank 0 contributes an empty buffer.
    only_rank1 = tf.function(lambda: distributed.gather_from_owners(
        comm, [tf.fill([4], 3.5) if comm.rank == 1 else None], [(4,)], [1],
        wire_dtype="bfloat16", category="preconditioned"))
    saved["idle_rank_gather"] = only_rank1()[0].numpy()


def check_broadcasts(comm, saved):
    keras.utils.set_random_seed(comm.rank)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.BatchNormalization()])
    optimizer = keras.optimizers.SGD(momentum=0.9)
    optimizer.build(model.trainable_variables)
    variables = model.variables + optimizer.variables
    for variable in variables:  # Make every variable differ between the ranks.
        variable.assign(variable + tf.cast(5 + comm.rank, variable.dtype))
    for i, variable in enumerate(variables):
        saved[f"variable_before_{i}"] = np.asarray(variable.numpy())
    comm.broadcast_variables(variables, root_rank=0)
    for i, variable in enumerate(variables):
        saved[f"variable_after_{i}"] = np.asarray(variable.numpy())

    from_rank1 = tf.function(lambda x, y: comm.broadcast([x, y], root_rank=1))
    value = float(comm.rank + 1)
    x, y = from_rank1(tf.fill([2, 2], value), tf.fill([3], tf.cast(value + 0.5, tf.bfloat16)))
    saved["broadcast_float32"] = x.numpy()
    saved["broadcast_bfloat16"] = tf.cast(y, tf.float32).numpy()


def fail_on_rank1(comm):
    """Rank 1 raises; rank 0 is left waiting in a collective nobody else will join."""
    wait_in_allreduce = tf.function(lambda x: comm.grouped_allreduce_mean([x]))
    if comm.rank == 1:
        print(f"FAILING_AT {time.time():.3f}", flush=True)
        raise RuntimeError(FAILURE_MESSAGE)
    time.sleep(1.0)
    wait_in_allreduce(tf.ones([3]))


def main(out_dir):
    comm = distributed.get_communicator("auto")
    assert type(comm).__name__ == "HorovodCommunicator" and comm.size == 2, comm
    saved = {"rank": comm.rank,
             "resnet50_owners": np.asarray(lpt_owners(resnet50_factor_dims(), comm.size))}
    check_gradient_allreduce(comm, saved)
    check_conditional_collectives(comm, saved)
    check_factor_allreduce(comm, saved)
    check_distributed_eigh(comm, saved)
    check_broadcasts(comm, saved)
    np.savez(os.path.join(out_dir, f"rank{comm.rank}.npz"), **saved)
    print(f"rank {comm.rank} saved its results", flush=True)
    comm.grouped_allreduce_mean([tf.ones([1])], category="metrics")  # Both ranks saved.
    fail_on_rank1(comm)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
