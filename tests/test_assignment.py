"""Owner assignment: LPT balances ResNet factor work better than round-robin, deterministically."""

import itertools
import os
import sys

import numpy as np
from absl import logging
from absl.testing import absltest, parameterized

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata"))

from resnet_factors import resnet20_factor_dims, resnet50_factor_dims  # noqa: E402
from tfkfac.distributed import assignment  # noqa: E402

MODELS = {"resnet20": resnet20_factor_dims, "resnet50": resnet50_factor_dims}


def numpy_loads(costs, owners, size):
    return np.bincount(np.asarray(owners), weights=np.asarray(costs, float), minlength=size)


def optimal_makespan(costs, size):
    """Smallest possible maximum load, by trying every assignment."""
    costs = np.asarray(costs, float)
    return min(numpy_loads(costs, owners, size).max()
               for owners in itertools.product(range(size), repeat=len(costs)))


class AssignmentTest(parameterized.TestCase):

    @parameterized.product(model=sorted(MODELS), size=[2, 3, 4, 8])
    def test_lpt_beats_round_robin_on_resnet_factors(self, model, size):
        dims = MODELS[model]()
        costs = [assignment.eigen_cost(n) for n in dims]
        lpt = assignment.load_balance(costs, assignment.assign_owners(dims, size, "lpt"), size)
        robin = assignment.load_balance(
            costs, assignment.assign_owners(dims, size, "round_robin"), size)
        logging.info("%s on %d ranks: LPT max/min %.3f, round-robin max/min %.3f, "
                     "max load LPT/round-robin %.3f", model, size, lpt["max_over_min"],
                     robin["max_over_min"], lpt["max"] / robin["max"])
        self.assertLess(lpt["max"], robin["max"])
        self.assertLess(lpt["max_over_min"], robin["max_over_min"])
        # No rank can carry less than the largest item or the mean load.
        self.assertGreaterEqual(lpt["max"], max(max(costs), sum(costs) / size))

    @parameterized.parameters(2, 3)
    def test_lpt_within_graham_bound_of_optimum(self, size):
        rng = np.random.default_rng(size)
        for _ in range(20):
            costs = rng.integers(1, 60, size=7).astype(float) ** 3
            owners = assignment.lpt_assignment(costs, size)
            makespan = numpy_loads(costs, owners, size).max()
            self.assertLessEqual(makespan, (4 / 3 - 1 / (3 * size)) * optimal_makespan(costs, size))

    def test_rank_loads_match_numpy(self):
        rng = np.random.default_rng(1)
        costs = rng.random(30) * 100
        owners = assignment.lpt_assignment(costs, 4)
        np.testing.assert_allclose(assignment.rank_loads(costs, owners, 4),
                                   numpy_loads(costs, owners, 4))
        self.assertEqual(sorted(set(owners)), [0, 1, 2, 3])

    def test_ties_are_broken_by_item_then_rank(self):
        self.assertEqual(assignment.lpt_assignment([8, 8, 8, 8, 1], 2), [0, 1, 0, 1, 0])
        self.assertEqual(assignment.lpt_assignment([1, 5, 5], 3), [2, 0, 1])

    def test_deterministic_across_calls_and_input_types(self):
        dims = resnet50_factor_dims()
        first = assignment.assign_owners(dims, 8)
        self.assertEqual(first, assignment.assign_owners(list(dims), 8))
        self.assertEqual(first, assignment.assign_owners(np.asarray(dims), 8))
        self.assertEqual(first, assignment.assign_owners(tuple(dims), 8))

    def test_round_robin_cycles_ranks(self):
        self.assertEqual(assignment.round_robin_assignment(5, 2), [0, 1, 0, 1, 0])

    def test_idle_rank_reports_infinite_imbalance(self):
        owners = assignment.lpt_assignment([3.0, 2.0], 3)
        balance = assignment.load_balance([3.0, 2.0], owners, 3)
        self.assertEqual((balance["max"], balance["min"]), (3.0, 0.0))
        self.assertEqual(balance["max_over_min"], float("inf"))

    def test_rejects_bad_input(self):
        with self.assertRaisesRegex(ValueError, "strategy must be one of"):
            assignment.assign_owners([3, 4], 2, strategy="random")
        with self.assertRaisesRegex(ValueError, "size must be a positive integer"):
            assignment.lpt_assignment([1.0], 0)
        with self.assertRaisesRegex(ValueError, "costs must be non-negative"):
            assignment.lpt_assignment([-1.0], 2)
        with self.assertRaisesRegex(ValueError, "one entry per cost"):
            assignment.rank_loads([1.0, 2.0], [0], 2)
        with self.assertRaisesRegex(ValueError, "owners must be ranks"):
            assignment.rank_loads([1.0], [2], 2)


if __name__ == "__main__":
    absltest.main()
