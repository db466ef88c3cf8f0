"""Trains a tiny model for a few K-FAC steps with the *installed* tfkfac (wheel check).

Run by tools/wheel_check.sh inside a fresh virtual environment, from a directory outside
the repository, so `import tfkfac` must come from that environment's site-packages.
Exits non-zero unless: tfkfac imports from site-packages, the layers are managed, the
loss is finite at every step, and factors and decompositions were updated. Prints one
JSON line with the versions found and the losses.
"""

import json
import math
import os
import sys
import sysconfig

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfkfac  # noqa: E402

STEPS = 6


def main():
    site_packages = os.path.realpath(sysconfig.get_paths()["purelib"])
    location = os.path.realpath(tfkfac.__file__)
    if not location.startswith(site_packages + os.sep):
        sys.exit(f"tfkfac imported from {location}, not from {site_packages}")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(4, 3),
        keras.layers.BatchNormalization(),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(3),
    ])
    optimizer = tfkfac.KFAC(learning_rate=0.05, damping=1e-2, factor_update_freq=1,
                            decomposition_update_freq=2).attach(model)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    images = rng.normal(size=(STEPS * 16, 8, 8, 1)).astype("float32")
    labels = rng.integers(0, 3, size=STEPS * 16)
    losses = [float(model.train_on_batch(images[i * 16:(i + 1) * 16], labels[i * 16:(i + 1) * 16]))
              for i in range(STEPS)]

    summary = optimizer.summary()
    counters = summary["counters"]
    report = {"python": sys.version.split()[0], "tensorflow": tf.__version__,
              "keras": keras.__version__, "tfkfac": tfkfac.__version__, "losses": losses,
              "managed": [block["layer"] for block in summary["managed"]],
              "factor_updates": counters.get("factor_updates"),
              "decomposition_updates": counters.get("decomposition_updates")}
    print(json.dumps(report))
    problems = []
    if not all(math.isfinite(loss) for loss in losses):
        problems.append("non-finite loss")
    if len(summary["managed"]) != 5:
        problems.append(f"expected 5 managed layers, got {summary['managed']}")
    if counters.get("steps") != STEPS or not counters.get("factor_updates") or not counters.get(
            "decomposition_updates"):
        problems.append(f"K-FAC did not run every phase: {counters}")
    if problems:
        sys.exit("wheel smoke test failed: " + "; ".join(problems))


if __name__ == "__main__":
    main()
