"""One rank of the 2-rank K-FAC job launched by tests/test_distributed_kfac.py.

Every scenario trains with `model.fit` and `tfkfac.KFAC` on the Horovod communicator and
saves what this rank holds to `$DISTRIBUTED_KFAC_OUT_DIR/<scenario>.rank<r>.npz`:
- `sync`: 20 steps on this rank's shard of real Fashion-MNIST (Conv2D + BatchNorm +
  Dense), models initialized differently per rank (attach must broadcast): every model
  and optimizer variable, collective calls/bytes after every step, factors after step 0.
- `sync_float16`: its first step again with float16 factors on the wire.
- `equivalence_<placement>_<method>`: per-rank batch B of fixed global batches of 2B,
  factor_update_freq = decomposition_update_freq = 5 over 6 steps, some with
  `steps_per_execution` > 1 (Keras then runs the steps in a tf.while_loop); the test
  runs the same function in one process with batch 2B (`run_equivalence`).
- `modern_<placement>_<method>`: the equivalence run with tests/modern_net.py (one layer
  of every block kind added for modern architectures: batched per-group pairs, diagonal
  vectors, EinsumDense, Embedding), factors every 5 steps in one grouped call.
- `late_logs`: `steps_per_execution` = 4 with a metric whose value reaches rank 1's
  logs SLOW_METRIC_SECONDS late (a non-stateful op, as Keras metrics are): the next
  step may not reissue the averaged-logs collective while the last one is in flight
  (Horovod refuses a name in flight). Saves the logs after every execution.
- `owner_restore`: "owner" placement across a checkpoint: rank 0 saves after
  RESTORE_STEPS steps, every rank restores that file into a fresh model and optimizer
  and trains RESTORE_STEPS more (`run_owner_restore`; also the 1-process reference).
- `batch_fraction`: one step with `factor_batch_fraction=0.5`; each rank takes its
  factor statistics from its own random half (saved with the factors).
Last, rank 1 raises inside `model.fit` while rank 0 trains on: the job must end.
Everything the test needs to rebuild (models, data, settings) lives here.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import tfkfac  # noqa: E402
from kfac_reference import managed_factors, sgd_kfac  # noqa: E402
from modern_net import modern_net  # noqa: E402
from pipelines import idx_dataset  # noqa: E402
from tfkfac import distributed  # noqa: E402
from tfkfac.curvature import kept_examples  # noqa: E402

OUT_DIR_VARIABLE = "DISTRIBUTED_KFAC_OUT_DIR"
FAILURE_MESSAGE = "rank 1 fails inside model.fit on purpose"
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# Stated rather than the library's defaults (which the benchmarks choose): the eigen
# method, factors every step.
KFAC_ARGS = dict(learning_rate=0.05, damping=1e-2, method="eigen", factor_update_freq=1)

SYNC_STEPS, SYNC_BATCH = 20, 32
# Every step a factor step.
SYNC_FREQ = dict(factor_update_freq=1, decomposition_update_freq=2)
# (placement, method, steps_per_execution, xla); per-rank batch B, the reference uses 2B
# without XLA. With xla=True the local stages are XLA-compiled and the Horovod calls run
# between them.
EQUIVALENCE_CASES = [("replicated", "eigen", 1, False), ("owner", "eigen", 1, False),
                     ("replicated", "inverse", 4, False), ("owner", "inverse", 3, True)]
EQUIVALENCE_STEPS, EQUIVALENCE_BATCH, EQUIVALENCE_FREQ = 6, 16, 5
MODERN_CASES = [("replicated", "eigen"), ("owner", "inverse")]
LATE_LOGS_STEPS, LATE_LOGS_STEPS_PER_EXECUTION, SLOW_METRIC_SECONDS = 8, 4, 0.3
# Steps before and after the restore, and between decompositions.
RESTORE_STEPS, RESTORE_DECOMPOSITION_FREQ = 6, 4
# factor_examples="fresh": per step of EQUIVALENCE_STEPS, which examples of the global batch
# (rank 0's half, then rank 1's) are fresh. Step 0 has fresh examples on rank 0 only,
# steps 1 and 4 repeat the batch before them (batch echoing: stale steps), step 5 has
# fresh examples on rank 1 only. The inverse method: 2 ranks measured 4.6e-6 x max|w| from
# one process (the eigen method 7.0e-5, too near EQUIVALENCE_RTOL to tell bugs from noise).
FRESH_PATTERNS = ("rank0", "none", "mixed", "all", "none", "rank1")
# The echo-aware scenario's examples carry sample weights too (docs/design.md §2, sample
# weights): their statistics are normalized by the weight of the fresh examples of all ranks.
FRESH_SAMPLE_WEIGHTS = (0.5, 1.0, 2.0, 0.25, 1.5)
FRESH_SETTINGS = dict(factor_update_freq=1, decomposition_update_freq=2, method="inverse")


def small_cnn(seed, batch_norm):
    """Conv2D (+ BatchNorm) + two Dense layers: every K-FAC block kind, small factors.

    Factor dims: conv A 3*3*1+1 = 10, G 4; hidden A 6*6*4+1 = 145, G 32; logits A 33,
    G 10; BatchNorm a diagonal of 2*4 (gamma, beta).
    """
    seeds = iter(range(1000 * seed, 1000 * seed + 10))
    layers = [keras.Input((28, 28, 1)),
              keras.layers.Conv2D(4, 3, strides=2, activation="relu", name="conv",
                                  kernel_initializer=keras.initializers.HeNormal(next(seeds)))]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization(name="bn"))
    layers += [keras.layers.MaxPooling2D(2), keras.layers.Flatten(),
               keras.layers.Dense(32, activation="relu", name="hidden",
                                  kernel_initializer=keras.initializers.HeNormal(next(seeds))),
               keras.layers.Dense(10, name="logits",
                                  kernel_initializer=keras.initializers.GlorotUniform(next(seeds)))]
    return keras.Sequential(layers, name="small_cnn")


def compiled(model, comm, steps_per_execution=1, metrics=None, **kfac_args):
    optimizer = sgd_kfac(communicator=comm, **dict(KFAC_ARGS, **kfac_args)).attach(model)
    model.compile(optimizer=optimizer, loss=LOSS, metrics=metrics,
                  steps_per_execution=steps_per_execution)
    return optimizer


def normalize(example):
    return tf.cast(example["image"], tf.float32) / 255.0, example["label"]


def fixed_examples(count):
    """The first `count` Fashion-MNIST training examples as numpy (x float32, y int64)."""
    ds = idx_dataset.load_idx("fashion_mnist", f"train[:{count}]").map(normalize)
    x, y = next(iter(ds.batch(count)))
    return x.numpy(), y.numpy()


def rank_part(array, global_batch, rank, size):
    """Rank r's examples: the r-th of `size` equal parts of every global batch, in order."""
    steps = len(array) // global_batch
    parts = array[: steps * global_batch].reshape((steps, size, global_batch // size)
                                                  + array.shape[1:])
    return parts[:, rank].reshape((-1,) + array.shape[1:])


class CounterLog(keras.callbacks.Callback):
    """Collective calls and bytes per category after every execution; factors after the first."""

    def __init__(self, comm, optimizer):
        super().__init__()
        self.comm, self.optimizer = comm, optimizer
        self.calls, self.bytes, self.first_factors = [], [], None

    def on_train_begin(self, logs=None):
        self.comm.reset_counters()  # Count from the first step, after attach's broadcast.

    def on_train_batch_end(self, batch, logs=None):
        calls, sent = self.comm.collective_calls(), self.comm.bytes_sent()
        self.calls.append([calls[c] for c in distributed.CATEGORIES])
        self.bytes.append([sent[c] for c in distributed.CATEGORIES])
        if self.first_factors is None:
            self.first_factors = managed_factors(self.optimizer)

    def results(self):
        saved = {"calls": np.asarray(self.calls), "bytes": np.asarray(self.bytes)}
        for i, factor in enumerate(self.first_factors):
            saved[f"first_factor{i}"] = factor
        return saved


def run_equivalence(comm, placement, method, steps_per_execution=1, xla=False,
                    build=lambda: small_cnn(seed=7, batch_norm=False)):
    """Model variables after EQUIVALENCE_STEPS steps on this rank's part of each batch.

    With `comm.size == 1` this is the single-process reference with batch 2B.
    """
    global_batch = 2 * EQUIVALENCE_BATCH
    x, y = fixed_examples(EQUIVALENCE_STEPS * global_batch)
    model = build()
    optimizer = compiled(model, comm, steps_per_execution, placement=placement, method=method,
                         xla=xla, factor_update_freq=EQUIVALENCE_FREQ,
                         decomposition_update_freq=EQUIVALENCE_FREQ)
    log = CounterLog(comm, optimizer)
    model.fit(rank_part(x, global_batch, comm.rank, comm.size),
              rank_part(y, global_batch, comm.rank, comm.size),
              batch_size=global_batch // comm.size, epochs=1, shuffle=False, verbose=0,
              callbacks=[log])
    return dict(log.results(), **final_state(model, optimizer))


def final_state(model, optimizer):
    """Model variables, K-FAC counters and the bytes of K-FAC state this rank holds."""
    saved = {f"weight{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(model.variables)}
    summary = optimizer.summary()
    saved["kfac_counters"] = np.asarray([summary["counters"][k] for k in
                                         ("steps", "factor_updates", "decomposition_updates")])
    saved["state_bytes"] = np.asarray(summary["state_bytes"])
    saved["managed"] = np.asarray([f"{m['layer']}:{m['kind']}" for m in summary["managed"]])
    saved["factor_shapes"] = np.asarray([str(m["factor_shapes"]) for m in summary["managed"]])
    return saved


def run_modern(comm, placement, method):
    """The equivalence run with modern_net (see tests/modern_net.py)."""
    return run_equivalence(comm, placement, method, build=lambda: modern_net(seed=7))


class LateOnRank1(keras.metrics.SparseCategoricalAccuracy):
    """Accuracy whose result reaches rank 1's logs late, through a non-stateful op."""

    def __init__(self, rank):
        super().__init__(name="late_accuracy")
        self.rank = rank

    def result(self):
        value = super().result()
        if self.rank != 1:
            return value
        return tf.numpy_function(lambda v: (time.sleep(SLOW_METRIC_SECONDS), v)[1], [value],
                                 value.dtype, stateful=False)


def echoed_examples():
    """(x, y, fresh, sample weights) of the echo-aware scenario, global batches of 2B in
    order.

    A repeat is a copy of an example seen before: its batch's fresh copy (example
    echoing) or the whole previous batch (batch echoing).
    """
    global_batch, half = 2 * EQUIVALENCE_BATCH, EQUIVALENCE_BATCH
    x, y = fixed_examples(EQUIVALENCE_STEPS * global_batch)
    rng = np.random.default_rng(3)
    flags = np.zeros((EQUIVALENCE_STEPS, global_batch), np.float32)
    for step, pattern in enumerate(FRESH_PATTERNS):
        rows = slice(step * global_batch, (step + 1) * global_batch)
        if pattern == "none":
            previous = slice(rows.start - global_batch, rows.start)
            x[rows], y[rows] = x[previous], y[previous]
            continue
        fresh = {"all": np.ones(global_batch, bool),
                 "mixed": rng.random(global_batch) < 0.5,
                 "rank0": np.arange(global_batch) < half // 2,
                 "rank1": np.arange(global_batch) >= global_batch - 3}[pattern]
        sources = rng.choice(np.flatnonzero(fresh), global_batch)
        x[rows] = np.where(fresh[:, None, None, None], x[rows], x[rows][sources])
        y[rows] = np.where(fresh, y[rows], y[rows][sources])
        flags[step] = fresh
    weights = np.resize(np.asarray(FRESH_SAMPLE_WEIGHTS, np.float32), flags.size)
    return x, y, flags.reshape(-1), weights


def run_echo_aware(comm):
    """factor_examples="fresh" on this rank's part of `echoed_examples()` (with
    `comm.size == 1`: the single-process reference with batch 2B)."""
    global_batch = 2 * EQUIVALENCE_BATCH
    x, y, fresh, weights = (rank_part(a, global_batch, comm.rank, comm.size)
                            for a in echoed_examples())
    model = small_cnn(seed=7, batch_norm=False)
    optimizer = compiled(model, comm, factor_examples="fresh", **FRESH_SETTINGS)
    log = CounterLog(comm, optimizer)
    model.fit(x, y, sample_weight=tfkfac.fresh_flags(fresh, sample_weight=weights),
              batch_size=global_batch // comm.size, epochs=1, shuffle=False, verbose=0,
              callbacks=[log])
    return dict(log.results(), **final_state(model, optimizer))


def first_step_fresh_alone(comm):
    """Plain K-FAC's factors after one step on the fresh examples of the first batch,
    with their sample weights."""
    x, y, fresh, weights = (a[: 2 * EQUIVALENCE_BATCH] for a in echoed_examples())
    return first_step_on(x[fresh == 1], y[fresh == 1], comm, weights[fresh == 1])


def run_batch_fraction(comm):
    """One step of `factor_batch_fraction=0.5` on this rank's part of the first batch:
    the factors (rank r's statistics from the examples `kept_examples` draws for step 0
    and rank r, averaged over ranks) and the examples each rank kept."""
    global_batch = 2 * EQUIVALENCE_BATCH
    x, y = (rank_part(a, global_batch, comm.rank, comm.size)
            for a in fixed_examples(global_batch))
    model = small_cnn(seed=7, batch_norm=False)
    log = CounterLog(comm, compiled(model, comm, factor_batch_fraction=0.5,
                                    **FRESH_SETTINGS))
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0, callbacks=[log])
    return dict(log.results(), kept=kept_examples(len(x), 0.5, 0, comm.rank).numpy())


def first_step_on(x, y, comm, sample_weight=None):
    """Plain K-FAC's factors after one step on the batch (x, y)."""
    model = small_cnn(seed=7, batch_norm=False)
    log = CounterLog(comm, compiled(model, comm, **FRESH_SETTINGS))
    model.fit(x, y, sample_weight=sample_weight, batch_size=len(x), epochs=1, shuffle=False,
              verbose=0, callbacks=[log])
    return log.results()


def run_late_logs(comm):
    """Per-execution fit logs (averaged over ranks) while rank 1's metric arrives late.

    (The epoch-end logs in `History` are Keras's recomputation from this rank's own
    metric objects, not the averaged ones.)
    """
    model = small_cnn(seed=7, batch_norm=False)
    compiled(model, comm, LATE_LOGS_STEPS_PER_EXECUTION, metrics=[LateOnRank1(comm.rank)])
    global_batch = comm.size * EQUIVALENCE_BATCH
    x, y = (rank_part(a, global_batch, comm.rank, comm.size)
            for a in fixed_examples(LATE_LOGS_STEPS * global_batch))
    executions = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: executions.append(logs))
    model.fit(x, y, batch_size=EQUIVALENCE_BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[record])
    return {name: np.asarray([float(logs[name]) for logs in executions])
            for name in executions[0]}


