"""Helpers of the trainer tests: small real-data settings, running the binary, reading
what a run wrote (checkpoint tensors, metrics.csv, JSON)."""

import csv
import json
import os
import re
import subprocess
import sys
import time

from absl import flags
from absl.testing import flagsaver
import numpy as np
import tensorflow as tf

import process_output
from process_output import own_lines  # noqa: F401 (the trainer tests read it here)
from trainers import cli, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 32
TRAIN_EXAMPLES = 640  # 20 steps per epoch
STEPS_PER_EPOCH = TRAIN_EXAMPLES // BATCH
# Small slices keep each run to seconds; the data is real Fashion-MNIST.
SMALL = dict(train_split=f"train[:{TRAIN_EXAMPLES}]", eval_split="test[:256]",
             batch_size=BATCH, verbose=0)
SMALL_FLAGS = [f"--{name}={value}" for name, value in SMALL.items()]


def config_from_argv(*argv):
    """The TrainConfig (and explicitly set names) that `python -m trainers.train argv` uses."""
    flag_values = flags.FLAGS
    with flagsaver.flagsaver():
        flag_values.unparse_flags()
        try:
            flag_values(["train", *argv])
            return train.config_from_flags(flag_values)
        finally:
            flag_values.mark_as_parsed()  # absltest's own flags stay readable afterwards


def assert_error(test, result, message, expected=cli.USAGE_EXIT_CODE):
    """`run_binary`'s `result` ended with exit code `expected` and the error `message`
    (a regex) last (`process_output.assert_error`)."""
    process_output.assert_error(test, train.CLI, result.returncode, result.stderr, message,
                                expected)


def read_csv(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def checkpoint_tensors(prefix):
    """Every saved tensor (model and optimizer variables) of a checkpoint, by key."""
    reader = tf.train.load_checkpoint(prefix)
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
            if "OBJECT_GRAPH" not in key}


def assert_same_tensors(test, want, have):
    """The same tensor keys and, but K-FAC's wall-clock phase totals, equal values."""
    test.assertEqual(sorted(want), sorted(have))
    for key, value in want.items():
        if "phase_seconds" not in key:  # wall-clock totals, not training state
            np.testing.assert_array_equal(have[key], value, err_msg=key)


def checkpoint_dir(model_dir, step):
    return os.path.join(model_dir, "checkpoints", f"step-{step}")


def step_tensors(model_dir, step):
    """The tensors of a run's checkpoint `step-<step>`."""
    return checkpoint_tensors(os.path.join(checkpoint_dir(model_dir, step), "variables"))


def run_binary(*argv, env=None, timeout=300):
    """Runs `python -m trainers.train argv`; returns the CompletedProcess."""
    return run_binaries([argv], env, timeout)[0]


def run_binaries(argvs, env=None, timeout=300):
    """`run_binary` of every argv in `argvs` at once (their start-ups, most of their
    time, overlap); their CompletedProcesses, in order. Past `timeout` s a binary (they
    share the machine, as one after the other they would share the time) all are killed."""
    processes = [subprocess.Popen(
        [sys.executable, "-m", "trainers.train", *argv], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {}))) for argv in argvs]
    deadline = time.monotonic() + timeout * len(argvs)
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=max(deadline - time.monotonic(), 0))
            results.append(subprocess.CompletedProcess(process.args, process.returncode,
                                                       stdout, stderr))
        return results
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()


def start_binary(*argv, log_dir, env=None):
    """Starts `python -m trainers.train argv` with its output in `log_dir`/stdout and
    `log_dir`/stderr; returns the Popen, for tests that signal the process as it trains."""
    with open(os.path.join(log_dir, "stdout"), "w", encoding="utf-8") as stdout, \
            open(os.path.join(log_dir, "stderr"), "w", encoding="utf-8") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "trainers.train", *argv], cwd=ROOT, stdout=stdout,
            stderr=stderr, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **(env or {})))


def wait_for(process, path, pattern=None, timeout=900):
    """Waits until `path` exists (and its text matches the regex `pattern`, if given);
    fails if `process` ends first or `timeout` s pass (the generous default is for a
    loaded machine)."""
    deadline = time.monotonic() + timeout
    while True:
        if os.path.exists(path) and pattern is None:
            return
        if pattern is not None and os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                if re.search(pattern, f.read(), re.DOTALL):
                    return
        if process.poll() is not None:
            raise AssertionError(f"the process ended (exit code {process.returncode}) "
                                 f"before {path} appeared" + (f" holding {pattern!r}"
                                                               if pattern else ""))
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


