"""The plan as a table on stdout, a JSON document and a PNG."""

import json
import os

from trainers.planning import memory, recommend, step_model

LABELS = {"forward_backward": "forward/backward", "factor_statistics": "factor statistics",
          "factor_reduction": "factor reduction", "decomposition": "decompositions (slowest)",
          "decomposition_sharing": "decomposition sharing",
          "preconditioning": "preconditioning", "preconditioned_sharing": "precond. sharing",
          "gradient_reduction": "gradient reduction", "update": "update"}


def _columns(entry):
    """(heading, Configuration or None for SGD, phases) of the table's columns."""
    columns = [("SGD", None, entry["sgd"]), ("K-FAC fastest", entry["best"],
                                             entry["best_phases"])]
    if entry["best_default_approximation"] is not None:
        columns.append(("K-FAC default approx.", entry["best_default_approximation"],
                        entry["best_default_phases"]))
    if "library_defaults_phases" in entry:
        columns.append(("K-FAC defaults", step_model.LIBRARY_DEFAULTS,
                        entry["library_defaults_phases"]))
    return columns


def table(setting, results, bound, needs, device):
    """The per-phase table of every worker count, the memory per worker (`needs`:
    `memory.per_worker`'s rows), the recommendation and the bound, as text."""
    lines = [f"{setting['model']}: {setting['batch']} examples per worker, "
             f"{setting['trainable_parameters']:,} parameters; device {setting['device']} "
             f"({setting['precision']}), network {setting['network']}, "
             f"{setting['ranks_per_node']} worker(s) and {setting['links_per_node']} "
             f"link(s) per node; {setting['configurations']} K-FAC configurations",
             f"Times are per step, amortized over each configuration's intervals; "
             f"forward/backward: {setting['forward_backward']}."]
    if setting["collective"] == "reduce_scatter_v":
        lines.append("K-FAC's collectives: ReduceScatterV of the factors to their owners, "
                     "AllGatherV of their results (Osawa et al. 2019, Ueno et al. 2020); "
                     "tfkfac runs allreduce, so these K-FAC times are the papers' system's.")
    if setting["collective"] == "kfac_pytorch":
        lines.append("K-FAC's collectives: kfac_pytorch's (Pauloski et al. 2020): factors "
                     "allreduced whole, decompositions shared by an allreduce-sum of "
                     "zero-filled buffers; tfkfac packs factors and allgathers decompositions, "
                     "so these K-FAC times are that system's.")
    if setting["steps_to_target"]:
        lines.append(f"Steps to target: {setting['steps_to_target']}.")
    if setting["unpriced_settings"]:
        lines.append("Not priced (every step at tfkfac's default for them): "
                     f"{', '.join(setting['unpriced_settings'])}.")
    for entry in results:
        columns = _columns(entry)
        lines.append("")
        lines.append(f"{entry['workers']} worker(s), global batch {entry['global_batch']}")
        lines.append(f"  {'ms per step':32s}"
                     + "".join(f"{heading:>23s}" for heading, _, _ in columns))
        for phase in step_model.PHASES:
            values = [phases[phase].per_step * 1e3 if phase in phases else None
                      for _, _, phases in columns]
            lines.append(f"  {LABELS[phase]:32s}" + "".join(
                f"{v:23.2f}" if v is not None else f"{'-':>23s}" for v in values))
        steps = [step_model.step_seconds(phases) for _, _, phases in columns]
        lines.append(f"  {'step':32s}" + "".join(f"{s * 1e3:23.2f}" for s in steps))
        lines.append(f"  {'x SGD':32s}" + "".join(f"{s / steps[0]:23.2f}" for s in steps))
        for heading, config, _ in columns[1:]:
            lines.append(f"  {heading}: {config.label()}")
        if "sgd_time_to_target_s" in entry:
            hours = _worker_hours(device)
            priced = (lambda name: f" at {entry[f'{name}_step_s_to_target'] * 1e3:.3g} ms "
                      "(measured, scaled)") if entry["priced"] else lambda name: ""
            lines.append(f"  to target: SGD {entry['sgd_steps_to_target']:.0f} steps"
                         f"{priced('sgd')}, {_seconds(entry['sgd_time_to_target_s'])} s, "
                         f"{entry['sgd_gpu_hours']:.3g} {hours}; K-FAC "
                         + (f"as measured ({_to_target(entry)})" if entry["priced"] else
                            "fastest") + f" {entry['kfac_steps_to_target']:.0f} steps"
                         f"{priced('kfac')}, {_seconds(entry['kfac_time_to_target_s'])} s, "
                         f"{entry['kfac_gpu_hours']:.3g} {hours}")
    lines += ["", memory_text(needs, device), "",
              recommendation(results, needs, device, setting["collective"]), bound_text(bound)]
    return "\n".join(lines)


