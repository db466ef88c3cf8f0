"""`make test`'s closing line: tools/summarize_bazel_tests.py counts Bazel's per-target
results, so a failed, timed-out or unbuilt test (or a run with no test) fails `make test`."""

import os
import subprocess
import sys

from absl.testing import absltest

SUMMARIZER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "tools", "summarize_bazel_tests.py")

LOG_DIR = ("/root/.cache/bazel/_bazel_root/0f3a/execroot/tfkfac_repo/bazel-out/"
           "k8-fastbuild/testlogs/tests")

# Shaped like Bazel 4.2.3's output with --test_output=errors: a failing test's log
# (whose own lines must not be counted), then the per-target summary.
MIXED_RUN = f"""\
INFO: Analyzed 9 targets (16 packages loaded, 96 targets configured).
INFO: Found 3 targets and 6 test targets...
FAIL: //tests:test_linalg (see {LOG_DIR}/test_linalg/test.log)
INFO: From Testing //tests:test_linalg:
==================== Test output for //tests:test_linalg:
[ RUN      ] EighTest.test_matches_numpy
//tests:test_in_log_text                                   PASSED in 1.0s
AssertionError: 0.5 != 0.25
================================================================================
TIMEOUT: //tests:test_slow (Summary)
      {LOG_DIR}/test_slow/test.log
INFO: Elapsed time: 312.4s, Critical Path: 300.2s
INFO: 21 processes: 12 internal, 9 local.
INFO: Build completed, 2 tests FAILED, 21 total actions
//tests:test_capture                                            (cached) PASSED in 8.9s
//tests:test_horovod_collectives                                         PASSED in 22.6s
//tests:test_idx_dataset                                                 PASSED in 57.3s
//tests:test_package                                                      FLAKY, failed in 1 out of 2 in 5.1s
  Stats over 2 runs: max = 5.1s, min = 4.9s, avg = 5.0s, dev = 0.1s
//tests:test_linalg                                                      FAILED in 3.2s
  {LOG_DIR}/test_linalg/test.log
//tests:test_slow                                                       TIMEOUT in 300.0s
  {LOG_DIR}/test_slow/test.log

Executed 5 out of 6 tests: 4 tests pass and 2 fail locally.
INFO: Build completed, 2 tests FAILED, 21 total actions
"""

ALL_PASSED_RUN = """\
INFO: Build completed successfully, 13 total actions
//tests:test_horovod_collectives                                         PASSED in 22.6s
//tests:test_idx_dataset                                                 PASSED in 57.3s
//tests:test_package                                                      PASSED in 35.5s

Executed 3 out of 3 tests: 3 tests pass.
"""

BUILD_FAILURE_RUN = """\
ERROR: /work/main/tests/BUILD:10:12: no such target '//tfkfac:missing'
//tests:test_package                                                      PASSED in 4.1s
//tests:test_optimizer                                                FAILED TO BUILD
//tests:test_schedules                                                      NO STATUS

Executed 1 out of 3 tests: 1 test passes and 2 were skipped.
FAILED: Build did NOT complete successfully
"""

NO_TEST_RUN = """\
INFO: Found 3 targets and 0 test targets...
ERROR: No test targets were found, yet testing was requested
FAILED: Build did NOT complete successfully
"""


def summarize(bazel_output, bazel_exit_code):
    """Runs the summariser as `make test` does; returns (exit code, printed lines)."""
    result = subprocess.run(
        [sys.executable, SUMMARIZER, f"--bazel_exit_code={bazel_exit_code}"],
        input=bazel_output, capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout.splitlines()


class SummarizeBazelTestsTest(absltest.TestCase):

    def test_failed_and_timed_out_targets_fail_the_run(self):
        code, lines = summarize(MIXED_RUN, bazel_exit_code=3)
        self.assertEqual(lines[-1], "4 passed, 2 failed")
        self.assertIn("FAILED: //tests:test_linalg", lines)
        self.assertIn("TIMEOUT: //tests:test_slow", lines)
        self.assertNotEqual(code, 0)

    def test_all_passed_exits_zero(self):
        code, lines = summarize(ALL_PASSED_RUN, bazel_exit_code=0)
        self.assertEqual(lines, ["3 passed, 0 failed"])
        self.assertEqual(code, 0)

    def test_targets_that_did_not_build_or_run_count_as_failed(self):
        code, lines = summarize(BUILD_FAILURE_RUN, bazel_exit_code=1)
        self.assertEqual(lines[-1], "1 passed, 2 failed")
        self.assertIn("FAILED TO BUILD: //tests:test_optimizer", lines)
        self.assertIn("NO STATUS: //tests:test_schedules", lines)
        self.assertNotEqual(code, 0)

    def test_no_test_ran_fails_the_run(self):
        code, lines = summarize(NO_TEST_RUN, bazel_exit_code=4)
        self.assertEqual(lines[-2:], ["no test target ran", "0 passed, 0 failed"])
        self.assertNotEqual(code, 0)

    def test_bazel_error_fails_the_run_even_if_every_test_passed(self):
        code, lines = summarize(ALL_PASSED_RUN, bazel_exit_code=1)
        self.assertEqual(lines[-2:], ["bazel test exited with status 1", "3 passed, 0 failed"])
        self.assertNotEqual(code, 0)


if __name__ == "__main__":
    absltest.main()
