"""trainers.train's multi-worker start-up, each worker started with its own TF_CONFIG as
on a cluster: a worker that never comes, a port another process holds, workers started
with different flags and a malformed TF_CONFIG each end every started worker with one
line naming the cause (the worker and its address, the port, the setting, TF_CONFIG)
instead of a wait without end or a traceback; a missing worker within the start-up
deadline (`--startup_timeout_seconds`, short here).

The workers of every scenario start together (setUpClass): most of a scenario is waiting
for a deadline, so they overlap instead of adding up."""

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import logging
from absl.testing import absltest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import trainer_testing as tt  # noqa: E402
from trainers import launch  # noqa: E402

DEADLINE_SECONDS = 10
# Starting Python, TensorFlow and the trainer takes 10-30 s on the loaded 2-core machine
# (more with every scenario's workers starting at once) before the deadline's clock
# starts; a worker still running after this is killed.
WORKER_TIMEOUT_SECONDS = 150
FLAGS = [*tt.SMALL_FLAGS, "--steps=4", "--distribution=multi_worker"]
ERROR = "trainers.train: error: "
ERROR_RE = re.escape(ERROR)


def run_workers(ports, worker_flags, started=None):
    """Runs `python -m trainers.train` as worker i of a localhost cluster on `ports` with
    FLAGS + `worker_flags[i]`, for each i in `started` (default: all), at the same time;
    returns {i: (exit code, output lines, seconds)}. A worker still running after
    WORKER_TIMEOUT_SECONDS is killed with its process group (TimeoutError)."""
    env = launch.job_environment()
    started = list(range(len(ports)) if started is None else started)

    def run(index):
        start = time.monotonic()
        code, output = launch.run_job(
            [sys.executable, "-m", "trainers.train", *FLAGS, *worker_flags[index]],
            WORKER_TIMEOUT_SECONDS, dict(env, TF_CONFIG=launch.tf_config(ports, index)))
        return code, output.splitlines(), time.monotonic() - start

    with concurrent.futures.ThreadPoolExecutor(len(started)) as pool:
        return dict(zip(started, pool.map(run, started)))


MALFORMED_TF_CONFIGS = ('{"cluster": {"worker": ["localhost:1"]}, "task": ',
                        '{"cluster": {"worker": ["localhost:1"]}}',
                        '{"task": {"type": "worker", "index": 0}}')


def run_malformed(tf_config, model_dir):
    """`python -m trainers.train` (one worker) with TF_CONFIG `tf_config`: its
    CompletedProcess."""
    return subprocess.run(
        [sys.executable, "-m", "trainers.train", *FLAGS, f"--model_dir={model_dir}"],
        cwd=tt.ROOT, capture_output=True, text=True, timeout=WORKER_TIMEOUT_SECONDS,
        env=dict(launch.job_environment(), TF_CONFIG=tf_config))


class MultiWorkerStartupTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        """Runs every scenario at once: `ports` ({scenario: its cluster's ports}) and
        `futures` ({scenario: its Future}; a scenario that raised fails its test alone)."""
        super().setUpClass()
        os.makedirs(absltest.get_default_test_tmpdir(), exist_ok=True)
        model_dir = lambda: tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        deadline = [f"--startup_timeout_seconds={DEADLINE_SECONDS}"]
        ports = iter(launch.free_ports(6))  # one call: distinct ports for every scenario
        cls.ports = {name: [next(ports), next(ports)]
                     for name in ("never_starts", "port_held", "batch_sizes")}

        def never_starts():
            flags = [f"--model_dir={model_dir()}", *deadline]
            return run_workers(cls.ports["never_starts"], [flags, flags], started=[0])[0]

        def port_held():
            flags = [f"--model_dir={model_dir()}", *deadline]
            with socket.socket() as holder:
                holder.bind(("localhost", cls.ports["port_held"][0]))  # where the others meet
                return run_workers(cls.ports["port_held"], [flags, flags])

        def batch_sizes():
            flags = [f"--model_dir={model_dir()}"]
            return run_workers(cls.ports["batch_sizes"], [flags + ["--batch_size=32"],
                                                           flags + ["--batch_size=64"]])

        scenarios = {"never_starts": never_starts, "port_held": port_held,
                     "batch_sizes": batch_sizes, **{
                         tf_config: (lambda c=tf_config: run_malformed(c, model_dir()))
                         for tf_config in MALFORMED_TF_CONFIGS}}
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(scenarios)) as pool:
            cls.futures = {name: pool.submit(run) for name, run in scenarios.items()}
        logging.info("every scenario ended after %.1f s", time.monotonic() - start)

    def result(self, scenario):
        """What `scenario` returned (raises what it raised)."""
        return self.futures[scenario].result()

    def assert_ends_with_one_line(self, result, pattern):
        """The worker exited 1, its last line matches `pattern` and it printed no traceback."""
        code, lines, _ = result
        self.assertEqual(code, 1, "\n".join(lines[-30:]))
        self.assertRegex(lines[-1], pattern, "\n".join(lines[-30:]))
        self.assertFalse([line for line in lines if "Traceback" in line], "\n".join(lines[-60:]))

    def test_worker_that_never_starts_is_named_within_the_deadline(self):
        ports, result = self.ports["never_starts"], self.result("never_starts")
        self.assert_ends_with_one_line(result, (
            rf"^{ERROR_RE}multi-worker start-up: worker 1 \(localhost:{ports[1]}\) did not join "
            rf"within {DEADLINE_SECONDS} s \(--startup_timeout_seconds\).*; this is worker 0 "
            rf"\(localhost:{ports[0]}\)$"))
        logging.info("worker 0 alone ended after %.1f s", result[2])
        # Python and TensorFlow start first; the deadline counts from the strategy on.
        self.assertLess(result[2], DEADLINE_SECONDS + 60)

    def test_port_held_by_another_process_ends_every_worker(self):
        ports, results = self.ports["port_held"], self.result("port_held")
        self.assert_ends_with_one_line(results[0], (
            rf"^{ERROR_RE}multi-worker start-up: port {ports[0]} of this worker, worker 0 "
            rf"\(localhost:{ports[0]}\), is held by another process"))
        self.assert_ends_with_one_line(results[1], (
            rf"^{ERROR_RE}multi-worker start-up: worker 0 \(localhost:{ports[0]}\) did not join "
            rf"within {DEADLINE_SECONDS} s"))

    def test_workers_with_different_batch_sizes_end_naming_the_setting(self):
        results = self.result("batch_sizes")
        for index in range(2):
            self.assert_ends_with_one_line(results[index], (
                rf"^{ERROR_RE}ranks disagree on batch_size \(rank 0: 32, rank 1: 64\); "
                r"steps_per_epoch \(rank 0: 10, rank 1: 5\); every rank must run with the "
                "same settings$"))
        logging.info("workers with different --batch_size ended after %.1f s",
                     max(result[2] for result in results.values()))

    def test_malformed_tf_config_is_named(self):
        truncated = MALFORMED_TF_CONFIGS[0]
        with self.assertRaises(json.JSONDecodeError) as parse:
            json.loads(truncated)
        for tf_config, message in zip(MALFORMED_TF_CONFIGS, (
                f"TF_CONFIG is not valid JSON: {parse.exception}",
                'TF_CONFIG has no "task" (e.g. "task": {"type": "worker", "index": 0})',
                'TF_CONFIG has no "cluster" (e.g. "cluster": {"worker": ["host0:port", '
                '"host1:port"]})')):
            with self.subTest(tf_config=tf_config):
                # A TF_CONFIG that cannot run is a usage error (trainers/cli.py).
                tt.assert_error(self, self.result(tf_config), re.escape(message))

    def test_startup_deadline_is_checked(self):
        for argv, message in (
                (["--startup_timeout_seconds=0"],
                 "`startup_timeout_seconds` must be a finite number in (0, 604800]"),
                (["--distribution=none", "--startup_timeout_seconds=60"],
                 "startup_timeout_seconds applies to the start-up of distribution=multi_worker "
                 "with TF_CONFIG naming the workers, not distribution=none"),
                (["--distribution=multi_worker", "--startup_timeout_seconds=60"],
                 "not distribution=multi_worker without TF_CONFIG (one local worker)")):
            config, given = tt.config_from_argv(*argv)
            with self.subTest(argv=argv), self.assertRaisesRegex(ValueError, re.escape(message)):
                config.validate(given)


if __name__ == "__main__":
    absltest.main()
