"""bench/start_up.py's accounting, without training: TensorFlow's log lines become
Grappler and XLA spans; a window's phases count the outermost traces only and no
Grappler time twice where an XLA compilation overlaps it; a process's start-up is the
fit's set-up, its first step whole and every later first step of a kind by its excess
over the kind's steady time (the steady state itself is not start-up); the amortized step
weighs the kinds by K-FAC's schedule; a part of the start-up is summed up over the repeats
by medians.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# bench/ as its scripts see it (they import their neighbours by name).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

from absl.testing import absltest  # noqa: E402

import start_up  # noqa: E402

# Lines as TensorFlow 2.21 writes them (VLOG 1 of meta_optimizer and device_compiler),
# among others of no interest.
LOG = """\
I0000 00:00:100.000000   22984 port.cc:153] oneDNN custom operations are on.
I0000 00:00:101.000000   22984 meta_optimizer.cc:1059] Starting optimization for grappler item: __inference_g_28
I0000 00:00:101.200000   22984 meta_optimizer.cc:973] model_pruner: Graph size after: 13 nodes (-1), 13 edges (-1), time = 0.093ms.
I0000 00:00:101.400000   22984 meta_optimizer.cc:1092] Optimized main graph.
I0000 00:00:101.500000   22984 meta_optimizer.cc:1311] Optimized 0 functions: 
W0000 00:00:101.500100   22984 dump_graph.cc:162] Failed to dump after_MetaOptimizer_1
a line of Python's own
I0000 00:00:103.000000   22984 device_compiler.h:208] Compiled cluster using XLA!  This line is logged at most once for the lifetime of the process.
I0000 00:00:103.000000   22984 device_compiler.h:538] Compilation of XLA executable time: 800.0 ms (800000 us) (cumulative: 800.0 ms, max: 800.0 ms, #called: 1)
""".splitlines()


def step(index, kind, wall):
    return {"index": index, "kind": kind, "wall": wall}


class LogTest(absltest.TestCase):

    def test_grappler_items_and_xla_compilations_become_spans(self):
        spans = start_up.parse_log(LOG)
        self.assertEqual([s["phase"] for s in spans],
                         ["graph_optimization", "xla_compilation"])
        self.assertAlmostEqual(spans[0]["start"], 101.0)
        self.assertAlmostEqual(spans[0]["end"], 101.5)
        self.assertAlmostEqual(spans[1]["start"], 102.2)  # 800 ms before its line
        self.assertAlmostEqual(spans[1]["end"], 103.0)

    def test_a_window_counts_outermost_traces_and_grappler_outside_xla(self):
        spans = [{"phase": "graph_optimization", "start": 10.0, "end": 14.0},
                 {"phase": "xla_compilation", "start": 13.0, "end": 16.0}]
        traces = [{"start": 1.0, "end": 9.0, "depth": 0},
                  {"start": 2.0, "end": 8.0, "depth": 1},  # nested: inside the outer one
                  {"start": 30.0, "end": 31.0, "depth": 0}]  # after the window
        phases = start_up.window_phases(spans, traces, 0.0, 15.0)
        self.assertAlmostEqual(phases["tracing"], 8.0)
        self.assertAlmostEqual(phases["xla_compilation"], 2.0)  # clipped at the window
        self.assertAlmostEqual(phases["graph_optimization"], 3.0)  # 4 s less 1 s of XLA


class StartUpTest(absltest.TestCase):

    # K-FAC: factors and decompositions at step 1, stale steps, factors at step 4.
    FIRST = [step(1, "factors_and_decompositions", 20.0), step(2, "stale", 3.0),
             step(3, "stale", 1.5), step(4, "factors", 2.5), step(5, "stale", 1.0)]
    STEADY = {"factors_and_decompositions": 4.0, "stale": 1.0, "factors": 2.0}

    def test_the_first_step_whole_and_each_later_first_of_a_kind_by_its_excess(self):
        up = start_up.start_up({"wall": 0.5}, self.FIRST, self.STEADY)
        self.assertEqual([p["label"] for p in up["parts"]],
                         ["setup", "first factors_and_decompositions (step 1)",
                          "first stale (step 2)", "first factors (step 4)"])
        self.assertEqual([p["counted"] for p in up["parts"]], [0.5, 20.0, 2.0, 0.5])
        self.assertEqual(up["total_s"], 23.0)
        self.assertEqual(up["first_run_s"], 4.0)  # step 1's kind, steady
        # Every step's excess, step 3's 0.5 s of a stale step still warming up among them.
        self.assertEqual(up["excess_over_steady_s"], 0.5 + 20.0 + 2.0 + 0.5 + 0.5 + 0.0)

    def test_a_first_step_of_a_kind_without_a_steady_time_is_not_counted(self):
        up = start_up.start_up({"wall": 0.0}, self.FIRST, {"stale": 1.0})
        self.assertIsNone(up["parts"][3]["counted"])
        self.assertEqual(up["total_s"], 22.0)
        self.assertIsNone(up["first_run_s"])

    def test_the_inner_optimizer_has_one_kind_its_first_step(self):
        first = [step(1, "step", 0.7), step(2, "step", 0.05), step(3, "step", 0.04)]
        steady = start_up.steady_times([step(4, "step", 0.04), step(5, "step", 0.05),
                                        step(6, "step", 0.06)])
        self.assertEqual(steady, {"step": 0.05})
        up = start_up.start_up({"wall": 0.1}, first, steady)
        self.assertAlmostEqual(up["total_s"], 0.8)
        self.assertEqual(len(up["parts"]), 2)

    def test_steady_times_are_medians_per_kind_of_the_figure_asked(self):
        steps = [{"kind": "stale", "wall": 3.0, "cpu": 1.0},
                 {"kind": "stale", "wall": 1.0, "cpu": 2.0},
                 {"kind": "stale", "wall": 2.0, "cpu": 3.0},
                 {"kind": "factors", "wall": 5.0, "cpu": 4.0}]
        self.assertEqual(start_up.steady_times(steps), {"stale": 2.0, "factors": 5.0})
        self.assertEqual(start_up.steady_times(steps, "cpu"), {"stale": 2.0, "factors": 4.0})

    def test_the_amortized_step_weighs_the_kinds_by_the_schedule(self):
        # Per 100 steps: 90 stale, 9 factor-only, 1 factor and decomposition step.
        self.assertAlmostEqual(start_up.amortized_step(self.STEADY, 10, 100),
                               (90 * 1.0 + 9 * 2.0 + 4.0) / 100)

    def test_a_part_over_the_repeats_keeps_medians_of_its_phases_and_traces(self):
        def part(counted, tracing, cpu, nodes):
            return {"counted": counted, "measured": counted, "phases": {"tracing": tracing},
                    "traces": [{"name": "multi_step_on_iterator", "depth": 0,
                                "wall": tracing, "cpu": cpu, "graph_nodes": nodes}]}

        summary = start_up.part_summary([part(3.0, 2.0, 1.0, 10), part(1.0, 1.0, 0.5, 10),
                                         part(2.0, 4.0, 2.0, 10)])
        self.assertEqual(summary["counted"], {"min": 1.0, "median": 2.0, "max": 3.0})
        self.assertEqual(summary["tracing"]["median"], 2.0)
        (trace,) = summary["traces"]
        self.assertEqual((trace["name"], trace["cpu"]["median"], trace["graph_nodes"]["max"]),
                         ("multi_step_on_iterator", 1.0, 10))

    def test_median_range_skips_missing_values(self):
        self.assertEqual(start_up.median_range([3.0, None, 1.0, 2.0]),
                         {"min": 1.0, "median": 2.0, "max": 3.0})
        self.assertIsNone(start_up.median_range([None]))


if __name__ == "__main__":
    absltest.main()
