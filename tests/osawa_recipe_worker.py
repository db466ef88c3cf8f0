"""One rank of the 2-rank job of tests/test_osawa_recipe_distributed.py.

For each placement, `model.fit` trains tests/distributed_kfac_worker.py's small CNN
(Conv2D and two Dense layers, no BatchNorm: its batch statistics would differ per rank)
with weight rescaling and the momentum coupled to a decaying learning rate, on this
rank's half of each global batch of fixed Fashion-MNIST examples. Saved to
`$OSAWA_RECIPE_OUT_DIR/<placement>.rank<r>.npz`: the model's and the optimizer's
variables. With a single-process communicator `run` is the 1-process reference on the
global batches.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distributed_kfac_worker as kfac_worker  # noqa: E402
import job_results  # noqa: E402

OUT_DIR_VARIABLE = "OSAWA_RECIPE_OUT_DIR"
PLACEMENTS = ("replicated", "owner")
STEPS, GLOBAL_BATCH = 6, 32
# The rescaled kernels and their output widths (Conv2D filters, Dense units).
RESCALED = {"small_cnn/conv/kernel": 4, "small_cnn/hidden/kernel": 32,
            "small_cnn/logits/kernel": 10}
INITIAL_RATE = 0.05


def run(comm, placement):
    """{"weight/<path>": ..., "optimizer/<i>": ...} after STEPS steps on this rank's
    part of each global batch."""
    x, y = kfac_worker.fixed_examples(STEPS * GLOBAL_BATCH)
    model = kfac_worker.small_cnn(seed=7, batch_norm=False)
    optimizer = kfac_worker.compiled(
        model, comm, placement=placement, factor_update_freq=1, decomposition_update_freq=2,
        weight_rescaling=True, couple_momentum_to_lr=True,
        learning_rate=keras.optimizers.schedules.ExponentialDecay(INITIAL_RATE, 1, 0.8))
    model.fit(kfac_worker.rank_part(x, GLOBAL_BATCH, comm.rank, comm.size),
              kfac_worker.rank_part(y, GLOBAL_BATCH, comm.rank, comm.size),
              batch_size=GLOBAL_BATCH // comm.size, epochs=1, shuffle=False, verbose=0)
    saved = {f"weight/{v.path}": v.numpy() for v in model.variables}
    saved.update({f"optimizer/{i:03d}": np.asarray(v.numpy())
                  for i, v in enumerate(optimizer.variables)})
    saved["peak_learning_rate"] = np.asarray(
        [v.numpy() for v in optimizer.variables if v.name == "peak_learning_rate"])
    return saved


def main(out_dir):
    job_results.save_each_placement(out_dir, PLACEMENTS, run)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
