"""Adaptive stale statistics (docs/design.md §12): a recorded run and the numpy replay
of the rule, for tests/test_adaptive_staleness.py, and one rank of the 2-rank job of
tests/test_adaptive_staleness_distributed.py.

`train` runs `model.fit` with adaptive stale statistics and records, after every step,
each block's factors, decompositions, interval and next due step, and which train
function the step ran (`stale_steps_worker.chosen_functions`). `replay` applies the rule
in numpy to the recorded factor sequence: which blocks were due at each step, their
intervals and next due steps, which decompositions were recomputed.

As a worker (`$ADAPTIVE_STALENESS_OUT_DIR` set, under horovodrun), each rank trains on
its half of every global batch of 2B under each placement and saves its record to
`<placement>.rank<r>.npz`.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kfac_reference import sgd_kfac  # noqa: E402
from stale_steps_worker import LOSS, chosen_functions  # noqa: E402
from tfkfac import distributed  # noqa: E402

OUT_DIR_VARIABLE = "ADAPTIVE_STALENESS_OUT_DIR"
PLACEMENTS = ("replicated", "owner")
STEPS, BATCH = 40, 16  # BATCH: per process (per rank in the job)
# Factors at least every step, decompositions every 4, intervals up to 8 steps.
BASE, DECOMPOSITION_FREQ, CAP = 1, 4, 8
SETTINGS = dict(learning_rate=0.05, damping=1e-2, method="eigen", factor_decay=0.8,
                factor_update_freq=BASE, decomposition_update_freq=DECOMPOSITION_FREQ,
                max_factor_interval=CAP, xla=False)
# α among the relative changes of this run's refreshes (about 0.03-0.16), so that some
# intervals grow and others shrink.
THRESHOLD = 0.12


def dense_net():
    """Conv2D and two Dense layers (no BatchNorm, whose statistics would differ between
    one process and ranks holding half the batch each)."""
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.Flatten(), keras.layers.Dense(12, activation="tanh"),
        keras.layers.Dense(5)])


def global_batches(steps=STEPS, batch=BATCH):
    """STEPS batches of 2·`batch` examples, (x, y) each with a leading (steps, 2, batch)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps, 2, batch, 8, 8, 1)).astype("float32")
    return x, rng.integers(0, 5, (steps, 2, batch))


class Recorder(keras.callbacks.Callback):
    """After every step: each block's factors, decompositions, interval and next due step."""

    def __init__(self, optimizer):
        super().__init__()
        self.kfac = optimizer
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        curvature = self.kfac.curvature  # the decompositions: in no narrower public API
        managed = self.kfac.summary()["managed"]
        self.steps.append({
            "factors": [[f.numpy() for f in state.factors] for state in curvature.states],
            "decompositions": [[v.numpy() for d in state.decompositions or [] for v in d]
                               for state in curvature.states],
            "intervals": [entry["factor_interval"] for entry in managed],
            "next_steps": [entry["next_factor_step"] for entry in managed]})


def train(x, y, batch, communicator=None, steps_per_execution=1, threshold=THRESHOLD,
          **settings):
    """(model, optimizer, per-step records, the train function each step ran)."""
    model = dense_net()
    optimizer = sgd_kfac(communicator=communicator, stale_threshold=threshold,
                         **dict(SETTINGS, **settings)).attach(model)
    model.compile(optimizer=optimizer, loss=LOSS, steps_per_execution=steps_per_execution)
    recorder = Recorder(optimizer)
    with chosen_functions() as ran:
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                  callbacks=[recorder])
    return model, optimizer, recorder.steps, ran


def relative_change(old, new):
    """max over factors of ||new - old||_F / ||old||_F (eq. 19), float64; inf for old 0."""
    changes = []
    for before, after in zip(old, new):
        before, after = before.astype(np.float64), after.astype(np.float64)
        norm = np.linalg.norm(before.ravel())
        changes.append(np.linalg.norm((after - before).ravel()) / norm if norm > 0
                       else np.inf)
    return max(changes)


def replay(records, threshold=THRESHOLD, base=BASE, cap=CAP,
           decomposition_freq=DECOMPOSITION_FREQ):
    """The rule replayed on the recorded factors: per step, the blocks due, each
    block's relative change where refreshed, the intervals and next due steps after it,
    and the blocks whose decompositions were recomputed."""
    blocks = len(records[0]["factors"])
    intervals, next_steps, pending = [0] * blocks, [0] * blocks, [False] * blocks
    previous = [[np.zeros_like(f) for f in factors] for factors in records[0]["factors"]]
    steps = []
    for step, record in enumerate(records):
        due = [step >= next_steps[b] for b in range(blocks)]
        changes = {}
        for b in range(blocks):
            if not due[b]:
                continue
            changes[b] = relative_change(previous[b], record["factors"][b])
            current = max(intervals[b], base)
            grown = min(2 * current, cap)
            intervals[b] = max(grown if changes[b] < threshold else current // 2, base)
            next_steps[b] = step + intervals[b]
            pending[b] = True
        decomposed = []
        if step % decomposition_freq == 0:
            decomposed = [b for b in range(blocks) if pending[b]]
            pending = [False] * blocks
        steps.append({"due": due, "changes": changes, "intervals": list(intervals),
                      "next_steps": list(next_steps), "decomposed": decomposed,
                      "decomposition_step": step % decomposition_freq == 0})
        previous = record["factors"]
    return steps


def flat_record(records, ran):
    """`train`'s records as arrays for np.savez."""
    arrays = {"ran": np.asarray(ran)}
    for step, record in enumerate(records):
        arrays[f"intervals{step}"] = np.asarray(record["intervals"])
        arrays[f"next_steps{step}"] = np.asarray(record["next_steps"])
        for b, factors in enumerate(record["factors"]):
            for i, factor in enumerate(factors):
                arrays[f"factor{step}_{b}_{i}"] = factor
    return arrays


def records_from(arrays, blocks, factors_per_block):
    """The inverse of `flat_record` (decompositions are not saved)."""
    steps = len([k for k in arrays if k.startswith("intervals")])
    return [{"intervals": list(arrays[f"intervals{step}"]),
             "next_steps": list(arrays[f"next_steps{step}"]),
             "factors": [[arrays[f"factor{step}_{b}_{i}"]
                          for i in range(factors_per_block[b])] for b in range(blocks)]}
            for step in range(steps)]


def main(out_dir):
    comm = distributed.get_communicator("auto")
    assert type(comm).__name__ == "HorovodCommunicator" and comm.size == 2, comm
    x, y = global_batches()
    x, y = x[:, comm.rank].reshape((-1, 8, 8, 1)), y[:, comm.rank].reshape(-1)
    for placement in PLACEMENTS:
        _, _, records, ran = train(x, y, BATCH, communicator=comm, placement=placement)
        np.savez(os.path.join(out_dir, f"{placement}.rank{comm.rank}.npz"),
                 **flat_record(records, ran))
        print(f"rank {comm.rank}: {placement} done", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