def run_owner_restore(comm, directory):
    """Owner placement: RESTORE_STEPS steps, rank 0 saves, all ranks restore, RESTORE_STEPS more.

    The checkpoint holds factors but no decompositions (each rank holds only its own),
    so every rank can restore rank 0's file. With `comm.size == 1` this is the
    single-process reference with batch 2B.
    """
    global_batch = 2 * EQUIVALENCE_BATCH
    x, y = (rank_part(a, global_batch, comm.rank, comm.size)
            for a in fixed_examples(2 * RESTORE_STEPS * global_batch))
    half = len(x) // 2
    path = os.path.join(directory, "owner_restore_checkpoint")

    def fresh():
        model = small_cnn(seed=7, batch_norm=False)
        optimizer = compiled(model, comm, placement="owner",
                             decomposition_update_freq=RESTORE_DECOMPOSITION_FREQ)
        optimizer.build(model.trainable_variables)
        return model, optimizer, tf.train.Checkpoint(model=model, optimizer=optimizer)

    def fit(model, part):
        model.fit(x[part], y[part], batch_size=global_batch // comm.size, epochs=1,
                  shuffle=False, verbose=0)

    model, optimizer, checkpoint = fresh()
    fit(model, slice(0, half))
    if comm.rank == 0:
        checkpoint.write(path)
    comm.grouped_allreduce_mean([tf.ones([1])], category="metrics")  # rank 0 has written
    model, optimizer, checkpoint = fresh()
    checkpoint.read(path).assert_existing_objects_matched()
    fit(model, slice(half, None))
    return final_state(model, optimizer)


