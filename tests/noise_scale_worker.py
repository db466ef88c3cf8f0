"""One rank of the 2-rank job of tests/test_noise_scale.py.

K-FAC (placement "replicated") trains the linear regression of
tests/noise_scale_reference.py at learning rate 0 with `model.fit` and a
`tfkfac.GradientNoiseScale`, on this rank's half of every global batch of 2·BATCH (rank
0 the first half, the one a single process takes as its first half). Saved to
`$NOISE_SCALE_OUT_DIR/logs.rank<r>.npz`: the epoch's logged noise scales, and the error
placement "owner" gives for the preconditioned one.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS_DIR))
sys.path.insert(0, TESTS_DIR)

import noise_scale_reference as reference  # noqa: E402
import tfkfac  # noqa: E402
from tfkfac import distributed  # noqa: E402

OUT_DIR_VARIABLE = "NOISE_SCALE_OUT_DIR"
STEPS, BATCH = 6, 8  # BATCH: per rank
SETTINGS = dict(method="eigen", damping=1e-2, factor_update_freq=10 ** 6,
                decomposition_update_freq=10 ** 6, kl_clip=None)


def global_data():
    """(x, y) of STEPS global batches of 2·BATCH."""
    return reference.data(STEPS, 2 * BATCH, seed=3)


def rank_data(rank):
    """This rank's half of each global batch."""
    x, y = global_data()
    halves = lambda a: a.reshape((STEPS, 2, BATCH) + a.shape[1:])[:, rank].reshape(
        (STEPS * BATCH,) + a.shape[1:])
    return halves(x), halves(y)


def train(comm, placement):
    """The epoch logs of `fit` with a GradientNoiseScale."""
    model = reference.model()
    optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(0.0), communicator=comm,
                            placement=placement, **SETTINGS).attach(model)
    model.compile(optimizer=optimizer, loss="mean_squared_error")
    x, y = rank_data(comm.rank)
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                        callbacks=[tfkfac.GradientNoiseScale()])
    return {name: np.asarray(values[0]) for name, values in history.history.items()}


def main(out_dir):
    comm = distributed.get_communicator("auto")
    assert type(comm).__name__ == "HorovodCommunicator" and comm.size == 2, comm
    arrays = train(comm, "replicated")
    try:
        train(comm, "owner")
        arrays["owner_error"] = np.asarray("no error")
    except ValueError as error:
        arrays["owner_error"] = np.asarray(str(error))
    np.savez(os.path.join(out_dir, f"logs.rank{comm.rank}.npz"), **arrays)
    print(f"rank {comm.rank}: done", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
