"""bench/harness.py: the one timer runs every configuration's warm-up untimed, then
interleaves their blocks in an order reversed every other repeat (A B C, C B A, ...) and
sums each configuration up by min, median and max; a written report carries its
provenance (library commit, date, the machine with its load at start and end) beside its
figure; a script's program refuses positional arguments, and flags of a module it imports
for its code but does not read, instead of ignoring them.
"""

import datetime
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# bench/ as its scripts see it (they import their neighbours by name).
BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH_DIR)

from absl import flags  # noqa: E402
from absl.testing import absltest, flagsaver  # noqa: E402

import harness  # noqa: E402

# Two flags of a module a script imports, of which it reads one.
flags.DEFINE_integer("probe_read", 0, "Read by the script.", module_name="probe_module")
flags.DEFINE_integer("probe_unread", 0, "Not read by the script.", module_name="probe_module")


class TimerTest(absltest.TestCase):

    def test_blocks_interleave_in_alternating_order_after_an_untimed_warm_up(self):
        calls = []

        def block(name):
            def run():
                calls.append(name)
                return len(calls)  # the block's figure: when it ran
            return run

        samples = harness.interleave({name: block(name) for name in "abc"}, repeats=3,
                                     warm_up=1)
        self.assertEqual("".join(calls), "abc" + "abc" + "cba" + "abc")
        self.assertEqual(samples, {"a": [4, 9, 10], "b": [5, 8, 11], "c": [6, 7, 12]})

    def test_spread_and_figures_by_name(self):
        self.assertEqual(harness.spread([3.0, 1.0, 2.0, 10.0]),
                         {"min": 1.0, "median": 2.5, "max": 10.0})
        self.assertEqual(harness.by_figure([{"full": 1}, {"stale": 2}, {"full": 3}]),
                         {"full": [1, 3], "stale": [2]})


class WriteTest(absltest.TestCase):

    def test_the_report_is_written_with_its_provenance_and_figure(self):
        def draw(report):
            figure, axis = harness.subplots()
            axis.plot(report["values"])
            return figure

        output_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        with flagsaver.flagsaver(output_dir=output_dir):
            harness.write({"values": [1, 2]}, "probe", draw)
        with open(os.path.join(output_dir, "probe.json"), encoding="utf-8") as f:
            report = json.load(f)
        self.assertEqual(report["values"], [1, 2])
        self.assertRegex(report["library_commit"], r"^([0-9a-f]{7,}|unknown)(\+dirty)?$")
        date = datetime.datetime.fromisoformat(report["date"])
        self.assertEqual(date.utcoffset(), datetime.timedelta(0))
        self.assertLess(abs(datetime.datetime.now(datetime.timezone.utc) - date),
                        datetime.timedelta(minutes=5))
        for key in ("load_average_at_start", "load_average_at_end"):
            self.assertLen(report["machine"][key], 3)
        self.assertGreater(os.path.getsize(os.path.join(output_dir, "probe.png")), 0)


class RunTest(absltest.TestCase):

    def run_program(self, *args):
        code = (f"import sys; sys.path.insert(0, {BENCH_DIR!r}); import harness; "
                "harness.run(lambda: print('main ran'))")
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True,
                              text=True, timeout=120, check=False)

    def test_positional_arguments_are_refused(self):
        refused = self.run_program("--output_dir=/tmp", "stray")
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("unexpected arguments ['stray']", refused.stderr)
        self.assertNotIn("main ran", refused.stdout)
        self.assertIn("main ran", self.run_program("--output_dir=/tmp").stdout)

    def test_a_set_flag_the_script_does_not_read_is_refused(self):
        with flagsaver.flagsaver():
            flags.FLAGS["probe_read"].parse("1")
            harness.refuse_unread("probe_module", ("probe_read",))
            flags.FLAGS["probe_unread"].parse("1")
            with self.assertRaisesRegex(ValueError, r"does not read --probe_unread "
                                        r"\(bench/probe_module.py's\)"):
                harness.refuse_unread("probe_module", ("probe_read",))


if __name__ == "__main__":
    absltest.main()
