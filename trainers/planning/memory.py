"""What one worker holds in memory for SGD and K-FAC, counted from the model's blocks.

Per worker, in bytes (float32 state):
- model: the weights, their gradients and the inner optimizer's momentum (SGD's too);
- factors: K-FAC's running factors, on every worker;
- decompositions: per symmetric factor what the method stores of it
  (`Method.decomposition_parts`: eigen and eigen_adam an eigenbasis and eigenvalues,
  inverse the inverse); every worker holds all of them under "replicated", a block's
  owner only its blocks' under "owner" (the worker holding most is counted), which also
  keeps the damping they were computed at;
- method_state: the method's own state per piece (`Method.state_shapes`: eigen_adam's
  second moments, one per managed parameter), on every worker under both placements;
- host: under "owner", the copy of the factors last decomposed that a resumed owner
  rebuilds from, which tfkfac keeps in host memory, not on the device;
- activations: the tensors the forward pass makes at the worker's batch (the input and
  every layer's output), which the backward pass reads, in the forward/backward's
  precision (SGD's too): a lower bound, TensorFlow may keep more.

tests/test_plan_memory.py checks the K-FAC part against a real tfkfac.KFAC's
`summary()["state_bytes"]`. Not counted: the framework's workspace, which SGD needs as well
and which depends on TensorFlow's memory planner.
"""

import math

from tfkfac import config as config_lib
from trainers.planning import step_model

COMPONENTS = ("model", "activations", "factors", "decompositions", "method_state", "host")
DEVICE_COMPONENTS = COMPONENTS[:-1]
# What SGD holds of them too.
SGD_COMPONENTS = ("model", "activations")
# Weights, gradients and momentum, each a float32 per trainable parameter.
MODEL_COPIES = 3


def library_methods():
    """The method names `tfkfac.KFACConfig` accepts."""
    field = next(f for f in config_lib.settings() if f.name == "method")
    return tuple(field.metadata["check"].choices)


def per_worker(work, placements, workers, methods=None, precision=None):
    """[{workers, placement, method, component: bytes..., device: their device sum}] of
    every placement and method (names or `tfkfac.Method` values; default: every method of the
    library) at every worker count; activations in `precision` (None: not counted)."""
    rows = []
    for ranks in workers:
        for placement in placements:
            for method in methods or library_methods():
                needs = worker_bytes(work, placement, method, ranks, precision)
                rows.append({"workers": ranks, "placement": placement, "method": method,
                             **needs,
                             "device": sum(needs[c] for c in DEVICE_COMPONENTS)})
    return rows


def worker_bytes(work, placement, method, ranks, precision=None):
    """{component: bytes} on the worker of `ranks` that holds the most under `method` (a
    name or a `tfkfac.Method`); its activations in the forward/backward's `precision`
    (None: not counted, 0)."""
    itemsize = step_model.STATE_ITEMSIZE
    geometries = list(work.geometries["expand"].values())
    factors = [sum(math.prod(s) for s in g.factor_shapes()) for g in geometries]
    decompositions = [sum(e) for e in work.decomposition_elements(method)]
    if placement == "replicated":
        held, rebuild = sum(decompositions), 0
    else:
        owners = step_model.owners_of(work.blocks["expand"], placement, ranks)
        held = max(sum(e for e, owner in zip(decompositions, owners) if owner == rank)
                   for rank in range(ranks)) + 1  # and the damping they were computed at
        rebuild = sum(f for f, g in zip(factors, geometries) if g.symmetric_factors())
    return {"model": MODEL_COPIES * itemsize * work.trainable_parameters,
            "activations": work.activation_bytes(precision) if precision else 0,
            "factors": itemsize * sum(factors),
            "decompositions": itemsize * held,
            "method_state": itemsize * sum(work.method_state(method)),
            "host": itemsize * rebuild}
