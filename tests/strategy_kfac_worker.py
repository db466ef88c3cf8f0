"""K-FAC under a tf.distribute strategy: the scenarios of tests/test_mirrored_kfac.py
(MirroredStrategy, 2 logical CPUs, in its process) and tests/test_multi_worker_kfac.py
(MultiWorkerMirroredStrategy, 2 workers on localhost launched by `trainers.launch`).

Each scenario builds its model and optimizer inside `strategy.scope()` and returns what
this process holds (replica 0's copy; `replicas_identical` says whether every local
replica holds the same). With the default strategy it is the one-process reference with
the global batch. The models, data and settings are those of the Horovod suite
(tests/distributed_kfac_worker.py), so the two engines are held to the same scenarios:
- `equivalence`: global batches of 2B split over the replicas by Keras `fit`, factors and
  decompositions at steps 0 and 5 of 6: replicated/eigen, and owner/inverse with 3 steps
  per execution and XLA-compiled local stages; per-step fit logs, calls and bytes.
- `wire`: the first step with factors and decompositions in float16 or bfloat16.
- `custom_loop`: `optimizer.record()` / `minimize()` inside `strategy.run` on
  `experimental_distribute_dataset`, the loss a Keras loss (scaled by 1/replicas).
- `plain_gradient`: every layer skipped, SGD without momentum: one step moves the weights
  by -lr x the mean gradient, which would double if gradients were summed over replicas.
- `batchnorm`: Input -> BatchNorm -> Dense, one step: moving statistics averaged.
- `restore`: owner placement, worker 0 writes a checkpoint, every worker restores it into
  a fresh model and optimizer and trains on.
The worker's `main` runs them under MultiWorkerMirroredStrategy (`fit` one step per
execution: more is one clear error, saved), saves `<scenario>.worker<i>.npz` to
$STRATEGY_KFAC_OUT_DIR, then worker 1 raises inside fit.
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
from kfac_reference import sgd_kfac  # noqa: E402
import tfkfac  # noqa: E402

OUT_DIR_VARIABLE = "STRATEGY_KFAC_OUT_DIR"
FAILURE_MESSAGE = "worker 1 fails inside model.fit on purpose"
# Of the Horovod suite's cases (placement, method, steps_per_execution, xla), those that
# together cover both placements, both methods, a tf.while_loop of steps and XLA.
EQUIVALENCE_CASES = [horovod_suite.EQUIVALENCE_CASES[i] for i in (0, 3)]
STEPS, BATCH, FREQ = (horovod_suite.EQUIVALENCE_STEPS, horovod_suite.EQUIVALENCE_BATCH,
                      horovod_suite.EQUIVALENCE_FREQ)
LOSS = horovod_suite.LOSS
WIRES = ("float16", "bfloat16")
PLAIN_LEARNING_RATE = 0.1
RESTORE_STEPS = horovod_suite.RESTORE_STEPS


def settings(**overrides):
    """KFAC arguments of the equivalence runs (the Horovod suite's), with `overrides`."""
    return dict(horovod_suite.KFAC_ARGS, factor_update_freq=FREQ,
                decomposition_update_freq=FREQ, **overrides)


def held(strategy, variables):
    """(replica 0's value of each variable, whether every local replica holds the same)."""
    values = [[np.asarray(v) for v in strategy.experimental_local_results(variable)]
              for variable in variables]
    identical = all(np.array_equal(copies[0], copy) for copies in values for copy in copies)
    return [copies[0] for copies in values], identical


def final_state(strategy, model, optimizer):
    """The Horovod suite's final state (weights, counters, state bytes) as held here."""
    saved = horovod_suite.final_state(model, optimizer)
    weights, identical = held(strategy, [v.value for v in model.variables])
    saved.update({f"weight{i:03d}": w for i, w in enumerate(weights)})
    saved["replicas_identical"] = np.asarray(identical)
    return saved


class StepLog(horovod_suite.CounterLog):
    """The Horovod suite's counter log, plus fit's logs after every execution."""

    def __init__(self, comm, optimizer):
        super().__init__(comm, optimizer)
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        self.logs.append([float(np.squeeze(logs[name])) for name in ("loss", "accuracy")])

    def results(self):
        return dict(super().results(), logs=np.asarray(self.logs))


def compiled(strategy, steps_per_execution=1, **kfac_settings):
    """small_cnn (no BatchNorm) and its KFAC, made and compiled under `strategy`."""
    with strategy.scope():
        model = horovod_suite.small_cnn(seed=7, batch_norm=False)
        optimizer = sgd_kfac(**kfac_settings).attach(model)
        model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"],
                      steps_per_execution=steps_per_execution)
    return model, optimizer


