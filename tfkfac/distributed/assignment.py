"""Which rank owns which work item (e.g. the eigendecomposition of one factor).

Pure Python and deterministic: every rank computes the same owners from the same sizes,
so no communication is needed to agree. Greedy longest-processing-time (LPT) with
cost ∝ dim³ balances the slowest rank far better than the factor-wise round-robin of
Pauloski et al. (2020), whose own profile shows the slowest rank barely speeding up
(tests/test_assignment.py compares the two).
"""


def eigen_cost(dim, count=1):
    """Relative cost of decomposing `count` matrices of dim x dim: O(count dim³)."""
    return float(count) * float(dim) ** 3


def lpt_assignment(costs, size):
    """Owner rank of every item: largest cost first, each to the least-loaded rank.

    Ties are broken deterministically: equal costs by item index, equal loads by the
    lowest rank. The makespan is within 4/3 of optimal (Graham 1969).
    """
    costs = _check_costs(costs)
    size = _check_size(size)
    loads = [0.0] * size
    owners = [0] * len(costs)
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(size), key=lambda r: (loads[r], r))
        owners[item] = rank
        loads[rank] += costs[item]
    return owners


def _check_costs(costs):
    costs = [float(c) for c in costs]
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be non-negative, got {costs}")
    return costs


def _check_size(size):
    if int(size) != size or size < 1:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    return int(size)
