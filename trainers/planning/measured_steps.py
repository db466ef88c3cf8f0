"""Steps to target at any global batch from steps measured at a few batch sizes (the
JSON bench/batch_scaling.py writes), so that the planner can turn step times into times
to target without the user supplying the steps.

Between two measured batches the steps are interpolated on a log-log scale (a power law
between them, the shape of the curves Shallue et al. 2019 measure); beyond the measured
batches there is nothing to interpolate from, and the planner refuses rather than guess:
how far steps keep falling past the largest measured batch is what the measurement is
for. Only the JSON's layout is read here; trainers/ imports nothing from bench/.
"""

import bisect
import json
import math


def load(path, model, target, entries):
    """(the target, {entry: {global batch: median steps to it, or None where not
    reached}}) of `entries` from the batch-scaling JSON at `path`, for `model`. `target`
    None means the JSON's primary target. Raises ValueError naming what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except OSError as error:
        raise ValueError(f"--steps_from: cannot read {path}: {error.strerror}") from None
    except ValueError as error:
        raise ValueError(f"--steps_from: {path} is not JSON ({error})") from None
    try:
        measured_model, targets = document["model"], document["targets"]
        target = document["primary_target"] if target is None else target
        results = document["entries"]
    except (KeyError, TypeError):
        raise ValueError(f"--steps_from: {path} is not a batch-scaling JSON (it needs "
                         "model, targets, primary_target and entries)") from None
    if model != measured_model:
        raise ValueError(f"--steps_from: {path} holds steps measured on {measured_model}, "
                         f"not --model={model}; steps to target are the model's own")
    if target not in targets:
        raise ValueError(f"--steps_target must be one of {', '.join(map(str, targets))} "
                         f"(the targets measured in {path}); got {target}")
    steps = {}
    for entry in entries:
        if entry not in results:
            raise ValueError(f"--steps_from: {path} has no entry {entry}; its entries are "
                             f"{', '.join(results)}")
        steps[entry] = {int(batch): cell["to_target"][str(target)]["median_steps"]
                        for batch, cell in results[entry]["batches"].items()
                        if cell["complete"]}
        if not steps[entry]:
            raise ValueError(f"--steps_from: {path} has no finished batch size for {entry}")
    return target, steps


def at_batch(measured, batch, entry, target):
    """Steps to target at global batch `batch`, from `measured` {batch: steps or None}:
    a measured value, or the log-log interpolation between the two measured batches
    around it. Raises ValueError beyond the measured batches, or where a neighbouring
    measurement did not reach the target."""
    batches = sorted(measured)
    if not batches[0] <= batch <= batches[-1]:
        raise ValueError(
            f"global batch {batch} is outside the batches measured for {entry} "
            f"({batches[0]} to {batches[-1]}): steps to target are not extrapolated; "
            "choose --batch and --workers whose product lies in that range")
    if batch in measured:
        neighbours = [batch]
    else:
        position = bisect.bisect(batches, batch)
        neighbours = batches[position - 1:position + 1]
    unreached = [b for b in neighbours if measured[b] is None]
    if unreached:
        raise ValueError(f"{entry} did not reach {target} at batch {unreached[0]} within "
                         f"its budget, so its steps at global batch {batch} are unknown")
    if len(neighbours) == 1:
        return float(measured[batch])
    (low, high), (low_steps, high_steps) = neighbours, [measured[b] for b in neighbours]
    share = math.log(batch / low) / math.log(high / low)
    return math.exp(math.log(low_steps) + share * math.log(high_steps / low_steps))
