"""Counts `bazel test` results per target and prints the closing `N passed, M failed` line.

Bazel's own closing lines are not read by CI's parser, and a run that built nothing must
not look green, so `make test` pipes Bazel's output through this script.

Usage: bazel test //... 2>&1 | tee log; summarize_bazel_tests.py --bazel_exit_code=$? < log
"""

import argparse
import re
import sys

# Bazel's per-target summary line, e.g.
#   //tests:test_package                              (cached) PASSED in 3.1s
#   //tests:test_slow                                          TIMEOUT in 300.0s
#   //tests:test_broken                                        FAILED TO BUILD
PASSING_STATUSES = ("PASSED", "FLAKY")
FAILING_STATUSES = ("FAILED TO BUILD", "FAILED", "TIMEOUT", "NO STATUS", "INCOMPLETE",
                    "REMOTE FAILURE", "SKIPPED")
_SUMMARY_LINE = re.compile(
    r"^(?P<target>@?[\w./-]*//[\w./-]*:[\w./+-]+)\s+(?:\(cached\)\s+)?"
    r"(?P<status>" + "|".join(re.escape(s) for s in PASSING_STATUSES + FAILING_STATUSES)
    + r")\b")


# With --test_output=errors Bazel inlines a failing test's log between these markers;
# nothing a test prints may count as a result.
_TEST_OUTPUT_START = "==================== Test output for "
_TEST_OUTPUT_END = re.compile(r"^={40,}$")


def parse_results(lines):
    """Returns {target: status} from Bazel's output; a target's last line wins."""
    results = {}
    in_test_output = False
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith(_TEST_OUTPUT_START):
            in_test_output = True
        elif in_test_output:
            in_test_output = not _TEST_OUTPUT_END.match(line)
        else:
            match = _SUMMARY_LINE.match(line)
            if match:
                results[match.group("target")] = match.group("status")
    return results


def summarize(results):
    """Returns (passed, failed) target counts."""
    passed = sum(status in PASSING_STATUSES for status in results.values())
    return passed, len(results) - passed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bazel_exit_code", type=int, default=0,
                        help="exit status of `bazel test`; non-zero fails the run even if "
                        "every counted target passed (e.g. a binary failed to build)")
    args = parser.parse_args(argv)
    results = parse_results(sys.stdin)
    passed, failed = summarize(results)
    for target, status in sorted(results.items()):
        if status not in PASSING_STATUSES:
            print(f"{status}: {target}")
    if passed == 0 and failed == 0:
        print("no test target ran")
    elif args.bazel_exit_code != 0 and failed == 0:
        print(f"bazel test exited with status {args.bazel_exit_code}")
    print(f"{passed} passed, {failed} failed")
    return 0 if passed > 0 and failed == 0 and args.bazel_exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
