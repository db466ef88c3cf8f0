"""bench/batch_scaling.py's protocol without training: the tuning on the validation split
(its grids, the trials placed by their results, the same count for every entry), the
race's runs on the test split with fresh seeds interleaved round by round, the budget
doubled for the misses, the ratios and the critical batch with their bootstrap
intervals, a restart that trains nothing, and the JSON the planner reads, from a stand-in
trainer that writes the summaries the trainer would. One short real run: the retime's
interleaved blocks."""

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
import race  # noqa: E402
import trials  # noqa: E402
from trainers import config as config_lib, lr_schedules, reporting, runner  # noqa: E402
from trainers.planning import measured_steps  # noqa: E402

VARIANTS_JSON = os.path.join(REPO_ROOT, "bench", "results", "variants", "batch_scaling.json")


def learning_rates(indices):
    return [trials.series_value(index) for index in indices]


def tuned(steps=None, best_accuracy=0.9, diverged=False):
    """A tuning trial's record reaching the primary target at `steps` (None: never)."""
    if diverged:
        return {"point": {}, "diverged": True, "message": "nan"}
    return {"point": {}, "diverged": False, "gave_up": False, "steps": 1000,
            "steps_to_primary": steps, "best_accuracy": best_accuracy, "curve": []}


class FakeTrainer:
    """trials.run's stand-in: the summary the trainer would write (and writes it, with the
    machine's record around it), from a made-up accuracy curve a * (1 - exp(-s / tau))
    evaluated where the trainer's `EvaluationSchedule` evaluates, stopping at the target
    or giving up as it does.
    Each entry reaches 0.90 at batch 128 in `BEST[entry][0]` steps at its best
    (effective) rate `BEST[entry][1]`, more away from it and fewer at larger batches;
    SGD tops out at 0.895 from batch 2048 up within the budget (the misses)."""

    BEST = {"kfac": (400, 0.02), "sgd": (1300, 2.0), "schedule_free_adamw": (700, 0.02),
            "muon": (950, 0.005), "adamw": (1400, 0.01), "lamb": (1800, 0.01)}

    def __init__(self):
        self.calls = []

    def steps_to_primary(self, settings):
        entry, batch = settings["optimizer"], settings["batch_size"]
        base, best = self.BEST[entry]
        rate = settings["learning_rate"] / (1 - settings["momentum"]) if entry == "sgd" \
            else settings["learning_rate"]
        scale = (128 / batch) ** (0.8 if entry == "kfac" else 0.6)
        return base * scale * (1 + 0.5 * math.log2(rate / best) ** 2) * (
            1 + 0.05 * (settings["seed"] % 3))

    def run(self, work_dir, name, **settings):
        self.calls.append((name, settings))
        batch = settings["batch_size"]
        examples = (batch_scaling.TUNE_EXAMPLES if settings.get("train_split")
                    == trials.TUNE_SPLIT else batch_scaling.TRAIN_EXAMPLES)
        per_epoch = examples // batch
        total = settings.get("steps") or settings["epochs"] * per_epoch
        ceiling = 0.93
        if (settings["optimizer"] == "sgd" and batch >= 2048
                and total <= batch_scaling.budget_steps(batch)):
            ceiling = 0.895
        tau = self.steps_to_primary(settings) / math.log(0.93 / 0.03)
        step_s = 0.01 * batch / 128 * (1.5 if settings["optimizer"] == "kfac" else 1.0)
        schedule = reporting.EvaluationSchedule(settings["eval_every_steps"],
                                                settings["eval_spacing"])
        evaluations, gave_up, to_target = [], False, None
        give_up = settings.get("give_up_steps"), settings.get("give_up_accuracy")
        for steps in range(1, total + 1):
            if not (schedule(steps) or steps % per_epoch == 0 or steps == total):
                continue
            accuracy = ceiling * (1 - math.exp(-steps / tau))
            evaluations.append({"steps": steps, "train_time_s": 1.0 + steps * step_s,
                                "val_accuracy": accuracy})
            if settings.get("target_accuracy") and accuracy >= settings["target_accuracy"]:
                to_target = {"steps": steps}
                if settings["stop_at_target"]:
                    break
            if give_up[0] is not None and steps > give_up[0] and not any(
                    e["steps"] <= give_up[0] and e["val_accuracy"] >= give_up[1]
                    for e in evaluations):
                gave_up = True
                break
        history = [dict({"epoch": epoch, "steps": epoch * per_epoch, "noise_scale": 100.0 * epoch},
                        **({"preconditioned_noise_scale": 300.0 * epoch}
                           if settings["optimizer"] == "kfac" else {}))
                   for epoch in range(1, math.ceil(steps / per_epoch) + 1)]
        summary = {"config": settings, "steps": steps, "gave_up": gave_up,
                   "to_target": to_target, "mean_step_time_s": {"all": step_s},
                   "evaluations": evaluations, "history": history}
        model_dir = os.path.join(work_dir, name)
        os.makedirs(model_dir, exist_ok=True)
        with trials.machine_record(model_dir, resumed=False) as machine:
            with open(os.path.join(model_dir, runner.SUMMARY_FILE), "w") as f:
                json.dump(summary, f)
        return dict(json.loads(json.dumps(summary)), machine=machine)


