"""Where decompositions and preconditioning happen across ranks (docs/design.md §6).

A placement answers, for this rank: which factors it decomposes, which blocks'
decompositions it holds (and saves), which blocks it preconditions, and how the results
reach the other ranks. Owners come from a greedy longest-processing-time assignment on
cost q·n³ per factor: deterministic, so every rank computes the same owners without
talking. With one process both placements do everything locally and send nothing.
"""

import numpy as np

from tfkfac import distributed, methods

PLACEMENTS = ("replicated", "owner")


def decomposition_cost(shape):
    """Relative cost of decomposing a factor of `shape` (n, n) or a batch (q, n, n)."""
    return distributed.eigen_cost(shape[-1], int(np.prod(shape[:-2])))


def factor_items(blocks):
    """One work item per symmetric factor: (block index, factor index)."""
    return [(b, j) for b, block in enumerate(blocks) for j in block.symmetric_factors()]


def owners(name, blocks, size):
    """Owner rank of each unit of work of placement `name` on `size` ranks, as every rank
    computes it: of each `factor_items(blocks)` item ("replicated"), of each block
    ("owner"). Public so that a cost model can use the rule the ranks use."""
    _check_name(name)
    if name == "replicated":
        costs = [decomposition_cost(blocks[b].factor_shapes()[j])
                 for b, j in factor_items(blocks)]
    else:
        costs = [sum(decomposition_cost(block.factor_shapes()[j])
                     for j in block.symmetric_factors()) or 1.0 for block in blocks]
    return distributed.lpt_assignment(costs, size)


class Placement:
    """Shared bookkeeping and the owners of `name`'s units of work; subclasses choose
    what a rank holds and how results travel."""

    name = None
    saves_decompositions = True

    def __init__(self, blocks, comm, method, dtype="float32"):
        """`method`: the `tfkfac.Method`, which says what results hold."""
        self.blocks, self.comm, self.method = list(blocks), comm, method
        self.dtype = dtype  # of the decompositions and preconditioned gradients
        self.items = factor_items(self.blocks)
        self.owners = owners(self.name, self.blocks, comm.size)
        self.state_shapes = [methods.state_shapes(method, block) for block in self.blocks]
        self.method_keeps_state = any(self.state_shapes)

    def decomposition_shapes(self, item):
        """Shapes of the decomposition of `item`, known to every rank."""
        b, j = item
        return [part.shape for part in
                self.method.decomposition_parts(self.blocks[b].factor_shapes()[j])]

    def decomposed_items(self):
        """The (block, factor) items whose decomposition this rank computes."""
        raise NotImplementedError

    def holds_decompositions(self, b):
        """Whether this process keeps block `b`'s decompositions (for one of the ranks in
        `comm.state_ranks`)."""
        raise NotImplementedError

    def share_decompositions(self, results, wire_dtype):
        """{item: decomposition} for the items this rank holds, from its own `results`."""
        raise NotImplementedError

    def preconditioned_blocks(self):
        """Indices of the blocks this rank preconditions."""
        raise NotImplementedError

    def share_preconditioned(self, local, wire_dtype, method_state=None):
        """(every block's preconditioned gradients, {block: the method's state} to store)
        from this rank's {block: gradients} and, if not None, {block: updated state}."""
        raise NotImplementedError

    def _gather(self, local, owners, shapes_of, keys, wire_dtype, category, exact_from=None):
        """{key: values} for all `keys`, each computed by its owner (one allgather).
        Values from index `exact_from(key)` on travel bit-exactly, whatever the wire."""
        values, shapes, item_owners, exact = [], [], [], []
        for key, owner in zip(keys, owners):
            first_exact = len(shapes_of(key)) if exact_from is None else exact_from(key)
            for k, shape in enumerate(shapes_of(key)):
                values.append(local[key][k] if key in local else None)
                shapes.append(shape)
                item_owners.append(owner)
                exact.append(k >= first_exact)
        gathered = iter(distributed.gather_from_owners(
            self.comm, values, shapes, item_owners, wire_dtype, category, self.dtype, exact))
        return {key: [next(gathered) for _ in shapes_of(key)] for key in keys}


class Replicated(Placement):
    """Every rank holds every decomposition and preconditions every block (Pauloski et al.).

    Each factor is decomposed by its owner and the results are gathered on every rank,
    so stale steps send nothing but gradients.
    """

    name = "replicated"

    def decomposed_items(self):
        return [item for item, owner in zip(self.items, self.owners) if owner == self.comm.rank]

    def holds_decompositions(self, b):
        return True

    def share_decompositions(self, results, wire_dtype):
        return self._gather(results, self.owners, self.decomposition_shapes, self.items,
                            wire_dtype, "decompositions")

    def preconditioned_blocks(self):
        return list(range(len(self.blocks)))

    def share_preconditioned(self, local, wire_dtype, method_state=None):
        return [local[b] for b in range(len(self.blocks))], method_state or {}


class Owner(Placement):
    """Each block's owner decomposes and preconditions it (Osawa et al.).

    Preconditioned gradients are gathered every step, with the method's state the
    owners updated (`EigenAdam`'s moments), so that every rank holds every block's. A rank
    holds only its own blocks' decompositions, which are rank-specific and not saved: a
    resumed owner rebuilds them from the decomposed factors every rank saves
    (`Curvature.rebuild_variables`).
    """

    name = "owner"
    saves_decompositions = False

    def decomposed_items(self):
        return [(b, j) for b, j in self.items if self._owns(b)]

    def holds_decompositions(self, b):
        return self.owners[b] in self.comm.state_ranks

    def _owns(self, b):
        return self.owners[b] == self.comm.rank

    def share_decompositions(self, results, wire_dtype):
        return results

    def preconditioned_blocks(self):
        return [b for b in range(len(self.blocks)) if self._owns(b)]

    def share_preconditioned(self, local, wire_dtype, method_state=None):
        blocks = range(len(self.blocks))
        grad_shapes = lambda b: [v.shape for v in self.blocks[b].variables]
        state_shapes = lambda b: [] if method_state is None else self.state_shapes[b]
        gathered = self._gather(
            {b: local[b] + (method_state[b] if method_state is not None else [])
             for b in local},
            self.owners, lambda b: grad_shapes(b) + state_shapes(b), blocks, wire_dtype,
            "preconditioned", lambda b: len(grad_shapes(b)))
        return ([gathered[b][:len(grad_shapes(b))] for b in blocks],
                {} if method_state is None else {b: gathered[b][len(grad_shapes(b)):]
                                                 for b in blocks})


def make_placement(name, blocks, comm, method, dtype="float32"):
    """The placement called `name` ("replicated" or "owner") for `method` (a
    `tfkfac.Method`)."""
    _check_name(name)
    return {kind.name: kind for kind in (Replicated, Owner)}[name](blocks, comm, method, dtype)


def _check_name(name):
    if name not in PLACEMENTS:
        raise ValueError(f"`placement` must be one of {PLACEMENTS}; received {name!r}")
