"""Predict SGD's and K-FAC's step time per phase on 1 to 1024 workers, and recommend.

  python -m trainers.plan --model=resnet50 --workers=1,8,64,128,1024 --device=v100 \\
      --network=ib-edr

--model: a trainer model, a keras.applications name or a saved .keras file. Prints the
per-phase table and the recommendation; writes plan.json and plan.png to --output_dir.
How the model works and what it was validated against: docs/planner.md.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

from trainers.planning import (hardware, recommend, report, step_model,  # noqa: E402
                               workloads)

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Trainer model, keras.applications name or .keras path.")
flags.DEFINE_integer("batch", 32, "Examples per worker per step.", lower_bound=1)
flags.DEFINE_list("workers", ["1", "8", "64", "128", "1024"], "Worker counts (1 to 1024).")
flags.DEFINE_string("device", "v100", f"One of {', '.join(hardware.device_names())}.")
flags.DEFINE_string("network", "ib-edr", f"One of {', '.join(hardware.network_names())}.")
flags.DEFINE_integer("workers_per_node", 1, "Workers sharing a node (NVLink between them).",
                     lower_bound=1)
flags.DEFINE_integer("links_per_node", 1, "Network links of a node.", lower_bound=1)
flags.DEFINE_enum("precision", "mixed", list(workloads.PRECISIONS),
                  "Forward/backward precision (K-FAC's factors stay float32).")
flags.DEFINE_list("input_shape", None, "H,W,C of the model's input; default 28,28,1 for "
                  "the trainer's models, 224,224,3 for keras.applications.")
flags.DEFINE_integer("classes", None, "Classes of the head (default 10 / 1000).")
flags.DEFINE_list("placements", list(step_model.PLACEMENTS), "Placements compared.")
flags.DEFINE_list("factor_wires", list(step_model.WIRE_DTYPES), "Factor wire dtypes compared.")
flags.DEFINE_list("decomposition_wires", list(step_model.WIRE_DTYPES),
                  "Decomposition wire dtypes compared.")
flags.DEFINE_list("factor_intervals", ["1", "10"], "Factor intervals compared.")
flags.DEFINE_list("decomposition_intervals", ["10", "100"],
                  "Decomposition intervals compared.")
flags.DEFINE_list("weight_sharing", list(workloads.WEIGHT_SHARING), "Weight-sharing rules.")
flags.DEFINE_list("methods", list(step_model.METHODS), "Decomposition methods compared.")
flags.DEFINE_float("forward_backward_ms", None, "Measured forward/backward of one worker "
                   "at --batch (replaces the device model's).")
flags.DEFINE_list("sgd_steps", None, "Steps to target for SGD: one value, or one per worker "
                  "count (global batch changes with it).")
flags.DEFINE_list("kfac_steps", None, "Steps to target for K-FAC, as --sgd_steps.")
flags.DEFINE_string("output_dir", "runs/plan", "Where plan.json and plan.png go.")


def _choices(name, values, allowed):
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"--{name} must be a list of {', '.join(map(str, allowed))}; "
                         f"got {','.join(map(str, values))}")
    return list(values)


def _integers(name, values, low=1, high=None):
    try:
        numbers = [int(v) for v in values]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < low or (high is not None and max(numbers) > high):
        bounds = f"from {low} to {high}" if high else f"of at least {low}"
        raise ValueError(f"--{name} must be a list of integers {bounds}; got {','.join(values)}")
    return numbers


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
    device = hardware.device(FLAGS.device, FLAGS.model)
    if device.max_ranks() and max(workers) > device.max_ranks():
        raise ValueError(f"--workers: device local runs at most {device.max_ranks()} ranks "
                         f"(its cores); got {max(workers)}")
    configs = recommend.grid(
        _choices("placements", FLAGS.placements, step_model.PLACEMENTS),
        _choices("factor_wires", FLAGS.factor_wires, step_model.WIRE_DTYPES),
        _choices("decomposition_wires", FLAGS.decomposition_wires, step_model.WIRE_DTYPES),
        _integers("factor_intervals", FLAGS.factor_intervals),
        _integers("decomposition_intervals", FLAGS.decomposition_intervals),
        _choices("weight_sharing", FLAGS.weight_sharing, workloads.WEIGHT_SHARING),
        _choices("methods", FLAGS.methods, step_model.METHODS))
    input_shape = (None if FLAGS.input_shape is None
                   else tuple(_integers("input_shape", FLAGS.input_shape)))
    return dict(workers=workers, device=device, network=hardware.network(FLAGS.network),
                configs=configs, input_shape=input_shape,
                sgd_steps=_steps("sgd_steps", FLAGS.sgd_steps, len(workers)),
                kfac_steps=_steps("kfac_steps", FLAGS.kfac_steps, len(workers)))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    try:
        settings = _settings()
        work = workloads.named(FLAGS.model, settings["input_shape"],
                               FLAGS.classes).at_batch(FLAGS.batch)
    except ValueError as error:
        raise app.UsageError(str(error)) from None
    device, network, workers = settings["device"], settings["network"], settings["workers"]
    fabric = step_model.fabric(device, network, FLAGS.workers_per_node, FLAGS.links_per_node)
    forward_backward_s = (None if FLAGS.forward_backward_ms is None
                          else FLAGS.forward_backward_ms / 1e3)
    results = recommend.evaluate(work, settings["configs"], workers, device, fabric,
                                 FLAGS.precision, forward_backward_s, settings["sgd_steps"],
                                 settings["kfac_steps"])
    # The bound of exact K-FAC (eigen, the default wires and rule) when it was compared:
    # the method whose decompositions cost most, so the one a worker count must spread.
    exact = [c for c in settings["configs"] if recommend.same_approximation(c, "eigen")]
    bounded = min(exact, key=results[-1]["times"].get) if exact else results[-1]["best"]
    bound = dict(recommend.one_factor_bound(work, bounded, workers, device),
                 configuration=bounded)
    setting = {"model": FLAGS.model, "batch": FLAGS.batch, "device": device.name,
               "network": network.name, "precision": FLAGS.precision,
               "ranks_per_node": FLAGS.workers_per_node, "links_per_node": FLAGS.links_per_node,
               "trainable_parameters": work.trainable_parameters,
               "configurations": len(settings["configs"]),
               "layers_without_block": [s["layer"] for s in work.skipped]}
    print(report.table(setting, results, bound))
    if work.skipped:
        print(f"Not counted in forward/backward: {len(work.skipped)} layer(s) without a "
              f"K-FAC block ({', '.join(setting['layers_without_block'][:5])}...)")
    sources = tuple(dict.fromkeys(device.sources + network.sources))
    document = report.to_json(setting, results, bound, sources)
    paths = report.write(document, results, bound, FLAGS.output_dir)
    print("Sources: " + "; ".join(sources))
    print(f"Wrote {paths[0]} and {paths[1]}")


if __name__ == "__main__":
    app.run(main)
