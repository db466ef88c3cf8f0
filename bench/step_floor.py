"""Every phase of a training step against its arithmetic floor, per model and method.

For each model, the floor (trainers/planning/floor_model.py) counts from the layers'
shapes at the batch size the FLOPs and bytes of each phase of a step — forward/backward, factor
statistics (im2col, Gram products, running averages), communication (none on one
process; the bytes a `--ranks` job would move are reported), decompositions (eigh or
Cholesky inverse per factor), preconditioning (with the KL clip), update — and the
time this machine needs for them at the rates `bench/linalg_benchmark.py`'s `rates()`
measures in the same run, before and after the timed steps (the better of the two:
best float32 matmul FLOP/s, elementwise bandwidth, LAPACK eigh and Cholesky-inverse
FLOP/s). Factor and decomposition work is
amortized over the schedule (factors every 10 steps, decompositions every 100).

Measured against it, with bench/step_time.py's machinery (`time_model`: trainers built
as `python -m trainers.train` builds them, 16 cached batches, a warm-up, then
interleaved timed blocks): Keras SGD with momentum compiled with jit_compile=False and
with jit_compile=True (the faster is the baseline, and the report says which), and
K-FAC amortized (10/100) with the eigen and the inverse method (K-FAC's own XLA off, its
CPU default). A K-FAC phase's measured time is the optimizer's phase clock over the
timed steps (`summary()["phase_seconds"]`); "forward/backward" is the rest of the step
(forward, backward, Keras's train step around them). Each kind of K-FAC step (stale:
forward/backward + preconditioning + update; factor steps add factors; decomposition
steps add decompositions) is also compared with the sum of its phases' floors.

bench/step_time.py's flags apply (--models, --batch_size, --repeats,
--amortized_block_steps, --cached_batches, --output_dir); its others are refused.

Run (in the background, on an idle machine; ~15 min on 2 cores):
  cd /work/main && TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python bench/step_floor.py \\
      > /tmp/step_floor.log 2>&1 &
Writes bench/results/step_floor.json and step_floor.png and prints the table.
"""

import dataclasses

from absl import flags

import harness
import linalg_benchmark
import step_time
from tfkfac import costs
from trainers import config as config_lib, data as data_lib, models
from trainers.planning import floor_model

FLAGS = flags.FLAGS
flags.DEFINE_integer("rate_repeats", 5, "Timed repetitions of each rate measurement.")
flags.DEFINE_integer("ranks", 2, "Processes of the job whose communication is reported.")
FLAGS.set_default("models", list(models.CLASSIFIERS))

CONFIGURATIONS = {
    "sgd": dict(optimizer="sgd"),  # jit_compile=False, the trainer's default
    "sgd_xla": dict(optimizer="sgd", xla=True),  # jit_compile=True
    # With their phase clocks (`phase_clocks`, off by default): 0.2-0.6 ms per step more.
    "kfac_eigen": dict(step_time.CONFIGURATIONS["kfac_amortized"], phase_clocks=True),
    "kfac_inverse": dict(step_time.CONFIGURATIONS["kfac_amortized_inverse"], phase_clocks=True),
}
METHODS = {"eigen": "kfac_eigen", "inverse": "kfac_inverse"}
RATES = ("matmul", "bandwidth", "eigh", "cholesky_inverse")  # what Kernel.seconds reads
SGD_PHASES = ("forward_backward", "update")
# Per kind of K-FAC step (`trainers.runner.phase_fn`), the phases it runs, each in full.
STEP_KINDS = {
    "stale": ("forward_backward", "precondition", "update"),
    "factors": ("forward_backward", "factors", "precondition", "update"),
    "factors_and_decompositions": ("forward_backward", "factors", "decomposition",
                                   "precondition", "update"),
}
LABELS = {"forward_backward": "forward+backward", "factors": "factors",
          "communication": "communication", "decomposition": "decomposition",
          "precondition": "precondition", "update": "update"}


def geometry_of(model):
    """(block geometries, attention kernels, trainable parameters, KL clip on) of
    `model` as the trainer builds it, at --batch_size."""
    defaults = config_lib.TrainConfig(model=model)
    info = data_lib.dataset_info(defaults.dataset)
    keras_model = models.build_model(model, info.features["image"].shape,
                                     info.features["label"].num_classes, defaults.seed)
    geometries, attention, skipped = floor_model.record_geometries(
        keras_model, FLAGS.batch_size, defaults.weight_sharing)
    if skipped:  # their forward products would be missing from the floor
        raise ValueError(f"{model}: layers without a K-FAC block: {skipped}")
    parameters = sum(int(v.shape.num_elements()) for v in keras_model.trainable_variables)
    return geometries, attention, parameters, defaults.kl_clip is not None