def run_equivalence(strategy, placement, method, steps_per_execution=1, xla=False,
                    **kfac_settings):
    """STEPS fit steps on global batches of 2B (Keras gives each replica its part)."""
    x, y = horovod_suite.fixed_examples(STEPS * 2 * BATCH)
    model, optimizer = compiled(strategy, steps_per_execution, **settings(
        placement=placement, method=method, xla=xla, **kfac_settings))
    log = StepLog(optimizer.communicator, optimizer)
    model.fit(x, y, batch_size=2 * BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[log])
    return dict(log.results(), steps_per_execution=np.asarray(steps_per_execution),
                **final_state(strategy, model, optimizer))


def run_wire(strategy, wire):
    """One step (a factor and decomposition step) with both wires in `wire`."""
    return run_equivalence(strategy, "replicated", "eigen", factor_wire_dtype=wire,
                           decomposition_wire_dtype=wire)


def run_custom_loop(strategy, placement):
    """STEPS custom-loop steps on global batches of 2B."""
    x, y = horovod_suite.fixed_examples(STEPS * 2 * BATCH)
    with strategy.scope():
        model = horovod_suite.small_cnn(seed=7, batch_norm=False)
        optimizer = sgd_kfac(**settings(placement=placement)).attach(model)
    batches = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(2 * BATCH))

    @tf.function
    def train_step(batch):
        def step(x, y):
            with optimizer.record() as tape:
                loss = LOSS(y, model(x, training=True))
            optimizer.minimize(loss, tape=tape)
        strategy.run(step, args=batch)

    for batch in batches:
        train_step(batch)
    return final_state(strategy, model, optimizer)


def run_plain_gradient(strategy):
    """One step with every layer skipped and plain SGD: the update is -lr x gradient."""
    x, y = horovod_suite.fixed_examples(2 * BATCH)
    with strategy.scope():
        model = horovod_suite.small_cnn(seed=7, batch_norm=False)
        optimizer = tfkfac.KFAC(inner_optimizer=keras.optimizers.SGD(PLAIN_LEARNING_RATE),
                                skip_layers=[".*"]).attach(model)
        model.compile(optimizer=optimizer, loss=LOSS)
    before = [np.asarray(v) for v in model.get_weights()]
    model.fit(x, y, batch_size=2 * BATCH, epochs=1, shuffle=False, verbose=0)
    saved = final_state(strategy, model, optimizer)
    for i, start in enumerate(before):
        saved[f"step{i:03d}"] = saved[f"weight{i:03d}"] - start
    return saved


def bn_model():
    """Input -> BatchNormalization -> Flatten -> Dense: the batch statistics are the
    inputs' own, so the test computes the expected moving statistics from the data."""
    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.BatchNormalization(),
                             keras.layers.Flatten(), keras.layers.Dense(10)])


def run_batchnorm(strategy):
    x, y = horovod_suite.fixed_examples(2 * BATCH)
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = bn_model()
        model.compile(optimizer=sgd_kfac(**settings()).attach(model), loss=LOSS)
    model.fit(x, y, batch_size=2 * BATCH, epochs=1, shuffle=False, verbose=0)
    layer = model.layers[0]
    (mean, variance), identical = held(
        strategy, [layer.moving_mean.value, layer.moving_variance.value])
    return {"moving_mean": mean, "moving_variance": variance,
            "replicas_identical": np.asarray(identical)}


