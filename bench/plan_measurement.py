"""This machine's side of the planner's validation (`bench/plan_validation.py --measure`):
its rates now, the 2-rank collectives over loopback (bench/results/loopback.json, the
planner's "loopback" network) and the 2-rank K-FAC job of bench/distributed_benchmark.py,
stored in bench/results/plan_validation/ for the report to compare with.

Each rank of the loopback timing runs this file: `plan_measurement.py OUT_PATH` under
horovodrun.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402

MEASURED_DIR = os.path.join(harness.RESULTS_DIR, "plan_validation")
LOOPBACK_SIZES = [2 ** k for k in range(8, 23, 2)]  # float32 elements: 1 kB to 16 MB
LOOPBACK_REPEATS = 15
# The 2-rank K-FAC job (bench/distributed_benchmark.py's flags).
LOCAL_MODELS, LOCAL_BATCH, LOCAL_FACTOR, LOCAL_DECOMPOSITION = ("mlp", "cnn"), 128, 5, 10
# The layout of the phase clocks of a saved measurement. Before the fix (library 6a78fc7
# and earlier, no "phase_clocks" key in distributed.json) they nest: "update"'s start
# stamp waited for nothing, so it ran from the start of the step (forward, backward,
# gradient reduction and all K-FAC phases inside), and a phase's tf.function could run
# before its own start stamp, on the previous phase's clock (preconditioning under the
# decompositions'). Then the clocks sum to more than the step ("rest" < 0) and only
# the factors clock, the span factors..precondition and the decomposition clock of an
# inverse step (its own work plus at most that step's preconditioning) are usable.
# `measure` marks its results "sequential" (tfkfac.state.PhaseClocks since the fix).
NESTED, SEQUENTIAL = "nested", "sequential"


def loopback_worker(out_path):
    """One rank: median seconds of the communicator's allreduce and allgather per size,
    the two interleaved (both ranks run the same calls in the same order)."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from tfkfac import distributed

    comm = distributed.get_communicator("horovod")
    reduce = tf.function(lambda t: comm.grouped_allreduce_mean([t], "gradients")[0])
    gather = tf.function(lambda t: comm.allgather(t, "allgather"))
    result = {"ranks": comm.size, "sizes_bytes": [4 * n for n in LOOPBACK_SIZES],
              "allreduce_s": [], "allgather_s": []}
    for n in LOOPBACK_SIZES:
        x = tf.ones([n])
        samples = harness.interleave(
            {name: lambda function=function: harness.seconds(lambda: function(x).numpy())
             for name, function in (("allreduce_s", reduce), ("allgather_s", gather))},
            LOOPBACK_REPEATS, warm_up=1)
        for name, seconds in samples.items():
            result[name].append(harness.spread(seconds)["median"])
    if comm.rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)


def fit_loopback(measured):
    """Least squares T = a + b·n over the allreduce sizes; on 2 ranks a ring allreduce is 2
    steps and moves n bytes: ring step latency a/2, bandwidth 1/b."""
    import numpy as np

    n, t = np.array(measured["sizes_bytes"], float), np.array(measured["allreduce_s"])
    b, a = np.polyfit(n, t, 1)
    return {"ring_step_latency": max(a, 0.0) / 2, "bandwidth": 1.0 / b}


def measure():
    """This machine's rates now, the loopback collectives, then the 2-rank K-FAC job."""
    import linalg_benchmark
    from trainers import launch
    from trainers.planning import hardware

    env = launch.job_environment()
    os.makedirs(MEASURED_DIR, exist_ok=True)
    rates = linalg_benchmark.rates(3)
    linalg_benchmark.print_rates(rates)
    with open(os.path.join(MEASURED_DIR, "rates.json"), "w") as f:
        json.dump({"rates": rates, "load_average": os.getloadavg()}, f, indent=1)
    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "loopback.json")
        command = launch.horovodrun_command([os.path.abspath(__file__), out], 2, env)
        code, output = launch.run_job(command, 600, env)
        if code:
            raise RuntimeError(f"loopback timing failed:\n{output[-3000:]}")
        with open(out) as f:
            measured = json.load(f)
    measured["fit"] = fit_loopback(measured)
    with open(hardware.LOOPBACK_JSON, "w") as f:
        json.dump(harness.stamp(measured), f, indent=1)
    print(f"loopback fit: {measured['fit']}", flush=True)
    command = [sys.executable, os.path.join(os.path.dirname(__file__), "distributed_benchmark.py"),
               f"--models={','.join(LOCAL_MODELS)}", f"--global_batch={LOCAL_BATCH}",
               f"--factor_update_freq={LOCAL_FACTOR}",
               f"--decomposition_update_freq={LOCAL_DECOMPOSITION}", "--bytes_configs=",
               f"--output_dir={MEASURED_DIR}"]
    code, output = launch.run_job(command, 1200, env)
    print(output[-3000:], flush=True)
    if code:
        raise RuntimeError("bench/distributed_benchmark.py failed")
    path = os.path.join(MEASURED_DIR, "distributed.json")
    with open(path) as f:
        report = json.load(f)
    report["phase_clocks"] = SEQUENTIAL  # measured by this library's PhaseClocks
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    loopback_worker(sys.argv[1])