def measure(model):
    """The model's geometry and its configurations' measured step times and clocks."""
    geometries, attention, parameters, kl_clip = geometry_of(model)
    measured = step_time.time_model(model, CONFIGURATIONS)["configurations"]
    for name, result in measured.items():
        print(f"{model:9s} {name:13s} {result['mean_step_s'] * 1e3:8.1f} ms/step", flush=True)
    return geometries, attention, parameters, kl_clip, measured


def compare(measurement, rates):
    """The floor of every phase beside its measured time, for SGD and both methods."""
    geometries, attention, parameters, kl_clip, measured = measurement
    sgd_name = min(("sgd", "sgd_xla"), key=lambda name: measured[name]["mean_step_s"])
    result = {"geometry": {path: {"kind": type(g).__name__, **dataclasses.asdict(g)}
                           for path, g in geometries.items()},
              "trainable_parameters": parameters, "measured": measured,
              "sgd_baseline": sgd_name, "methods": {}}
    for method, name in METHODS.items():
        schedule = CONFIGURATIONS[name]
        floor = floor_model.model_floor(
            geometries, attention, parameters, method, schedule["factor_update_freq"],
            schedule["decomposition_update_freq"], FLAGS.ranks, kl_clip)
        phases = floor_model.phase_summary(floor, rates)
        clocks = measured[name]["kfac_phase_s_per_step"]
        step_s = measured[name]["mean_step_s"]
        for phase, entry in phases.items():
            entry["measured_s_per_step"] = (
                clocks[phase] if phase in clocks else 0.0 if phase == "communication"
                else step_s - sum(clocks.values()))
        result["methods"][method] = {
            "phases": phases, "communication": floor["communication"],
            "step": {"floor_s": sum(p["floor_s_per_step"] for p in phases.values()),
                     "measured_s": step_s},
            "step_kinds": {kind: {
                "floor_s": sum(floor_model.floor_seconds(floor["phases"][p]["kernels"], rates)
                               for p in kind_phases),
                "measured_s": measured[name]["mean_step_s_by_kind"].get(kind)}
                for kind, kind_phases in STEP_KINDS.items()}}
    # SGD: the same forward/backward and update kernels (any method's).
    sgd_phases = {phase: dict(phases[phase]) for phase in SGD_PHASES}
    for phase in SGD_PHASES:
        sgd_phases[phase].pop("measured_s_per_step")
    result["sgd"] = {"phases": sgd_phases,
                     "step": {"floor_s": sum(p["floor_s_per_step"] for p in sgd_phases.values()),
                              "measured_s": measured[sgd_name]["mean_step_s"],
                              "measured_s_jit_compile_false": measured["sgd"]["mean_step_s"],
                              "measured_s_jit_compile_true": measured["sgd_xla"]["mean_step_s"]}}
    for method in METHODS:
        step = result["methods"][method]["step"]
        step["ratio_to_sgd_measured"] = step["measured_s"] / result["sgd"]["step"]["measured_s"]
        step["ratio_to_sgd_floor"] = step["floor_s"] / result["sgd"]["step"]["floor_s"]
    return result


def _ratio(measured, floor):
    return f"{measured / floor:9.2f}x" if floor > 0 and measured is not None else " " * 10


def print_table(model, result):
    sgd = result["sgd"]["step"]
    print(f"\n{model}: batch {FLAGS.batch_size}; Keras SGD jit_compile=False "
          f"{sgd['measured_s_jit_compile_false'] * 1e3:.1f} ms, jit_compile=True "
          f"{sgd['measured_s_jit_compile_true'] * 1e3:.1f} ms -> baseline "
          f"{'jit_compile=True' if result['sgd_baseline'] == 'sgd_xla' else 'jit_compile=False'}")
    print(f"{'':15s} {'phase':17s} {'GFLOP/step':>10s} {'MB/step':>9s} {'floor ms':>9s} "
          f"{'measured ms':>11s} {'meas/floor':>10s}")
    for name, entry in [("sgd", result["sgd"])] + [
            (f"kfac {m}", e) for m, e in result["methods"].items()]:
        for phase, p in entry["phases"].items():
            measured = p.get("measured_s_per_step")
            if phase == "communication":
                comm = entry["communication"]
                kfac_mb = comm["kfac_bytes_per_rank_per_step"] / 1e6
                gradient_mb = comm["gradient_bytes_sent_per_rank_per_step"] / 1e6
                print(f"{name:15s} {LABELS[phase]:17s} {'0 bytes on 1 process; ':>31s}"
                      f"{comm['ranks']} ranks: K-FAC {kfac_mb:.2f} MB/step/rank "
                      f"(+ gradients {gradient_mb:.2f} MB, as SGD)")
                continue
            print(f"{name:15s} {LABELS[phase]:17s} {p['flops_per_step'] / 1e9:10.3f} "
                  f"{p['bytes_per_step'] / 1e6:9.2f} {p['floor_s_per_step'] * 1e3:9.2f} "
                  + (f"{measured * 1e3:11.2f} {_ratio(measured, p['floor_s_per_step'])}"
                     if measured is not None else ""))
        steps = [("step", entry["step"])] + [
            (f"{kind.replace('_and_decompositions', '+decomp')} step", step)
            for kind, step in entry.get("step_kinds", {}).items()]
        for label, step in steps:
            measured = step["measured_s"]
            print(f"{name:15s} {label:17s} {'':10s} {'':9s} {step['floor_s'] * 1e3:9.2f} "
                  + (f"{measured * 1e3:11.2f} {_ratio(measured, step['floor_s'])}"
                     if measured is not None else ""), flush=True)