def run_sync(comm, steps, factor_wire_dtype="float32"):
    """`steps` fit steps on this rank's shard; the models start different on each rank."""
    model = small_cnn(seed=comm.rank, batch_norm=True)
    saved = {f"initial{i:03d}": np.asarray(v.numpy()) for i, v in enumerate(model.variables)}
    optimizer = compiled(model, comm, factor_wire_dtype=factor_wire_dtype, **SYNC_FREQ)
    log = CounterLog(comm, optimizer)
    ds = idx_dataset.load_idx("fashion_mnist", "train").shard(comm.size, comm.rank)
    ds = ds.map(normalize).batch(SYNC_BATCH).take(steps)
    history = model.fit(ds, epochs=1, verbose=0, callbacks=[log])
    saved.update(log.results())
    saved["local_loss"] = np.asarray(history.history["loss"])  # This rank's shard only.
    for kind, variables in (("model", model.variables), ("optimizer", optimizer.variables)):
        for i, variable in enumerate(variables):
            saved[f"{kind}{i:03d}"] = np.asarray(variable.numpy())
    return model, ds, saved


class FailOnRank1(keras.callbacks.Callback):
    """Rank (or worker) 1 raises `message` at its third step, after printing the time."""

    def __init__(self, rank, message=FAILURE_MESSAGE):
        super().__init__()
        self.rank, self.message = rank, message

    def on_train_batch_begin(self, batch, logs=None):
        if self.rank == 1 and batch == 2:
            print(f"FAILING_AT {time.time():.3f}", flush=True)
            raise RuntimeError(self.message)


