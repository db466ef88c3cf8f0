"""One rank of the 2-rank K-FAC job launched by tests/test_plan.py.

For each case (placement, factor wire, decomposition wire, method) the model below trains
STEPS steps with `model.fit` on the Horovod communicator (factors every FACTOR_INTERVAL
steps, decompositions every DECOMPOSITION_INTERVAL) and this rank saves the bytes its
communicator counted per category after every step to
`$PLAN_WORKER_OUT_DIR/<case>.rank<r>.npz`. The test predicts the same bytes with the
planner. Inputs are random: what crosses the wire does not depend on them.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfkfac  # noqa: E402
from tfkfac import distributed  # noqa: E402

OUT_DIR_VARIABLE = "PLAN_WORKER_OUT_DIR"
CASES = (("replicated", "float32", "float32", "eigen"),
         ("owner", "float16", "bfloat16", "inverse"),
         ("replicated", "bfloat16", "float16", "inverse"))
STEPS, BATCH, FACTOR_INTERVAL, DECOMPOSITION_INTERVAL = 5, 8, 2, 4
INPUT_SHAPE = (12, 12, 2)


def case_name(case):
    return "_".join(case)


def build_model():
    """Conv2D + BatchNorm (a diagonal factor, moving statistics averaged with the
    gradients), a grouped Conv2D (batched factor pairs), two Dense layers."""
    return keras.Sequential([
        keras.Input(INPUT_SHAPE),
        keras.layers.Conv2D(6, 3, activation="relu", name="conv"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.Conv2D(6, 3, strides=2, groups=2, activation="relu", name="grouped"),
        keras.layers.Flatten(),
        keras.layers.Dense(12, activation="relu", name="hidden"),
        keras.layers.Dense(5, name="logits")], name="plan_worker")


class Bytes(keras.callbacks.Callback):
    """The communicator's bytes per category after every step, from the first step on."""

    def __init__(self, comm):
        super().__init__()
        self.comm, self.after = comm, []

    def on_train_begin(self, logs=None):
        self.comm.reset_counters()  # after attach's broadcast

    def on_train_batch_end(self, batch, logs=None):
        sent = self.comm.bytes_sent()
        self.after.append([sent[c] for c in distributed.CATEGORIES])


def main():
    comm = distributed.get_communicator("horovod")
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((STEPS * BATCH,) + INPUT_SHAPE).astype(np.float32)
    y = rng.integers(0, 5, STEPS * BATCH)
    for case in CASES:
        placement, factor_wire, decomposition_wire, method = case
        keras.utils.set_random_seed(0)
        model = build_model()
        optimizer = tfkfac.KFAC(
            inner_optimizer=keras.optimizers.SGD(0.01, momentum=0.9), damping=0.1,
            kl_clip=1e-3, placement=placement, factor_wire_dtype=factor_wire,
            decomposition_wire_dtype=decomposition_wire, method=method,
            factor_update_freq=FACTOR_INTERVAL,
            decomposition_update_freq=DECOMPOSITION_INTERVAL, communicator=comm).attach(model)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        counter = Bytes(comm)
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[counter])
        np.savez(os.path.join(os.environ[OUT_DIR_VARIABLE],
                              f"{case_name(case)}.rank{comm.rank}.npz"),
                 after=np.asarray(counter.after, np.int64))


if __name__ == "__main__":
    main()