def _to_target(entry):
    """The K-FAC configuration(s) whose step prices the time to target: the fastest, or
    the measured entry's own at the batches its steps are read from."""
    return " / ".join(c.label() for c in entry["kfac_to_target_configurations"])


def _seconds(seconds):
    """Whole seconds, but three digits below 100 s (a small model's time to target on a
    GPU is a fraction of a second)."""
    return f"{seconds:.0f}" if seconds >= 100 else f"{seconds:.3g}"


def _worker_hours(device):
    """What a worker-hour is on `device`: a GPU's, or a rank's on this machine."""
    return "rank-hours" if device.cores else "GPU-hours"


def _over_memory(needs, device):
    """{(workers, placement, method): device bytes} of the rows that exceed what a worker
    of `device` has."""
    return {(row["workers"], row["placement"], row["method"]): row["device"] for row in needs
            if device.memory_per_worker(row["workers"]) is not None
            and row["device"] > device.memory_per_worker(row["workers"])}


def _sgd_over_memory(needs, device):
    """{workers: bytes} of SGD's own memory (`memory.SGD_COMPONENTS`) where it exceeds
    what a worker of `device` has."""
    over = {}
    for row in needs:
        sgd = sum(row[component] for component in memory.SGD_COMPONENTS)
        limit = device.memory_per_worker(row["workers"])
        if limit is not None and sgd > limit:
            over[row["workers"]] = sgd
    return over


def memory_text(needs, device):
    """Per placement and method, the device memory of the worker holding most at each
    worker count, what it is made of, and a warning for each that exceeds the device."""
    workers = list(dict.fromkeys(row["workers"] for row in needs))
    unit, scale = ("GB", 1e9) if max(row["device"] for row in needs) >= 1e8 else ("MB", 1e6)
    first = needs[0]
    lines = [f"Memory per worker, {unit} (the worker holding most; the framework's "
             "workspace not counted):",
             f"  {'placement, method':32s}" + "".join(f"{f'{p} worker(s)':>16s}" for p in workers)]
    for placement, method in dict.fromkeys((row["placement"], row["method"]) for row in needs):
        values = [row["device"] for row in needs
                  if (row["placement"], row["method"]) == (placement, method)]
        lines.append(f"  {placement + ' ' + method:32s}"
                     + "".join(f"{v / scale:16.2f}" for v in values))
    host = max(row["host"] for row in needs)
    activations = (f"activations {first['activations'] / scale:.2f} (every layer's output at "
                   "the batch, SGD's too; at least that)" if first["activations"] else
                   "activations not counted (the model has no functional graph)")
    lines.append(f"  of which weights, gradients and momentum {first['model'] / scale:.2f} "
                 f"(SGD's too), {activations}, factors {first['factors'] / scale:.2f}, "
                 "eigen_adam's moments "
                 f"{max(row['method_state'] for row in needs) / scale:.2f}; the rest is "
                 "decompositions (all under replicated, the worker's own blocks' under owner)"
                 + (f"; owner also keeps {host / scale:.2f} {unit} in host memory (the factors "
                    "last decomposed)" if host else ""))
    sgd_over = _sgd_over_memory(needs, device)
    if sgd_over:
        lines.append(f"  WARNING: SGD alone (weights, gradients, momentum and activations) needs "
                     f"more than {device.name}'s memory per worker ({device.memory / 1e9:.0f} GB"
                     f"{', shared by its ranks' if device.cores else ''}) at "
                     + ", ".join(f"{w} worker(s) ({b / 1e9:.1f} GB)" for w, b in sgd_over.items())
                     + ": no optimizer fits there; lower --batch")
    over = _over_memory(needs, device)
    if over:
        lines.append(f"  WARNING: more than {device.name}'s memory per worker "
                     f"({device.memory / 1e9:.0f} GB"
                     f"{', shared by its ranks' if device.cores else ''}): "
                     + "; ".join(f"{p} {m} at {w} worker(s) ({b / 1e9:.1f} GB)"
                                 for (w, p, m), b in over.items()))
    return "\n".join(lines)