def run_restore(strategy, directory, chief=True):
    """Owner placement: RESTORE_STEPS steps, the chief writes a checkpoint, everyone reads
    it into a fresh model and optimizer and trains RESTORE_STEPS more."""
    x, y = horovod_suite.fixed_examples(2 * RESTORE_STEPS * 2 * BATCH)
    half = len(x) // 2
    path = os.path.join(directory, "restore_checkpoint")

    def fresh():  # the Horovod suite's settings: factors every step
        model, optimizer = compiled(strategy, placement="owner", **dict(
            horovod_suite.KFAC_ARGS,
            decomposition_update_freq=horovod_suite.RESTORE_DECOMPOSITION_FREQ))
        with strategy.scope():
            optimizer.build(model.trainable_variables)
        return model, optimizer, tf.train.Checkpoint(model=model, optimizer=optimizer)

    def fit(model, part):
        model.fit(x[part], y[part], batch_size=2 * BATCH, epochs=1, shuffle=False, verbose=0)

    model, optimizer, checkpoint = fresh()
    fit(model, slice(0, half))
    if chief:
        checkpoint.write(path)
    wait_for_every_worker(optimizer.communicator)
    model, optimizer, checkpoint = fresh()
    checkpoint.read(path).assert_existing_objects_matched()
    fit(model, slice(half, None))
    return final_state(strategy, model, optimizer)


def wait_for_every_worker(comm):
    """A collective every replica must join: returns once all of them reached it."""
    comm.grouped_allreduce_mean([tf.ones([1])], category="metrics")


def scenarios(strategy, directory, chief=True):
    """{name: function returning the scenario's saved arrays} for `strategy`."""
    # Across workers `fit` runs one step per execution (keras_integration).
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    cases = {f"equivalence_{p}_{m}": (lambda p=p, m=m, s=s, x=x: run_equivalence(
        strategy, p, m, 1 if multi_worker else s, x)) for p, m, s, x in EQUIVALENCE_CASES}
    cases.update({f"wire_{wire}": lambda wire=wire: run_wire(strategy, wire)
                  for wire in WIRES})
    cases.update({f"custom_loop_{p}": lambda p=p: run_custom_loop(strategy, p)
                  for p in ("replicated", "owner")})
    cases["plain_gradient"] = lambda: run_plain_gradient(strategy)
    cases["batchnorm"] = lambda: run_batchnorm(strategy)
    cases["restore"] = lambda: run_restore(strategy, directory, chief)
    return cases


def main(out_dir):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    worker = strategy.cluster_resolver.task_id
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    assert "horovod" not in sys.modules  # this engine runs where Horovod is not built
    timings = {}
    for name, run in scenarios(strategy, out_dir, chief=worker == 0).items():
        start = time.time()
        saved = run()
        timings[name] = np.asarray(time.time() - start)
        np.savez(os.path.join(out_dir, f"{name}.worker{worker}.npz"), **saved)
        print(f"worker {worker}: {name} done in {timings[name]:.1f} s", flush=True)
    np.savez(os.path.join(out_dir, f"timings.worker{worker}.npz"), **timings)
    x, y = horovod_suite.fixed_examples(8 * 2 * BATCH)
    model, _ = compiled(strategy, steps_per_execution=2, **settings())
    try:
        model.fit(x, y, batch_size=2 * BATCH, epochs=1, verbose=0)
        message = ""
    except ValueError as error:
        message = str(error)
    np.savez(os.path.join(out_dir, f"steps_per_execution.worker{worker}.npz"),
             message=np.asarray(message))
    model, _ = compiled(strategy, **settings())
    print(f"worker {worker} saved its results", flush=True)
    model.fit(x, y, batch_size=2 * BATCH, epochs=1, verbose=0,
              callbacks=[horovod_suite.FailOnRank1(worker, FAILURE_MESSAGE)])
    print(f"worker {worker}: fit finished although worker 1 failed", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