class InWorkDir(absltest.TestCase):
    """Each test with a work dir and an output dir of its own."""

    def setUp(self):
        super().setUp()
        self.work_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        self.output_dir = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
        saver = flagsaver.flagsaver(work_dir=self.work_dir, output_dir=self.output_dir)
        saver.__enter__()
        self.addCleanup(saver.__exit__, None, None, None)

    def document(self):
        with open(os.path.join(self.output_dir, "batch_scaling.json")) as f:
            return json.load(f)


class GridTest(absltest.TestCase):

    def test_series_index_rounds_on_a_log_scale(self):
        self.assertEqual(trials.series_value(trials.series_index(0.4)), 0.5)  # 0.4/0.2 > 0.5/0.4
        self.assertEqual(trials.series_value(trials.series_index(0.8)), 1.0)
        self.assertEqual(trials.series_value(trials.series_index(0.1)), 0.1)
        self.assertEqual(trials.series_value(-1), 0.5)
        with self.assertRaisesRegex(ValueError, "finite number > 0"):
            trials.series_index(0.0)

    def test_four_rates_around_the_pick_scaled_by_the_root_of_the_batch(self):
        # AdamW's pick 0.01: x1 at 128, x4 at 2048 (0.04 -> 0.05), x8 at 8192 (0.08 ->
        # 0.1); two points of the series below, one above.
        expected = {128: [0.002, 0.005, 0.01, 0.02], 2048: [0.01, 0.02, 0.05, 0.1],
                    8192: [0.02, 0.05, 0.1, 0.2]}
        for batch, rates in expected.items():
            self.assertEqual(learning_rates(batch_scaling.grid("adamw", batch)), rates)
        self.assertEqual(learning_rates(batch_scaling.grid("kfac", 128)),
                         [0.005, 0.01, 0.02, 0.05])

    def test_sgd_tunes_the_effective_rate_at_two_momenta(self):
        # Its pick 0.1 at momentum 0.9: effective rate 1, x4 at 2048 (4 -> 5); the grid
        # is that rate and one below, each at both momenta.
        self.assertEqual(learning_rates(batch_scaling.grid("sgd", 2048)), [2.0, 5.0])
        self.assertEqual(batch_scaling.points_at("sgd", batch_scaling.centre("sgd", 2048)),
                         [{"learning_rate": 0.5, "momentum": 0.9},
                          {"learning_rate": 0.15, "momentum": 0.97}])
        self.assertEqual(batch_scaling.points_at("muon", 0), [{"learning_rate": 1.0}])

    def test_picks_are_the_recorded_batch_128_bests_on_the_validation_split(self):
        with open(os.path.join(REPO_ROOT, "bench/results/variants/time_to_accuracy.json")) as f:
            cnn = json.load(f)["models"]["cnn"]["optimizers"]
        self.assertEqual(batch_scaling.ENTRIES["adamw"]["pick"], cnn["adamw"]["setting"])
        # The heavy-ball pick at its momentum, the trainer's default.
        self.assertEqual(batch_scaling.ENTRIES["sgd"]["pick"],
                         dict(cnn["sgd"]["setting"],
                              momentum=config_lib.TrainConfig.momentum))
        with open(os.path.join(REPO_ROOT,
                               "bench/results/cnn_kfac_schedule_free/time_to_accuracy.json")) as f:
            raced = json.load(f)["models"]["cnn"]["optimizers"]
        self.assertEqual(batch_scaling.ENTRIES["schedule_free_adamw"]["pick"],
                         raced["schedule_free_adamw"]["setting"])
        summaries = os.path.join(REPO_ROOT, "bench/results/trial_summaries/cnn")

        def best(prefix, **fixed):
            scores = {}
            for name in os.listdir(summaries):
                if name.startswith(prefix):
                    with open(os.path.join(summaries, name, runner.SUMMARY_FILE)) as f:
                        summary = json.load(f)
                    config = summary["config"]
                    self.assertEqual(config["train_split"], trials.TUNE_SPLIT)
                    if all(config[key] == value for key, value in fixed.items()):
                        scores[config["learning_rate"]] = summary["final_eval_accuracy"]
            self.assertGreaterEqual(len(scores), 4, prefix)
            return {"learning_rate": max(scores, key=scores.get)}

        for entry in ("muon", "lamb"):
            self.assertEqual(batch_scaling.ENTRIES[entry]["pick"], best(f"cnn-{entry}-tune-"))
        # The default's settings: inverse into ScheduleFreeAdamW at damping 0.03.
        self.assertEqual(batch_scaling.ENTRIES["kfac"]["pick"],
                         best("cnn-kfac_schedule_free_adamw-tune-", damping=0.03))
        self.assertEqual(trials.OPTIMIZERS["kfac"],
                         dict(trials.OPTIMIZERS["kfac_schedule_free_adamw"], damping=0.03))


