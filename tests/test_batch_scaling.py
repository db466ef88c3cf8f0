"""bench/batch_scaling.py's protocol without training: where each grid sits and how it
moves at its edge, the critical batch size, the work dir read back and skipped on a
restart, and the JSON assembled from trial summaries written here the way the trainer
writes them."""

import json
import math
import os
import sys
import tempfile
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/ as its scripts see it (they import their neighbours by name).
sys.path.insert(0, os.path.join(REPO_ROOT, "bench"))

import numpy  # noqa: E402
from absl.testing import absltest, flagsaver  # noqa: E402

import batch_scaling  # noqa: E402
import trials  # noqa: E402
from trainers import runner  # noqa: E402
from trainers.planning import measured_steps  # noqa: E402


def learning_rates(indices):
    return [trials.series_value(index) for index in indices]


def trial(learning_rate, steps_to_primary=None, best_accuracy=0.9, seed=0):
    """A finished trial's record reaching the primary target (only) at `steps_to_primary`."""
    to_target = {str(t): None for t in batch_scaling.TARGETS}
    if steps_to_primary is not None:
        to_target[str(batch_scaling.PRIMARY_TARGET)] = {"steps": steps_to_primary,
                                                        "time_s": steps_to_primary / 10}
    return {"learning_rate": learning_rate, "seed": seed, "diverged": False,
            "steps": 1000, "best_accuracy": best_accuracy, "mean_step_time_s": 0.1,
            "to_target": to_target}


def measured(steps, budget_steps=10_000):
    """A complete cell whose median steps to every target are `steps` (None: not
    reached within `budget_steps`)."""
    result = {"median_steps": steps, "median_time_s": None if steps is None else steps / 10,
              "reached": 0 if steps is None else 2}
    if steps is None:
        result["steps_above"] = budget_steps
    return {"complete": True, "to_target": {str(t): dict(result)
                                            for t in batch_scaling.TARGETS}}


class GridTest(absltest.TestCase):

    def test_series_index_rounds_on_a_log_scale(self):
        self.assertEqual(trials.series_value(trials.series_index(0.4)), 0.5)  # 0.4/0.2 > 0.5/0.4
        self.assertEqual(trials.series_value(trials.series_index(0.8)), 1.0)
        self.assertEqual(trials.series_value(trials.series_index(0.1)), 0.1)
        self.assertEqual(trials.series_value(-1), 0.5)
        with self.assertRaisesRegex(ValueError, "finite number > 0"):
            trials.series_index(0.0)

    def test_six_points_around_the_pick_scaled_by_the_root_of_the_batch(self):
        # SGD's pick 0.1: x1 at 128, x2 at 512 (0.2), x4 at 2048 (0.4 -> 0.5), x8 at 8192
        # (0.8 -> 1); two points of the series below, three above.
        expected = {128: [0.02, 0.05, 0.1, 0.2, 0.5, 1.0],
                    512: [0.05, 0.1, 0.2, 0.5, 1.0, 2.0],
                    2048: [0.1, 0.2, 0.5, 1.0, 2.0, 5.0],
                    8192: [0.2, 0.5, 1.0, 2.0, 5.0, 10.0]}
        for batch, rates in expected.items():
            self.assertEqual(learning_rates(batch_scaling.grid("sgd_nesterov", batch)), rates)
        self.assertEqual(learning_rates(batch_scaling.grid("muon", 128)),
                         [0.001, 0.002, 0.005, 0.01, 0.02, 0.05])

    def test_the_kl_clip_scales_with_the_square_of_the_learning_rate(self):
        self.assertEqual(batch_scaling.setting("kfac_inverse", 0.05)["kl_clip"], 1e-3)
        self.assertEqual(batch_scaling.setting("kfac_inverse", 0.5)["kl_clip"], 0.1)
        self.assertEqual(batch_scaling.setting("kfac_inverse", 0.5)["damping"], 0.1)
        self.assertNotIn("kl_clip", batch_scaling.setting("adamw", 0.5))

    def test_a_best_point_at_an_edge_moves_the_grid_out(self):
        indices = [3, 4, 5]
        self.assertEqual(batch_scaling.outward(indices, 3), 2)
        self.assertEqual(batch_scaling.outward(indices, 5), 6)
        self.assertIsNone(batch_scaling.outward(indices, 4))

    def test_picks_are_the_recorded_batch_128_bests(self):
        with open(os.path.join(REPO_ROOT, "bench/results/variants/time_to_accuracy.json")) as f:
            cnn = json.load(f)["models"]["cnn"]
        # A measured entry's setting, or the pick of one tuned and awaiting its timed runs.
        picks = {**{entry: tuning["best"] for entry, tuning in cnn["tuned_only"].items()},
                 **{entry: result["setting"] for entry, result in cnn["optimizers"].items()}}
        for entry, recorded in (("sgd_nesterov", "sgd"), ("adamw", "adamw"),
                                ("kfac_inverse", "kfac_inverse"),
                                ("kfac_eigen_adam", "kfac_eigen_adam")):
            self.assertEqual(batch_scaling.ENTRIES[entry]["pick"], picks[recorded])
        with open(os.path.join(REPO_ROOT,
                               "bench/results/cnn_kfac_schedule_free/time_to_accuracy.json")) as f:
            race = json.load(f)["models"]["cnn"]["optimizers"]
        for entry in ("schedule_free_adamw", "kfac_schedule_free_adamw"):
            self.assertEqual(batch_scaling.ENTRIES[entry]["pick"], race[entry]["setting"])
        summaries = os.path.join(REPO_ROOT, "bench/results/trial_summaries/cnn")
        for entry in ("muon", "lamb"):
            scores = {}
            for name in os.listdir(summaries):
                if name.startswith(f"cnn-{entry}-tune-"):
                    with open(os.path.join(summaries, name, runner.SUMMARY_FILE)) as f:
                        summary = json.load(f)
                    scores[summary["config"]["learning_rate"]] = summary["final_eval_accuracy"]
            self.assertLen(scores, trials.TUNING_TRIALS, entry)
            self.assertEqual(batch_scaling.ENTRIES[entry]["pick"],
                             {"learning_rate": max(scores, key=scores.get)})


