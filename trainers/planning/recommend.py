"""Every configuration at every worker count, ranked; and the one-factor bound.

The recommendation is the configuration with the lowest predicted time per step at each
worker count, and, given steps to target for SGD and K-FAC, the worker count and
optimizer with the lowest time to target. Only time is modelled: a configuration that
changes the approximation (wire dtypes, intervals, the reduce rule, the method, the factor
batch fraction, the sampled Fisher) may change the steps to target, which the user's
estimates must account for; the fastest configuration with the library's default
approximation is reported beside it.
"""

import dataclasses
import itertools

from tfkfac.distributed import assignment
from trainers.planning import step_model

# What a remedy for the one-factor bound assumes: the largest factors'
# decompositions split over this many ranks at this parallel efficiency (a distributed
# eigensolver), or refreshed this many times less often than the others.
SPLIT_RANKS, SPLIT_EFFICIENCY, REFRESH_EVERY = 4, 0.5, 4


def grid(placements, factor_wires, decomposition_wires, factor_intervals,
         decomposition_intervals, weight_sharing, methods, overlap=(False,),
         hierarchical=(False,), collective="allreduce",
         fractions=(step_model.LIBRARY_DEFAULTS.factor_batch_fraction,),
         fishers=(step_model.LIBRARY_DEFAULTS.fisher,)):
    """(every combination the library accepts, [(combination, why)] of those
    `tfkfac.KFACConfig` refuses): the planner never ranks a configuration tfkfac would
    not run. Under the papers' collectives ("reduce_scatter_v", which tfkfac does not
    run) the reduction options are those of their V collectives, so only the other
    settings are checked (Ueno et al. summed float21 factors hierarchically, §4.1);
    `tfkfac_refusal` names on the recommendation line what tfkfac refuses."""
    accepted, refused = [], []
    for *values, fraction, fisher in itertools.product(
            placements, factor_wires, decomposition_wires, factor_intervals,
            decomposition_intervals, weight_sharing, methods, overlap, hierarchical,
            fractions, fishers):
        config = step_model.Configuration(*values, factor_batch_fraction=fraction,
                                          fisher=fisher)
        checked = config
        if collective == "reduce_scatter_v":
            checked = dataclasses.replace(config, overlap_reduction=False,
                                          hierarchical_reduction=False)
        why = tfkfac_refusal(checked)
        if why is None:
            accepted.append(config)
        else:
            refused.append((config, why))
    return accepted, refused


def tfkfac_refusal(config):
    """Why `tfkfac.KFACConfig` refuses `config`'s settings, or None when it takes them."""
    try:
        config.library_config()
    except ValueError as error:
        return str(error)
    return None


def usable(work, configs, ranks, fabric):
    """(the `configs` tfkfac runs on `ranks` workers of `fabric`, [(config, why)] of the
    others)."""
    kept, refused = [], []
    for config in configs:
        why = step_model.refusal(work, config, ranks, fabric)
        if why is None:
            kept.append(config)
        else:
            refused.append((config, why))
    return kept, refused


def same_approximation(config, method=step_model.LIBRARY_DEFAULTS.method):
    """Whether `config` computes what the library's defaults compute (up to staleness),
    with `method` in place of the default method when given."""
    defaults = dataclasses.replace(step_model.LIBRARY_DEFAULTS, method=method)
    fields = ("factor_wire", "decomposition_wire", "weight_sharing", "method",
              "factor_batch_fraction", "fisher")
    return all(getattr(config, name) == getattr(defaults, name) for name in fields)


def bound_configuration(work, times):
    """The configuration whose one-factor bound the plan reports, of those timed at one
    worker count (`times`: {config: seconds per step}): of those with the default
    approximation up to the method, one whose method's decompositions cost most (the
    work a worker count must spread), the fastest of them; else the fastest."""
    exact = [config for config in times if same_approximation(config, config.method)]
    if not exact:
        return min(times, key=times.get)
    flops = {method: sum(k.flops for ks in work.decompositions(method) for k in ks)
             for method in {config.method for config in exact}}
    return max(exact, key=lambda config: (flops[config.method], -times[config]))