def plot(report):
    model_names = list(report["models"])
    phases = floor_model.PHASES
    figure, axes = harness.subplots(1, len(model_names), figsize=(4.2 * len(model_names), 4.8),
                                squeeze=False)
    for axis, model in zip(axes[0], model_names):
        result = report["models"][model]
        entries = [("SGD", result["sgd"])] + [(m, e) for m, e in result["methods"].items()]
        for i, (name, entry) in enumerate(entries):
            for j, kind in enumerate(("floor", "measured")):
                x = i + (j - 0.5) * 0.4
                bottom = 0.0
                for k, phase in enumerate(phases):
                    p = entry["phases"].get(phase)
                    if p is None:
                        continue
                    value = (p["floor_s_per_step"] if kind == "floor"
                             else p.get("measured_s_per_step", 0.0)) * 1e3
                    if kind == "measured" and name == "SGD":
                        continue
                    axis.bar(x, value, 0.38, bottom=bottom, color=f"C{k}",
                             alpha=0.45 if kind == "floor" else 1.0,
                             hatch="//" if kind == "floor" else None,
                             label=LABELS[phase] if i == 1 and j == 1 else None)
                    bottom += value
                if kind == "measured":
                    measured = entry["step"]["measured_s"] * 1e3
                    if name == "SGD":  # no phase clocks: one bar
                        axis.bar(x, measured, 0.38, color="0.5",
                                 label="SGD step (measured)")
                    axis.annotate(f"{measured / (entry['step']['floor_s'] * 1e3):.1f}x",
                                  (x, measured), ha="center", va="bottom", fontsize=8)
        axis.set_xticks(range(len(entries)), [name for name, _ in entries])
        axis.set_ylabel("ms per step (amortized)")
        sgd = "XLA" if result["sgd_baseline"] == "sgd_xla" else "no XLA"
        axis.set_title(f"{model}: floor (hatched) | measured\n(SGD {sgd}; label = measured/floor)",
                       fontsize=9)
    axes[0][0].legend(fontsize=7)
    figure.suptitle(f"Step time: floor vs measured, batch {report['batch_size']}\n"
                    f"K-FAC factors every 10 steps, decompositions every 100", fontsize=10)
    return figure


def main():
    harness.check_among("models", FLAGS.models, models.CLASSIFIERS)
    harness.refuse_unread("step_time", ("models", "batch_size", "amortized_block_steps",
                                        "cached_batches"))
    report = {"batch_size": FLAGS.batch_size, "blocks": FLAGS.repeats,
              "amortized_block_steps": FLAGS.amortized_block_steps,
              "configurations": CONFIGURATIONS,
              "floor_model": {"eigh_flops_per_n3": costs.EIGH_FLOPS_PER_N3,
                              "cholesky_inverse_flops_per_n3":
                                  costs.CHOLESKY_INVERSE_FLOPS_PER_N3},
              "notes": {
                  "floor": "trainers/planning/floor_model.py: per phase FLOPs and bytes "
                           "from the layer shapes, time = max(FLOPs / matmul rate, bytes / bandwidth) per "
                           "kernel, decompositions at the LAPACK rates; amortized by the "
                           "schedule",
                  "measured": "K-FAC phases: the optimizer's phase clocks over the timed "
                              "steps; forward_backward: the mean step minus those clocks; "
                              "communication: 0 (one process)"},
              "models": {}}
    # Rates before and after the timed steps; the floor takes the better of each, so a
    # moment of contention on the shared machine does not lower it.
    report["rates_at_start"] = linalg_benchmark.rates(FLAGS.rate_repeats)
    linalg_benchmark.print_rates(report["rates_at_start"])
    measurements = {model: measure(model) for model in FLAGS.models}
    report["rates_at_end"] = linalg_benchmark.rates(FLAGS.rate_repeats)
    linalg_benchmark.print_rates(report["rates_at_end"])
    report["rates"] = {key: max(report["rates_at_start"][key], report["rates_at_end"][key])
                       for key in RATES}
    for model, measurement in measurements.items():
        report["models"][model] = compare(measurement, report["rates"])
        print_table(model, report["models"][model])
    harness.write(report, "step_floor", plot)


if __name__ == "__main__":
    harness.run(main)
