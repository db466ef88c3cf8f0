"""One rank of the 2-rank job of tests/test_sampled_fisher_distributed.py.

Both ranks train the same two-layer net with `model.fit` and KFAC(fisher="sampled") on
the same batches (so that only their draws can tell them apart), factors every step:
one step, then STEPS - 1 more. Saved to `$SAMPLED_FISHER_OUT_DIR/sampled.rank<r>.npz`:
both layers' G after the first step, then every weight and optimizer variable.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kfac_reference import sgd_kfac  # noqa: E402
from tfkfac import distributed  # noqa: E402

OUT_DIR_VARIABLE = "SAMPLED_FISHER_OUT_DIR"
STEPS, BATCH, CLASSES = 3, 64, 3
LAYERS = ("hidden", "out")
SETTINGS = dict(fisher="sampled", factor_update_freq=1, decomposition_update_freq=1,
                method="eigen", damping=1e-2, xla=False)


def net():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(4, activation="tanh", name="hidden"),
        keras.layers.Dense(CLASSES, name="out")])


def batches():
    """STEPS batches of BATCH examples, the same on every rank."""
    rng = np.random.default_rng(0)
    return (rng.normal(size=(STEPS * BATCH, 5)).astype("float32"),
            rng.integers(0, CLASSES, STEPS * BATCH))


def first_step_and_rest(comm):
    """({layer: G after the first step}, the model, the optimizer after STEPS steps)."""
    model = net()
    optimizer = sgd_kfac(communicator=comm, **SETTINGS).attach(model)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = batches()
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    first = {layer: optimizer.factors(layer)["G"].numpy() for layer in LAYERS}
    model.fit(x[BATCH:], y[BATCH:], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return first, model, optimizer


def main(out_dir):
    comm = distributed.get_communicator("auto")
    assert type(comm).__name__ == "HorovodCommunicator" and comm.size == 2, comm
    first, model, optimizer = first_step_and_rest(comm)
    arrays = {f"first_G_{layer}": g for layer, g in first.items()}
    arrays.update({f"weight{i}": v.numpy() for i, v in enumerate(model.variables)})
    arrays.update({f"optimizer{i}": v.numpy() for i, v in enumerate(optimizer.variables)})
    np.savez(os.path.join(out_dir, f"sampled.rank{comm.rank}.npz"), **arrays)
    print(f"rank {comm.rank}: done", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