def evaluate(work, configs, workers, device, fabric, precision, forward_backward_s=None,
             sgd_steps=None, kfac_steps=None, collective="allreduce", priced=None):
    """Per worker count: SGD's phases, the step time of every configuration tfkfac runs
    there (`usable`; K-FAC's collectives `collective`, step_model.COLLECTIVES) and the
    [(config, why)] it refuses there, the fastest and the fastest with the default
    approximation, and times to target when steps are given: at SGD's and the fastest
    configuration's step, or at `priced`'s per worker count (`pricing.priced`: the
    measured entries' own steps). ValueError when tfkfac refuses every configuration at
    one worker count."""
    results = []
    for i, ranks in enumerate(workers):
        here, refused = usable(work, configs, ranks, fabric)
        if not here:
            config, why = refused[0]
            raise ValueError(f"--workers={ranks}: tfkfac refuses every configuration "
                             f"compared there, e.g. {config.label()}: {why}")
        sgd = step_model.sgd_step(work, ranks, device, fabric, precision, forward_backward_s)
        steps = {config: step_model.kfac_step(work, config, ranks, device, fabric, precision,
                                              forward_backward_s, collective)
                 for config in here}
        times = {config: step_model.step_seconds(phases) for config, phases in steps.items()}
        best = min(here, key=times.get)
        exact = [c for c in here if same_approximation(c)]
        entry = {"workers": ranks, "global_batch": ranks * work.batch, "sgd": sgd,
                 "sgd_step_s": step_model.step_seconds(sgd), "times": times,
                 "refused": refused, "best": best,
                 "best_phases": steps[best],
                 "best_default_approximation": min(exact, key=times.get) if exact else None}
        if entry["best_default_approximation"] is not None:
            entry["best_default_phases"] = steps[entry["best_default_approximation"]]
        if step_model.LIBRARY_DEFAULTS in steps:
            entry["library_defaults_phases"] = steps[step_model.LIBRARY_DEFAULTS]
        if sgd_steps and kfac_steps:
            own = priced[i] if priced else {"sgd_step_s": entry["sgd_step_s"],
                                            "kfac_step_s": times[best],
                                            "kfac_configurations": [best]}
            entry["kfac_to_target_configurations"] = own["kfac_configurations"]
            entry["priced"] = priced is not None
            for name, steps, step_s in (("sgd", sgd_steps[i], own["sgd_step_s"]),
                                        ("kfac", kfac_steps[i], own["kfac_step_s"])):
                entry[f"{name}_step_s_to_target"] = step_s
                entry[f"{name}_steps_to_target"] = steps
                entry[f"{name}_time_to_target_s"] = steps * step_s
                entry[f"{name}_gpu_hours"] = steps * step_s * ranks / 3600
        results.append(entry)
    return results


def best_to_target(results, measure):
    """(workers, optimizer, value) with the lowest `measure` to target ("time_to_target_s"
    or "gpu_hours": steps x step time x workers), or None without steps."""
    options = [(entry["workers"], name, entry[f"{name}_{measure}"])
               for entry in results if f"sgd_{measure}" in entry
               for name in ("sgd", "kfac")]
    return min(options, key=lambda option: option[2]) if options else None


# ------------------------------------------------------------ one-factor bound
def slowest_rank(seconds, owners, ranks):
    """The largest per-rank sum of `seconds` under `owners`."""
    return max(map(sum, step_model.by_rank([[s] for s in seconds], owners, ranks)))


def one_factor_bound(work, config, workers, device):
    """The decomposition phase on the slowest rank (seconds per decomposition step) at each
    worker count with the library's owners (LPT on n³), the speed-up bound total / largest
    unit, and three remedies the library does not implement:
    - timed: LPT on the device's time per unit (a decomposition call's latency included),
      where the library's n³ costs let many small factors pile up on one rank;
    - split (on top of timed): each unit above the mean load decomposed by SPLIT_RANKS
      ranks at SPLIT_EFFICIENCY (a distributed eigensolver);
    - refresh (on top of timed): those units decomposed every REFRESH_EVERY decomposition
      intervals, amortized over them (Osawa et al. 2019: A factors change slowly)."""
    units = [kernels for kernels, _ in step_model.decomposition_units(work, config)]
    blocks = work.blocks[config.weight_sharing]
    one = [device.seconds(unit, "decomposition") for unit in units]
    rows = []
    for ranks in workers:
        seconds = [device.seconds(unit, "decomposition", ranks=ranks) for unit in units]
        base = slowest_rank(seconds, step_model.owners_of(blocks, config.placement, ranks),
                            ranks)
        timed_owners = assignment.lpt_assignment(seconds, ranks)
        timed = slowest_rank(seconds, timed_owners, ranks)
        big = [s > sum(seconds) / ranks for s in seconds]
        split = [s for s, b in zip(seconds, big) if not b] + [
            s / (SPLIT_RANKS * SPLIT_EFFICIENCY) for s, b in zip(seconds, big) if b
            for _ in range(SPLIT_RANKS)]
        rest = [0.0 if b else s for s, b in zip(seconds, big)]
        rows.append({
            "workers": ranks, "slowest_rank_s": base, "speedup": sum(seconds) / base,
            "timed_s": timed,
            "split_s": slowest_rank(split, assignment.lpt_assignment(split, ranks), ranks),
            "refresh_s": (timed + (REFRESH_EVERY - 1) * slowest_rank(rest, timed_owners, ranks))
            / REFRESH_EVERY})
    return {"total_s": sum(one), "largest_s": max(one), "bound": sum(one) / max(one),
            "rows": rows}
