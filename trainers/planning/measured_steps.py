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

from trainers.checkpoints import describe


class _Field(ValueError):
    """A field of the JSON that is not what bench/batch_scaling.py writes."""


def load(path, model, target, entries):
    """(the target, {entry: {global batch: median steps to it, or None where not
    reached}}) of `entries` from the batch-scaling JSON at `path`, for `model`. `target`
    None means the JSON's primary target. Raises ValueError in one line naming the file,
    and the field that is wrong with what it holds and what it must be."""
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except OSError as error:
        raise ValueError(f"--steps_from: cannot read {path}: {error.strerror}") from None
    except ValueError as error:  # not JSON, or bytes that are not UTF-8
        raise ValueError(f"--steps_from: {path} is not JSON ({error})") from None
    try:
        return _read(document, path, model, target, entries)
    except _Field as error:
        raise ValueError(f"--steps_from: {path}: {error}; it is not the batch-scaling JSON "
                         "bench/batch_scaling.py writes") from None


def _read(document, path, model, target, entries):
    """`load`'s result from the parsed `document`; `_Field` names a field that is wrong."""
    _require(document, "the document", dict, "an object")
    measured_model = _require(_get(document, "model", "the document"), "model", str,
                              "a string")
    targets = _require(_get(document, "targets", "the document"), "targets", list,
                       "a list of accuracies")
    for index, value in enumerate(targets):
        _accuracy(value, f"targets[{index}]")
    primary = _accuracy(_get(document, "primary_target", "the document"), "primary_target")
    results = _require(_get(document, "entries", "the document"), "entries", dict,
                       "an object")
    if model != measured_model:
        raise ValueError(f"--steps_from: {path} holds steps measured on {measured_model}, "
                         f"not --model={model}; steps to target are the model's own")
    if target is None:
        if primary not in targets:
            raise _Field(f"primary_target is {primary}, not one of its targets "
                         f"({', '.join(map(str, targets))})")
        target = primary
    elif target not in targets:
        raise ValueError(f"--steps_target must be one of {', '.join(map(str, targets))} "
                         f"(the targets measured in {path}); got {target}")
    steps = {}
    for entry in entries:
        if entry not in results:
            raise ValueError(f"--steps_from: {path} has no entry {entry}; its entries are "
                             f"{', '.join(results)}")
        steps[entry] = _finished(results[entry], f"entries.{entry}", target)
        if not steps[entry]:
            raise ValueError(f"--steps_from: {path} has no finished batch size for {entry}")
    return target, steps


def _finished(result, name, target):
    """{global batch: median steps to `target`, or None} of the finished batch sizes of
    one entry (`result`, the JSON's field `name`)."""
    batches = _require(_get(_require(result, name, dict, "an object"), "batches", name),
                       f"{name}.batches", dict, "an object of batch sizes")
    steps = {}
    for batch, cell in batches.items():
        where = f"{name}.batches.{batch}"
        if not (batch.isdigit() and int(batch) > 0):
            raise _Field(f"{name}.batches has the key {json.dumps(batch)}, not a batch size "
                         "(an integer > 0)")
        _require(cell, where, dict, "an object")
        if not _require(_get(cell, "complete", where), f"{where}.complete", bool,
                        "true or false"):
            continue
        reached = _require(_get(_require(_get(cell, "to_target", where), f"{where}.to_target",
                                         dict, "an object of targets"), str(target),
                                f"{where}.to_target"),
                           f"{where}.to_target.{target}", dict, "an object")
        median = _get(reached, "median_steps", f"{where}.to_target.{target}")
        if median is not None and not (isinstance(median, (int, float))
                                       and not isinstance(median, bool)
                                       and math.isfinite(median) and median > 0):
            raise _Field(f"{where}.to_target.{target}.median_steps is {describe(median)}, not "
                         "a number of steps > 0 (or null: not reached)")
        steps[int(batch)] = median
    return steps


def _get(mapping, key, name):
    """`mapping[key]`, or `_Field` saying that `name` lacks it."""
    if key not in mapping:
        raise _Field(f"{name} has no field {key}")
    return mapping[key]


def _require(value, name, kind, expected):
    """`value` if it is a `kind` (a bool is no number), else `_Field` naming `name`."""
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise _Field(f"{name} is {describe(value)}, not {expected}")
    return value


def _accuracy(value, name):
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value <= 1):
        raise _Field(f"{name} is {describe(value)}, not an accuracy in (0, 1]")
    return value


def measured_cells(path, entries):
    """({entry: {global batch: the cell's measured step and K-FAC settings}}, the CPUs of
    the machine that measured them) from the batch-scaling JSON at `path` (`load` has
    read it): per finished batch, "step_s" (the retimed median step in seconds, or None
    where the JSON has none) and "kfac" (the entry's settings with the protocol's
    per-batch K-FAC settings and the batch's chosen point over them)."""
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    budgets = document.get("protocol", {}).get("budgets", {})
    per_batch = document.get("protocol", {}).get("kfac_batch_settings", [])
    cells = {}
    for entry in entries:
        result = document["entries"][entry]
        cells[entry] = {}
        for batch, cell in result["batches"].items():
            if not cell["complete"]:
                continue
            step = cell.get("retimed", {}).get("step_s", {}).get("median")
            settings = dict(result.get("settings", {}))
            settings.update({k: budgets[batch][k] for k in per_batch
                             if k in budgets.get(batch, {})})
            settings.update(cell.get("chosen") or {})
            cells[entry][int(batch)] = {"step_s": step, "kfac": settings}
    return cells, document.get("machine", {}).get("cpus")


def around(batches, batch, entry):
    """The measured `batches` that global batch `batch` is read from: itself, or the two
    around it. Raises ValueError beyond them (nothing is extrapolated)."""
    batches = sorted(batches)
    if not batches[0] <= batch <= batches[-1]:
        raise ValueError(
            f"global batch {batch} is outside the batches measured for {entry} "
            f"({batches[0]} to {batches[-1]}): steps to target are not extrapolated; "
            "choose --batch and --workers whose product lies in that range")
    if batch in batches:
        return [batch]
    position = bisect.bisect(batches, batch)
    return batches[position - 1:position + 1]


def at_batch(measured, batch, entry, target):
    """Steps to target at global batch `batch`, from `measured` {batch: steps or None}:
    a measured value, or the log-log interpolation between the two measured batches
    around it. Raises ValueError beyond the measured batches, or where a neighbouring
    measurement did not reach the target."""
    neighbours = around(measured, batch, entry)
    unreached = [b for b in neighbours if measured[b] is None]
    if unreached:
        raise ValueError(f"{entry} did not reach {target} at batch {unreached[0]} within "
                         f"its budget, so its steps at global batch {batch} are unknown")
    return interpolated({b: measured[b] for b in neighbours}, batch)


def interpolated(values, batch):
    """The value at `batch` from {batch: value} at it or at the two batches around it: a
    power law between them."""
    if batch in values:
        return float(values[batch])
    (low, high), (low_value, high_value) = sorted(values), [values[b] for b in sorted(values)]
    share = math.log(batch / low) / math.log(high / low)
    return math.exp(math.log(low_value) + share * math.log(high_value / low_value))
