"""A K-FAC run resumed from a checkpoint ends exactly as the uninterrupted run, for every
method (eigen, inverse, eigen_adam, Adam grafted on eigen) x placement (replicated,
owner) x engine: a 2-rank Horovod job (Gloo), MirroredStrategy over 2 logical CPUs, and
one process.

tests/resume_matrix_worker.py runs each cell: STEPS steps uninterrupted, and a
`tf.train.Checkpoint` written after RESUME_AT steps (right after a factor step, between
decomposition steps) read into a fresh model and optimizer that take the remaining
steps. Both runs issue the same computations and collectives in the same order, so
nothing may differ: weights, every saved optimizer variable, the decompositions each
rank holds and the counters are bit-identical. Under "owner" that needs the saved
decomposed factors and damping (an owner rebuilds its decompositions from them, not from
the restored, fresher factors) and the saved eigenbasis moments.

Also: in the Horovod job every cell resumes as exactly from a .keras file, which holds
the optimizer's variables by name, and eigen_adam under "owner" with a bfloat16 wire
sends the moments bit-exactly with the preconditioned gradients (bytes counted); under
MirroredStrategy, eigen_adam under "owner" trains (each replica preconditions other
blocks) as under "replicated", and `KFAC.precondition` refuses after an owner restore
until a training step rebuilt the decompositions; in one process, every method under
"owner" resumes exactly through a .keras file, and saves of an "owner" run by tfkfac
0.2.0 (no rebuild state) load, also by the trainer's resume, and go on with
decompositions rebuilt from the factors, with a warning.
"""

import json
import os
import re
import shutil
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest  # noqa: E402

# Two logical CPU devices for MirroredStrategy, before TensorFlow initializes its devices.
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
OLDER_SAVES = os.path.join(TESTS_DIR, "testdata", "owner_v0_2")
sys.path.insert(0, TESTS_DIR)
sys.path.insert(0, os.path.join(TESTS_DIR, "testdata"))

import job_results  # noqa: E402
import owner_save_v0_2 as older  # noqa: E402
import resume_matrix_worker as worker  # noqa: E402
import saved_fixtures  # noqa: E402
from kfac_reference import sgd_kfac  # noqa: E402
from every_block_net import is_eigenbasis_moment as is_moment  # noqa: E402
from tfkfac import distributed  # noqa: E402
from trainers import checkpoints, reporting  # noqa: E402

# Parameters of small_cnn's blocks by owner under "owner" on 2 ranks (greedy LPT on
# n³): the hidden layer (145 x 32) alone on one rank; the logits (33 x 10), the conv
# (10 x 4) and BatchNorm (4 gammas, 4 betas) on the other. A block's moments have as
# many entries as its parameters.
OWNED_PARAMETERS = [145 * 32, 33 * 10 + 10 * 4 + 2 * 4]
BFLOAT16, FLOAT32 = 2, 4


