"""One rank of the 2-rank job of tests/test_stale_steps_distributed.py.

For each placement, `model.fit` trains a small conv net (Conv2D, BatchNorm, Dense) on
this rank's half of every global batch of 2B, factors every FACTOR_FREQ steps: once as
users run it (stale steps in their own train function) and once with
`steps_per_execution=2` (every step the factor step). Saved to
`$STALE_STEPS_OUT_DIR/<placement>.rank<r>.npz`: which train function each step ran, and
after the run the weights, every optimizer variable and the counters of both runs. Then
`jit_compile=True` on 2 ranks: the warning it gives (`jit.rank<r>.npz`).
"""

import contextlib
import os
import sys
import warnings
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import job_results  # noqa: E402
from kfac_reference import sgd_kfac  # noqa: E402
from tfkfac import stale_steps  # noqa: E402

OUT_DIR_VARIABLE = "STALE_STEPS_OUT_DIR"
PLACEMENTS = ("replicated", "owner")
STEPS, BATCH, FACTOR_FREQ = 7, 8, 3  # BATCH: per rank
SETTINGS = dict(learning_rate=0.05, damping=1e-2, method="eigen",
                factor_update_freq=FACTOR_FREQ, decomposition_update_freq=2 * FACTOR_FREQ,
                xla=False)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def conv_net():
    """Conv2D, BatchNorm, two Dense layers: Kronecker and diagonal blocks."""
    keras.utils.set_random_seed(3)
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
        keras.layers.BatchNormalization(), keras.layers.Flatten(),
        keras.layers.Dense(12, activation="tanh"), keras.layers.Dense(5)])


def rank_examples(comm):
    """This rank's half of each of STEPS global batches of 2B."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS, 2, BATCH, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 5, (STEPS, 2, BATCH))
    return x[:, comm.rank].reshape((-1, 8, 8, 1)), y[:, comm.rank].reshape(-1)


@contextlib.contextmanager
def chosen_functions():
    """The train function each step of `fit` ran, "factor" or "stale", in order (none
    where no choice is made): the real functions, wrapped where `StaleSteps.choosing`
    receives them."""
    ran = []
    choosing = stale_steps.StaleSteps.choosing

    def counted(name, function):
        def run(iterator):
            ran.append(name)
            return function(iterator)
        return run

    def spied(self, model, factor_function, stale_function):
        return choosing(self, model, counted("factor", factor_function),
                        counted("stale", stale_function))

    with mock.patch.object(stale_steps.StaleSteps, "choosing", spied):
        yield ran


def train(comm, steps_per_execution=1, jit_compile=False, **settings):
    """(model, optimizer, `chosen_functions`)."""
    model = conv_net()
    optimizer = sgd_kfac(communicator=comm, **dict(SETTINGS, **settings)).attach(model)
    model.compile(optimizer=optimizer, loss=LOSS, steps_per_execution=steps_per_execution,
                  jit_compile=jit_compile)
    x, y = rank_examples(comm)
    with chosen_functions() as ran:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model, optimizer, ran


def state(model, optimizer):
    """Weights, every optimizer variable, the decompositions held, the counters."""
    arrays = {f"weight{i}": v.numpy() for i, v in enumerate(model.variables)}
    arrays.update({f"optimizer{i}": v.numpy() for i, v in enumerate(optimizer.variables)})
    # Private: an owner's decompositions are in no public API (and not saved).
    for b, block_state in enumerate(optimizer.curvature.states):
        for j, decomposition in enumerate(block_state.decompositions or []):
            for k, variable in enumerate(decomposition):
                arrays[f"decomposition{b}_{j}_{k}"] = variable.numpy()
    arrays.update({f"counter_{k}": np.asarray(v) for k, v in optimizer.counters().items()})
    return arrays


def run_placement(comm, placement):
    arrays = {}
    for run, steps_per_execution in (("chosen", 1), ("factor_only", 2)):
        model, optimizer, ran = train(comm, steps_per_execution, placement=placement)
        arrays.update({f"{run}/{k}": v for k, v in state(model, optimizer).items()})
        arrays[f"{run}/ran"] = np.asarray(ran)
    return arrays


def run_jit(comm):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _, ran = train(comm, jit_compile=True)
    said = [str(w.message) for w in caught if "KFAC" in str(w.message)]
    return {"warnings": np.asarray(said), "jit_compile": np.asarray(model.jit_compile),
            "ran": np.asarray(ran)}


def main(out_dir):
    comm = job_results.save_each_placement(out_dir, PLACEMENTS, run_placement)
    np.savez(os.path.join(out_dir, f"jit.rank{comm.rank}.npz"), **run_jit(comm))
    print(f"rank {comm.rank}: jit done", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
