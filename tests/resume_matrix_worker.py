"""The runs of tests/test_resume_matrix.py: a K-FAC run resumed from a checkpoint ends as
the uninterrupted run, for every method x placement, on any engine.

A cell (method, placement) trains tests/distributed_kfac_worker.py's small_cnn with
BatchNorm (a diagonal block beside three Kronecker ones; under "owner" on 2 ranks one
rank owns the hidden layer, the other the rest) on fixed Fashion-MNIST global batches for
STEPS steps, factors every FACTOR_FREQ steps and decompositions every DECOMPOSITION_FREQ.
A callback writes a `tf.train.Checkpoint(model=..., optimizer=...)` (as
trainers/checkpoints.py does) after RESUME_AT steps: right after a factor step, between
two decomposition steps, where a resumed owner that recomputed its decompositions from
the restored factors would leave the uninterrupted run. A fresh model and optimizer,
built first (as trainers/ does), read it and take the remaining steps.

`Engine(comm)` runs a cell on Horovod (this rank's part of every global batch) or in one
process (`SingleProcess`, the global batch); `Engine(strategy=...)` under a tf.distribute
strategy (Keras splits the global batch). `main` is one rank of the test's Horovod job:
every cell (also through a .keras file), and `run_narrow_wire`, saved to
$RESUME_MATRIX_OUT_DIR/<scenario>.rank<r>.npz.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)
sys.path.insert(0, os.path.dirname(TESTS_DIR))

import distributed_kfac_worker as horovod_suite  # noqa: E402
import every_block_net  # noqa: E402
from test_saved_state_compat import saved_optimizer_state  # noqa: E402
from kfac_reference import sgd_kfac  # noqa: E402
from tfkfac import distributed  # noqa: E402

OUT_DIR_VARIABLE = "RESUME_MATRIX_OUT_DIR"
# Method name -> KFAC settings; "grafted": Adam's step length on the eigen direction.
METHODS = {"eigen": dict(method="eigen"), "inverse": dict(method="inverse"),
           "eigen_adam": dict(method="eigen_adam"),
           "grafted": dict(method="eigen", grafting="adam")}
PLACEMENTS = ("replicated", "owner")
CELLS = [(method, placement) for method in METHODS for placement in PLACEMENTS]
# Factors at 0, 2, 4, ...; decompositions at 0, 4, 8: the checkpoint after step 5 holds
# the factors of step 4, and the resumed run's first step (6) updates them again.
STEPS, RESUME_AT, FACTOR_FREQ, DECOMPOSITION_FREQ, GLOBAL_BATCH = 12, 6, 2, 4, 32
WIRE_STEPS = 2
SETTINGS = dict(learning_rate=0.05, damping=1e-2, factor_update_freq=FACTOR_FREQ,
                decomposition_update_freq=DECOMPOSITION_FREQ, xla=False)


def name(cell):
    return "_".join(cell)


class Engine:
    """Where a cell runs: Horovod or one process (`comm`), or a tf.distribute `strategy`
    (its own communicator)."""

    def __init__(self, comm=None, strategy=None):
        self.comm, self.strategy = comm, strategy or tf.distribute.get_strategy()
        self.chief = comm is None or comm.rank == 0

    def examples(self):
        """(x, y, batch): this process's examples of STEPS global batches, in order."""
        x, y = horovod_suite.fixed_examples(STEPS * GLOBAL_BATCH)
        ranks = 1 if self.comm is None else self.comm.size
        if ranks == 1:
            return x, y, GLOBAL_BATCH
        part = lambda a: horovod_suite.rank_part(a, GLOBAL_BATCH, self.comm.rank, ranks)
        return part(x), part(y), GLOBAL_BATCH // ranks

    def fresh(self, cell, **overrides):
        """A new compiled model and its built KFAC of `cell`, and their checkpoint."""
        method, placement = cell
        with self.strategy.scope():
            model = horovod_suite.small_cnn(seed=7, batch_norm=True)
            optimizer = sgd_kfac(communicator=self.comm, placement=placement, **dict(
                SETTINGS, **METHODS[method], **overrides)).attach(model)
            model.compile(optimizer=optimizer, loss=horovod_suite.LOSS)
            optimizer.build(model.trainable_variables)
        return model, optimizer, tf.train.Checkpoint(model=model, optimizer=optimizer)

    def copies(self, variable):
        """The value of `variable` on every replica of this process."""
        return [np.asarray(value) for value in
                self.strategy.experimental_local_results(variable.value)]

    def barrier(self):
        """Returns once every rank reached it (the chief has written its checkpoint)."""
        if self.comm is not None:
            self.comm.grouped_allreduce_mean([tf.ones([1])], category="metrics")


