"""bench/distributed_benchmark.py's rows from its ranks' records, without running a job:
rounds of one configuration fold into one row (its median round, every round's step
times beside it), configurations keep their order, bytes-only runs stay rows of their own,
and each step counts at its slowest rank."""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# bench/ as its scripts see it (they import their neighbours by name).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

from absl.testing import absltest, flagsaver  # noqa: E402

import distributed_benchmark as bench  # noqa: E402

WARMUP, TIMED = 2, 4


def record(model, placement, option, step_times, rank=0, timed=True):
    """One rank's record of one window: its steps took `step_times` seconds."""
    warmup = [{"factors": 10 * (s + 1), "gradients": 4 * (s + 1), "decompositions": 0}
              for s in range(WARMUP)]
    result = {"model": model, "placement": placement, "factor_wire": "float32",
              "eigen_wire": "float32", "option": option, "rank": rank,
              "local_batch": 64, "threads": 1, "kfac_state_bytes": 100,
              "steps": WARMUP + (TIMED if timed else 0), "warmup_bytes": warmup}
    if timed:
        result["timed"] = {"steps": TIMED, "step_seconds": sum(step_times) / TIMED,
                           "phase_seconds": {"factors": rank + sum(step_times)},
                           "step_seconds_each": list(step_times),
                           "decomposition_seconds_each": None,
                           "bytes_per_step": {}, "calls_per_step": {}}
    return result


class RoundsTest(absltest.TestCase):

    @flagsaver.flagsaver(warmup_steps=WARMUP, timed_steps=TIMED, decomposition_update_freq=4)
    def test_rounds_fold_into_their_median_round(self):
        # Rank 1 is slower in round 0's third step: that step counts at rank 1's time.
        rounds = {"replicated": ([1, 1, 1, 1], [3, 3, 3, 3], [2, 2, 2, 2]),
                  "owner": ([5, 5, 5, 5], [4, 4, 4, 4], [6, 6, 6, 6])}
        per_rank = [[], []]
        for r in range(3):
            for placement in ("replicated", "owner"):
                for rank in (0, 1):
                    times = list(rounds[placement][r])
                    if rank == 1 and r == 0 and placement == "replicated":
                        times[2] = 9
                    per_rank[rank].append(record("cnn", placement, None, times, rank))
        for rank in (0, 1):  # a bytes-only run after the timed rounds
            per_rank[rank].append(record("cnn", "replicated", None, [], rank, timed=False))
        single = {"step_seconds": 2.0, "median_step_seconds": 2.0,
                  "decomposition_seconds_per_inverse_step": None}
        rows = bench._rows("cnn", "horovod", per_rank, single)
        self.assertEqual([(r["placement"], "step_seconds" in r) for r in rows],
                         [("replicated", True), ("owner", True), ("replicated", False)])
        replicated, owner, bytes_only = rows
        # Round 0 at its slowest rank: (1 + 1 + 9 + 1) / 4 = 3.0 s.
        self.assertEqual(replicated["step_seconds_rounds"], [3.0, 3.0, 2.0])
        self.assertEqual(replicated["median_step_seconds_rounds"], [1.0, 3.0, 2.0])
        self.assertEqual(owner["step_seconds_rounds"], [5.0, 4.0, 6.0])
        # The median round by mean step: a 3.0 s round for replicated, round 0 for owner.
        self.assertEqual(replicated["step_seconds"], 3.0)
        self.assertEqual(owner["step_seconds"], 5.0)
        self.assertEqual(owner["median_step_seconds"], 5.0)
        self.assertEqual(owner["phase_seconds_per_rank"], [{"factors": 20}, {"factors": 21}])
        self.assertEqual(owner["speedup_vs_single"], 2.0 / 5.0)
        self.assertEqual(bytes_only["factor_bytes_per_factor_step"], 10)
        self.assertNotIn("step_seconds_rounds", bytes_only)

    @flagsaver.flagsaver(warmup_steps=WARMUP, timed_steps=TIMED, decomposition_update_freq=4)
    def test_single_process_rounds(self):
        single = [record("mlp", "replicated", None, [t] * TIMED) for t in (2, 1, 3)]
        single[0]["parameters"], single[0]["factor_dims"] = 10, [3, 2]
        report = bench.summarize(single, {}, 0.0)
        row = report["models"]["mlp"]["single"]
        self.assertEqual(row["step_seconds_rounds"], [2.0, 1.0, 3.0])
        self.assertEqual(row["step_seconds"], 2.0)
        self.assertEqual(row["phase_seconds"], {"factors": 8})


if __name__ == "__main__":
    absltest.main()