def recommendation(results, needs, device, collective="allreduce"):
    """One line per worker count; under a paper's collectives (`collective` other than
    "allreduce") each line says that tfkfac does not run it, and what
    `tfkfac.KFACConfig` refuses of its settings."""
    over = _over_memory(needs, device)
    lines = ["Recommendation (lowest predicted time per step; the approximation's effect on "
             "steps to target is not modelled):"]
    if over and len(over) == len(needs):
        lines.append(f"  WARNING: no configuration compared fits in {device.name}'s memory per "
                     "worker at any worker count (see Memory per worker): every line below "
                     "needs more than the device has; lower --batch or choose a larger device")
    for entry in results:
        best, time = entry["best"], entry["times"][entry["best"]]
        text = (f"  {entry['workers']:5d} workers: {best.label()}: {time * 1e3:.1f} ms/step, "
                f"{time / entry['sgd_step_s']:.2f}x SGD")
        exact = entry["best_default_approximation"]
        if exact is not None and exact != best:
            text += (f"; default approximation: {exact.label()}: "
                     f"{entry['times'][exact] * 1e3:.1f} ms, "
                     f"{entry['times'][exact] / entry['sgd_step_s']:.2f}x")
        need = over.get((entry["workers"], best.placement, best.method))
        if need is not None:
            text += (f"; WARNING: needs {need / 1e9:.1f} GB per worker, more than "
                     f"{device.name} has")
        if collective != "allreduce":
            why = recommend.tfkfac_refusal(best)
            text += (f"; the papers' system (--collective={collective}), which tfkfac does "
                     "not run" + (f"; tfkfac's KFACConfig refuses it: {why}" if why else ""))
        lines.append(text)
    fastest = recommend.best_to_target(results, "time_to_target_s")
    if fastest is not None:
        workers, name, seconds = fastest
        entry = next(entry for entry in results if entry["workers"] == workers)
        lines.append(f"  fastest to target: {_optimizer(name)} on {workers} workers, "
                     f"{_seconds(seconds)} s"
                     + (f" ({_to_target(entry)})" if name == "kfac" else ""))
        workers, name, hours = recommend.best_to_target(results, "gpu_hours")
        lines.append(f"  cheapest to target: {_optimizer(name)} on {workers} workers, "
                     f"{hours:.3g} {_worker_hours(device)} (steps x step time x workers)")
    return "\n".join(lines)


def _optimizer(name):
    return "K-FAC" if name == "kfac" else "SGD"


def bound_text(bound):
    config = bound["configuration"]
    lines = [f"One-factor bound ({config.label()}): decompositions take "
             f"{bound['total_s'] * 1e3:.1f} ms on one worker, the largest unit "
             f"{bound['largest_s'] * 1e3:.1f} ms: no worker count speeds them up more than "
             f"{bound['bound']:.2f}x.",
             f"  {'workers':>8s} {'slowest rank ms':>16s} {'speed-up':>9s} {'timed ms':>9s} "
             f"{'split ms':>9s} {'refresh ms':>11s}   (per decomposition step)"]
    for row in bound["rows"]:
        lines.append(f"  {row['workers']:8d} {row['slowest_rank_s'] * 1e3:16.1f} "
                     f"{row['speedup']:9.2f} {row['timed_s'] * 1e3:9.1f} "
                     f"{row['split_s'] * 1e3:9.1f} {row['refresh_s'] * 1e3:11.1f}")
    lines.append("  timed: owners by LPT on the device's time per decomposition (latency "
                 "included) instead of n³; on top of it, split: units above the mean load "
                 f"decomposed by {recommend.SPLIT_RANKS} ranks at "
                 f"{recommend.SPLIT_EFFICIENCY:.0%} efficiency; refresh: those units every "
                 f"{recommend.REFRESH_EVERY} decomposition intervals (amortized). None is in "
                 "the library.")
    return "\n".join(lines)


