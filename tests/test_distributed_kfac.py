"""Distributed K-FAC in a real 2-rank Horovod job (Gloo), checked against one process.

One `horovodrun --gloo -np 2` job of distributed_kfac_worker.py trains several models
with `model.fit`; each rank saves what it holds. The checks:
- after 20 steps on sharded real Fashion-MNIST every model and optimizer variable
  (BatchNorm moving statistics included) is bit-identical on both ranks;
- 2 ranks with per-rank batch B end with the same weights as 1 process with batch 2B on
  the same examples, for both placements and both methods, with `steps_per_execution`
  > 1 (steps inside a tf.while_loop), and with XLA-compiled local stages;
- factor bytes per factor step = (Σ n(n+1)/2 + BatchNorm diagonals) x wire dtype size, in
  one grouped call, and float16-wire factors are within 2^-10 relative error of float32
  ones;
- stale steps send nothing but gradients and the averaged fit logs (and, for "owner",
  preconditioned gradients);
- the same with a model of every block kind added for modern architectures
  (tests/modern_net.py): batched per-group factors and diagonal vectors travel in the one
  grouped factor call, and 2 ranks equal 1 process for both placements;
- fit logs averaged over ranks inside Keras's `steps_per_execution` loop, with one rank's
  metric arriving late, finish on both ranks with identical values;
- "owner" placement holds only the decompositions of the layers a rank owns, and a
  checkpoint written by rank 0 restores on both ranks (decompositions rebuilt);
- factor_examples="fresh" (data echoing): with fresh examples on one rank only, on both,
  or on none (batch-echo repeats), 2 ranks equal 1 process on the concatenated batches;
  the first factors equal plain K-FAC's on the fresh examples alone (the other rank has
  none: no NaN), all with sample weights; steps without fresh examples send no factors,
  and the fresh count and weight ride in the gradient allreduce;
- factor_batch_fraction=0.5: each rank draws its own half of its batch, and the factors
  (averaged over ranks) equal one process's on the two halves together;
- a rank that raises inside `model.fit` ends the whole job within 60 s, error visible.
"""

import ast
import concurrent.futures
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
from absl import logging
from absl.testing import absltest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import distributed_checks as checks  # noqa: E402
import distributed_kfac_worker as worker  # noqa: E402
import job_results  # noqa: E402
import modern_net  # noqa: E402
from distributed_checks import (EQUIVALENCE_RTOL, FLOAT32, PARAMS, STEPS,  # noqa: E402
                                SYMMETRIC_DIMS, UPDATES, column, triangles)
from trainers.launch import run_horovod_job  # noqa: E402
from tfkfac import distributed  # noqa: E402

JOB_TIMEOUT_SECONDS = 600  # Measured 75-120 s alone, 241 s at load 6-8 (2 cores); Bazel allows 900.
# float16 rounds each rank's entry and the mean once each (unit roundoff 2^-11).
FLOAT16_WIRE_RTOL = 2.0 ** -10

BN_DIAGONAL = 2 * 4  # gamma and beta of 4 channels
BN_PARAMS, BN_MOVING = 2 * 4, 2 * 4


def per_step(cumulative):
    """Per-execution increments of cumulative counters (rows: executions)."""
    cumulative = np.asarray(cumulative)
    return np.diff(np.concatenate([np.zeros_like(cumulative[:1]), cumulative]), axis=0)


