"""The slow storage both data-echoing benchmarks stand in for: a read latency per example
in the input pipeline, calibrated so that the pipeline alone delivers a batch in a
wanted time (R times a training step)."""

import time

import harness

# Input timed per measurement of the pipeline alone (at least MIN_BATCHES batches).
READ_SECONDS, MIN_BATCHES = 4.0, 10
# Sleeping overshoots by a factor that depends on the latency: corrected until the
# pipeline's time is within the tolerance of the wanted one, at most this many rounds.
CALIBRATION_ROUNDS, CALIBRATION_TOLERANCE = 4, 0.05


def seconds_per_batch(dataset, batches, clock=time.perf_counter):
    """Time per batch of iterating `dataset` alone, after two warm-up batches, on `clock`
    (wall time, or `time.process_time` for the CPU time of all this process's threads)."""
    iterator = iter(dataset)
    for _ in range(2):
        next(iterator)
    return harness.seconds(lambda: [next(iterator) for _ in range(batches)],
                           clock=clock) / batches


def upstream_seconds(pipeline, read_latency, batch_size):
    """Seconds per batch of `pipeline(read_latency)` (a dataset of `batch_size` batches)
    iterated alone, no training: about READ_SECONDS of its batches."""
    batches = max(MIN_BATCHES, int(READ_SECONDS / (read_latency * batch_size)))
    return seconds_per_batch(pipeline(read_latency), batches)


def calibrate(pipeline, wanted, batch_size):
    """The read latency per example at which `pipeline` (as in `upstream_seconds`) takes
    `wanted` seconds per batch: {"read_latency_s", "t_upstream_s"} (the last measured)."""
    latency, t_up = wanted / batch_size, None
    for _ in range(CALIBRATION_ROUNDS):
        if t_up is not None:
            latency *= wanted / t_up
        t_up = upstream_seconds(pipeline, latency, batch_size)
        if abs(t_up / wanted - 1) < CALIBRATION_TOLERANCE:
            break
    return {"read_latency_s": latency, "t_upstream_s": t_up}