class CallAfter(keras.callbacks.Callback):
    """Calls `function()` once `steps` training steps are done."""

    def __init__(self, steps, function):
        super().__init__()
        self.steps, self.function = steps, function

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.steps - 1:
            self.function()


def snapshot(engine, model, optimizer):
    """Every replica's copy (key suffix @<replica>) of the model's variables, the
    optimizer's (in save order) and the decompositions this process holds; the counters."""
    arrays = {}

    def add(key, variable):
        for replica, value in enumerate(engine.copies(variable)):
            arrays[f"{key}@{replica}"] = value

    for i, variable in enumerate(model.variables):
        add(f"weight{i:03d}", variable)
    for i, variable in enumerate(optimizer.variables):
        add(f"optimizer{i:03d}_{variable.name}", variable)
    # Private: no public API shows the decompositions a rank holds (an owner's own).
    for b, state in enumerate(optimizer.curvature.states):
        for j, decomposition in enumerate(state.decompositions or []):
            for k, variable in enumerate(decomposition):
                add(f"decomposition{b}_{j}_{k}", variable)
    arrays.update({f"counter_{k}": np.asarray(v) for k, v in optimizer.counters().items()})
    return arrays


def run_cell(engine, cell, directory, keras_file=False):
    """{"uninterrupted/<key>", "resumed/<key>": `snapshot`} of `cell`: STEPS steps, and
    RESUME_AT steps, a checkpoint (written by the chief into `directory`), a fresh model
    and optimizer restored from it, STEPS - RESUME_AT more. With `keras_file`, the chief
    also saves a .keras file there, and every process loads it (`load_model` +
    `attach`) and takes the same steps: "keras_resumed/<key>", and "keras_keys", the
    keys of the optimizer's variables in the file."""
    x, y, batch = engine.examples()
    path = os.path.join(directory, name(cell))
    model, optimizer, checkpoint = engine.fresh(cell)

    def save():
        if engine.chief:
            checkpoint.write(path)
            if keras_file:
                model.save(f"{path}.keras")

    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[CallAfter(RESUME_AT, save)])
    arrays = {f"uninterrupted/{k}": v for k, v in snapshot(engine, model, optimizer).items()}
    engine.barrier()
    model, optimizer, checkpoint = engine.fresh(cell)
    checkpoint.read(path).assert_existing_objects_matched()
    rest = slice(RESUME_AT * batch, None)
    model.fit(x[rest], y[rest], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    arrays.update({f"resumed/{k}": v for k, v in snapshot(engine, model, optimizer).items()})
    if keras_file:
        arrays["keras_keys"] = np.array(sorted(saved_optimizer_state(f"{path}.keras")))
        model = keras.models.load_model(f"{path}.keras")
        model.optimizer.attach(model)
        model.fit(x[rest], y[rest], batch_size=batch, epochs=1, shuffle=False, verbose=0)
        arrays.update({f"keras_resumed/{k}": v
                       for k, v in snapshot(engine, model, model.optimizer).items()})
    return arrays


def run_narrow_wire(engine):
    """WIRE_STEPS steps of eigen_adam under "owner" with a bfloat16 decomposition wire:
    the eigenbasis moments each rank holds, and the bytes and calls of the gathers of
    preconditioned gradients (which carry the moments)."""
    x, y, batch = engine.examples()
    model, optimizer, _ = engine.fresh(("eigen_adam", "owner"),
                                       decomposition_wire_dtype="bfloat16")
    engine.comm.reset_counters()
    rows = slice(0, WIRE_STEPS * batch)
    model.fit(x[rows], y[rows], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    arrays = {f"moment_{v.name}": v.numpy() for v in optimizer.variables
              if every_block_net.is_eigenbasis_moment(v.name)}
    arrays["bytes"] = np.asarray(engine.comm.bytes_sent()["preconditioned"])
    arrays["calls"] = np.asarray(engine.comm.collective_calls()["preconditioned"])
    return arrays


def main(out_dir):
    comm = distributed.get_communicator("auto")
    assert type(comm).__name__ == "HorovodCommunicator" and comm.size == 2, comm
    engine = Engine(comm)
    runs = [(name(cell), lambda cell=cell: run_cell(engine, cell, out_dir, keras_file=True))
            for cell in CELLS]
    for scenario, run in runs + [("narrow_wire", lambda: run_narrow_wire(engine))]:
        start = time.time()
        np.savez(os.path.join(out_dir, f"{scenario}.rank{comm.rank}.npz"), **run())
        print(f"rank {comm.rank}: {scenario} done in {time.time() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
