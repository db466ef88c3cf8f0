"""What the multi-process K-FAC suites check the same way on either engine, one code path
per guarantee: Horovod (tests/test_distributed_kfac.py) and tf.distribute
(tests/strategy_kfac_checks.py for tests/test_mirrored_kfac.py and
tests/test_multi_worker_kfac.py). Their scenarios share the models, data and settings of
tests/distributed_kfac_worker.py.

A test class mixes `ScenarioChecks` into an `absltest.TestCase` and sets `saved`
({scenario: [what each process saved]}; tests/job_results.py loads a launched job's).
"""

import re

import numpy as np
from absl import logging

import distributed_kfac_worker as worker
from tfkfac import distributed

# Processes (or replicas) vs one process differ only by float32 summation order: measured
# max |w_2 ranks - w_1 process| / max|w_1 process| = 1e-5 .. 7e-5 after 6 steps (weights
# moved 0.13).
EQUIVALENCE_RTOL = 1e-4
# A process that raises inside `fit` ends the whole job within this.
FAILURE_EXIT_SECONDS = 60
FLOAT32 = 4

# small_cnn's K-FAC factors (see worker.small_cnn), independent of tfkfac's own summary.
SYMMETRIC_DIMS = [3 * 3 * 1 + 1, 4,  # conv: patch + bias, output channels
                  6 * 6 * 4 + 1, 32,  # hidden: flattened 6x6x4 + bias, units
                  32 + 1, 10]  # logits
PARAMS = (3 * 3 * 1 * 4 + 4) + (6 * 6 * 4 * 32 + 32) + (32 * 10 + 10)

# The equivalence runs' schedule: factor and inverse steps at 0 and 5 of 6 steps.
STEPS = worker.EQUIVALENCE_STEPS
UPDATES = len(range(0, STEPS, worker.EQUIVALENCE_FREQ))


def triangles(dims):
    """Packed upper-triangle elements of symmetric matrices of sizes `dims`."""
    return sum(n * (n + 1) // 2 for n in dims)


def column(category):
    return distributed.CATEGORIES.index(category)


class ScenarioChecks:
    """Assertions on `saved` (see the module docstring) shared by both engines' suites."""

    saved = None

    def held(self, name, key):
        """`key` of scenario `name`: identical in every process (and on every replica of a
        process, where it saved `replicas_identical`)."""
        values = [process[key] for process in self.saved[name]]
        for process in self.saved[name]:
            if "replicas_identical" in process:
                self.assertTrue(bool(process["replicas_identical"]), f"{name}: replicas")
        for other in values[1:]:
            np.testing.assert_array_equal(values[0], other, err_msg=f"{name}: {key}")
        return values[0]

    def assert_weights_match(self, name, reference, counters):
        """The K-FAC counters (steps, factor and decomposition updates) of `name` and of
        the 1-process `reference` are `counters`, and the weights every process holds
        (identical) equal the reference's."""
        np.testing.assert_array_equal(reference["kfac_counters"], counters)
        np.testing.assert_array_equal(self.held(name, "kfac_counters"), counters)
        keys = sorted(k for k in reference if k.startswith("weight"))
        self.assertLen(keys, 6)
        initial = worker.small_cnn(seed=7, batch_norm=False).get_weights()
        worst = 0.0
        for key, start in zip(keys, initial):
            expected, got = reference[key], self.held(name, key)
            tolerance = EQUIVALENCE_RTOL * np.max(np.abs(expected))
            np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance,
                                       err_msg=f"{name}: {key}")
            worst = max(worst, np.max(np.abs(got - expected)) / np.max(np.abs(expected)))
            if key in ("weight000", "weight002", "weight004"):  # kernels
                # Training moved every kernel far beyond the tolerance.
                self.assertGreater(np.max(np.abs(expected - start)), 100 * tolerance, key)
        logging.info("%s: max |w_processes - w_1 process| / max|w| = %.2e", name, worst)

    def assert_each_collective_once_per_step(self, name, placement, steps_per_execution):
        """The equivalence run `name` issued each collective exactly once per step: a
        gradient allreduce and the fit logs' average per step, a factor reduction per
        factor step, and per placement a decomposition exchange per inverse step or a
        preconditioned-gradient gather per step; counters read after every execution."""
        calls = self.held(name, "calls")
        self.assertLen(calls, -(-STEPS // steps_per_execution))  # executions
        expected = {"gradients": STEPS, "metrics": STEPS, "factors": UPDATES,
                    "decompositions": UPDATES if placement == "replicated" else 0,
                    "preconditioned": STEPS if placement == "owner" else 0}
        for category in distributed.CATEGORIES:
            self.assertEqual(calls[-1][column(category)], expected.get(category, 0),
                             f"{name}: {category}")

    def assert_failure_ended_job(self, returncode, output, exit_time, failure_message):
        """Every process saved its results, then process 1 raised `failure_message` inside
        `fit` (printing FAILING_AT <time>): the job ended non-zero, the error visible,
        within FAILURE_EXIT_SECONDS, and no process finished that `fit`."""
        self.assertIn("saved its results", output)
        self.assertNotEqual(returncode, 0, msg=output[-3000:])
        self.assertIn(failure_message, output)
        self.assertNotIn("fit finished although", output)
        failed_at = float(re.search(r"FAILING_AT (\d+\.\d+)", output).group(1))
        seconds = exit_time - failed_at
        logging.info("job exited %.1f s after process 1 raised", seconds)
        self.assertLess(seconds, FAILURE_EXIT_SECONDS)
