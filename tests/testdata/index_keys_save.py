"""Writes tests/testdata/index_keys: .keras files whose optimizer variables are saved
under index keys ("0", "1", ...: in `KFAC.variables` order), as every tfkfac before the
keys of tfkfac/state.py wrote them (commit f83d94a), with every piece that holds state,
and what that tfkfac's resumed run did next. tests/test_saved_state_compat.py loads
them with today's.

Run it with that tfkfac first on the path:

    git archive f83d94a tfkfac | tar -x -C /tmp/f83d94a
    PYTHONPATH=/tmp/f83d94a python <this file> <checkout>/tests/testdata/index_keys

One process, per placement: method "eigen_adam" with Adam grafting, adaptive stale
statistics and momentum coupling, on tests/test_saved_state_compat.py's Conv2D +
BatchNorm + Dense model, SAVED_AFTER steps of owner_save_v0_2.py's examples, saved as
`<placement>.keras`; that file, loaded (`load_model` + `attach`), takes the remaining
steps on the same batches.
`<placement>_expected.npz` holds the optimizer's variables when saved (`optimizer<i>`,
in order), the examples (`x`, `y`) and the weights the loaded run ended with
(`next_weight<i>`).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kfac_reference import sgd_kfac  # noqa: E402
from owner_save_v0_2 import BATCH, SAVED_AFTER, examples, fit  # noqa: E402 (the same run)
from test_saved_state_compat import LOSS, model_fn  # noqa: E402 (the same model)

PLACEMENTS = ("replicated", "owner")
SETTINGS = dict(learning_rate=0.05, damping=1e-2, method="eigen_adam", grafting="adam",
                stale_threshold=0.1, couple_momentum_to_lr=True, factor_update_freq=1,
                decomposition_update_freq=2, xla=False)


def main(directory):
    os.makedirs(directory, exist_ok=True)
    x, y = examples()
    first, rest = slice(0, SAVED_AFTER * BATCH), slice(SAVED_AFTER * BATCH, None)
    for placement in PLACEMENTS:
        model = model_fn()
        optimizer = sgd_kfac(placement=placement, **SETTINGS).attach(model)
        model.compile(optimizer=optimizer, loss=LOSS)
        fit(model, x[first], y[first])
        path = os.path.join(directory, f"{placement}.keras")
        model.save(path)
        saved = {f"optimizer{i:03d}": v.numpy() for i, v in enumerate(optimizer.variables)}
        loaded = keras.models.load_model(path)
        loaded.optimizer.attach(loaded)
        fit(loaded, x[rest], y[rest])
        np.savez(os.path.join(directory, f"{placement}_expected.npz"), x=x, y=y, **saved,
                 **{f"next_weight{i:03d}": w for i, w in enumerate(loaded.get_weights())})


if __name__ == "__main__":
    main(sys.argv[1])