class CellTest(absltest.TestCase):
    """The tuning of one (entry, batch) from trials handed to it."""

    def test_edge_moves_until_the_best_is_inside_then_a_second_seed(self):
        asked = []
        rates = learning_rates(batch_scaling.grid("adamw", 128))
        self.assertEqual(rates, [0.002, 0.005, 0.01, 0.02, 0.05, 0.1])

        def get(learning_rate, seed, give_up):
            asked.append((learning_rate, seed, give_up))
            # Fewer steps the larger the rate up to 0.2, which beats 0.1 and 0.5.
            steps = {0.1: 350, 0.2: 300, 0.5: 500}.get(learning_rate,
                                                        int(20 / learning_rate))
            return trial(learning_rate, steps, seed=seed)

        cell = batch_scaling.cell("adamw", 128, get)
        self.assertTrue(cell["complete"])
        self.assertEqual(cell["edge_moves"], 2)  # 0.1 was best, then 0.2; then inside
        # From the centre (the pick 0.01) outward, lower first; the first, with no trial
        # at 0.90 yet, gives up below 0.5 at a tenth of the budget (4680 steps), each
        # after it past the fewest steps to 0.90 so far (20 / rate: 2000 at 0.01, 1000 at
        # 0.02, 400 at 0.05, ...); the second seed runs in full.
        self.assertEqual(batch_scaling.budget_steps(128), 4680)
        early = (468, batch_scaling.EARLY_ACCURACY)
        self.assertEqual(asked, [(0.01, 0, early)] + [
            (rate, 0, (steps, 0.9)) for rate, steps in (
                (0.005, 2000), (0.02, 2000), (0.002, 1000), (0.05, 1000), (0.1, 400),
                (0.2, 350), (0.5, 300))] + [(0.2, 1, None)])
        self.assertEqual(cell["chosen"], {"learning_rate": 0.2})
        self.assertFalse(cell["best_at_edge"])
        self.assertEqual(cell["to_target"]["0.9"]["median_steps"], 300)

    def test_the_moves_are_bounded_and_an_edge_best_is_flagged(self):
        cell = batch_scaling.cell("adamw", 128, lambda learning_rate, seed, _: trial(
            learning_rate, int(20 / learning_rate), seed=seed))
        self.assertEqual(cell["edge_moves"], batch_scaling.MAX_EDGE_MOVES)
        self.assertEqual(cell["chosen"], {"learning_rate": 0.5})
        self.assertTrue(cell["best_at_edge"])
        self.assertIsNone(cell["to_target"]["0.91"]["median_steps"])
        self.assertEqual(cell["to_target"]["0.91"]["steps_above"],
                         10 * (batch_scaling.TRAIN_EXAMPLES // 128))

    def test_unreached_rank_by_accuracy_and_diverged_last(self):
        def get(learning_rate, seed, give_up):
            # No trial reaches the target: a collapsed one gives up early, a second seed
            # runs in full.
            self.assertEqual(give_up, None if seed else (468, batch_scaling.EARLY_ACCURACY))
            if learning_rate >= 0.5:
                return batch_scaling.diverged_record(learning_rate, seed, "nan")
            return trial(learning_rate, None, best_accuracy=0.8 + learning_rate / 10,
                         seed=seed)

        cell = batch_scaling.cell("sgd_nesterov", 128, get)
        self.assertEqual(cell["chosen"], {"learning_rate": 0.2})
        self.assertFalse(cell["best_at_edge"])
        self.assertEqual(cell["to_target"]["0.9"]["reached"], 0)

    def test_a_missing_trial_leaves_the_cell_incomplete_with_what_it_has(self):
        def get(learning_rate, seed, give_up):
            return trial(learning_rate, 100) if learning_rate <= 0.1 else None

        cell = batch_scaling.cell("sgd_nesterov", 128, get)
        self.assertFalse(cell["complete"])
        # The centre (0.1), then 0.05; 0.2 is not there yet.
        self.assertEqual([t["learning_rate"] for t in cell["trials"]], [0.05, 0.1])

    def test_the_median_of_two_seeds_is_infinite_when_one_misses(self):
        both = batch_scaling.over_seeds([trial(0.1, 100), trial(0.1, 300, seed=1)], 0.9, 999)
        self.assertEqual(both["median_steps"], 200)
        one = batch_scaling.over_seeds([trial(0.1, 100), trial(0.1, None, seed=1)], 0.9, 999)
        self.assertIsNone(one["median_steps"])
        self.assertEqual(one["steps_above"], 999)


class CriticalBatchTest(absltest.TestCase):

    def test_the_largest_batch_whose_next_step_still_scales(self):
        # 128 -> 512 cuts 4x, 512 -> 2048 2.5x (>= 2.25), 2048 -> 8192 2x (< 2.25).
        cells = {128: measured(4000), 512: measured(1000), 2048: measured(400),
                 8192: measured(200)}
        result = batch_scaling.critical_batch(cells, 0.9)
        self.assertEqual(result["critical_batch"], 512)
        self.assertFalse(result["at_least"])
        self.assertEqual([step["scales"] for step in result["steps"]], [True, True, False])
        self.assertAlmostEqual(result["steps"][0]["needed_cut"], 2.25)

    def test_a_last_step_that_scales_gives_a_lower_bound(self):
        cells = {128: measured(4000), 512: measured(1000)}
        result = batch_scaling.critical_batch(cells, 0.9)
        self.assertEqual((result["critical_batch"], result["at_least"]), (128, True))

    def test_none_below_the_smallest_batch(self):
        cells = {128: measured(400), 512: measured(300)}
        result = batch_scaling.critical_batch(cells, 0.9)
        self.assertIsNone(result["critical_batch"])
        self.assertTrue(result["below_smallest"])

    def test_mccandlishs_curve_fitted_in_one_over_the_batch(self):
        # S(B) = 300 (1 + 600 / B) exactly at three batches; 8192 not reached.
        cells = {batch: measured(300 * (1 + 600 / batch)) for batch in (128, 512, 2048)}
        cells[8192] = measured(None)
        fitted = batch_scaling.critical_batch(cells, 0.9)["fitted"]
        self.assertAlmostEqual(fitted["min_steps"], 300)
        self.assertAlmostEqual(fitted["critical_batch"], 600)
        self.assertEqual(fitted["batches"], [128, 512, 2048])
        # A least-squares fit: numpy's line through (1/B, S) with noise added.
        steps = {128: 1800.0, 512: 600.0, 2048: 420.0, 8192: 300.0}
        slope, intercept = numpy.polyfit([1 / b for b in steps], list(steps.values()), 1)
        fitted = batch_scaling.critical_batch(
            {batch: measured(s) for batch, s in steps.items()}, 0.9)["fitted"]
        self.assertAlmostEqual(fitted["min_steps"], intercept)
        self.assertAlmostEqual(fitted["critical_batch"], slope / intercept)

    def test_no_fit_from_one_batch_or_steps_that_rise(self):
        self.assertIsNone(batch_scaling.critical_batch({128: measured(400)}, 0.9)["fitted"])
        rising = {128: measured(400), 512: measured(500)}
        self.assertIsNone(batch_scaling.critical_batch(rising, 0.9)["fitted"])

    def test_an_unreached_target_judged_on_its_bound(self):
        # 1000 / more than 2000 steps: below 0.5x, fails; 10000 / more than 2000 is
        # below 5x, which could still be >= 2.25x: undetermined.
        fails = batch_scaling.critical_batch(
            {128: measured(1000), 512: measured(None, budget_steps=2000)}, 0.9)
        self.assertIs(fails["steps"][0]["scales"], False)
        self.assertAlmostEqual(fails["steps"][0]["cut_below"], 0.5)
        open_ = batch_scaling.critical_batch(
            {128: measured(10000), 512: measured(None, budget_steps=2000)}, 0.9)
        self.assertIsNone(open_["steps"][0]["scales"])
        self.assertEqual(open_["undetermined"], [128])
        self.assertFalse(open_["below_smallest"])


def write_summary(work_dir, entry, batch, learning_rate, seed, steps_to_primary):
    """A finished trial's summary.json as the trainer writes it (the fields the benchmark
    reads), reaching 0.89 at half the steps to the primary target and stopping there
    without reaching 0.91."""
    settings = batch_scaling.trial_settings(entry, batch, learning_rate, seed)
    model_dir = os.path.join(work_dir, batch_scaling.trial_name(entry, batch, learning_rate,
                                                                seed))
    os.makedirs(model_dir)
    half = steps_to_primary // 2
    evaluations = [{"train_time_s": s / 10, "steps": s, "val_accuracy": accuracy}
                   for s, accuracy in ((half, 0.895), (steps_to_primary, 0.905),
                                       (2 * steps_to_primary, 0.9))]
    summary = {"config": settings, "to_target": None, "steps": 2 * steps_to_primary,
               "mean_step_time_s": {"all": 0.1}, "evaluations": evaluations}
    with open(os.path.join(model_dir, runner.SUMMARY_FILE), "w") as f:
        json.dump(summary, f)


def write_noise_summary(work_dir, entry, learning_rate, noise_scales):
    """A finished noise run's summary.json: per epoch the noise scales logged."""
    model_dir = os.path.join(work_dir, batch_scaling.noise_name(entry, learning_rate))
    os.makedirs(model_dir)
    history = [dict({"epoch": epoch + 1, "steps": 468 * (epoch + 1)}, **scales)
               for epoch, scales in enumerate(noise_scales)]
    summary = {"config": batch_scaling.noise_settings(entry, learning_rate),
               "to_target": None, "history": history}
    with open(os.path.join(model_dir, runner.SUMMARY_FILE), "w") as f:
        json.dump(summary, f)


class InWorkDir(absltest.TestCase):
    """Each test with a work dir and an output dir of its own."""

    def setUp(self):
        super().setUp()
        self.work_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        self.output_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        saver = flagsaver.flagsaver(work_dir=self.work_dir, output_dir=self.output_dir)
        saver.__enter__()
        self.addCleanup(saver.__exit__, None, None, None)

    def fill(self, entry, batch, best, best_steps):
        """Every trial of (entry, batch) finished, `best` the fastest (the others take
        twice its steps), its second seed 100 steps more."""
        for learning_rate in learning_rates(batch_scaling.grid(entry, batch)):
            write_summary(self.work_dir, entry, batch, learning_rate, 0,
                          best_steps * (1 if learning_rate == best else 2))
        write_summary(self.work_dir, entry, batch, best, 1, best_steps + 100)


class WorkDirTest(InWorkDir):
    """Finished and diverged trials are read back (a restart skips them), and `--collect`
    writes the JSON from them."""

    def test_finished_and_diverged_trials_are_skipped_on_a_restart(self):
        write_summary(self.work_dir, "sgd_nesterov", 128, 0.1, 0, 400)
        diverged = os.path.join(self.work_dir, batch_scaling.trial_name(
            "sgd_nesterov", 128, 1.0, 0))
        os.makedirs(diverged)
        with open(os.path.join(diverged, batch_scaling.DIVERGED_FILE), "w") as f:
            json.dump({"message": "training diverged: ..."}, f)
        # run_trial would train (minutes) if it did not read these back.
        done = batch_scaling.run_trial("sgd_nesterov", 128, 0.1, 0)
        self.assertEqual(done["to_target"]["0.9"], {"steps": 400, "time_s": 40.0})
        self.assertEqual(done["to_target"]["0.89"], {"steps": 200, "time_s": 20.0})
        self.assertIsNone(done["to_target"]["0.91"])
        self.assertEqual(done["best_accuracy"], 0.905)
        self.assertTrue(batch_scaling.run_trial("sgd_nesterov", 128, 1.0, 0)["diverged"])
        self.assertIsNone(batch_scaling.read_trial("sgd_nesterov", 128, 0.2, 0))

    def test_a_trial_given_steps_gives_up_and_reads_back_finished(self):
        asked = {}

        def run(work_dir, name, **settings):
            asked.update(settings)
            return {"steps": 450, "gave_up": True, "mean_step_time_s": {"all": 0.1},
                    "evaluations": [{"train_time_s": 40.0, "steps": 400, "val_accuracy": 0.8},
                                    {"train_time_s": 45.0, "steps": 450, "val_accuracy": 0.85}]}

        with mock.patch.object(trials, "run", run):
            record = batch_scaling.run_trial("adamw", 128, 0.01, 0, give_up=(400, 0.9))
        self.assertEqual((asked["give_up_steps"], asked["give_up_accuracy"]), (400, 0.9))
        self.assertTrue(record["gave_up"])
        self.assertEqual(batch_scaling.rank(record), (1, -0.85))
        # A run that gave up is finished although it neither reached its target nor ran
        # its epochs; one that did neither and did not give up resumes.
        stopped = {"config": {"stop_at_target": True, "epochs": 2}, "to_target": None}
        self.assertTrue(trials.finished(dict(stopped, gave_up=True), 10))
        self.assertFalse(trials.finished(dict(stopped, gave_up=False), 10))

    def test_a_noise_run_is_read_back_at_the_batch_128_cells_chosen_point(self):
        self.fill("kfac_inverse", 128, best=0.05, best_steps=600)
        self.fill("sgd_nesterov", 128, best=0.1, best_steps=1000)
        scales = [{"noise_scale": 310.0, "preconditioned_noise_scale": 95.0},
                  {"noise_scale": 420.0, "preconditioned_noise_scale": 130.0}]
        write_noise_summary(self.work_dir, "kfac_inverse", 0.05, scales)
        settings = batch_scaling.noise_settings("kfac_inverse", 0.05)
        self.assertTrue(settings["noise_scale"])
        self.assertEqual(settings["noise_scale_interval"], batch_scaling.NOISE_INTERVAL)
        self.assertEqual(settings["batch_size"], 128)
        batch_scaling.collect()
        with open(os.path.join(self.output_dir, "batch_scaling.json")) as f:
            entries = json.load(f)["entries"]
        noise = entries["kfac_inverse"]["noise_scale"]
        self.assertEqual(noise["learning_rate"], 0.05)
        self.assertEqual([row["preconditioned_noise_scale"] for row in noise["epochs"]],
                         [95.0, 130.0])
        self.assertEqual(noise["epochs"][1]["steps"], 936)
        self.assertIsNone(entries["sgd_nesterov"]["noise_scale"])  # not run yet

    def test_a_trial_with_other_settings_is_an_error(self):
        write_summary(self.work_dir, "adamw", 128, 0.01, 0, 400)
        path = os.path.join(self.work_dir, batch_scaling.trial_name("adamw", 128, 0.01, 0),
                            runner.SUMMARY_FILE)
        with open(path) as f:
            summary = json.load(f)
        summary["config"]["weight_decay"] = 1.0
        with open(path, "w") as f:
            json.dump(summary, f)
        with self.assertRaisesRegex(ValueError, "holds a trial with other settings"):
            batch_scaling.read_trial("adamw", 128, 0.01, 0)

    def test_collect_writes_the_cells_the_critical_batch_and_the_ratios(self):
        self.fill("sgd_nesterov", 128, best=0.1, best_steps=1000)
        self.fill("sgd_nesterov", 512, best=0.2, best_steps=500)  # 2x: does not scale
        self.fill("kfac_inverse", 128, best=0.05, best_steps=600)
        self.fill("kfac_inverse", 512, best=0.1, best_steps=200)  # 3x: scales
        write_summary(self.work_dir, "adamw", 128, 0.01, 0, 700)  # a cell's first trial
        batch_scaling.collect()
        path = os.path.join(self.output_dir, "batch_scaling.json")
        with open(path) as f:
            document = json.load(f)
        self.assertTrue(os.path.exists(os.path.join(self.output_dir, "batch_scaling.png")))
        self.assertEqual(set(document["entries"]), {"sgd_nesterov", "kfac_inverse", "adamw"})
        sgd = document["entries"]["sgd_nesterov"]
        self.assertEqual(sgd["batches"]["128"]["chosen"], {"learning_rate": 0.1})
        self.assertEqual(sgd["batches"]["128"]["to_target"]["0.9"]["median_steps"], 1050)
        self.assertFalse(document["entries"]["adamw"]["batches"]["128"]["complete"])
        # (1000 + 1100) / 2 over (500 + 600) / 2: 1.91x < 2.25x; K-FAC 650 / 250 = 2.6x.
        self.assertIsNone(sgd["critical_batch"]["0.9"]["critical_batch"])
        kfac = document["entries"]["kfac_inverse"]
        self.assertEqual(kfac["critical_batch"]["0.9"]["critical_batch"], 128)
        self.assertEqual(kfac["batches"]["512"]["chosen"],
                         {"learning_rate": 0.1, "damping": 0.1, "kl_clip": 4e-3})
        ratio = kfac["over_best_first_order"]["512"]["0.9"]
        self.assertEqual(ratio["baseline"], "sgd_nesterov")
        self.assertAlmostEqual(ratio["steps"], 250 / 550)
        self.assertEqual(document["protocol"]["budgets"]["8192"]["steps"],
                         32 * (60000 // 8192))
        self.assertTrue(math.isclose(kfac["critical_batch"]["0.9"]["steps"][0]["cut"], 2.6))
        # What the planner reads of it (`--steps_from`).
        self.assertEqual(measured_steps.load(path, "cnn", None, ("sgd_nesterov", "kfac_inverse")),
                         (0.9, {"sgd_nesterov": {128: 1050, 512: 550},
                                "kfac_inverse": {128: 650, 512: 250}}))


    def test_the_tables_of_the_cells(self):
        self.fill("sgd_nesterov", 128, best=0.1, best_steps=1000)
        self.fill("sgd_nesterov", 512, best=0.2, best_steps=500)
        self.fill("kfac_inverse", 128, best=0.05, best_steps=600)
        self.fill("kfac_inverse", 512, best=0.1, best_steps=200)
        batch_scaling.collect()
        with open(os.path.join(self.output_dir, "batch_scaling.json")) as f:
            document = json.load(f)
        lines = batch_scaling.tables(document).splitlines()
        # Fewest steps first, the fewest to 0.90 in bold; 0.91 never reached (budget
        # 10 epochs of 468 steps); no step time before the batch is retimed.
        header = lines.index("| entry | learning rate | step ms | 0.89 | 0.90 | 0.91 |")
        self.assertEqual(lines[header + 2:header + 4], [
            "| K-FAC inverse, KL clip (momentum SGD) | 0.05 | – | 325 | **650** | > 4680 |",
            "| SGD, Nesterov | 0.1 | – | 525 | 1050 | > 4680 |"])
        self.assertIn("K-FAC inverse, KL clip (momentum SGD): 0.62x SGD, Nesterov's steps "
                      "to 0.90.", lines)
        # 1050 / 550 = 1.9x < 2.25x: below 128; K-FAC 650 / 250 = 2.6x: at least 128;
        # 0.91, reached at neither batch, undetermined. The fit through (1/128, 650) and
        # (1/512, 250): slope 400 / (3/512), S_min 650 - slope / 128, B_crit slope / S_min.
        self.assertIn("| K-FAC inverse, KL clip (momentum SGD) | ≥ 128 / ≥ 128 / ? "
                      "| 585 (117) | – |", lines)
        self.assertIn("| SGD, Nesterov | < 128 / < 128 / ? | 223 (383) | – |", lines)
        self.assertEqual((lines[0], lines[-1]), (batch_scaling.TABLES_BEGIN,
                                                 batch_scaling.TABLES_END))
        lines = batch_scaling.summary(document).splitlines()
        # The headline: steps to 0.90 per batch, the fewest of each batch in bold, the
        # critical batch and fit at 0.90 as in the full tables.
        self.assertIn("| entry | batch 128 | batch 512 | critical batch | fitted B_crit "
                      "(S_min) | B_simple |", lines)
        self.assertIn("| K-FAC inverse, KL clip (momentum SGD) | **650** | **250** | ≥ 128 "
                      "| 585 (117) | – |", lines)
        self.assertIn("| SGD, Nesterov | 1050 | 550 | < 128 | 223 (383) | – |", lines)
        self.assertEqual((lines[0], lines[-1]), (batch_scaling.SUMMARY_BEGIN,
                                                 batch_scaling.SUMMARY_END))

    def test_the_docs_hold_the_tables_of_the_committed_results(self):
        with open(os.path.join(REPO_ROOT, "bench", "results", "batch_scaling.json")) as f:
            document = json.load(f)
        for name, begin_mark, end_mark, make in (
                ("benchmarks.md", batch_scaling.SUMMARY_BEGIN, batch_scaling.SUMMARY_END,
                 batch_scaling.summary),
                ("large_batch.md", batch_scaling.TABLES_BEGIN, batch_scaling.TABLES_END,
                 batch_scaling.tables)):
            with open(os.path.join(REPO_ROOT, "docs", name)) as f:
                doc = f.read()
            begin = doc.index(begin_mark)
            end = doc.index(end_mark) + len(end_mark)
            self.assertEqual(doc[begin:end], make(document),
                             f"docs/{name}'s batch-scaling tables are not those of "
                             "bench/results/batch_scaling.json: paste what "
                             "`bench/batch_scaling.py --collect` prints")

class RetimeTest(InWorkDir):
    """Times to target from the chosen points trained side by side (`retime`): a real
    run on the CNN, read back instead of run again, and the report's times from it."""

    def test_the_chosen_points_train_interleaved_and_are_read_back(self):
        cells = {"sgd_nesterov": {128: {"complete": True, "chosen": {"learning_rate": 0.1}}},
                 "kfac_inverse": {128: {"complete": True, "chosen": batch_scaling.setting(
                     "kfac_inverse", 0.05)}},
                 "adamw": {128: {"complete": False, "trials": []}}}  # not timed
        batches = dict(batch_scaling.BATCHES)
        batches[128] = dict(batches[128], timing_block_steps=3)
        with mock.patch.object(batch_scaling, "BATCHES", batches), \
                mock.patch.object(batch_scaling, "RETIME_REPEATS", 2):
            timing = batch_scaling.retime(128, cells)
        self.assertEqual(set(timing["entries"]), {"sgd_nesterov", "kfac_inverse"})
        self.assertEqual((timing["block_steps"], timing["repeats"]), (3, 2))
        self.assertEqual(timing["compilations"], ["graph", "xla"])
        for compilation in ("graph", "xla"):
            kfac, sgd = (timing["entries"][name]["compilations"][compilation]
                         for name in ("kfac_inverse", "sgd_nesterov"))
            # K-FAC's first steps hold each kind of its steps: factors and
            # decompositions, stale ones, a factor step (every 10).
            self.assertEqual((kfac["start_steps"], sgd["start_steps"]), (11, 2))
            for entry in (kfac, sgd):
                self.assertLen(entry["blocks_step_s"], 2)
                self.assertTrue(all(0 < step_s < entry["start_s"]
                                    for step_s in entry["blocks_step_s"]))
        with open(batch_scaling.retime_path(128)) as f:
            self.assertEqual(json.load(f), timing)
        # The same complete cells: read back, nothing trains.
        with mock.patch.object(batch_scaling.timed_steps, "Timed", None):
            self.assertEqual(batch_scaling.retime(128, cells), timing)

    def test_times_to_target_and_their_ratio_from_the_retime_run(self):
        self.fill("sgd_nesterov", 128, best=0.1, best_steps=1000)
        self.fill("kfac_inverse", 128, best=0.05, best_steps=600)
        # SGD's XLA step is faster, and so is its time to 0.90 despite its slower start;
        # K-FAC's XLA start (compiling) outweighs its slightly faster step.
        timing = {"compilations": ["graph", "xla"], "entries": {
            "sgd_nesterov": {"chosen": {"learning_rate": 0.1}, "compilations": {
                "graph": {"start_steps": 2, "start_s": 1.0, "blocks_step_s": [0.2, 0.2]},
                "xla": {"start_steps": 2, "start_s": 3.0,
                        "blocks_step_s": [0.05, 0.04, 0.06]}}},
            "kfac_inverse": {"chosen": batch_scaling.setting("kfac_inverse", 0.05),
                             "compilations": {
                "graph": {"start_steps": 11, "start_s": 9.0,
                          "blocks_step_s": [0.07, 0.06, 0.08, 0.09]},
                "xla": {"start_steps": 11, "start_s": 90.0,
                        "blocks_step_s": [0.07, 0.07]}}}}}
        with open(batch_scaling.retime_path(128), "w") as f:
            json.dump(dict(timing, compilations=["graph"]), f)
        self.assertIsNone(batch_scaling.read_retime(128))  # other compilations: run again
        with open(batch_scaling.retime_path(128), "w") as f:
            json.dump(timing, f)
        batch_scaling.collect()
        with open(os.path.join(self.output_dir, "batch_scaling.json")) as f:
            entries = json.load(f)["entries"]
        sgd = entries["sgd_nesterov"]["batches"]["128"]["retimed"]
        kfac = entries["kfac_inverse"]["batches"]["128"]["retimed"]
        # Median steps to 0.90: (1000 + 1100) / 2 and (600 + 700) / 2; to 0.89 half each.
        self.assertAlmostEqual(sgd["time_s_to_target"]["0.9"], 3.0 + (1050 - 2) * 0.05)
        self.assertAlmostEqual(kfac["time_s_to_target"]["0.9"], 9.0 + (650 - 11) * 0.075)
        self.assertAlmostEqual(kfac["time_s_to_target"]["0.89"], 9.0 + (325 - 11) * 0.075)
        self.assertIsNone(kfac["time_s_to_target"]["0.91"])
        for key, value in {"min": 0.06, "median": 0.075, "max": 0.09}.items():
            self.assertAlmostEqual(kfac["step_s"][key], value)
        self.assertEqual((sgd["compilation"], kfac["compilation"]), ("xla", "graph"))
        self.assertEqual((sgd["other_step_s"], kfac["other_step_s"]),
                         ({"graph": 0.2}, {"xla": 0.07}))
        ratio = entries["kfac_inverse"]["over_best_first_order"]["128"]["0.9"]
        self.assertAlmostEqual(ratio["time"], (9.0 + 639 * 0.075) / (3.0 + 1048 * 0.05))
        # The tables say which compilation each step time is.
        with open(os.path.join(self.output_dir, "batch_scaling.json")) as f:
            lines = batch_scaling.tables(json.load(f)).splitlines()
        self.assertTrue(any(line.startswith("| SGD, Nesterov | 0.1 | 50.0 [40.0-60.0] XLA |")
                            for line in lines))
        self.assertTrue(any(line.startswith("| K-FAC inverse, KL clip (momentum SGD) | 0.05 "
                                            "| 75.0 [60.0-90.0] |") for line in lines))

if __name__ == "__main__":
    absltest.main()