def main(out_dir):
    comm = distributed.get_communicator("auto")
    assert type(comm).__name__ == "HorovodCommunicator" and comm.size == 2, comm
    timings = {}

    def run(name, function, *args):
        start = time.time()
        result = function(*args)
        timings[name] = np.asarray(time.time() - start)
        print(f"rank {comm.rank}: {name} done in {timings[name]:.1f} s", flush=True)
        saved = result[-1] if isinstance(result, tuple) else result
        np.savez(os.path.join(out_dir, f"{name}.rank{comm.rank}.npz"), **saved)
        return result

    model, ds, _ = run("sync", run_sync, comm, SYNC_STEPS)
    run("sync_float16", run_sync, comm, 1, "float16")
    for placement, method, steps_per_execution, xla in EQUIVALENCE_CASES:
        run(f"equivalence_{placement}_{method}", run_equivalence, comm, placement, method,
            steps_per_execution, xla)
    for placement, method in MODERN_CASES:
        run(f"modern_{placement}_{method}", run_modern, comm, placement, method)
    run("late_logs", run_late_logs, comm)
    run("echo_aware", run_echo_aware, comm)
    run("batch_fraction", run_batch_fraction, comm)
    run("owner_restore", run_owner_restore, comm, out_dir)
    np.savez(os.path.join(out_dir, f"timings.rank{comm.rank}.npz"), **timings)
    # Both ranks have saved everything before one of them fails.
    comm.grouped_allreduce_mean([tf.ones([1])], category="metrics")
    print(f"rank {comm.rank} saved its results", flush=True)
    model.fit(ds, epochs=1, verbose=0, callbacks=[FailOnRank1(comm.rank)])
    print(f"rank {comm.rank}: fit finished although rank 1 failed", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