class ResumeChecks:
    """Assertions on `worker.run_cell` results."""

    def assert_resumes_exactly(self, arrays, cell, where=""):
        uninterrupted = {k.split("/", 1)[1]: v for k, v in arrays.items()
                         if k.startswith("uninterrupted/")}
        resumed = {k.split("/", 1)[1]: v for k, v in arrays.items()
                   if k.startswith("resumed/")}
        self.assertEqual(sorted(resumed), sorted(uninterrupted), where)
        for key, value in uninterrupted.items():
            np.testing.assert_array_equal(resumed[key], value, err_msg=f"{where} {key}")
        # The decompositions held were compared, and the schedule ran: factors at 0, 2,
        # ..., decompositions at 0, 4, 8 (a rebuild after the restore is not one).
        self.assertTrue(any(k.startswith("decomposition") for k in uninterrupted), where)
        self.assertEqual(uninterrupted["counter_steps"], worker.STEPS, where)
        self.assertEqual(uninterrupted["counter_factor_updates"],
                         worker.STEPS // worker.FACTOR_FREQ, where)
        self.assertEqual(uninterrupted["counter_decomposition_updates"],
                         -(-worker.STEPS // worker.DECOMPOSITION_FREQ), where)
        moments = [k for k in uninterrupted if is_moment(k.split("@")[0])]
        self.assertEqual(bool(moments), cell[0] == "eigen_adam", where)


def setUpModule():
    TwoRankHorovodResumeTest.start_job()


class TwoRankHorovodResumeTest(job_results.TwoRankJob, ResumeChecks, absltest.TestCase):
    """(Named to run after this module's one-process tests, which run while its job,
    started by setUpModule, does.)"""

    # Measured 160 s alone on the 2-core machine at load 7, 379 s beside this module's
    # other tests at load ~10.
    WORKER, JOB_TIMEOUT_SECONDS = worker, 600
    SCENARIOS = [worker.name(c) for c in worker.CELLS] + ["narrow_wire"]

    def test_every_cell_resumes_bit_identically_on_both_ranks(self):
        for cell in worker.CELLS:
            for rank, arrays in enumerate(self.saved[worker.name(cell)]):
                with self.subTest(cell=cell, rank=rank):
                    self.assert_resumes_exactly(arrays, cell, f"{cell} rank {rank}")

    def test_every_cell_resumes_bit_identically_from_a_keras_file_saved_by_name(self):
        for cell in worker.CELLS:
            for rank, arrays in enumerate(self.saved[worker.name(cell)]):
                with self.subTest(cell=cell, rank=rank):
                    keys = set(arrays["keras_keys"])
                    self.assertEqual([k for k in keys if k.isdigit()], [])
                    self.assertIn("counters:factor_updates", keys)
                    self.assertIn("block:hidden:factor:A", keys)
                    self.assertEqual("curvature:decomposed_damping" in keys,
                                     cell[1] == "owner")
                    # The inner optimizer's slots are named after the model's variables,
                    # whose names the loaded model's differ in: matched by position.
                    position = lambda key: re.sub(r"^(optimizer\d+)_.*(@\d+)$", r"\1\2", key)
                    named = {position(k.split("/", 1)[1]): k.split("/", 1)[1]
                             for k in arrays if k.startswith("uninterrupted/")}
                    self.assert_resumes_exactly(
                        {**{k: v for k, v in arrays.items() if k.startswith("uninterrupted/")},
                         **{"resumed/" + named[position(k.split("/", 1)[1])]: v
                            for k, v in arrays.items() if k.startswith("keras_resumed/")}},
                        cell, f"{cell} rank {rank} (.keras)")

    def test_owner_moments_travel_bit_exactly_with_the_preconditioned_gradients(self):
        ranks = self.saved["narrow_wire"]
        moments = sorted(k for k in ranks[0] if k.startswith("moment_"))
        self.assertLen(moments, 4)  # one per block
        for key in moments:  # every rank holds every block's, identical
            np.testing.assert_array_equal(ranks[0][key], ranks[1][key], err_msg=key)
        # Not rounded to the bfloat16 wire: float32 bits beyond bfloat16's 16 survive.
        low_bits = [np.any(ranks[0][k].view(np.uint32) & 0xFFFF) for k in moments]
        self.assertTrue(all(low_bits), moments)
        # One gather a step; per step each rank sends its blocks' preconditioned
        # gradients in bfloat16 and their moments as float32 bits.
        self.assertEqual([int(r["calls"]) for r in ranks], [worker.WIRE_STEPS] * 2)
        self.assertCountEqual(
            [int(r["bytes"]) for r in ranks],
            [worker.WIRE_STEPS * n * (BFLOAT16 + FLOAT32) for n in OWNED_PARAMETERS])


class MirroredResumeTest(ResumeChecks, absltest.TestCase):
    """Every cell run once in setUpClass: its results and checkpoints serve every test."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.engine = worker.Engine(strategy=tf.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"]))
        cls.directory = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        cls.cells = {cell: worker.run_cell(cls.engine, cell, cls.directory)
                     for cell in worker.CELLS}

    def test_every_cell_resumes_bit_identically_on_both_replicas(self):
        for cell in worker.CELLS:
            with self.subTest(cell=cell):
                self.assert_resumes_exactly(self.cells[cell], cell, str(cell))

    def test_precondition_refuses_after_an_owner_restore_until_a_training_step(self):
        cell = ("inverse", "owner")
        x, y, batch = self.engine.examples()
        # The checkpoint setUpClass's run of the cell wrote (it decomposed at steps 0, 4).
        model, optimizer, checkpoint = self.engine.fresh(cell)
        checkpoint.read(os.path.join(self.directory, worker.name(cell))
                        ).assert_existing_objects_matched()
        variables = model.trainable_variables
        ones = lambda: [tf.ones_like(v) for v in variables]
        # (A graph's error message escapes the apostrophe.)
        stale = (r"KFAC.precondition: this rank\\?'s decompositions are not current: "
                 r".*Train one step first")
        with self.assertRaisesRegex(RuntimeError, stale):
            optimizer.precondition(ones(), variables)
        in_replicas = tf.function(lambda: self.engine.strategy.run(
            lambda: optimizer.precondition(ones(), variables)))
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError, stale):
            in_replicas()
        model.fit(x[batch:2 * batch], y[batch:2 * batch], batch_size=batch, epochs=1,
                  verbose=0)  # rebuilds them
        for variable, per_replica in zip(variables, in_replicas()):
            first, second = self.engine.strategy.experimental_local_results(per_replica)
            np.testing.assert_array_equal(first, second, err_msg=variable.path)
            self.assertTrue(np.all(np.isfinite(first)), variable.path)
            self.assertFalse(np.allclose(first, 1.0), variable.path)  # preconditioned

    def test_under_owner_eigen_adam_trains_as_under_replicated(self):
        # Each replica preconditions its own blocks, not those of the first replica's:
        # the moments of every block exist on every replica. (setUpClass's uninterrupted
        # runs of both cells: weights by position, moments by name.)
        held = {}
        for placement in worker.PLACEMENTS:
            held[placement] = {}
            for key, value in self.cells[("eigen_adam", placement)].items():
                run, key = key.split("/", 1)
                key = re.sub(r"^optimizer\d+_", "", key)
                if run == "uninterrupted" and (key.startswith("weight")
                                               or is_moment(key.split("@")[0])):
                    held[placement][key] = value
        self.assertLen([k for k in held["owner"] if is_moment(k.split("@")[0])], 2 * 4)
        self.assertEqual(sorted(held["owner"]), sorted(held["replicated"]))
        for key, value in held["replicated"].items():
            np.testing.assert_allclose(held["owner"][key], value, rtol=0,
                                       atol=1e-6 * np.max(np.abs(value)), err_msg=key)


class OneProcessResumeTest(absltest.TestCase):

    def test_every_method_under_owner_resumes_exactly_through_a_keras_file(self):
        engine = worker.Engine(distributed.SingleProcess())
        x, y, batch = engine.examples()
        path = os.path.join(tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir()),
                            "model.keras")
        for method in worker.METHODS:
            with self.subTest(method=method):
                model, optimizer, _ = engine.fresh((method, "owner"))
                save = worker.CallAfter(worker.RESUME_AT, lambda: model.save(path))
                model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                          callbacks=[save])
                loaded = keras.models.load_model(path)
                loaded.optimizer.attach(loaded)
                rest = slice(worker.RESUME_AT * batch, None)
                loaded.fit(x[rest], y[rest], batch_size=batch, epochs=1, shuffle=False,
                           verbose=0)
                for got, want in zip(loaded.variables + loaded.optimizer.variables,
                                     model.variables + optimizer.variables):
                    np.testing.assert_array_equal(got.numpy(), want.numpy(), err_msg=got.path)
                self.assertEqual(loaded.optimizer.counters(), optimizer.counters())


class OlderOwnerSaveTest(absltest.TestCase):
    """Saves of an "owner" run by tfkfac 0.2.0, which kept no rebuild state
    (tests/testdata/owner_save_v0_2.py wrote them): they load, and at its first step the
    owner rebuilds its decompositions from the factors it holds, saying so: each
    eigenbasis then diagonalizes its factor, and the run goes on.

    The weights that tfkfac's resumed run reached (`next_weight<i>` in the data) are not
    compared: eigen_adam's moments live in the factors' eigenbases, which within the
    near-degenerate eigenspaces of this small random problem LAPACK's CPU kernels choose
    differently (after the 2 steps up to 1.4e-2 apart across OpenBLAS's kernels on one
    machine, about what the steps move the weights), so a continuation is comparable only
    on one machine."""

    def setUp(self):
        super().setUp()
        self.expected = np.load(os.path.join(OLDER_SAVES, "expected.npz"))
        self.rest = slice(older.SAVED_AFTER * older.BATCH, None)

    def assert_rebuilds_and_goes_on(self, model):
        x, y = self.expected["x"][self.rest], self.expected["y"][self.rest]
        output = stderr_of(lambda: older.fit(model, x[:older.BATCH], y[:older.BATCH]))
        self.assertIn("KFAC warning: the restored state holds no decomposed factors (saved "
                      "by an older tfkfac under placement \"owner\"); decompositions "
                      "recomputed from the restored factors", output)
        curvature = model.optimizer.curvature
        for state in curvature.states:
            for factor, decomposition in zip(state.factor_values(), state.decompositions):
                if len(factor.shape) != 2:  # a diagonal factor keeps no eigenbasis
                    continue
                basis, factor = decomposition[0].numpy(), factor.numpy()
                rotated = basis.T @ factor @ basis
                np.testing.assert_allclose(basis.T @ basis, np.eye(len(basis)), atol=1e-5)
                np.testing.assert_allclose(rotated - np.diag(np.diag(rotated)), 0,
                                           atol=1e-5 * np.abs(factor).max())
        older.fit(model, x[older.BATCH:], y[older.BATCH:])
        self.assertTrue(all(np.isfinite(w).all() for w in model.get_weights()))

    def test_keras_file_loads_and_goes_on(self):
        model = saved_fixtures.load(self, os.path.join(OLDER_SAVES, "model.keras"))
        model.optimizer.attach(model)
        self.assert_rebuilds_and_goes_on(model)

    def test_tf_checkpoint_reads_and_goes_on(self):
        model = older.model_fn()
        optimizer = sgd_kfac(**older.SETTINGS).attach(model)
        model.compile(optimizer=optimizer, loss=older.LOSS)
        optimizer.build(model.trainable_variables)
        status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(
            os.path.join(OLDER_SAVES, "ckpt"))
        with self.assertRaisesRegex(AssertionError, "decomposed"):  # names what it lacks
            status.assert_existing_objects_matched()
        self.assert_rebuilds_and_goes_on(model)

    def test_trainer_resume_loads_it_and_goes_on(self):
        """The trainer's resume (trainers/checkpoints.py) takes it as a run's newest
        checkpoint, as tfkfac reads it; where it lacks more than the rebuild state (into
        placement "replicated", whose decompositions it does not hold), it refuses it."""
        model_dir = self.create_tempdir().full_path
        step_dir = os.path.join(model_dir, checkpoints.CHECKPOINT_SUBDIR,
                                f"step-{older.SAVED_AFTER}")
        os.makedirs(step_dir)
        for name in os.listdir(OLDER_SAVES):
            if name.startswith("ckpt."):
                shutil.copy(os.path.join(OLDER_SAVES, name), os.path.join(
                    step_dir, checkpoints.VARIABLES_PREFIX + name[len("ckpt"):]))
        with open(os.path.join(step_dir, checkpoints.STATE_FILE), "w", encoding="utf-8") as f:
            json.dump({"counters": reporting.RunCounters(steps=older.SAVED_AFTER).to_dict(),
                       "epoch_metrics": None}, f)

        def store(placement):
            model = older.model_fn()
            optimizer = sgd_kfac(**dict(older.SETTINGS, placement=placement)).attach(model)
            model.compile(optimizer=optimizer, loss=older.LOSS)
            optimizer.build(model.trainable_variables)
            return model, checkpoints.CheckpointStore(model_dir, model, optimizer)

        _, replicated = store("replicated")
        with self.assertRaises(checkpoints.CheckpointError):
            replicated.restore(report=False)
        model, owner = store("owner")
        state = owner.restore()
        self.assertEqual(state["counters"]["steps"], older.SAVED_AFTER)
        self.assert_rebuilds_and_goes_on(model)


def stderr_of(function):
    """What `function()` writes to file descriptor 2, where tf.print's warnings go."""
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            function()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        return captured.read().decode(errors="replace")


if __name__ == "__main__":
    absltest.main()