class DistributedKfacTest(checks.ScenarioChecks, absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        names = ["sync", "sync_float16", "late_logs", "echo_aware", "owner_restore",
                 "batch_fraction", "timings"] + [
            f"equivalence_{p}_{m}" for p, m, *_ in worker.EQUIVALENCE_CASES] + [
            f"modern_{p}_{m}" for p, m in worker.MODERN_CASES]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            job = pool.submit(job_results.run_and_load, lambda: run_horovod_job(
                os.path.join(TESTS_DIR, "distributed_kfac_worker.py"), num_ranks=2,
                timeout=JOB_TIMEOUT_SECONDS), worker.OUT_DIR_VARIABLE, names, "rank")
            # Single-process references (batch 2B), while the job runs: on the core its
            # ranks leave idle (horovodrun's start, a rank waiting for the other). With
            # one process both placements run the same code: one reference per method.
            comm = distributed.SingleProcess()
            cls.references = {m: worker.run_equivalence(comm, "replicated", m)
                              for m in sorted({m for _, m, *_ in worker.EQUIVALENCE_CASES})}
            cls.modern_references = {m: worker.run_modern(comm, "replicated", m)
                                     for _, m in worker.MODERN_CASES}
            with tempfile.TemporaryDirectory() as directory:
                cls.restore_reference = worker.run_owner_restore(comm, directory)
            cls.echo_reference = worker.run_echo_aware(comm)
            cls.fresh_alone = worker.first_step_fresh_alone(comm)
            cls.returncode, cls.output, cls.exit_time, cls.saved = job.result()
        global_batch = 2 * worker.EQUIVALENCE_BATCH
        x, y = worker.fixed_examples(global_batch)
        kept = [np.concatenate([worker.rank_part(a, global_batch, rank, 2)[
                    cls.saved["batch_fraction"][rank]["kept"]] for rank in range(2)])
                for a in (x, y)]
        cls.kept_halves = worker.first_step_on(*kept, comm)

    def test_every_variable_identical_on_both_ranks_after_20_fit_steps(self):
        rank0, rank1 = self.saved["sync"]
        keys = sorted(k for k in rank0 if k.startswith(("model", "optimizer")))
        # 10 model variables (BatchNorm moving statistics included) and the optimizer's
        # iteration, learning rate, momenta, K-FAC counters, factors, decompositions.
        self.assertLen([k for k in keys if k.startswith("model")], 10)
        self.assertGreater(len(keys), 40)
        for key in keys:
            np.testing.assert_array_equal(rank0[key], rank1[key], err_msg=key)
        # Each rank trained on its own shard (Keras's loss is the rank's own mean)...
        self.assertNotEqual(float(rank0["local_loss"][0]), float(rank1["local_loss"][0]))
        # ...and started from different weights: attach broadcast rank 0's.
        self.assertFalse(np.array_equal(rank0["initial000"], rank1["initial000"]))
        # 20 steps ran and moved the weights away from rank 0's start.
        self.assertEqual(int(rank0["optimizer000"]), worker.SYNC_STEPS)
        self.assertLen(rank0["calls"], worker.SYNC_STEPS)
        self.assertGreater(np.max(np.abs(rank0["model000"] - rank0["initial000"])), 1e-3)

    def assert_matches_one_process(self, placement, method):
        name = f"equivalence_{placement}_{method}"
        counters = [STEPS, UPDATES, UPDATES]  # steps, factor and decomposition updates
        self.assert_weights_match(name, self.references[method], counters)

    def test_two_ranks_match_one_process_with_double_batch(self):
        # Both placements x both methods; the inverse cases run several steps per
        # execution (see the next test), the reference always one.
        for placement, method, *_ in worker.EQUIVALENCE_CASES:
            with self.subTest(placement=placement, method=method):
                self.assert_matches_one_process(placement, method)

    def test_modern_layers_two_ranks_match_one_process(self):
        for placement, method in worker.MODERN_CASES:
            name = f"modern_{placement}_{method}"
            reference = self.modern_references[method]
            with self.subTest(placement=placement, method=method):
                managed = dict(m.split(":") for m in self.held(name, "managed"))
                self.assertEqual(managed, modern_net.MANAGED_KINDS)
                # Batched pairs (grouped, depthwise) and diagonals are among the factors.
                ranks = {len(shape) for shapes in self.held(name, "factor_shapes")
                         for shape in ast.literal_eval(str(shapes))}
                self.assertEqual(ranks, {1, 2, 3})
                np.testing.assert_array_equal(self.held(name, "kfac_counters"),
                                              [STEPS, UPDATES, UPDATES])
                calls = self.held(name, "calls")[-1]
                self.assertEqual(calls[column("factors")], UPDATES)  # one call per update
                keys = sorted(k for k in reference if k.startswith("weight"))
                initial = modern_net.modern_net(seed=7).get_weights()
                self.assertLen(keys, len(initial))
                moved = 0
                for key, start in zip(keys, initial):
                    expected, got = reference[key], self.held(name, key)
                    # A floor for weights that stay at zero up to rounding (the attention
                    # key bias: softmax ignores it, so its gradient is rounding noise).
                    tolerance = max(EQUIVALENCE_RTOL * np.max(np.abs(expected)), 1e-7)
                    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance,
                                               err_msg=f"{name}: {key}")
                    moved += np.max(np.abs(expected - start)) > 10 * tolerance
                self.assertGreater(moved, 0.8 * len(keys))  # training moved the weights

    def test_owner_placement_holds_only_its_layers_decompositions(self):
        # K-FAC state bytes from the factor dims alone: every rank holds every factor
        # (they are allreduced); decompositions are eigenvectors + eigenvalues (eigen)
        # or the inverse (inverse) of each factor.
        blocks = list(zip(SYMMETRIC_DIMS[::2], SYMMETRIC_DIMS[1::2]))  # (A, G) per layer
        factor_bytes = sum(n * n for n in SYMMETRIC_DIMS) * FLOAT32
        for method in ("eigen", "inverse"):
            per_factor = (lambda n: n * n + n) if method == "eigen" else (lambda n: n * n)
            per_block = [(per_factor(a) + per_factor(g)) * FLOAT32 for a, g in blocks]
            replicated = factor_bytes + sum(per_block)
            self.assertEqual(self.held(f"equivalence_replicated_{method}", "state_bytes"),
                             replicated, method)
            # Under "owner" every rank also holds a copy of the factors the
            # decompositions came from, and their damping (saved in their place).
            held = [int(saved["state_bytes"]) - 2 * factor_bytes - FLOAT32
                    for saved in self.saved[f"equivalence_owner_{method}"]]
            # Greedy LPT on dim^3 gives the hidden layer (145, 32) one rank, the conv and
            # logits layers the other: each rank holds its own layers' decompositions.
            self.assertCountEqual(held, [per_block[1], per_block[0] + per_block[2]], method)
            logging.info("%s: K-FAC state per rank %s bytes (owner) vs %d (replicated)",
                         method, [h + 2 * factor_bytes + FLOAT32 for h in held], replicated)

    def test_owner_checkpoint_from_rank_0_restores_on_every_rank(self):
        # Decompositions at steps 0 and 4, rebuilt at 6 right after the restore from the
        # saved factors they came from (uncounted), then at the scheduled step 8.
        steps = 2 * worker.RESTORE_STEPS
        self.assertEqual(worker.RESTORE_DECOMPOSITION_FREQ, 4)
        self.assert_weights_match("owner_restore", self.restore_reference,
                                  [steps, steps, 3])

    def test_steps_per_execution_runs_collectives_inside_while_loop(self):
        cases = [c for c in worker.EQUIVALENCE_CASES if c[2] > 1]
        self.assertNotEmpty(cases)
        for placement, method, steps_per_execution, _ in cases:
            with self.subTest(placement=placement, method=method):
                self.assert_each_collective_once_per_step(
                    f"equivalence_{placement}_{method}", placement, steps_per_execution)
                self.assert_matches_one_process(placement, method)

    def shared_counts(self, name, key, category):
        """Cumulative `key` ("calls"/"bytes") of one category; the same on both ranks."""
        first, second = (saved[key][:, column(category)] for saved in self.saved[name])
        np.testing.assert_array_equal(first, second, err_msg=f"{name}: {key} {category}")
        return first

    def test_fresh_only_factors_two_ranks_match_one_process(self):
        name = "echo_aware"
        fresh = [pattern != "none" for pattern in worker.FRESH_PATTERNS]
        decompositions, due = 0, 0  # due work waits for a step with fresh examples
        for step in np.flatnonzero(fresh):
            if step >= due:
                decompositions, due = decompositions + 1, step + worker.FRESH_SETTINGS[
                    "decomposition_update_freq"]
        self.assert_weights_match(name, self.echo_reference,
                                  [STEPS, sum(fresh), decompositions])
        # Stale steps send no factors; the fresh count and weight ride with the gradients.
        np.testing.assert_array_equal(per_step(self.shared_counts(name, "calls", "factors")),
                                      np.asarray(fresh, int))
        np.testing.assert_array_equal(per_step(self.shared_counts(name, "bytes", "gradients")),
                                      (PARAMS + 2) * FLOAT32)
        # Step 0 had fresh examples on rank 0 only: the factors are those of plain K-FAC
        # on them alone.
        self.assertEqual(worker.FRESH_PATTERNS[0], "rank0")
        for i in range(len(SYMMETRIC_DIMS)):
            key = f"first_factor{i}"
            expected = self.fresh_alone[key]
            np.testing.assert_allclose(self.held(name, key), expected, rtol=0,
                                       atol=EQUIVALENCE_RTOL * np.max(np.abs(expected)),
                                       err_msg=key)

    def test_batch_fraction_two_ranks_match_one_process_on_the_kept_halves(self):
        kept = [saved["kept"] for saved in self.saved["batch_fraction"]]
        self.assertLen(kept[0], worker.EQUIVALENCE_BATCH // 2)
        self.assertFalse(np.array_equal(kept[0], kept[1]))  # each rank its own draw
        for i in range(len(SYMMETRIC_DIMS)):
            key = f"first_factor{i}"
            expected = self.kept_halves[key]
            np.testing.assert_allclose(self.held("batch_fraction", key), expected,
                                       rtol=0,
                                       atol=EQUIVALENCE_RTOL * np.max(np.abs(expected)),
                                       err_msg=key)

    def test_late_metric_does_not_collide_with_next_steps_collectives(self):
        # The scenario finishing at all is the regression check (it failed with Horovod's
        # "same name as another tensor that is currently being processed").
        for key in ("loss", "late_accuracy"):
            values = self.held("late_logs", key)
            executions = 2 * worker.LATE_LOGS_STEPS // worker.LATE_LOGS_STEPS_PER_EXECUTION
            self.assertEqual(values.shape, (executions,))
            self.assertTrue(np.all(np.isfinite(values)), values)

    def test_factor_bytes_match_packed_triangle_formula(self):
        # With BatchNorm every step is a factor step: packed triangles and the BatchNorm
        # diagonal, both in the wire dtype, in one grouped call.
        for name, wire_size in (("sync", FLOAT32), ("sync_float16", 2)):
            expected = (triangles(SYMMETRIC_DIMS) + BN_DIAGONAL) * wire_size
            np.testing.assert_array_equal(
                per_step(self.shared_counts(name, "bytes", "factors")), expected, name)
            np.testing.assert_array_equal(
                per_step(self.shared_counts(name, "calls", "factors")), 1, name)
            # Gradients, with the BatchNorm moving statistics in the same call.
            np.testing.assert_array_equal(
                per_step(self.shared_counts(name, "bytes", "gradients")),
                (PARAMS + BN_PARAMS + BN_MOVING) * FLOAT32, name)
            np.testing.assert_array_equal(
                per_step(self.shared_counts(name, "calls", "gradients")), 1, name)
        # Without BatchNorm: one call per factor step.
        for placement, method, *_ in worker.EQUIVALENCE_CASES:
            name = f"equivalence_{placement}_{method}"
            self.assertEqual(self.shared_counts(name, "bytes", "factors")[-1],
                             UPDATES * triangles(SYMMETRIC_DIMS) * FLOAT32, name)
            self.assertEqual(self.shared_counts(name, "bytes", "gradients")[-1],
                             STEPS * PARAMS * FLOAT32, name)
            # Each rank sends the results it owns; together every result once per
            # exchange: eigenvalues + eigenvectors (eigen) or the inverse (inverse).
            ranks_total = sum(saved["bytes"][-1] for saved in self.saved[name])
            per_factor = (lambda n: n + n * n) if method == "eigen" else (lambda n: n * n)
            eigen = UPDATES * sum(per_factor(n) for n in SYMMETRIC_DIMS) * FLOAT32
            preconditioned = STEPS * PARAMS * FLOAT32
            if placement == "replicated":
                self.assertEqual(ranks_total[column("decompositions")], eigen, name)
                self.assertEqual(ranks_total[column("preconditioned")], 0, name)
            else:
                self.assertEqual(ranks_total[column("decompositions")], 0, name)
                self.assertEqual(ranks_total[column("preconditioned")], preconditioned, name)

    def test_float16_wire_factors_close_to_float32(self):
        count = sum(k.startswith("first_factor") for k in self.saved["sync"][0])
        self.assertEqual(count, len(SYMMETRIC_DIMS) + 1)
        worst = 0.0
        for i in range(count):
            key = f"first_factor{i}"
            reference = self.held("sync", key)
            got = self.held("sync_float16", key)  # Bit-identical on both ranks.
            self.assertTrue(np.all(np.isfinite(got)), key)
            if reference.ndim == 2:
                np.testing.assert_array_equal(got, got.T)
            error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
            self.assertLess(error, FLOAT16_WIRE_RTOL, key)
            worst = max(worst, error)
        self.assertGreater(worst, 0.0)  # float16 really was on the wire.
        logging.info("float16 wire: max relative Frobenius error of factors %.2e", worst)

    def test_stale_steps_issue_no_kfac_collectives(self):
        factor_steps = set(range(0, STEPS, worker.EQUIVALENCE_FREQ))
        self.assertEqual(factor_steps, {0, 5})
        for placement, method, steps_per_execution, _ in worker.EQUIVALENCE_CASES:
            if steps_per_execution != 1:
                continue
            name = f"equivalence_{placement}_{method}"
            for rank, saved in enumerate(self.saved[name]):
                calls, sent = per_step(saved["calls"]), per_step(saved["bytes"])
                self.assertLen(calls, STEPS)
                for step in range(STEPS):
                    fresh = step in factor_steps
                    expected = {"gradients": 1, "metrics": 1, "factors": int(fresh),
                                "decompositions": int(fresh and placement == "replicated"),
                                "preconditioned": int(placement == "owner")}
                    for category in distributed.CATEGORIES:
                        where = f"{name} rank {rank} step {step} {category}"
                        self.assertEqual(calls[step, column(category)],
                                         expected.get(category, 0), where)
                        if not expected.get(category, 0):
                            self.assertEqual(sent[step, column(category)], 0, where)

    def test_failing_rank_ends_job_with_visible_error(self):
        self.assert_failure_ended_job(self.returncode, self.output, self.exit_time,
                                      worker.FAILURE_MESSAGE)

if __name__ == "__main__":
    absltest.main()
