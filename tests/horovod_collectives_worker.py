"""One rank of a real 2-process Horovod job (launched by test_horovod_collectives.py).

Checks grouped_allreduce over three shapes, allgather of uneven sizes and broadcast,
eagerly and inside tf.function, against numpy values every rank computes for itself.
Prints one success line per rank; any mismatch raises, so the rank exits non-zero.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # pylint: disable=wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position

SHAPES = ((3,), (2, 4), (2, 3, 5))


def rank_tensors(rank):
    """Rank-dependent float32 tensors of the three shapes (rank r scales by r + 1)."""
    return [np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * (rank + 1) + 0.5 * i
            for i, shape in enumerate(SHAPES)]


def rank_rows(rank):
    """Rank r contributes r + 1 rows (uneven sizes) of 3 values starting at 100 r."""
    return (100 * rank + np.arange(3 * (rank + 1), dtype=np.float32)).reshape(rank + 1, 3)


def check_collectives(rank, size, compile_fn):
    grouped = compile_fn(lambda ts: hvd.grouped_allreduce(ts, op=hvd.Sum))
    averaged = compile_fn(lambda ts: hvd.grouped_allreduce(ts, op=hvd.Average))
    gather = compile_fn(hvd.allgather)
    broadcast = compile_fn(lambda t: hvd.broadcast(t, root_rank=0))

    mine = [tf.constant(t) for t in rank_tensors(rank)]
    everyone = [rank_tensors(r) for r in range(size)]
    expected_sum = [sum(ts[i] for ts in everyone) for i in range(len(SHAPES))]
    for got, want in zip(grouped(mine), expected_sum):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    for got, want in zip(averaged(mine), expected_sum):
        np.testing.assert_allclose(got.numpy(), want / size, rtol=1e-6)

    gathered = gather(tf.constant(rank_rows(rank))).numpy()
    np.testing.assert_array_equal(gathered, np.concatenate([rank_rows(r) for r in range(size)]))
    assert gathered.shape == (size * (size + 1) // 2, 3), gathered.shape

    local = np.full((2, 3), 7.0 + rank, dtype=np.float32) if rank == 0 else np.zeros((2, 3),
                                                                                     np.float32)
    np.testing.assert_array_equal(broadcast(tf.constant(local)).numpy(), np.full((2, 3), 7.0))


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert size == 2, f"expected 2 ranks, got {size}"
    for mode, compile_fn in (("eager", lambda fn: fn), ("tf.function", tf.function)):
        check_collectives(rank, size, compile_fn)
        print(f"rank {rank} of {size}: collectives OK ({mode})", flush=True)


if __name__ == "__main__":
    main()
