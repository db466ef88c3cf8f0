"""The float21 wire on 2 ranks: one rank of the Horovod job of tests/test_float21.py, and
the same scenarios under a tf.distribute strategy (that test runs them in its process on
MirroredStrategy over 2 logical CPUs).

Each engine gives, per rank it runs, a dict of numpy arrays:
- `exchange`: `allreduce_symmetric` on a float21 wire of factors that are functions of
  the rank (`rank_factors`: matrices, a batch of matrices, a diagonal), and
  `gather_from_owners` on a float21 wire of items (`item_value`) owned by both ranks,
  some of them exact; what every rank holds, and the bytes and calls counted.
- one K-FAC run per entry of RUNS: the model of tests/plan_worker.py fitted STEPS steps
  on global batches of 2 BATCH (each rank its half), factors every step, decompositions
  every DECOMPOSITION_INTERVAL; the bytes counted per category after every step; after
  step 0 the factors, the decompositions a rank holds, eigen_adam's moments and the
  weights (and the weights before it).
`main` (a Horovod rank, or with TF_CONFIG a MultiWorkerMirroredStrategy worker, which
runs `exchange` alone) saves `<scenario>.rank<r>.npz` to $FLOAT21_WORKER_OUT_DIR.
"""

import contextlib
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)
sys.path.insert(0, os.path.dirname(TESTS_DIR))

import plan_worker  # noqa: E402
import tfkfac  # noqa: E402
from tfkfac import distributed  # noqa: E402

OUT_DIR_VARIABLE = "FLOAT21_WORKER_OUT_DIR"
RANKS = 2
# Factors of the exchange: single matrices, a batch of two, and a diagonal.
FACTOR_SHAPES = [(5, 5), (2, 4, 4), (1, 1), (7,)]
# Items of the gather: shape, owner, exact (bit-exact whatever the wire).
ITEMS = [((3,), 0, False), ((2, 2), 1, False), ((5,), 1, True), ((4,), 0, False),
         ((7,), 0, True)]
# name: (placement, method, factor wire, decomposition wire).
RUNS = {
    "reference": ("replicated", "eigen", "float32", "float32"),
    "float21_factors": ("replicated", "eigen", "float21", "float32"),
    "float21_decompositions": ("replicated", "eigen", "float32", "float21"),
    "adam_reference": ("owner", "eigen_adam", "float32", "float32"),
    "adam_float21": ("owner", "eigen_adam", "float32", "float21"),
    "owner_float21": ("owner", "inverse", "float21", "float21"),
}
STEPS, BATCH, FACTOR_INTERVAL, DECOMPOSITION_INTERVAL = 3, 8, 1, 2
LEARNING_RATE = 0.01
DECOMPOSITION_NAME = re.compile(r"_decomp\d+_\d+$")
MOMENT_NAME = re.compile(r"_moment\d+$")


def rank_factors(rank):
    """Symmetric positive semi-definite factors (and a positive diagonal) of rank `rank`."""
    rng = np.random.default_rng(10 + rank)
    factors = []
    for shape in FACTOR_SHAPES:
        if len(shape) == 1:
            factors.append(rng.random(shape).astype(np.float32))
            continue
        x = rng.standard_normal(shape[:-1] + (shape[-1] + 2,)).astype(np.float32)
        upper = np.triu(x @ np.swapaxes(x, -1, -2))
        factors.append(upper + np.swapaxes(np.triu(upper, 1), -1, -2))  # exactly symmetric
    return factors


def item_value(i):
    """Item i's value, as its owner computes it."""
    return np.random.default_rng(20 + i).standard_normal(ITEMS[i][0]).astype(np.float32)


def examples():
    """STEPS global batches of 2 BATCH inputs and labels (the same on every rank)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * 2 * BATCH,) + plan_worker.INPUT_SHAPE).astype(np.float32)
    return x, rng.integers(0, 5, STEPS * 2 * BATCH)


class Horovod:
    """This process is one rank of a Horovod job."""

    def __init__(self):
        self.comm = distributed.get_communicator("horovod")
        self.ranks = (self.comm.rank,)
        self.scope = contextlib.nullcontext

    def per_rank(self, function):
        """{rank: function(rank)} for this process's rank, in a `tf.function`."""
        result = tf.function(lambda: function(self.comm.rank), autograph=False)()
        return {self.comm.rank: tf.nest.map_structure(lambda t: t.numpy(), result)}

    def held(self, variables):
        """{rank: [value of each variable]} for this process's rank."""
        return {self.comm.rank: [np.asarray(v.numpy()) for v in variables]}

    def fit(self, model, x, y, callbacks):
        """Keras fit on this rank's half of every global batch."""
        half = lambda a: a.reshape((STEPS, RANKS, BATCH) + a.shape[1:])[:, self.comm.rank]
        model.fit(half(x).reshape((-1,) + x.shape[1:]), half(y).reshape(-1),
                  batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)


class Strategy:
    """The replicas of a tf.distribute strategy in this process are the ranks."""

    def __init__(self, strategy):
        self.strategy = strategy
        with strategy.scope():
            self.comm = distributed.StrategyCommunicator(strategy)
        self.ranks = self.comm.local_ranks
        self.scope = strategy.scope

    def per_rank(self, function):
        replica = tf.autograph.experimental.do_not_convert(lambda: function(self.comm.rank))
        results = tf.function(lambda: self.strategy.run(replica), autograph=False)()
        return {rank: tf.nest.map_structure(lambda t: t.numpy(), value) for rank, value in
                zip(self.ranks, self.strategy.experimental_local_results(results))}

    def held(self, variables):
        values = [self.strategy.experimental_local_results(
            v.value if isinstance(v, keras.Variable) else v) for v in variables]
        return {rank: [np.asarray(copies[i]) for copies in values]
                for i, rank in enumerate(self.ranks)}

    def fit(self, model, x, y, callbacks):
        """Keras fit on global batches: the strategy gives each replica its half."""
        model.fit(x, y, batch_size=RANKS * BATCH, shuffle=False, verbose=0,
                  callbacks=callbacks)


