"""Predict SGD's and K-FAC's step time per phase on 1 to 1024 workers, and recommend.

  python -m trainers.plan --model=resnet50 --workers=1,8,64,128,1024 --device=v100 \\
      --network=ib-edr

--model: a trainer model, a keras.applications name or a saved .keras file. Prints the
per-phase table, the memory per worker and the recommendation; writes plan.json and
plan.png to --output_dir. A bad value ends it with a usage hint and one line naming the
flag and what it allows (exit code 2, trainers/cli.py). Its use: docs/guide.md §5; the
model: trainers/planning/ (each module's docstring); its validation: docs/benchmarks.md.
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

from tfkfac.fisher import FISHERS  # noqa: E402
from trainers import cli  # noqa: E402
from trainers.planning import (hardware, measured_steps, memory, pricing,  # noqa: E402
                               recommend, report, step_model, workloads)

CLI = cli.Program("trainers.plan")

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Trainer model, keras.applications name or .keras path.")
flags.DEFINE_integer("batch", 32, "Examples per worker per step.", lower_bound=1)
flags.DEFINE_list("workers", ["1", "8", "64", "128", "1024"], "Worker counts (1 to 1024).")
flags.DEFINE_string("device", "v100",
                    f"One of {', '.join(hardware.device_names())} (any case).")
flags.DEFINE_string("network", "ib-edr",
                    f"One of {', '.join(hardware.network_names())} (any case).")
flags.DEFINE_integer("workers_per_node", 1, "Workers sharing a node (NVLink between them).",
                     lower_bound=1)
flags.DEFINE_integer("links_per_node", 1, "Network links of a node.", lower_bound=1)
flags.DEFINE_enum("precision", "mixed", list(workloads.PRECISIONS),
                  "Forward/backward precision (K-FAC's factors stay float32).",
                  case_sensitive=False)
flags.DEFINE_list("input_shape", None, "H,W,C of the model's input; default 28,28,1 for "
                  "the trainer's models, 224,224,3 for keras.applications.")
flags.DEFINE_integer("classes", None, "Classes of the head (default 10 / 1000).",
                     lower_bound=1)
flags.DEFINE_enum("collective", "allreduce", list(step_model.COLLECTIVES),
                  "K-FAC's collectives: allreduce (what tfkfac runs), reduce_scatter_v "
                  "(factors ReduceScatterV'd to their owners, results AllGatherV'd: Osawa's "
                  "and Ueno's system) or kfac_pytorch (factors allreduced whole, "
                  "decompositions by an allreduce-sum: Pauloski's); tfkfac runs neither of "
                  "the papers'.", case_sensitive=False)
flags.DEFINE_list("placements", list(step_model.PLACEMENTS), "Placements compared.")
flags.DEFINE_list("factor_wires", list(step_model.WIRE_DTYPES), "Factor wire dtypes compared.")
flags.DEFINE_list("decomposition_wires", list(step_model.WIRE_DTYPES),
                  "Decomposition wire dtypes compared.")
flags.DEFINE_list("factor_intervals", ["1", "10"], "Factor intervals compared.")
flags.DEFINE_list("decomposition_intervals", ["10", "100"],
                  "Decomposition intervals compared.")
flags.DEFINE_list("weight_sharing", list(workloads.WEIGHT_SHARING), "Weight-sharing rules.")
flags.DEFINE_list("methods", list(step_model.METHODS), "Preconditioning methods compared.")
flags.DEFINE_list("overlap_reduction", ["false"], "Compared values of tfkfac's "
                  "overlap_reduction (false, true); with --collective=reduce_scatter_v the "
                  "papers' overlap of A's reduction with the backward pass.")
flags.DEFINE_list("hierarchical_reduction", ["false"], "Compared values of tfkfac's "
                  "hierarchical_reduction (false, true): means summed within each node, "
                  "then across nodes.")
flags.DEFINE_list("factor_batch_fractions", ["1"], "Compared values of tfkfac's "
                  "factor_batch_fraction: the share of each batch, in (0, 1], the factor "
                  "statistics are taken from.")
flags.DEFINE_list("fishers", ["empirical"], "Compared values of tfkfac's fisher "
                  f"({', '.join(FISHERS)}): sampled adds a backward pass on factor steps.")
flags.DEFINE_float("forward_backward_ms", None, "Measured forward/backward of one worker "
                   "at --batch (replaces the device model's; required for a model with "
                   "weight products the planner cannot count, e.g. an LSTM).")
flags.register_validator("forward_backward_ms",
                         lambda ms: ms is None or (math.isfinite(ms) and ms > 0),
                         "must be a finite number of milliseconds > 0")
flags.DEFINE_list("sgd_steps", None, "Steps to target for SGD: one value, or one per worker "
                  "count (global batch changes with it).")
flags.DEFINE_list("kfac_steps", None, "Steps to target for K-FAC, as --sgd_steps.")
flags.DEFINE_string("steps_from", None,
                    "A batch-scaling JSON (e.g. bench/results/variants/batch_scaling.json): "
                    "steps to target at each global batch (--batch x workers) interpolated "
                    "from the measured ones, in place of --sgd_steps/--kfac_steps.")
flags.DEFINE_float("steps_target", None, "--steps_from: the test accuracy whose steps are "
                   "read (default: the JSON's primary target).")
flags.DEFINE_string("sgd_entry", "sgd_nesterov", "--steps_from: the entry read as SGD's steps.")
flags.DEFINE_string("kfac_entry", "kfac_inverse",
                    "--steps_from: the entry read as K-FAC's steps.")
flags.DEFINE_string("output_dir", "runs/plan", "Where plan.json and plan.png go.")


def _choices(name, values, allowed):
    chosen = [v.lower() for v in values]
    if not chosen or any(v not in allowed for v in chosen):
        raise ValueError(f"--{name} must be a list of {', '.join(map(str, allowed))}; "
                         f"got {','.join(map(str, values))}")
    return chosen


def _numbers(name, values, parse, accepted, wanted):
    """`values` parsed by `parse`, every one `accepted`; else a ValueError naming the flag
    and the `wanted` values."""
    try:
        numbers = [parse(v) for v in values]
    except ValueError:
        numbers = []
    if not numbers or not all(accepted(n) for n in numbers):
        raise ValueError(f"--{name} must be a list of {wanted}; got {','.join(values)}")
    return numbers


def _integers(name, values, low=1, high=None):
    bounds = f"from {low} to {high}" if high else f"of at least {low}"
    return _numbers(name, values, int, lambda n: n >= low and (high is None or n <= high),
                    f"integers {bounds}")


def _fractions(name, values):
    return _numbers(name, values, float, lambda n: 0 < n <= 1, "numbers in (0, 1]")


def _booleans(name, values):
    return [value == "true" for value in _choices(name, values, ("false", "true"))]


def _steps(name, values, count):
    if values is None:
        return None
    steps = _integers(name, values)
    if len(steps) not in (1, count):
        raise ValueError(f"--{name} must give one value or one per worker count ({count}); "
                         f"got {len(steps)}")
    return steps * count if len(steps) == 1 else steps


def _settings():
    """Every flag checked; raises ValueError naming the flag and its allowed values."""
    if not FLAGS.model:
        raise ValueError(f"--model is required: a .keras path or one of "
                         f"{', '.join(workloads.model_names())}")
    workers = _integers("workers", FLAGS.workers, 1, 1024)
    if (FLAGS.sgd_steps is None) != (FLAGS.kfac_steps is None):
        raise ValueError("--sgd_steps and --kfac_steps go together")
    if FLAGS.steps_from is not None and FLAGS.sgd_steps is not None:
        raise ValueError("--steps_from replaces --sgd_steps and --kfac_steps; give one or "
                         "the other")
    stray = [f"--{name}" for name in ("steps_target", "sgd_entry", "kfac_entry")
             if FLAGS[name].present and FLAGS.steps_from is None]
    if stray:
        raise ValueError(f"{', '.join(stray)} only appl{'ies' if len(stray) == 1 else 'y'} "
                         "with --steps_from")
    device = hardware.device(FLAGS.device, FLAGS.model)
    if device.max_ranks() and max(workers) > device.max_ranks():
        raise ValueError(f"--workers: device local runs at most {device.max_ranks()} ranks "
                         f"(its cores); got {max(workers)}")
    placements = _choices("placements", FLAGS.placements, step_model.PLACEMENTS)
    configs, refused = recommend.grid(
        placements,
        _choices("factor_wires", FLAGS.factor_wires, step_model.WIRE_DTYPES),
        _choices("decomposition_wires", FLAGS.decomposition_wires, step_model.WIRE_DTYPES),
        _integers("factor_intervals", FLAGS.factor_intervals),
        _integers("decomposition_intervals", FLAGS.decomposition_intervals),
        _choices("weight_sharing", FLAGS.weight_sharing, workloads.WEIGHT_SHARING),
        _choices("methods", FLAGS.methods, step_model.METHODS),
        _booleans("overlap_reduction", FLAGS.overlap_reduction),
        _booleans("hierarchical_reduction", FLAGS.hierarchical_reduction),
        FLAGS.collective.lower(),
        _fractions("factor_batch_fractions", FLAGS.factor_batch_fractions),
        _choices("fishers", FLAGS.fishers, FISHERS))
    if not configs:
        config, why = refused[0]
        raise ValueError(f"tfkfac refuses every configuration compared, e.g. "
                         f"{config.label()}: {why}")
    input_shape = (None if FLAGS.input_shape is None
                   else tuple(_integers("input_shape", FLAGS.input_shape)))
    if FLAGS.steps_from is not None:
        steps_source, sgd_steps, kfac_steps = _measured_steps(workers)
    else:
        steps_source = None if FLAGS.sgd_steps is None else "given (--sgd_steps, --kfac_steps)"
        sgd_steps = _steps("sgd_steps", FLAGS.sgd_steps, len(workers))
        kfac_steps = _steps("kfac_steps", FLAGS.kfac_steps, len(workers))
    return dict(workers=workers, device=device, network=hardware.network(FLAGS.network),
                placements=placements, configs=configs, refused=refused,
                input_shape=input_shape, output_dir=_output_dir(FLAGS.output_dir),
                sgd_steps=sgd_steps, kfac_steps=kfac_steps, steps_source=steps_source)


def _measured_steps(workers):
    """(where the steps come from, SGD's and K-FAC's steps to target at each worker
    count's global batch) from --steps_from (`measured_steps`)."""
    entries = (FLAGS.sgd_entry, FLAGS.kfac_entry)
    target, measured = measured_steps.load(FLAGS.steps_from, FLAGS.model, FLAGS.steps_target,
                                           entries)
    try:
        sgd, kfac = ([measured_steps.at_batch(measured[entry], FLAGS.batch * count, entry,
                                              target) for count in workers]
                     for entry in entries)
    except ValueError as error:
        raise ValueError(f"--steps_from: {error} (--batch={FLAGS.batch}, "
                         f"--workers={','.join(map(str, workers))})") from None
    source = (f"measured to test accuracy {target} ({FLAGS.steps_from}: SGD {entries[0]}, "
              f"K-FAC {entries[1]}; log-log between measured global batches)")
    return source, sgd, kfac


def _priced(settings, fabric, forward_backward_s):
    """--steps_from's measured steps scaled to the planned workers (`pricing`), or None."""
    if FLAGS.steps_from is None:
        return None
    try:
        return pricing.priced(
            FLAGS.steps_from, (FLAGS.sgd_entry, FLAGS.kfac_entry),
            workloads.named(FLAGS.model, settings["input_shape"], FLAGS.classes),
            FLAGS.batch, settings["workers"], settings["device"], fabric,
            FLAGS.precision.lower(), forward_backward_s)
    except ValueError as error:
        raise ValueError(f"--steps_from: {error}") from None


def _output_dir(path):
    """`path`, created if missing; refused when it cannot be written (before the plan's
    work)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--output_dir: {path} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--output_dir: cannot create {path}: {error.strerror}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--output_dir: {path} is not writable")
    return path


def _check_countable(work):
    """A model whose weight products the planner cannot count needs a measured
    forward/backward (an LSTM's would otherwise be 0 ms)."""
    if work.uncounted_products and FLAGS.forward_backward_ms is None:
        raise ValueError(
            f"--forward_backward_ms is required for {FLAGS.model}: layer(s) "
            f"{', '.join(work.uncounted_products[:3])} multiply by weight matrices without "
            "a K-FAC block, which the planner cannot count; measure one worker's "
            "forward/backward at --batch and pass it")


def main(_):
    logging.set_verbosity(logging.WARNING)
    try:
        settings = _settings()
        work = workloads.named(FLAGS.model, settings["input_shape"],
                               FLAGS.classes).at_batch(FLAGS.batch)
        _check_countable(work)
        device, network, workers = settings["device"], settings["network"], settings["workers"]
        fabric = step_model.fabric(device, network, FLAGS.workers_per_node,
                                   FLAGS.links_per_node)
        forward_backward_s = (None if FLAGS.forward_backward_ms is None
                              else FLAGS.forward_backward_ms / 1e3)
        results = recommend.evaluate(work, settings["configs"], workers, device, fabric,
                                     FLAGS.precision, forward_backward_s,
                                     settings["sgd_steps"], settings["kfac_steps"],
                                     FLAGS.collective,
                                     _priced(settings, fabric, forward_backward_s))
    except ValueError as error:
        CLI.usage_error(str(error))
    bounded = recommend.bound_configuration(work, results[-1]["times"])
    bound = dict(recommend.one_factor_bound(work, bounded, workers, device),
                 configuration=bounded)
    needs = memory.per_worker(work, settings["placements"], workers,
                              precision=FLAGS.precision.lower())
    setting = {"model": FLAGS.model, "batch": FLAGS.batch, "device": device.name,
               "network": network.name, "precision": FLAGS.precision,
               "ranks_per_node": FLAGS.workers_per_node, "links_per_node": FLAGS.links_per_node,
               "collective": FLAGS.collective,
               "trainable_parameters": work.trainable_parameters,
               "configurations": len(settings["configs"]),
               "refused_configurations": len(settings["refused"]),
               "forward_backward": "measured (--forward_backward_ms)" if forward_backward_s
               else f"from the {device.name} profile",
               "steps_to_target": settings["steps_source"],
               "layers_without_block": [s["layer"] for s in work.skipped],
               "unpriced_settings": list(step_model.unpriced_settings())}
    if settings["refused"]:
        config, why = settings["refused"][0]
        print(f"Left out {len(settings['refused'])} configuration(s) tfkfac refuses, e.g. "
              f"{config.label()}: {why}")
    for entry in results:
        if entry["refused"]:
            config, why = entry["refused"][0]
            print(f"At {entry['workers']} worker(s) left out {len(entry['refused'])} "
                  f"configuration(s) tfkfac refuses there, e.g. {config.label()}: {why}")
    print(report.table(setting, results, bound, needs, device))
    if work.skipped and forward_backward_s is None:
        print(f"Not counted in forward/backward: {len(work.skipped)} layer(s) without a "
              f"K-FAC block and with elementwise weights only "
              f"({', '.join(setting['layers_without_block'][:5])}...)")
    sources = tuple(dict.fromkeys(device.sources + network.sources))
    document = report.to_json(setting, results, bound, sources, device.estimates, needs,
                              device)
    try:
        paths = report.write(document, results, bound, settings["output_dir"])
    except OSError as error:
        CLI.failure(f"--output_dir: cannot write {error.filename}: {error.strerror}")
    print("Sources: " + "; ".join(sources))
    if device.estimates:
        print("Estimated (no published figure): " + "; ".join(device.estimates))
    print(f"Wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    app.run(main, flags_parser=CLI.parse_flags)
