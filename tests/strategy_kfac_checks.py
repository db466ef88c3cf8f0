"""The checks of K-FAC under a tf.distribute strategy against one process, shared by
tests/test_mirrored_kfac.py and tests/test_multi_worker_kfac.py (scenarios:
tests/strategy_kfac_worker.py), on top of those the Horovod suite makes through the same
code (tests/distributed_checks.py). A test class mixes `StrategyChecks` into an
`absltest.TestCase` and sets `saved` ({scenario: [what each process holds]}) and
`references` ({scenario: what one process with the global batch holds})."""

import tempfile

import numpy as np

import distributed_kfac_worker as horovod_suite
import strategy_kfac_worker as worker
from distributed_checks import (FLOAT32, PARAMS, STEPS, SYMMETRIC_DIMS, UPDATES,
                                ScenarioChecks, column, triangles)
from tfkfac import distributed

# The per-step fit logs (loss, accuracy) before the update amplifies rounding.
LOGS_RTOL = 1e-5
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
ITEMSIZE = {"float32": FLOAT32, "float16": 2, "bfloat16": 2}


def references():
    """Every scenario in one process with the global batch (the default strategy)."""
    import tensorflow as tf

    with tempfile.TemporaryDirectory() as directory:
        return {name: run() for name, run in
                worker.scenarios(tf.distribute.get_strategy(), directory).items()}


def owned_decomposition_elements(rank, size=2):
    """Elements of the eigen-decompositions (vectors n², values n) rank `rank` owns."""
    owners = distributed.lpt_assignment([distributed.eigen_cost(n) for n in SYMMETRIC_DIMS],
                                        size)
    return sum(n * n + n for n, owner in zip(SYMMETRIC_DIMS, owners) if owner == rank)


class StrategyChecks(ScenarioChecks):
    """Test methods comparing `saved` with `references` (see the module docstring)."""

    references = None

    def test_replicas_match_one_process_with_the_global_batch(self):
        for placement, method, _, _ in worker.EQUIVALENCE_CASES:
            name = f"equivalence_{placement}_{method}"
            with self.subTest(placement=placement, method=method):
                reference = self.references[name]
                self.assert_weights_match(name, reference, [STEPS, UPDATES, UPDATES])
                # fit's logs: the mean over replicas is one process's on the global batch.
                np.testing.assert_allclose(self.held(name, "logs")[-1],
                                           reference["logs"][-1], rtol=LOGS_RTOL)
                # counters after every execution of fit's loop
                self.assert_each_collective_once_per_step(
                    name, placement, int(self.held(name, "steps_per_execution")))
                for process in self.saved[name]:  # decompositions: each rank its own
                    sent = process["bytes"][-1]
                    self.assertEqual(sent[column("factors")],
                                     UPDATES * triangles(SYMMETRIC_DIMS) * FLOAT32)
                    # One allreduce of every gradient per step: averaged once, not twice.
                    self.assertEqual(sent[column("gradients")], STEPS * PARAMS * FLOAT32)

    def test_lossy_wires_round_factors_once_and_send_the_packing_formula(self):
        reference = self.references["equivalence_replicated_eigen"]
        for wire in worker.WIRES:
            name = f"wire_{wire}"
            with self.subTest(wire=wire):
                for i, n in enumerate(SYMMETRIC_DIMS):
                    got, expected = (self.held(name, f"first_factor{i}"),
                                     reference[f"first_factor{i}"])
                    np.testing.assert_array_equal(got, got.T)
                    # each replica's entry rounded once, their mean once more
                    bound = 4 * UNIT_ROUNDOFF[wire] * np.max(np.abs(expected))
                    np.testing.assert_allclose(got, expected, rtol=0, atol=bound,
                                               err_msg=f"{wire} factor {i} ({n}x{n})")
                self.assertEqual(self.held(name, "calls")[0][column("factors")], 1)
                for rank, process in zip(self.ranks, self.saved[name]):
                    sent = process["bytes"][0]  # the first step: factors + decompositions
                    self.assertEqual(sent[column("factors")],
                                     triangles(SYMMETRIC_DIMS) * ITEMSIZE[wire])
                    self.assertEqual(sent[column("decompositions")],
                                     owned_decomposition_elements(rank) * ITEMSIZE[wire])

    def test_custom_loop_inside_strategy_run_matches_one_process(self):
        for placement in ("replicated", "owner"):
            name = f"custom_loop_{placement}"
            with self.subTest(placement=placement):
                self.assert_weights_match(name, self.references[name],
                                          [STEPS, UPDATES, UPDATES])

    def test_gradients_are_averaged_exactly_once(self):
        reference = self.references["plain_gradient"]
        for i in range(6):
            key = f"step{i:03d}"
            expected = reference[key]
            self.assertGreater(np.max(np.abs(expected)), 0, key)
            np.testing.assert_allclose(self.held("plain_gradient", key), expected, rtol=0,
                                       atol=1e-5 * np.max(np.abs(expected)), err_msg=key)

    def test_batchnorm_moving_statistics_are_averaged_over_replicas(self):
        x, _ = horovod_suite.fixed_examples(2 * worker.BATCH)
        halves = np.split(x.astype(np.float64), 2)  # each replica's part of the batch
        momentum = 0.99  # Keras's default
        mean = (1 - momentum) * np.mean([h.mean() for h in halves])
        variance = momentum + (1 - momentum) * np.mean([h.var() for h in halves])
        np.testing.assert_allclose(self.held("batchnorm", "moving_mean"), [mean], rtol=1e-5)
        np.testing.assert_allclose(self.held("batchnorm", "moving_variance"), [variance],
                                   rtol=0, atol=1e-6)

    def test_checkpoint_from_one_worker_restores_on_every_replica(self):
        steps = 2 * worker.RESTORE_STEPS
        self.assertEqual(horovod_suite.RESTORE_DECOMPOSITION_FREQ, 4)
        # Decompositions at steps 0 and 4, rebuilt at 6 after the restore from the saved
        # factors they came from (uncounted), then at the scheduled 8.
        self.assert_weights_match("restore", self.references["restore"], [steps, steps, 3])