def run_exchange(engine):
    """{rank: saved} of a float21 factor mean and a float21 gather."""
    comm = engine.comm
    comm.reset_counters()
    means = engine.per_rank(lambda rank: distributed.allreduce_symmetric(
        comm, [tf.constant(f) for f in rank_factors(rank)], wire_dtype="float21"))
    counted = engine.held(_counters(comm))
    comm.reset_counters()
    gathered = engine.per_rank(lambda rank: distributed.gather_from_owners(
        comm, [tf.constant(item_value(i)) if owner == rank else None
               for i, (_, owner, _) in enumerate(ITEMS)],
        [shape for shape, _, _ in ITEMS], [owner for _, owner, _ in ITEMS],
        wire_dtype="float21", category="decompositions",
        exact=[exact for _, _, exact in ITEMS]))
    gather_counted = engine.held(_counters(comm))
    saved = {}
    for rank in engine.ranks:
        saved[rank] = {f"mean{i}": m for i, m in enumerate(means[rank])}
        saved[rank].update({f"item{i}": g for i, g in enumerate(gathered[rank])})
        saved[rank]["mean_counters"] = np.asarray(counted[rank])
        saved[rank]["gather_counters"] = np.asarray(gather_counted[rank])
    return saved


def _counters(comm):
    """The communicator's counter variables, bytes then calls in CATEGORIES order: each
    rank's own (`bytes_sent()` reads the first local replica's)."""
    return ([comm._bytes[c] for c in distributed.CATEGORIES]
            + [comm._calls[c] for c in distributed.CATEGORIES])


class StepRecorder(keras.callbacks.Callback):
    """Bytes per category after every step; after step 0, what the comparisons read."""

    def __init__(self, engine, optimizer, model):
        super().__init__()
        self.engine, self.optimizer, self.kfac_model = engine, optimizer, model
        self.bytes = {rank: [] for rank in engine.ranks}
        self.first = None

    def on_train_begin(self, logs=None):
        self.engine.comm.reset_counters()  # after attach's broadcast
        self.initial = self.engine.held(self.kfac_model.trainable_variables)

    def on_train_batch_end(self, batch, logs=None):
        counted = self.engine.held(_counters(self.engine.comm)[:len(distributed.CATEGORIES)])
        for rank in self.engine.ranks:
            self.bytes[rank].append(counted[rank])
        if self.first is None:
            variables = self.optimizer.variables
            self.first = {
                "factor": self.engine.held([v for v in variables
                                            if re.search(r"_factor\d+$", v.path)]),
                "decomposition": self.engine.held([v for v in variables
                                                   if DECOMPOSITION_NAME.search(v.path)]),
                "moment": self.engine.held([v for v in variables
                                            if MOMENT_NAME.search(v.path)]),
                "weight": self.engine.held(self.kfac_model.trainable_variables)}

    def results(self):
        saved = {}
        for rank in self.engine.ranks:
            saved[rank] = {"bytes": np.asarray(self.bytes[rank], np.int64)}
            for kind, held in self.first.items():
                saved[rank].update({f"{kind}{i}": v for i, v in enumerate(held[rank])})
            saved[rank].update({f"initial{i}": v for i, v in enumerate(self.initial[rank])})
        return saved


def run_kfac(engine, name):
    """{rank: saved} of the K-FAC run `name` (a key of RUNS)."""
    placement, method, factor_wire, decomposition_wire = RUNS[name]
    with engine.scope():
        keras.utils.set_random_seed(0)
        model = plan_worker.build_model()
        optimizer = tfkfac.KFAC(
            inner_optimizer=keras.optimizers.SGD(LEARNING_RATE, momentum=0.9), damping=0.1,
            kl_clip=None, placement=placement, method=method, factor_wire_dtype=factor_wire,
            decomposition_wire_dtype=decomposition_wire, factor_update_freq=FACTOR_INTERVAL,
            decomposition_update_freq=DECOMPOSITION_INTERVAL,
            communicator=engine.comm).attach(model)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    recorder = StepRecorder(engine, optimizer, model)
    engine.fit(model, *examples(), [recorder])
    return recorder.results()


def scenarios(engine):
    """{scenario: function returning {rank: saved}}."""
    return {"exchange": lambda: run_exchange(engine),
            **{name: (lambda name=name: run_kfac(engine, name)) for name in RUNS}}


def main(out_dir):
    if "TF_CONFIG" in os.environ:  # a MultiWorkerMirroredStrategy worker: the exchange
        engine = Strategy(tf.distribute.MultiWorkerMirroredStrategy())
        runs = {"exchange": lambda: run_exchange(engine)}
    else:
        engine = Horovod()
        runs = scenarios(engine)
    assert engine.comm.size == RANKS, engine.comm.size
    (rank,) = engine.ranks
    for name, run in runs.items():
        np.savez(os.path.join(out_dir, f"{name}.rank{rank}.npz"), **run()[rank])
        print(f"rank {rank}: {name} saved", flush=True)


if __name__ == "__main__":
    main(os.environ[OUT_DIR_VARIABLE])