def _phases_json(phases):
    return {name: {"ms_per_occurrence": phase.seconds * 1e3, "every": phase.every,
                   "ms_per_step": phase.per_step * 1e3, "category": phase.category,
                   "payload_bytes_per_rank": list(phase.payload)}
            for name, phase in phases.items()}


def to_json(setting, results, bound, sources, estimates, needs, device):
    over = _over_memory(needs, device)
    entries = []
    for entry in results:
        item = {"workers": entry["workers"], "global_batch": entry["global_batch"],
                "sgd_ms": entry["sgd_step_s"] * 1e3, "sgd_phases": _phases_json(entry["sgd"]),
                "best": entry["best"].label(), "best_phases": _phases_json(entry["best_phases"]),
                "kfac_ms": {c.label(): t * 1e3 for c, t in entry["times"].items()}}
        if entry["best_default_approximation"] is not None:
            item["best_default_approximation"] = entry["best_default_approximation"].label()
        for key in ("sgd_steps_to_target", "kfac_steps_to_target", "sgd_time_to_target_s",
                    "kfac_time_to_target_s", "sgd_gpu_hours", "kfac_gpu_hours",
                    "sgd_step_s_to_target", "kfac_step_s_to_target", "priced"):
            if key in entry:
                item[key] = entry[key]
        if "kfac_to_target_configurations" in entry:
            item["kfac_to_target"] = [c.label() for c in entry["kfac_to_target_configurations"]]
        entries.append(item)
    return {"setting": setting, "sources": list(sources), "estimates": list(estimates),
            "results": entries,
            "memory": {"device_bytes": device.memory, "per_worker_bytes": [
                dict(row, exceeds_device=(row["workers"], row["placement"], row["method"])
                     in over) for row in needs]},
            "one_factor_bound": {**{k: v for k, v in bound.items() if k != "configuration"},
                                 "configuration": bound["configuration"].label()}}


def write(document, results, bound, output_dir):
    """plan.json and plan.png in `output_dir`; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    json_path, png_path = (os.path.join(output_dir, f"plan.{ext}") for ext in ("json", "png"))
    with open(json_path, "w") as f:
        json.dump(document, f, indent=1)
    plot(document["setting"], results, bound, png_path)
    return json_path, png_path


def plot(setting, results, bound, path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    positions = range(len(results))
    for offset, (name, key) in ((-0.2, ("SGD", "sgd")), (0.2, ("K-FAC fastest", "best_phases"))):
        bottom = [0.0] * len(results)
        for k, phase in enumerate(step_model.PHASES):
            values = [entry[key][phase].per_step * 1e3 if phase in entry[key] else 0.0
                      for entry in results]
            left.bar([p + offset for p in positions], values, 0.38, bottom=bottom,
                     color=f"C{k}", label=step_model.PHASES[k] if offset > 0 else None,
                     hatch="//" if offset < 0 else None)
            bottom = [b + v for b, v in zip(bottom, values)]
    left.set_xticks(list(positions), [str(entry["workers"]) for entry in results])
    left.set_xlabel("workers (hatched: SGD; plain: fastest K-FAC configuration)")
    left.set_ylabel("ms per step (amortized)")
    left.legend(fontsize=6, ncol=3, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    workers = [entry["workers"] for entry in results]
    right.plot(workers, [entry["times"][entry["best"]] / entry["sgd_step_s"] for entry in results],
               "o-", label="K-FAC fastest / SGD")
    right.plot(workers, [entry["times"][step_model.LIBRARY_DEFAULTS] / entry["sgd_step_s"]
                         if step_model.LIBRARY_DEFAULTS in entry["times"] else float("nan")
                         for entry in results], "s--", label="K-FAC library defaults / SGD")
    right.plot([row["workers"] for row in bound["rows"]],
               [row["speedup"] for row in bound["rows"]], "^:",
               label="decomposition speed-up (slowest rank)")
    right.axhline(bound["bound"], color="0.5", lw=0.8,
                  label=f"one-factor bound {bound['bound']:.2f}x")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("workers")
    right.set_ylabel("ratio (log scale)")
    right.legend(fontsize=8)
    figure.suptitle(f"{setting['model']}, {setting['batch']} per worker, {setting['device']} "
                    f"({setting['precision']}), {setting['network']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
