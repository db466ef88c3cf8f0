"""Owner assignment: LPT balances ResNet factor work better than round-robin, deterministically.

Round-robin (item i to rank i mod size, Pauloski et al.) is the baseline LPT must beat;
it lives here because the library does not use it.
"""

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


def balance(costs, owners, size):
    """(max load, max/min load) of an assignment; max/min is inf when a rank is idle."""
    loads = numpy_loads(costs, owners, size)
    return loads.max(), loads.max() / loads.min() if loads.min() > 0 else float("inf")


def lpt(dims, size):
    return assignment.lpt_assignment([assignment.eigen_cost(n) for n in dims], size)


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
        lpt_max, lpt_ratio = balance(costs, lpt(dims, size), size)
        robin_max, robin_ratio = balance(costs, [i % size for i in range(len(dims))], size)
        logging.info("%s on %d ranks: LPT max/min %.3f, round-robin max/min %.3f, "
                     "max load LPT/round-robin %.3f", model, size, lpt_ratio, robin_ratio,
                     lpt_max / robin_max)
        self.assertLess(lpt_max, robin_max)
        self.assertLess(lpt_ratio, robin_ratio)
        # No rank can carry less than the largest item or the mean load.
        self.assertGreaterEqual(lpt_max, max(max(costs), sum(costs) / size))

    @parameterized.parameters(2, 3)
    def test_lpt_within_graham_bound_of_optimum(self, size):
        rng = np.random.default_rng(size)
        for _ in range(20):
            costs = rng.integers(1, 60, size=7).astype(float) ** 3
            owners = assignment.lpt_assignment(costs, size)
            makespan = numpy_loads(costs, owners, size).max()
            self.assertLessEqual(makespan, (4 / 3 - 1 / (3 * size)) * optimal_makespan(costs, size))

    def test_every_rank_gets_work(self):
        costs = np.random.default_rng(1).random(30) * 100
        self.assertEqual(sorted(set(assignment.lpt_assignment(costs, 4))), [0, 1, 2, 3])

    def test_ties_are_broken_by_item_then_rank(self):
        self.assertEqual(assignment.lpt_assignment([8, 8, 8, 8, 1], 2), [0, 1, 0, 1, 0])
        self.assertEqual(assignment.lpt_assignment([1, 5, 5], 3), [2, 0, 1])

    def test_deterministic_across_calls_and_input_types(self):
        dims = resnet50_factor_dims()
        first = lpt(dims, 8)
        self.assertEqual(first, lpt(list(dims), 8))
        self.assertEqual(first, lpt(np.asarray(dims), 8))
        self.assertEqual(first, lpt(tuple(dims), 8))

    def test_more_ranks_than_items_leaves_ranks_idle(self):
        self.assertEqual(assignment.lpt_assignment([3.0, 2.0], 3), [0, 1])

    def test_rejects_bad_input(self):
        with self.assertRaisesRegex(ValueError, "size must be a positive integer"):
            assignment.lpt_assignment([1.0], 0)
        with self.assertRaisesRegex(ValueError, "costs must be non-negative"):
            assignment.lpt_assignment([-1.0], 2)


if __name__ == "__main__":
    absltest.main()
