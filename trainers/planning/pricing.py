"""Step times for `--steps_from`'s times to target: the step the batch-scaling benchmark
measured, scaled to the planned device and workers by the planner's own model.

The benchmark timed each entry at each global batch b in one process on the machine that
ran it (the JSON's retimed median step). The planner predicts that step on the `local`
profile (this machine: bench/results/step_floor.json) and the planned one (`--device`,
the worker count, `--batch` each); the price is the measured step times their ratio, so
what the model leaves out on the measuring machine (Keras's step, the framework) is
carried over in proportion rather than dropped. Between measured batches the price is
interpolated as the steps are (log-log). The K-FAC step is the entry's own configuration
at b (its method, intervals, factor batch fraction, Fisher and KL clip; the rest the
library's defaults, which the benchmark's trainer runs), not the planner's fastest. What
cannot be priced (no measured step at a batch it needs, settings tfkfac refuses, a
local profile of another machine) ends the plan with one line.
"""

import dataclasses

from trainers.planning import hardware, measured_steps, step_model

# The JSON's K-FAC settings, as `step_model.Configuration`'s fields.
SETTINGS = {"kfac_method": "method", "factor_update_freq": "factor_interval",
            "decomposition_update_freq": "decomposition_interval", "kl_clip": "kl_clip",
            "factor_batch_fraction": "factor_batch_fraction", "fisher": "fisher"}


def configuration(settings, entry):
    """The `step_model.Configuration` of K-FAC entry `entry`'s measured `settings`."""
    if settings.get("optimizer", "kfac") != "kfac":
        raise ValueError(f"{entry} is not a K-FAC entry (optimizer {settings['optimizer']}), "
                         "so its step is not K-FAC's; choose one with --kfac_entry")
    config = dataclasses.replace(step_model.LIBRARY_DEFAULTS, **{
        SETTINGS[name]: value for name, value in settings.items() if name in SETTINGS})
    try:
        config.library_config()
    except ValueError as error:
        raise ValueError(f"{entry}'s settings cannot be priced: {error}") from None
    return config


def priced(path, entries, unit, batch, workers, device, fabric, precision,
           forward_backward_s=None):
    """Per worker count, {"sgd_step_s", "kfac_step_s", "kfac_configurations"}: the
    measured steps of `entries` (SGD's, K-FAC's) in the batch-scaling JSON at `path`
    scaled to `workers` workers of `device` at `batch` examples each (`unit`: the
    model's `Workload` at one example). ValueError in one line where a step cannot be
    priced."""
    cells, cpus = measured_steps.measured_cells(path, entries)
    local = hardware.device("local", unit.name)
    if cpus != local.cores:
        raise ValueError(f"{path} was timed on {cpus} CPUs, the local profile "
                         f"({hardware.STEP_FLOOR_JSON}) on {local.cores}: its steps cannot "
                         "be scaled to --device")
    local_fabric = step_model.fabric(local, hardware.network("loopback"))
    planned = unit.at_batch(batch)
    rows = []
    for ranks in workers:
        row = {}
        for entry, name in zip(entries, ("sgd", "kfac")):
            prices, configs = {}, {}
            for measured in measured_steps.around(cells[entry], batch * ranks, entry):
                cell = cells[entry][measured]
                if cell["step_s"] is None:
                    raise ValueError(f"{path} has no measured step of {entry} at batch "
                                     f"{measured} (retimed.step_s.median), so its time to "
                                     "target cannot be priced")
                there = unit.at_batch(measured)
                if name == "sgd":
                    model = lambda work, *where: step_model.sgd_step(work, *where)
                else:
                    configs[measured] = configuration(cell["kfac"], entry)
                    model = lambda work, n, *where, c=configs[measured]: (
                        step_model.kfac_step(work, c, n, *where))
                ratio = cell["step_s"] / step_model.step_seconds(
                    model(there, 1, local, local_fabric, "float32"))
                prices[measured] = ratio * step_model.step_seconds(
                    model(planned, ranks, device, fabric, precision, forward_backward_s))
            row[f"{name}_step_s"] = measured_steps.interpolated(prices, batch * ranks)
            if configs:  # the entry's settings at the batches it is read from
                row["kfac_configurations"] = list(dict.fromkeys(configs.values()))
        rows.append(row)
    return rows
