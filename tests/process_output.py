"""What a test reads of a child process: its output, how a binary ended, whether it runs;
and `in_background`, for tests whose processes run while others do."""

import concurrent.futures
import re

from trainers import cli


def own_lines(stderr):
    """stderr without the lines TensorFlow's C++ runtime prints at start-up (on CPUs with
    AVX-512, oneDNN's notice, whatever TF_CPP_MIN_LOG_LEVEL says)."""
    return [line for line in stderr.splitlines()
            if line.strip() and "absl::InitializeLog" not in line
            and not line.startswith(("I0000", "E0000", "W0000"))]


def assert_error(test, program, code, stderr, message, expected=cli.USAGE_EXIT_CODE):
    """`program` (a `trainers.cli.Program`) ended as trainers/cli.py says: exit code
    `expected`, no traceback, the error `message` (a regex) on the last line, right after
    the usage hint when it is a usage error."""
    test.assertEqual(code, expected, stderr[-3000:])
    test.assertNotIn("Traceback", stderr)
    lines = own_lines(stderr)
    test.assertRegex(lines[-1], f"^{re.escape(program.module)}: error: {message}")
    if expected == cli.USAGE_EXIT_CODE:
        test.assertEqual(lines[-2], program.usage_hint)


def running(pid):
    """True while `pid` exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def in_background(function, *args):
    """The Future of `function(*args)`, called in a thread of its own (which the process
    waits for at exit)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(function, *args)
    finally:
        pool.shutdown(wait=False)
