"""Adaptive stale statistics (docs/design.md §12), in one process.

- The rule against its numpy replay (tests/adaptive_staleness_worker.py) on the factor
  sequence a run records step by step: a block's factors change exactly at the steps the
  replay finds it due and nowhere else, its interval and next due step after every step
  are the replay's (doubled below the threshold, halved above it, between the base
  interval and the cap), and decompositions change exactly where the replay recomputes
  them (at a decomposition step, of the blocks refreshed since their last one); the
  counters count the steps that refreshed or decomposed a block. The run
  takes both decisions (some intervals grow, some shrink), and its relative changes are
  nowhere near the threshold (a tie would make the comparison meaningless).
- Stale steps: a step runs the factor train function exactly when some block's factors
  or the decompositions are due, and the run ends bit-identical to the same run where
  every step is the factor step (`steps_per_execution=2`).
- Checkpoints: a run written to a `tf.train.Checkpoint` mid-way, restored into a fresh
  model and optimizer and continued, ends with the intervals, due steps, weights and
  every optimizer variable of the uninterrupted run, under "replicated" and under
  "owner" with a damping schedule (an owner rebuilds each block's decompositions with
  the damping it was decomposed with).
- Bad settings raise errors naming the argument and what is allowed; the trainer's
  flags set them.
"""

import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl.testing import absltest, parameterized  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, TESTS_DIR)

import adaptive_staleness_worker as worker  # noqa: E402
from kfac_reference import sgd_kfac  # noqa: E402
import tfkfac  # noqa: E402
import trainer_testing as tt  # noqa: E402
from stale_steps_worker import state  # noqa: E402

# A relative change this close to the threshold could be decided either way by rounding.
TIE_MARGIN = 1e-6


def one_process_batches(steps=worker.STEPS):
    """Every global batch of 2B examples as one batch."""
    x, y = worker.global_batches(steps)
    return x.reshape((-1, 8, 8, 1)), y.reshape(-1)


class ReplayTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        x, y = one_process_batches()
        cls.model, cls.optimizer, cls.records, cls.ran = worker.train(x, y, 2 * worker.BATCH)
        cls.replayed = worker.replay(cls.records)

    def test_factors_change_exactly_at_the_replayed_refreshes(self):
        previous = None
        for step, (record, replayed) in enumerate(zip(self.records, self.replayed)):
            for b, factors in enumerate(record["factors"]):
                with self.subTest(step=step, block=b):
                    if previous is None:
                        self.assertTrue(replayed["due"][b])  # every block at step 0
                        continue
                    same = all(np.array_equal(a, c) for a, c in zip(factors, previous[b]))
                    self.assertEqual(same, not replayed["due"][b])
            previous = record["factors"]

    def test_intervals_and_due_steps_follow_the_replayed_rule(self):
        for step, (record, replayed) in enumerate(zip(self.records, self.replayed)):
            self.assertEqual(record["intervals"], replayed["intervals"], f"step {step}")
            self.assertEqual(record["next_steps"], replayed["next_steps"], f"step {step}")

    def test_the_run_takes_both_decisions_away_from_the_threshold(self):
        grown = shrunk = 0
        for replayed in self.replayed[1:]:
            for change in replayed["changes"].values():
                self.assertGreater(abs(change - worker.THRESHOLD),
                                   TIE_MARGIN * worker.THRESHOLD)
                grown += change < worker.THRESHOLD
                shrunk += change >= worker.THRESHOLD
        self.assertGreater(grown, 0)
        self.assertGreater(shrunk, 0)
        # Some step after the first had no block due: intervals did grow past the base.
        self.assertFalse(all(any(r["due"]) for r in self.replayed))
        self.assertIn(worker.CAP, [i for r in self.replayed for i in r["intervals"]])

    def test_decompositions_change_exactly_where_the_replay_recomputes_them(self):
        previous = self.records[0]["decompositions"]
        checked = 0
        for step in range(1, len(self.records)):
            record, replayed = self.records[step], self.replayed[step]
            for b, decomposition in enumerate(record["decompositions"]):
                if not decomposition:  # a diagonal block keeps none
                    continue
                with self.subTest(step=step, block=b):
                    same = all(np.array_equal(a, c) for a, c in zip(decomposition,
                                                                    previous[b]))
                    self.assertEqual(same, b not in replayed["decomposed"])
                    checked += b in replayed["decomposed"]
            previous = record["decompositions"]
        self.assertGreater(checked, 0)
        # A decomposition step that recomputed only some blocks' was seen.
        self.assertTrue(any(r["decomposition_step"] and 0 < len(r["decomposed"]) <
                            len(self.records[0]["factors"]) for r in self.replayed[1:]))

    def test_counters_count_the_steps_that_did_the_work(self):
        # `factor_updates`: the steps that refreshed a block; `decomposition_updates`:
        # those that decomposed one, not every due decomposition step. Decompositions due
        # every step while the factor intervals grow (every change below α) leave steps
        # with none to decompose.
        x, y = one_process_batches(steps=16)
        _, optimizer, records, _ = worker.train(x, y, 2 * worker.BATCH, threshold=1e3,
                                                decomposition_update_freq=1)
        replayed = worker.replay(records, threshold=1e3, decomposition_freq=1)
        self.assertTrue(any(not r["decomposed"] for r in replayed))
        for run, steps in ((self.optimizer, self.replayed), (optimizer, replayed)):
            counters = run.counters()
            self.assertEqual(counters["factor_updates"], sum(any(r["due"]) for r in steps))
            self.assertEqual(counters["decomposition_updates"],
                             sum(bool(r["decomposed"]) for r in steps))

    def test_a_step_is_a_factor_step_exactly_when_factors_or_decompositions_are_due(self):
        expected = ["factor" if any(r["due"]) or r["decomposition_step"] else "stale"
                    for r in self.replayed]
        self.assertEqual(self.ran, expected)
        self.assertIn("stale", self.ran)

    def test_equal_bit_for_bit_to_the_factor_step_alone(self):
        x, y = one_process_batches()
        model, optimizer, _, ran = worker.train(x, y, 2 * worker.BATCH, steps_per_execution=2)
        self.assertEqual(ran, [])  # every step the factor step
        chosen, factor_only = state(self.model, self.optimizer), state(model, optimizer)
        self.assertEqual(sorted(chosen), sorted(factor_only))
        for key, value in factor_only.items():
            np.testing.assert_array_equal(chosen[key], value, err_msg=key)


class CheckpointTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("replicated", dict(placement="replicated")),
        ("owner_inverse_damping_schedule",  # the inverse method's decompositions use λ
         dict(placement="owner", method="inverse",
              damping=tfkfac.WarmupDamping(1.0, 1e-2, 20))))
    def test_restored_mid_run_continues_as_the_uninterrupted_run(self, settings):
        steps, resume_at = 24, 13
        x, y = one_process_batches(steps)
        batch = 2 * worker.BATCH
        model, optimizer, records, _ = worker.train(x, y, batch, **settings)
        uninterrupted = state(model, optimizer)
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "checkpoint")
            rows = resume_at * batch
            model, optimizer, _, _ = worker.train(x[:rows], y[:rows], batch, **settings)
            tf.train.Checkpoint(model=model, optimizer=optimizer).write(path)
            model = worker.dense_net()
            optimizer = sgd_kfac(stale_threshold=worker.THRESHOLD,
                                **dict(worker.SETTINGS, **settings)).attach(model)
            model.compile(optimizer=optimizer, loss=worker.LOSS)
            optimizer.build(model.trainable_variables)
            tf.train.Checkpoint(model=model, optimizer=optimizer).read(
                path).assert_existing_objects_matched()
            recorder = worker.Recorder(optimizer)
            model.fit(x[rows:], y[rows:], batch_size=batch, epochs=1, shuffle=False,
                      verbose=0, callbacks=[recorder])
        for step, record in enumerate(recorder.steps, start=resume_at):
            self.assertEqual(record["intervals"], records[step]["intervals"], f"step {step}")
            self.assertEqual(record["next_steps"], records[step]["next_steps"],
                             f"step {step}")
        resumed = state(model, optimizer)
        self.assertEqual(sorted(resumed), sorted(uninterrupted))
        for key, value in uninterrupted.items():
            np.testing.assert_array_equal(resumed[key], value, err_msg=key)


class SettingsTest(parameterized.TestCase):

    @parameterized.parameters(0, -0.1, float("nan"), float("inf"), "0.1", True)
    def test_bad_threshold(self, value):
        with self.assertRaisesRegex(ValueError, "^`stale_threshold` must be a finite number > 0; "
                                    r"received .* \(None turns it off\)$"):
            tfkfac.KFACConfig(stale_threshold=value)

    @parameterized.parameters(0, -3, 2.5, float("inf"), "8")
    def test_bad_cap(self, value):
        with self.assertRaisesRegex(ValueError, r"^`max_factor_interval` must be an integer in "
                                    r"\[1, 2\*\*63 - 1\]; received .* \(None means no cap\)$"):
            tfkfac.KFACConfig(stale_threshold=0.1, max_factor_interval=value)

    def test_a_cap_without_a_threshold_would_be_ignored(self):
        with self.assertRaisesRegex(ValueError, "`max_factor_interval` caps .* `stale_threshold` "
                                    "turns on; received max_factor_interval=40 with "
                                    "stale_threshold=None"):
            tfkfac.KFAC(max_factor_interval=40)

    def test_a_cap_below_the_factor_interval(self):
        with self.assertRaisesRegex(ValueError, "`max_factor_interval` must be an integer >= "
                                    "factor_update_freq .*received max_factor_interval=5 with "
                                    "factor_update_freq=10"):
            tfkfac.KFAC(stale_threshold=0.1, max_factor_interval=5, factor_update_freq=10)

    def test_off_by_default_and_no_state_of_its_own(self):
        model = worker.dense_net()
        optimizer = tfkfac.KFAC().attach(model)
        optimizer.build(model.trainable_variables)
        self.assertIsNone(optimizer.stale_threshold)
        names = [v.path for v in optimizer.variables]
        self.assertFalse([n for n in names if "adaptive" in n])
        self.assertNotIn("factor_interval", optimizer.summary()["managed"][0])

    def test_trainer_flags_set_them(self):
        config, _ = tt.config_from_argv("--stale_threshold=0.05", "--max_factor_interval=40")
        kfac_config = config.kfac_config()
        self.assertEqual(kfac_config.stale_threshold, 0.05)
        self.assertEqual(kfac_config.max_factor_interval, 40)
        self.assertIsInstance(kfac_config.max_factor_interval, int)
        config, _ = tt.config_from_argv("--max_factor_interval=40")
        with self.assertRaisesRegex(ValueError, "`max_factor_interval` caps"):
            config.kfac_config()

    def test_get_config_round_trip(self):
        optimizer = tfkfac.KFAC(stale_threshold=0.05, max_factor_interval=40)
        restored = tfkfac.KFAC.from_config(optimizer.get_config())
        self.assertEqual(restored.stale_threshold, 0.05)
        self.assertEqual(restored.max_factor_interval, 40)


if __name__ == "__main__":
    absltest.main()