class SettingsTest(absltest.TestCase):

    def test_tuning_reads_the_validation_split_over_a_final_runs_steps(self):
        for batch in (128, 2048, 8192):
            for entry in batch_scaling.ENTRIES:
                point = batch_scaling.ENTRIES[entry]["pick"]
                tuning = batch_scaling.tuning_settings(entry, batch, point)
                final = batch_scaling.final_settings(entry, batch, point, 1)
                trials.check_entry(entry, tuning)
                trials.check_entry(entry, final)
                self.assertEqual((tuning["train_split"], tuning["eval_split"], tuning["seed"]),
                                 (trials.TUNE_SPLIT, trials.VALIDATION_SPLIT, 0))
                self.assertEqual((tuning["target_accuracy"], final["target_accuracy"]),
                                 (0.9, 0.91))
                # The final runs: the trainer's full train split and test split.
                self.assertNotIn("train_split", final)
                self.assertNotIn("eval_split", final)
                self.assertEqual(config_lib.TrainConfig(**final).eval_split, "test")
                # The same steps and warm-up, on either split's epochs.
                configs = [config_lib.TrainConfig(**settings) for settings in (tuning, final)]
                per_epoch = [54000 // batch, 60000 // batch]
                self.assertEqual(tuning["steps"], final["epochs"] * per_epoch[1])
                self.assertEqual(*(lr_schedules.warmup_length(config, spe, tuning["steps"])
                                   for config, spe in zip(configs, per_epoch)))
                for settings in (tuning, final):
                    self.assertEqual(settings["eval_spacing"], 0.025)
                    self.assertEqual(settings["eval_every_steps"],
                                     batch_scaling.BATCHES[batch]["eval_every_steps"])
        kfac = batch_scaling.final_settings("kfac", 8192, {"learning_rate": 0.02}, 3)
        self.assertEqual((kfac["factor_update_freq"], kfac["decomposition_update_freq"],
                          kfac["factor_batch_fraction"], kfac["damping"], kfac["xla"]),
                         (1, 2, 0.25, 0.03, True))
        self.assertFalse(batch_scaling.final_settings("muon", 8192, {"learning_rate": 0.02},
                                                      3)["xla"])
        self.assertEqual(batch_scaling.final_settings("kfac", 128, {"learning_rate": 0.02},
                                                      1, extension=2)["epochs"], 20)

    def test_evaluations_resolve_kfacs_earlier_steps_to_under_3_percent(self):
        # K-FAC's steps to 0.89 in the earlier protocol: 275 at 128, 48 at 2048, 44 at
        # 8192; the gap to the evaluation before the first one at or past them.
        for batch, steps in ((128, 275), (2048, 48), (8192, 44)):
            budget = batch_scaling.BATCHES[batch]
            schedule = reporting.EvaluationSchedule(budget["eval_every_steps"],
                                                    batch_scaling.EVAL_SPACING)
            evaluated = [s for s in range(1, 2 * steps) if schedule(s)]
            after = min(s for s in evaluated if s >= steps)
            before = max(s for s in evaluated if s < after)
            self.assertLess((after - before) / steps, 0.03, batch)


class TuningTest(absltest.TestCase):
    """The tuning of one (entry, batch) from trials handed to it."""

    def test_the_grid_from_its_centre_then_beyond_the_best_edge(self):
        asked = []

        def get(point, give_up):
            asked.append((point["learning_rate"], give_up))
            # Fewer steps the larger the rate up to 0.2, which beats 0.1 and 0.5.
            rate = point["learning_rate"]
            return tuned({0.1: 350, 0.2: 300, 0.5: 500}.get(rate, int(20 / rate)))

        tuning = batch_scaling.tune("adamw", 128, get)
        self.assertTrue(tuning["complete"])
        # From the centre (the pick 0.01) outward, lower first; the first, with no trial
        # at 0.90 yet, gives up below 0.5 at a tenth of the budget (4680 steps), each
        # after it past the fewest steps to 0.90 so far (20 / rate); then the best sits
        # at the top edge each time (0.02, 0.05, 0.1, 0.2) and the grid moves up, until
        # 0.5 (500 steps) leaves 0.2 inside.
        self.assertEqual(batch_scaling.budget_steps(128), 4680)
        self.assertEqual(asked, [(0.01, (468, 0.5))] + [
            (rate, (steps, 0.9)) for rate, steps in (
                (0.005, 2000), (0.02, 2000), (0.002, 1000), (0.05, 1000), (0.1, 400),
                (0.2, 350), (0.5, 300))])
        self.assertLen(tuning["trials"], trials.TUNING_TRIALS)
        self.assertEqual(tuning["chosen"], {"learning_rate": 0.2})
        self.assertEqual(tuning["added_rates"], [0.05, 0.1, 0.2, 0.5])
        self.assertFalse(tuning["best_at_edge"])
        self.assertEqual(tuning["score"], [0, 300, -0.9])

    def test_a_best_inside_sends_the_rest_past_the_better_edge(self):
        steps = {0.002: 900, 0.005: 500, 0.01: 400, 0.02: 600, 0.05: 700, 0.001: 2000}
        order = []

        def get(point, give_up):
            order.append(point["learning_rate"])
            return tuned(steps.get(point["learning_rate"]),
                         best_accuracy=0.89 - point["learning_rate"])

        tuning = batch_scaling.tune("adamw", 128, get)
        # The best, 0.01, is inside; of the edges 0.02 (600) beats 0.002 (900): 0.05; then
        # 0.05 (700) beats 0.002: 0.1 (never reaching 0.90); then 0.002 beats 0.1: 0.001
        # (2000), which beats 0.1 too: 0.0005.
        self.assertEqual(order[4:], [0.05, 0.1, 0.001, 0.0005])
        self.assertEqual(tuning["chosen"], {"learning_rate": 0.01})

    def test_sgd_runs_both_momenta_at_each_rate_eight_in_all(self):
        asked = []

        def get(point, give_up):
            asked.append(point)
            effective = point["learning_rate"] / (1 - point["momentum"])
            return tuned(int(1000 * (1 + abs(math.log10(effective / 2.0))))
                         + (5 if point["momentum"] == 0.97 else 0))

        tuning = batch_scaling.tune("sgd", 2048, get)
        # Effective rates 5 (the scaled pick) then 2; 2 is best at the low edge: 1, then
        # 0.5; each at momentum 0.9 and 0.97.
        self.assertEqual([round(p["learning_rate"] / (1 - p["momentum"]), 6) for p in asked],
                         [5, 5, 2, 2, 1, 1, 0.5, 0.5])
        self.assertEqual([p["momentum"] for p in asked], [0.9, 0.97] * 4)
        self.assertEqual(tuning["chosen"], {"learning_rate": 0.2, "momentum": 0.9})
        self.assertEqual(tuning["added_rates"], [1.0, 0.5])
        self.assertFalse(tuning["best_at_edge"])

    def test_every_entry_tunes_on_the_same_trial_count(self):
        for entry in batch_scaling.ENTRIES:
            for batch in (128, 8192):
                tuning = batch_scaling.tune(entry, batch, lambda point, _: tuned(100))
                self.assertLen(tuning["trials"], trials.TUNING_TRIALS, (entry, batch))

    def test_unreached_rank_by_accuracy_and_diverged_last(self):
        def get(point, give_up):
            # None reaches the target, so each gives up only if it collapses early.
            self.assertEqual(give_up, (468, batch_scaling.EARLY_ACCURACY))
            if point["learning_rate"] >= 0.05:
                return tuned(diverged=True)
            return tuned(None, best_accuracy=0.8 + point["learning_rate"])

        tuning = batch_scaling.tune("muon", 128, get)
        self.assertEqual(tuning["chosen"], {"learning_rate": 0.02})
        self.assertEqual(tuning["score"][0], 1)

    def test_a_missing_trial_leaves_the_tuning_incomplete_with_what_it_has(self):
        def get(point, give_up):
            return tuned(100) if point["learning_rate"] <= 0.01 else None

        tuning = batch_scaling.tune("adamw", 128, get)
        self.assertFalse(tuning["complete"])
        # The centre (0.01), then 0.005; 0.02 is not there yet.
        self.assertEqual([t["index"] for t in tuning["trials"]],
                         [trials.series_index(0.005), trials.series_index(0.01)])
        self.assertIsNone(batch_scaling.leader({}))


def run(seed, steps, step_s=1.0):
    """A final run reaching 0.89, 0.90 and 0.91 at `steps` (None: never), evaluated every
    step."""
    curve = [(step * step_s, step, 0.5) for step in range(1, steps or 10)]
    if steps:
        curve += [(steps * step_s, steps, 0.905), ((steps + 1) * step_s, steps + 1, 0.92)]
    return {"seed": seed, "curve": curve}


def cell(steps_by_seed, step_s=1.0):
    runs = [run(seed, steps, step_s) for seed, steps in enumerate(steps_by_seed, 1)]
    return {"complete": True, "runs": runs, "to_target": batch_scaling.to_target(runs, 999)}


class CriticalBatchTest(absltest.TestCase):

    def test_the_largest_batch_whose_next_step_still_scales(self):
        # 128 -> 512 cuts 4x, 512 -> 2048 2.5x (>= 2.25), 2048 -> 8192 2x (< 2.25).
        medians = {128: 4000, 512: 1000, 2048: 400, 8192: 200}
        result = batch_scaling.critical_batch(medians, {})
        self.assertEqual(result["critical_batch"], 512)
        self.assertFalse(result["at_least"])
        self.assertEqual([step["scales"] for step in result["steps"]], [True, True, False])
        self.assertAlmostEqual(result["steps"][0]["needed_cut"], 2.25)
        # 128 -> 2048 needs 1.5^4 = 5.06x.
        self.assertAlmostEqual(batch_scaling.critical_batch(
            {128: 1000, 2048: 100}, {})["steps"][0]["needed_cut"], 5.0625)

    def test_a_last_step_that_scales_gives_a_lower_bound_none_below_the_smallest(self):
        result = batch_scaling.critical_batch({128: 4000, 512: 1000}, {})
        self.assertEqual((result["critical_batch"], result["at_least"]), (128, True))
        self.assertEqual(batch_scaling.outcome(result), (128.5, "≥ 128"))
        result = batch_scaling.critical_batch({128: 400, 512: 300}, {})
        self.assertIsNone(result["critical_batch"])
        self.assertTrue(result["below_smallest"])
        self.assertEqual(batch_scaling.outcome(result), (0, "< 128"))

    def test_an_unreached_target_judged_on_its_bound(self):
        # 1000 / more than 2000 steps: below 0.5x, fails; 10000 / more than 2000 is
        # below 5x, which could still be >= 2.25x: undetermined.
        fails = batch_scaling.critical_batch({128: 1000, 512: None}, {512: 2000})
        self.assertIs(fails["steps"][0]["scales"], False)
        self.assertAlmostEqual(fails["steps"][0]["cut_below"], 0.5)
        open_ = batch_scaling.critical_batch({128: 10000, 512: None}, {512: 2000})
        self.assertIsNone(open_["steps"][0]["scales"])
        self.assertEqual(open_["undetermined"], [128])
        self.assertIsNone(batch_scaling.outcome(open_))

    def test_the_interval_resamples_each_batchs_seeds(self):
        budgets = {128: 4680, 2048: 928}
        # Every seed alike: one outcome. 4000 -> 400 cuts 10x >= 5.06x: 128 still
        # scales, the last step: at least 128.
        same = batch_scaling.critical_batch_interval({128: [4000] * 5, 2048: [400] * 5},
                                                     budgets)
        self.assertEqual((same["low"], same["high"], same["shares"]),
                         ("≥ 128", "≥ 128", {"≥ 128": 1.0}))
        # At 2048 two seeds of five at 1000 (a 4x cut, short of 5.06x): a resample's
        # median is 1000 when 3 or more of its 5 draws are, with probability
        # sum_k>=3 C(5, k) 0.4^k 0.6^(5-k) = 0.31744.
        mixed = batch_scaling.critical_batch_interval(
            {128: [4000] * 5, 2048: [400, 400, 400, 1000, 1000]}, budgets)
        self.assertEqual((mixed["low"], mixed["high"]), ("< 128", "≥ 128"))
        self.assertAlmostEqual(mixed["shares"]["< 128"], 0.31744, delta=0.015)
        # Seeds that never reached it: infinite; a median beyond the budget is judged
        # on its bound (4000 / 928 < 5.06: fails).
        unreached = batch_scaling.critical_batch_interval(
            {128: [4000] * 3, 2048: [math.inf] * 3}, budgets)
        self.assertEqual(unreached["shares"], {"< 128": 1.0})

    def test_mccandlishs_curve_fitted_in_one_over_the_batch(self):
        # S(B) = 300 (1 + 600 / B) exactly at three batches; 8192 not reached.
        medians = {batch: 300 * (1 + 600 / batch) for batch in (128, 512, 2048)}
        fitted = batch_scaling.fitted_critical_batch({**medians, 8192: None})
        self.assertAlmostEqual(fitted["min_steps"], 300)
        self.assertAlmostEqual(fitted["critical_batch"], 600)
        self.assertEqual(fitted["batches"], [128, 512, 2048])
        steps = {128: 1800.0, 512: 600.0, 2048: 420.0, 8192: 300.0}
        slope, intercept = numpy.polyfit([1 / b for b in steps], list(steps.values()), 1)
        fitted = batch_scaling.fitted_critical_batch(steps)
        self.assertAlmostEqual(fitted["min_steps"], intercept)
        self.assertAlmostEqual(fitted["critical_batch"], slope / intercept)
        self.assertIsNone(batch_scaling.fitted_critical_batch({128: 400}))
        self.assertIsNone(batch_scaling.fitted_critical_batch({128: 400, 512: 500}))


class RatioTest(absltest.TestCase):

    def test_kfacs_ratios_are_medians_of_per_round_ratios_with_intervals(self):
        cells = {"kfac": {2048: cell([50, 60, 55, 70, 52], step_s=2.0)},
                 "muon": {2048: cell([100, 110, 100, 120, 90])},
                 "adamw": {2048: cell([200, None, 220])}}
        found = batch_scaling.ratios(cells, 2048)
        self.assertEqual(set(found), {"muon", "adamw"})
        # 0.90 is first reached at the given steps.
        steps = found["muon"]["0.9"]["steps"]
        per_round = [50 / 100, 60 / 110, 55 / 100, 70 / 120, 52 / 90]
        self.assertEqual(steps["seeds"], [1, 2, 3, 4, 5])
        self.assertAlmostEqual(steps["median"], sorted(per_round)[2])
        self.assertLessEqual(steps["low"], steps["median"])
        self.assertTrue(steps["faster"])
        self.assertAlmostEqual(found["muon"]["0.9"]["time_s"]["median"],
                               2 * sorted(per_round)[2])
        # AdamW's seed 2 never reached it: a ratio of 0 there, over 3 rounds.
        self.assertEqual(found["adamw"]["0.9"]["steps"]["per_seed"][1], 0.0)
        self.assertLen(found["adamw"]["0.9"]["steps"]["seeds"], 3)
        self.assertEqual(cells["adamw"][2048]["to_target"]["0.9"]["median_steps"], 220)
        quantized = cells["kfac"][2048]["to_target"]["0.9"]["per_seed"]["1"]
        self.assertAlmostEqual(quantized["steps_quantization"], 1 / 50)
        incomplete = dict(cells, muon={2048: dict(cells["muon"][2048], complete=False)})
        self.assertEqual(set(batch_scaling.ratios(incomplete, 2048)), {"adamw"})

    def test_retimed_times_from_the_median_steps(self):
        found = cell([600, 700])
        # XLA's step is faster but its start (compiling) outweighs it.
        timing = {"chosen": {}, "compilations": {
            "graph": {"start_steps": 11, "start_s": 9.0,
                      "blocks_step_s": [0.07, 0.06, 0.08, 0.09]},
            "xla": {"start_steps": 11, "start_s": 90.0, "blocks_step_s": [0.07, 0.07]}}}
        timed = batch_scaling.retimed(found, timing)
        self.assertEqual(timed["compilation"], "graph")
        self.assertAlmostEqual(timed["time_s_to_target"]["0.9"], 9.0 + (650 - 11) * 0.075)
        self.assertEqual(timed["other_step_s"], {"xla": 0.07})


class RaceTest(InWorkDir):
    """The whole benchmark against the stand-in trainer: tuning, race, misses, report."""

    def setUp(self):
        super().setUp()
        # The report is written after every round: fewer resamples keep that quick.
        patch = mock.patch.object(race, "BOOTSTRAP_SAMPLES", 1000)
        patch.start()
        self.addCleanup(patch.stop)

    def test_tuning_then_the_race_then_the_misses_at_twice_the_budget(self):
        fake = FakeTrainer()
        with flagsaver.flagsaver(batch_sizes=["128", "2048"],
                                 entries=["kfac", "sgd", "muon", "adamw"], retime=False), \
                mock.patch.object(trials, "run", fake.run), \
                mock.patch.object(batch_scaling.harness, "save_plot"):
            batch_scaling.main()
        tuning = [(name, s) for name, s in fake.calls if name.startswith("tune-")]
        final = [(name, s) for name, s in fake.calls if not name.startswith(("tune-", "noise-"))]
        # The tuning reads no test data; the final runs nothing else, on fresh seeds.
        for name, settings in tuning + [c for c in fake.calls if c[0].startswith("noise-")]:
            self.assertEqual((settings["train_split"], settings["eval_split"],
                              settings["seed"]),
                             (trials.TUNE_SPLIT, trials.VALIDATION_SPLIT, 0), name)
        for name, settings in final:
            self.assertNotIn("train_split", settings)
            self.assertNotIn("eval_split", settings)
            self.assertGreaterEqual(settings["seed"], race.FIRST_SEED)
        # 8 tuning trials per (entry, batch), and one noise run per entry at 128.
        self.assertLen(tuning, 8 * 4 * 2)
        self.assertLen([c for c in fake.calls if c[0].startswith("noise-")], 4)
        document = self.document()
        batch = document["batches"]["128"]
        # Muon tunes best of the first-order entries at 128 (950 steps at its pick):
        # it runs 5 seeds with K-FAC, the others 3, round by round, after the tuning.
        self.assertEqual(batch["best_first_order_by_tuning"], "muon")
        at_128 = [(s["seed"], s["optimizer"]) for _, s in final if s["batch_size"] == 128]
        self.assertEqual(at_128, race.rounds({"kfac": 5, "sgd": 3, "muon": 5, "adamw": 3}))
        self.assertLess(fake.calls.index(next(c for c in fake.calls if c[0].startswith(
            "tune-adamw-batch128"))), fake.calls.index(final[0]))
        # The headline: K-FAC's steps to 0.90 over Muon's, 5 rounds, with an interval.
        headline = batch["headline"]
        self.assertEqual((headline["baseline"], headline["seeds"]), ("muon", [1, 2, 3, 4, 5]))
        self.assertLessEqual(headline["low"], headline["median"])
        self.assertLessEqual(headline["median"], headline["high"])
        self.assertLess(headline["high"], 1)
        self.assertEqual(set(batch["ratios"]), {"sgd", "muon", "adamw"})
        self.assertLess(max(batch["kfac_steps_quantization"].values()), 0.03)
        # Every per-seed figure, with the load around each run.
        kfac = document["entries"]["kfac"]["batches"]["128"]
        self.assertTrue(kfac["complete"])
        self.assertLen(kfac["runs"], 5)
        self.assertEqual(set(kfac["to_target"]["0.9"]["per_seed"]), {"1", "2", "3", "4", "5"})
        machine = kfac["runs"][0]["machine"]
        self.assertLen(machine["load_average_before"], 3)
        self.assertGreaterEqual(machine["cpu_time_s"], 0)
        self.assertLen(kfac["tuning"]["trials"], 8)
        # SGD misses 0.90 at 2048 within the budget: its 3 seeds run again at twice it
        # (64 epochs), after the race, where they reach it.
        sgd = document["entries"]["sgd"]["batches"]["2048"]
        self.assertIsNone(sgd["to_target"]["0.9"]["median_steps"])
        self.assertEqual(sgd["to_target"]["0.9"]["steps_above"], 928)
        self.assertEqual(sgd["extended"]["epochs"], 64)
        self.assertLen(sgd["extended"]["runs"], 3)
        self.assertIsNotNone(sgd["extended"]["to_target"]["0.9"]["median_steps"])
        extended = [s for name, s in final if s["epochs"] == 64]
        self.assertEqual([(s["seed"], s["optimizer"]) for s in extended],
                         [(1, "sgd"), (2, "sgd"), (3, "sgd")])
        self.assertNotIn("extended", document["entries"]["kfac"]["batches"]["2048"])
        # The critical batch with its interval over seeds; K-FAC's noise scale.
        critical = document["entries"]["kfac"]["critical_batch"]["0.9"]
        self.assertEqual(critical["steps"][0]["from"], 128)
        self.assertIn(critical["interval"]["low"], critical["interval"]["shares"])
        self.assertEqual(document["entries"]["kfac"]["noise_scale"]["epochs"][0]
                         ["preconditioned_noise_scale"], 300.0)
        self.assertEqual(document["protocol"]["tuning"]["eval_split"], trials.VALIDATION_SPLIT)
        # What the planner reads of it (`--steps_from`).
        target, steps = measured_steps.load(
            os.path.join(self.output_dir, "batch_scaling.json"), "cnn", None, ("kfac", "sgd"))
        self.assertEqual(target, 0.9)
        self.assertEqual(steps["sgd"][2048], None)
        self.assertEqual(steps["kfac"][128], kfac["to_target"]["0.9"]["median_steps"])
        # The tables and the plot of it.
        lines = batch_scaling.tables(document).splitlines()
        self.assertEqual((lines[0], lines[-1]), (batch_scaling.TABLES_BEGIN,
                                                 batch_scaling.TABLES_END))
        self.assertIn("| entry | tuned point | seeds | step ms | 0.89 | 0.90 | 0.91 |", lines)
        self.assertTrue(any(line.startswith("| SGD, Nesterov | ") and "> 928" in line
                            for line in lines))
        self.assertTrue(any(line.startswith("SGD, Nesterov at 2x the budget (64 epochs, 3 "
                                            "seeds)") for line in lines))
        self.assertTrue(any(line.startswith(f"{batch_scaling.NAMES['kfac']} over Muon to "
                                            "0.90: steps 0.") and "(5 rounds)" in line
                            for line in lines))
        summary = batch_scaling.summary(document)
        self.assertIn("| entry | batch 128 | batch 2048 | critical batch (interval) |", summary)
        self.assertIn("Batch 2048: K-FAC", summary)
        batch_scaling.collect()  # with its plot
        self.assertTrue(os.path.exists(os.path.join(self.output_dir, "batch_scaling.png")))
        # A restart trains nothing: every run is read back.
        calls = len(fake.calls)
        with flagsaver.flagsaver(batch_sizes=["128", "2048"],
                                 entries=["kfac", "sgd", "muon", "adamw"], retime=False), \
                mock.patch.object(trials, "run", fake.run), \
                mock.patch.object(batch_scaling.harness, "save_plot"):
            batch_scaling.main()
        self.assertLen(fake.calls, calls)

    def test_tune_only_stops_before_the_race(self):
        fake = FakeTrainer()
        with flagsaver.flagsaver(batch_sizes=["8192"], entries=["kfac", "lamb"],
                                 tune_only=True), \
                mock.patch.object(trials, "run", fake.run), \
                mock.patch.object(batch_scaling.harness, "save_plot"):
            batch_scaling.main()
        self.assertLen(fake.calls, 16)
        self.assertTrue(all(name.startswith("tune-") for name, _ in fake.calls))
        entries = self.document()["entries"]
        self.assertTrue(entries["kfac"]["batches"]["8192"]["tuning"]["complete"])
        self.assertFalse(entries["kfac"]["batches"]["8192"]["complete"])
        with flagsaver.flagsaver(entries=["kfac"]):
            with self.assertRaisesRegex(ValueError, "must hold a first-order entry"):
                batch_scaling.main()


class WorkDirTest(InWorkDir):
    """Finished and diverged runs are read back (a restart skips them)."""

    def test_finished_and_diverged_trials_are_read_back(self):
        fake = FakeTrainer()
        point = {"learning_rate": 0.01}
        with mock.patch.object(trials, "run", fake.run):
            done = batch_scaling.run_tuning_trial("adamw", 128, True, point)
        self.assertEqual(done["steps_to_primary"], done["curve"][-1][0])
        self.assertEqual(batch_scaling.run_tuning_trial("adamw", 128, False, point), done)
        diverged = os.path.join(self.work_dir, batch_scaling.tuning_name(
            "adamw", 128, {"learning_rate": 1.0}))
        os.makedirs(diverged)
        with open(os.path.join(diverged, batch_scaling.trials.DIVERGED_FILE), "w") as f:
            json.dump({"message": "training diverged: ..."}, f)
        # run_tuning_trial would train (minutes) if it did not read these back.
        with mock.patch.object(trials, "run", None):
            self.assertTrue(batch_scaling.run_tuning_trial(
                "adamw", 128, True, {"learning_rate": 1.0})["diverged"])
            self.assertIsNone(batch_scaling.run_tuning_trial(
                "adamw", 128, False, {"learning_rate": 0.2}))
            self.assertIsNone(batch_scaling.final_run("adamw", 128, point, 1, False))

    def test_a_trial_given_steps_gives_up_and_a_diverged_run_is_marked(self):
        asked = {}

        def gives_up(work_dir, name, **settings):
            asked.update(settings)
            return {"steps": 450, "gave_up": True, "mean_step_time_s": {"all": 0.1},
                    "evaluations": [{"train_time_s": 40.0, "steps": 400, "val_accuracy": 0.8},
                                    {"train_time_s": 45.0, "steps": 450,
                                     "val_accuracy": 0.85}]}

        os.makedirs(os.path.join(self.work_dir, batch_scaling.tuning_name(
            "adamw", 128, {"learning_rate": 0.01})))
        with mock.patch.object(trials, "run", gives_up):
            record = batch_scaling.run_tuning_trial("adamw", 128, True, {"learning_rate": 0.01},
                                                    give_up=(400, 0.9))
        self.assertEqual((asked["give_up_steps"], asked["give_up_accuracy"]), (400, 0.9))
        self.assertTrue(record["gave_up"])
        self.assertEqual(batch_scaling.rank(record), (1, -0.85, 0.0))
        stopped = {"config": {"stop_at_target": True, "epochs": 2}, "to_target": None}
        self.assertTrue(trials.finished(dict(stopped, gave_up=True), 10))
        self.assertFalse(trials.finished(dict(stopped, gave_up=False), 10))

        def diverges(work_dir, name, **settings):
            os.makedirs(os.path.join(work_dir, name))
            raise batch_scaling.trials.errors.RunError("training diverged: after step 3 ...")

        with mock.patch.object(trials, "run", diverges):
            lost = batch_scaling.final_run("sgd", 2048, {"learning_rate": 0.5,
                                                         "momentum": 0.9}, 2, True)
        self.assertEqual((lost["diverged"], lost["curve"], lost["seed"]), (True, [], 2))
        self.assertIsNone(race.crossing(lost, 0.9))
        with mock.patch.object(trials, "run", None):  # marked: not run again
            self.assertTrue(batch_scaling.final_run("sgd", 2048, {
                "learning_rate": 0.5, "momentum": 0.9}, 2, True)["diverged"])

    def test_a_trial_with_other_settings_is_an_error(self):
        fake = FakeTrainer()
        point = {"learning_rate": 0.01}
        with mock.patch.object(trials, "run", fake.run):
            batch_scaling.run_tuning_trial("adamw", 128, True, point)
        path = os.path.join(self.work_dir, batch_scaling.tuning_name("adamw", 128, point),
                            runner.SUMMARY_FILE)
        with open(path) as f:
            summary = json.load(f)
        summary["config"]["eval_split"] = "test"
        with open(path, "w") as f:
            json.dump(summary, f)
        with self.assertRaisesRegex(ValueError, "holds a trial with other settings"):
            batch_scaling.run_tuning_trial("adamw", 128, False, point)


class RecordTest(absltest.TestCase):
    """The earlier protocol's results, moved to bench/results/variants/, and the docs."""

    def test_the_planner_reads_the_variants_record(self):
        # What `trainers.plan --steps_from` reads from it (docs/guide.md §5).
        target, steps = measured_steps.load(VARIANTS_JSON, "cnn", None,
                                            ("muon", "kfac_schedule_free_adamw"))
        self.assertEqual(target, 0.9)
        self.assertEqual((steps["muon"][2048], steps["kfac_schedule_free_adamw"][2048]),
                         (120, 61))
        self.assertEqual((steps["muon"][8192], steps["kfac_schedule_free_adamw"][8192]),
                         (98.5, 59.5))

    def test_the_docs_hold_the_tables_of_the_committed_results(self):
        path = os.path.join(REPO_ROOT, "bench", "results", "batch_scaling.json")
        document = None
        if os.path.exists(path):
            with open(path) as f:
                document = json.load(f)
        for name, begin_mark, end_mark, make in (
                ("benchmarks.md", batch_scaling.SUMMARY_BEGIN, batch_scaling.SUMMARY_END,
                 batch_scaling.summary),
                ("benchmarks.md", batch_scaling.TABLES_BEGIN, batch_scaling.TABLES_END,
                 batch_scaling.tables)):
            with open(os.path.join(REPO_ROOT, "docs", name)) as f:
                doc = f.read()
            if document is None:  # the race has not run: no tables yet
                self.assertNotIn(begin_mark, doc, name)
                continue
            begin = doc.index(begin_mark)
            end = doc.index(end_mark) + len(end_mark)
            self.assertEqual(doc[begin:end], make(document),
                             f"docs/{name}'s batch-scaling tables are not those of "
                             "bench/results/batch_scaling.json: paste what "
                             "`bench/batch_scaling.py --collect` prints")


class RetimeTest(InWorkDir):
    """The tuned points trained side by side (`retime`): a real run on the CNN, read back
    instead of run again."""

    def test_the_tuned_points_train_interleaved_and_are_read_back(self):
        chosen = {"sgd": {"learning_rate": 0.1, "momentum": 0.9},
                  "kfac": {"learning_rate": 0.02}}
        batches = dict(batch_scaling.BATCHES)
        batches[128] = dict(batches[128], timing_block_steps=3)
        with mock.patch.object(batch_scaling, "BATCHES", batches), \
                mock.patch.object(batch_scaling, "RETIME_REPEATS", 2):
            timing = batch_scaling.retime(128, chosen)
        self.assertEqual(set(timing["entries"]), {"sgd", "kfac"})
        self.assertEqual((timing["block_steps"], timing["repeats"]), (3, 2))
        self.assertEqual(timing["compilations"], ["graph", "xla"])
        for compilation in ("graph", "xla"):
            kfac, sgd = (timing["entries"][name]["compilations"][compilation]
                         for name in ("kfac", "sgd"))
            # K-FAC's first steps hold each kind of its steps: factors and
            # decompositions, stale ones, a factor step (every 10).
            self.assertEqual((kfac["start_steps"], sgd["start_steps"]), (11, 2))
            for entry in (kfac, sgd):
                self.assertLen(entry["blocks_step_s"], 2)
                self.assertTrue(all(0 < step_s < entry["start_s"]
                                    for step_s in entry["blocks_step_s"]))
        with open(batch_scaling.retime_path(128)) as f:
            self.assertEqual(json.load(f), timing)
        # The same points: read back, nothing trains.
        with mock.patch.object(batch_scaling.timed_steps, "Timed", None):
            self.assertEqual(batch_scaling.retime(128, chosen), timing)


if __name__ == "__main__":
    absltest.main()
