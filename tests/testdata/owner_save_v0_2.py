"""Writes tests/testdata/owner_v0_2: saves of a run under placement "owner" by a tfkfac
that saved no rebuild state for an owner (0.2.0, commit 8f916f8), and what that
tfkfac's resumed run did next. tests/test_resume_matrix.py loads them with today's.

Run it with that tfkfac first on the path, from a worktree of the commit:

    git worktree add /tmp/v0_2 8f916f8
    cd /tmp/v0_2 && PYTHONPATH=/tmp/v0_2 python <this file> <checkout>/tests/testdata/owner_v0_2

One process, method "eigen_adam" (whose eigenbasis moments that tfkfac did not save
under "owner" either), on tests/test_saved_state_compat.py's Conv2D + BatchNorm + Dense
model: SAVED_AFTER steps (factors every step, decompositions every 4), saved as
`model.keras` and as a `tf.train.Checkpoint` (`ckpt`); then the .keras file, loaded
(`load_model` + `attach`), takes the remaining steps on the same batches.
`expected.npz` holds the examples (`x`, `y`) and the weights it ended with
(`next_weight<i>`).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kfac_reference import sgd_kfac  # noqa: E402
from test_saved_state_compat import LOSS, model_fn  # noqa: E402,F401 (the same model)

STEPS, SAVED_AFTER, BATCH = 4, 2, 16
SETTINGS = dict(learning_rate=0.05, damping=1e-2, method="eigen_adam", placement="owner",
                factor_update_freq=1, decomposition_update_freq=4, xla=False)


def examples():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(STEPS * BATCH, 6, 6, 1)).astype(np.float32),
            rng.integers(0, 4, size=STEPS * BATCH))


def fit(model, x, y):
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)


def main(directory):
    os.makedirs(directory, exist_ok=True)
    x, y = examples()
    model = model_fn()
    optimizer = sgd_kfac(**SETTINGS).attach(model)
    model.compile(optimizer=optimizer, loss=LOSS)
    fit(model, x[:SAVED_AFTER * BATCH], y[:SAVED_AFTER * BATCH])
    model.save(os.path.join(directory, "model.keras"))
    tf.train.Checkpoint(model=model, optimizer=optimizer).write(
        os.path.join(directory, "ckpt"))
    loaded = keras.models.load_model(os.path.join(directory, "model.keras"))
    loaded.optimizer.attach(loaded)
    fit(loaded, x[SAVED_AFTER * BATCH:], y[SAVED_AFTER * BATCH:])
    np.savez(os.path.join(directory, "expected.npz"), x=x, y=y,
             **{f"next_weight{i:03d}": w for i, w in enumerate(loaded.get_weights())})


if __name__ == "__main__":
    main(sys.argv[1])
