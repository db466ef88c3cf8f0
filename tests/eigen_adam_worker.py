"""One rank of the 2-rank job of tests/test_eigen_adam_distributed.py.

Every scenario trains tests/every_block_net.py (every block kind; no BatchNorm, whose
batch statistics would differ from one process's; float64 for eigenbasis Adam, see
DTYPES) with `model.fit` and `tfkfac.KFAC` on the Horovod communicator, on this rank's
half of every global batch of 2B examples, and saves what this rank holds to
`$EIGEN_ADAM_OUT_DIR/<scenario>.rank<r>.npz`, one scenario per case of CASES
(`<placement>_<method>[_grafting_<kind>]`): the trainable weights after STEPS steps
(decompositions every DECOMPOSITION_FREQ steps), every saved optimizer variable
(eigenbasis Adam's moments, under grafting Adam's v) and the counters.
RESTORE_CASE is also saved by rank 0 as a .keras file after RESTORE_AFTER steps, then
loaded (`load_model` + `attach`) on every rank and trained to STEPS again. `run(comm,
case)` with a single-process communicator is the test's reference with batch 2B.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import every_block_net as net  # noqa: E402
from kfac_reference import sgd_kfac  # noqa: E402
import tfkfac  # noqa: E402
from tfkfac import distributed  # noqa: E402

OUT_DIR_VARIABLE = "EIGEN_ADAM_OUT_DIR"
# (placement, method, grafting)
CASES = [("replicated", "eigen_adam", None), ("owner", "eigen_adam", None),
         ("replicated", "eigen", "adam"), ("owner", "eigen", "adam")]
RESTORE_CASE = ("replicated", "eigen_adam", None)
STEPS, BATCH, DECOMPOSITION_FREQ, RESTORE_AFTER = 4, 8, 2, 2  # BATCH: per rank
SETTINGS = dict(learning_rate=0.01, factor_update_freq=1,
                decomposition_update_freq=DECOMPOSITION_FREQ, xla=False)
# Model, state and wire dtype by method. Eigenbasis Adam runs in float64: in float32 the
# summation order alone (one process with its examples permuted) moves its weights by
# 1.2e-4 x max|w| in 4 steps, as rounding turns eigenvectors within nearly degenerate
# eigenvalues, which the elementwise ĝ / (√ŝ + ε) is not invariant to. Grafting over the
# eigen method agrees to 1e-5 in float32.
DTYPES = {"eigen_adam": "float64", "eigen": "float32"}


def name(case):
    placement, method, grafting = case
    return f"{placement}_{method}" + (f"_grafting_{grafting}" if grafting else "")


def rank_examples(comm, steps, dtype):
    """This rank's examples of `steps` global batches of 2B: the rank-th half of each."""
    per_rank = 2 * BATCH // comm.size
    halves = [((image[comm.rank * per_rank:(comm.rank + 1) * per_rank],
                tokens[comm.rank * per_rank:(comm.rank + 1) * per_rank]),
               y[comm.rank * per_rank:(comm.rank + 1) * per_rank])
              for (image, tokens), y in net.batches(steps, 2 * BATCH, seed=5, dtype=dtype)]
    return ([np.concatenate([x[0] for x, _ in halves]),
             np.concatenate([x[1] for x, _ in halves])],
            np.concatenate([y for _, y in halves]), per_rank)


def fit(model, comm, first_step, end_step):
    """Steps `first_step` ... `end_step` - 1 of the STEPS global batches, on this rank's
    examples."""
    x, y, per_rank = rank_examples(comm, STEPS, np.dtype(model.trainable_variables[0].dtype))
    rows = slice(first_step * per_rank, end_step * per_rank)
    model.fit([x[0][rows], x[1][rows]], y[rows], batch_size=per_rank, epochs=1,
              shuffle=False, verbose=0)


def compiled(comm, case):
    placement, method, grafting = case
    dtype = DTYPES[method]
    model = net.every_block_net(seed=7, dtype=dtype, batch_norm=False)
    optimizer = sgd_kfac(communicator=comm, placement=placement, method=method,
                         grafting=grafting, state_dtype=dtype, factor_wire_dtype=dtype,
                         decomposition_wire_dtype=dtype, **SETTINGS).attach(model)
    # The loss in the model's dtype (Keras's default: floatx).
    model.compile(optimizer=optimizer, loss=keras.losses.MeanSquaredError(dtype=dtype))
    return model, optimizer


def state(model, optimizer):
    """Trainable weights, every (saved) optimizer variable, the counters."""
    saved = {f"weight{i:03d}": v.numpy() for i, v in enumerate(model.trainable_variables)}
    saved.update({f"optimizer/{v.name}": v.numpy() for v in optimizer.variables})
    counters = optimizer.counters()
    saved["counters"] = np.asarray([counters[k] for k in ("steps", "factor_updates",
                                                           "decomposition_updates")])
    return saved


def run(comm, case, directory=None):
    """STEPS steps of `case` on this rank's examples (one process: batch 2B). With a
    `directory` (shared by the ranks), rank 0 also saves the model there as a .keras file
    after RESTORE_AFTER steps, and once the run is done every rank loads that file
    (`load_model` + `attach`), keys "loaded/...", and trains it to STEPS, "resumed/..."."""
    model, optimizer = compiled(comm, case)
    if directory is None:
        fit(model, comm, 0, STEPS)
        return state(model, optimizer)
    fit(model, comm, 0, RESTORE_AFTER)
    path = os.path.join(directory, "resume.keras")
    if comm.rank == 0:
        model.save(path)
    comm.grouped_allreduce_mean([tf.ones([1])], category="metrics")  # rank 0 has written
    fit(model, comm, RESTORE_AFTER, STEPS)
    saved = state(model, optimizer)
    loaded = keras.models.load_model(path)
    loaded.optimizer.attach(loaded)
    # The loss again in the model's dtype: a Keras loss does not save its own.
    loaded.compile(optimizer=loaded.optimizer, loss=keras.losses.MeanSquaredError(
        dtype=DTYPES[case[1]]))
    saved.update({f"loaded/{k}": v for k, v in state(loaded, loaded.optimizer).items()})
    fit(loaded, comm, RESTORE_AFTER, STEPS)
    saved.update({f"resumed/{k}": v for k, v in state(loaded, loaded.optimizer).items()})
    return saved


def main(out_dir):
    comm = distributed.get_communicator("auto")
    assert type(comm).__name__ == "HorovodCommunicator" and comm.size == 2, comm
    for case in CASES:
        scenario, start = name(case), time.time()
        saved = run(comm, case, out_dir if case == RESTORE_CASE else None)
        np.savez(os.path.join(out_dir, f"{scenario}.rank{comm.rank}.npz"), **saved)
        print(f"rank {comm.rank}: {scenario} done in {time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
