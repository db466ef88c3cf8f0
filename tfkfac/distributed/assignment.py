"""Which rank owns which work item (e.g. the eigendecomposition of one factor).

Pure Python and deterministic: every rank computes the same owners from the same sizes,
so no communication is needed to agree. Greedy longest-processing-time (LPT) with
cost ∝ dim³ balances the slowest rank far better than the factor-wise round-robin of
Pauloski et al. (2020), whose own profile shows the slowest rank barely speeding up.
"""

STRATEGIES = ("lpt", "round_robin")


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


def round_robin_assignment(num_items, size):
    """Owner rank of every item in turn, item i to rank i mod size (Pauloski et al.)."""
    size = _check_size(size)
    return [item % size for item in range(num_items)]


def assign_owners(dims, size, strategy="lpt"):
    """Owner rank of each square matrix of size `dims[i]` for its O(dim³) decomposition."""
    if strategy == "lpt":
        return lpt_assignment([eigen_cost(n) for n in dims], size)
    if strategy == "round_robin":
        return round_robin_assignment(len(dims), size)
    raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")


def rank_loads(costs, owners, size):
    """Total cost held by each rank."""
    costs = _check_costs(costs)
    size = _check_size(size)
    if len(owners) != len(costs):
        raise ValueError(
            f"owners must have one entry per cost ({len(costs)}), got {len(owners)}")
    loads = [0.0] * size
    for cost, rank in zip(costs, owners):
        if not 0 <= rank < size:
            raise ValueError(f"owners must be ranks in [0, {size}), got {rank}")
        loads[rank] += cost
    return loads


def load_balance(costs, owners, size):
    """Per-rank load summary: `max`, `min` and `max_over_min` (inf when a rank is idle)."""
    loads = rank_loads(costs, owners, size)
    high, low = max(loads), min(loads)
    return {
        "max": high,
        "min": low,
        "max_over_min": high / low if low > 0 else float("inf"),
    }


def _check_costs(costs):
    costs = [float(c) for c in costs]
    if any(c < 0 for c in costs):
        raise ValueError(f"costs must be non-negative, got {costs}")
    return costs


def _check_size(size):
    if int(size) != size or size < 1:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    return int(size)
