"""Faults and bad input of the trainer and its data path, on short real runs (MLP, slices
of Fashion-MNIST):

- `--resume` trains exactly to `--steps`/`--epochs`, mid-epoch too, without rewriting
  config.json; `--resume` with no run is an error, `--auto_resume` starts one;
  damaged checkpoints fall back to the newest one that loads, a process killed while
  writing one loses nothing that was complete; NaN and infinity are rejected for every
  float flag and float argument; predictable failures are one line (a usage error exit
  code 2, a run's failure 1: trainers/cli.py);
  loss-scale-skipped steps are counted; usage errors end with the error line,
  metrics.csv keeps its columns, data_dir is created only under an existing parent.
- SGD that diverges stops with one error (`DivergenceTest`); SIGTERM/SIGINT checkpoint
  the step in progress and resume exactly (`PreemptionTest`); a full disk is one clear
  error that blocks no resume (`DiskFaultTest` on a small tmpfs,
  `InjectedWriteFailureTest` without root); a new --epochs on resume is the budget
  (`ResumeBudgetTest`); the noise scale of an epoch a checkpoint cut is the
  uninterrupted run's (`NoiseScaleResumeTest`; after SIGTERM in `PreemptionTest`);
  absurd sizes are refused up front (`AbsurdSizeTest`); every `pipelines.build` argument
  is checked (`PipelineArgumentTest`), damaged run files, empty splits and a wrong kind
  of entry in model_dir are named (`RunFileTest`);
  K-FAC's counters hold the steps the loss scale skipped (`SkippedStepsTest`). Preemption
  and failed ranks under Horovod are in tests/test_trainer_horovod.py.
"""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from unittest import mock

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags, logging
from absl.testing import absltest, parameterized
import numpy as np
import tensorflow as tf

import pipelines
import tfkfac
from idx_testing import write_small_idx_dir
from process_output import in_background
from pipelines import augment, idx_dataset
import trainer_testing as tt
from trainers import checkpoints, cli, config as config_lib, errors, preemption
from trainers import runner, storage
from trainers import train

FLAGS = flags.FLAGS
# The warm-up is given: by default it is 5% of the budget, which these resumes change.
KFAC = dict(model="mlp", factor_update_freq=5, decomposition_update_freq=10,
            learning_rate=0.01, warmup_epochs=0.1)
# What a user types on resume; everything else comes from the run itself.
RESUME_GIVEN = {"model_dir", "resume", "steps"}


# The same K-FAC run as flags of the binary (without --model_dir and the budget).
KFAC_FLAGS = [f"--{name}={value}" for name, value in KFAC.items()] + tt.SMALL_FLAGS
_UNINTERRUPTED = {}


def uninterrupted_run(noise_scale=False):
    """The model_dir of a 40-step K-FAC run never stopped (checkpoints step-20 and
    step-40), with or without --noise_scale, made once and shared by the tests that
    resume a stopped run to 40."""
    if noise_scale not in _UNINTERRUPTED:
        name = "noise_straight" if noise_scale else "uninterrupted"
        model_dir = os.path.join(absltest.get_default_test_tmpdir(), name)
        shutil.rmtree(model_dir, ignore_errors=True)
        run(model_dir, steps=40, noise_scale=noise_scale, **KFAC)
        _UNINTERRUPTED[noise_scale] = model_dir
    return _UNINTERRUPTED[noise_scale]


def stopped_at_step_20(model_dir):
    """`model_dir`: a copy of the uninterrupted run without its step-40 checkpoint, which
    resumes from step 20 as a run stopped there does (it costs no training of its own)."""
    # (Not copied, rather than removed: it would not fit on DiskFaultTest's small disk.)
    shutil.copytree(uninterrupted_run(), model_dir, ignore=shutil.ignore_patterns("step-40"))
    return model_dir


def run(model_dir, explicitly_set=None, **settings):
    return runner.run(config_lib.TrainConfig(model_dir=model_dir, **dict(tt.SMALL, **settings)),
                      explicitly_set)


def resume(model_dir, steps):
    """`--resume --model_dir=D --steps=N` and nothing else."""
    return runner.run(config_lib.TrainConfig(model_dir=model_dir, steps=steps, resume=True,
                                             verbose=0), RESUME_GIVEN | {"verbose"})


def float_flags():
    """Every float-valued flag of trainers.train (list flags of floats included; not the
    old names of renamed flags, which are the same flags)."""
    names = [flag.name for flag in FLAGS.get_key_flags_for_module(train)
             if flag.flag_type() == "float" and flag.name not in config_lib.RENAMED_FIELDS]
    return sorted(names + ["lr_decay_epochs"])


class ResumeByStepTest(parameterized.TestCase):
    """1: resume continues to exactly the budget asked, mid-epoch included, with the
    same variables and metrics as an uninterrupted run; config.json keeps the original
    settings and run_history.json records what each start changed. 3: resume needs a run."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        root = absltest.get_default_test_tmpdir()
        cls.straight = os.path.join(root, "straight")
        cls.resumed = os.path.join(root, "resumed")
        shutil.rmtree(cls.straight, ignore_errors=True)
        shutil.rmtree(cls.resumed, ignore_errors=True)
        cls.expected = run(cls.straight, steps=50, **KFAC)
        # 5 steps (mid-epoch 1), then to 30 (mid-epoch 2), then to 50 (mid-epoch 3); the
        # resumed starts give only --resume, --model_dir and --steps.
        cls.first = run(cls.resumed, steps=5, **KFAC)
        cls.second = resume(cls.resumed, 30)
        cls.third = resume(cls.resumed, 50)

    def test_each_start_stops_at_exactly_the_steps_asked(self):
        self.assertEqual([self.first["steps"], self.second["steps"], self.third["steps"]],
                         [5, 30, 50])
        self.assertEqual(sorted(os.listdir(os.path.join(self.resumed, "checkpoints"))),
                         ["step-40", "step-50"])
        saved = tt.step_tensors(self.resumed, 50)
        self.assertEqual(saved["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"], 50)

    def test_variables_equal_an_uninterrupted_run(self):
        tt.assert_same_tensors(self, tt.step_tensors(self.straight, 50),
                               tt.step_tensors(self.resumed, 50))

    def test_metrics_equal_an_uninterrupted_run_with_the_same_columns(self):
        want = tt.read_csv(os.path.join(self.straight, "metrics.csv"))
        have = tt.read_csv(os.path.join(self.resumed, "metrics.csv"))
        self.assertEqual(list(want[0]), list(have[0]))  # column order (finding 9)
        self.assertEqual(list(have[0])[:3], ["epoch", "steps", "train_time_s"])
        self.assertEqual([row["steps"] for row in have], ["20", "40", "50"])
        for mine, theirs in zip(have, want):
            mine.pop("train_time_s")
            theirs.pop("train_time_s")
            self.assertEqual(mine, theirs)
        for key in ("epochs", "fresh_examples", "final_metrics"):
            if key == "final_metrics":
                self.third[key].pop("train_time_s")
                self.expected[key].pop("train_time_s")
            self.assertEqual(self.third[key], self.expected[key], key)

    def test_config_json_keeps_the_original_and_history_records_changes(self):
        config = tt.read_json(os.path.join(self.resumed, checkpoints.CONFIG_FILE))
        self.assertEqual((config["steps"], config["model"], config["resume"]), (5, "mlp", False))
        history = tt.read_json(os.path.join(self.resumed, checkpoints.RUN_HISTORY_FILE))
        self.assertEqual([(entry["from_step"], entry["changed"]) for entry in history],
                         [(0, {}), (5, {"steps": [5, 30]}), (30, {"steps": [5, 50]})])
        self.assertEqual(self.third["config"]["model"], "mlp")  # taken from the run

    def test_changing_a_fixed_setting_on_resume_is_an_error(self):
        config = config_lib.TrainConfig(model_dir=self.resumed, resume=True, steps=60,
                                        learning_rate=0.1)
        with self.assertRaisesRegex(ValueError, r"changed: learning_rate \(0.01 -> 0.1\); "
                                    r"only these may change: steps, epochs"):
            runner.check(config, RESUME_GIVEN | {"learning_rate"})

    def test_fewer_steps_than_done_is_an_error(self):
        config = config_lib.TrainConfig(model_dir=self.resumed, resume=True, steps=40)
        with self.assertRaisesRegex(ValueError, "has trained 50 steps already, more than the "
                                    "40 asked"):
            runner.check(config, RESUME_GIVEN)

    def test_resume_without_a_run_is_an_error_naming_the_directory(self):
        empty = self.create_tempdir().full_path
        missing = os.path.join(empty, "mistyped")
        for model_dir, what in ((empty, "holds no run to resume"),
                                (missing, "does not exist")):
            config = config_lib.TrainConfig(model_dir=model_dir, resume=True, **tt.SMALL)
            with self.assertRaisesRegex(ValueError, f"resume: model_dir {model_dir} {what}"):
                runner.check(config)

    def test_auto_resume_starts_fresh_or_continues(self):
        empty = self.create_tempdir().full_path
        fresh = runner.check(config_lib.TrainConfig(model_dir=empty, auto_resume=True,
                                                    **tt.SMALL), {"model_dir", "auto_resume"})
        self.assertFalse(fresh.resume)
        again = runner.check(config_lib.TrainConfig(model_dir=self.resumed, auto_resume=True,
                                                    verbose=0), {"model_dir", "auto_resume"})
        self.assertTrue(again.resume)
        self.assertEqual((again.model, again.steps), ("mlp", 50))


class CheckpointFaultTest(parameterized.TestCase):
    """4: a damaged newest checkpoint is reported by path and reason and the run falls
    back to the older one, saying how many steps are lost, and ends with the variables of
    an undamaged run; none loading is one error naming each; a process killed between
    writing a checkpoint and renaming it into place resumes from the previous one."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.base = uninterrupted_run()
        cls.want = tt.step_tensors(cls.base, 40)

    def damaged_copy(self, damage):
        model_dir = os.path.join(self.create_tempdir().full_path, "run")
        shutil.copytree(self.base, model_dir)
        damage(tt.checkpoint_dir(model_dir, 40))
        return model_dir

    @parameterized.named_parameters(
        ("half_truncated_data", "variables.data-00000-of-00001", "truncate",
         "variables .*/step-40/variables.* cannot be read: IndexError: Read less bytes"),
        ("truncated_index", "variables.index", "truncate",
         "variables .*/step-40/variables.* cannot be read: OpError: not an sstable"),
        ("deleted_data", "variables.data-00000-of-00001", "delete",
         "variables .*/step-40/variables.* \(.*/step-40/variables.index\) cannot be read"),
        ("truncated_state", checkpoints.STATE_FILE, "truncate", "is not valid JSON"),
        ("deleted_state", checkpoints.STATE_FILE, "delete", "trainer_state.json is missing"),
    )
    def test_falls_back_to_the_older_checkpoint(self, file_name, how, reason):
        def damage(directory):
            path = os.path.join(directory, file_name)
            if how == "delete":
                os.remove(path)
            else:
                os.truncate(path, os.path.getsize(path) // 2)

        model_dir = self.damaged_copy(damage)
        with self.assertLogs("absl", "WARNING") as logs:
            summary = resume(model_dir, 40)
        damaged = tt.checkpoint_dir(model_dir, 40)
        warnings = "\n".join(logs.output)
        self.assertRegex(warnings, f"checkpoint {damaged} \\(step 40\\) cannot be loaded: .*"
                         f"{reason}")
        self.assertIn(f"resuming from the older checkpoint {tt.checkpoint_dir(model_dir, 20)} "
                      "(step 20) instead: 20 steps of training (steps 20 to 40) are lost",
                      warnings)
        self.assertEqual(summary["steps"], 40)
        tt.assert_same_tensors(self, self.want, tt.step_tensors(model_dir, 40))

    def test_none_loading_is_one_error_naming_every_checkpoint(self):
        def damage(directory):
            os.remove(os.path.join(directory, "variables.index"))

        model_dir = self.damaged_copy(damage)
        older = tt.checkpoint_dir(model_dir, 20)
        with open(os.path.join(older, checkpoints.STATE_FILE), "w", encoding="utf-8") as f:
            f.write('{"counters": {"st')
        config = config_lib.TrainConfig(model_dir=model_dir, resume=True, steps=40, verbose=0)
        with self.assertRaises(checkpoints.CheckpointError) as caught:
            runner.check(config, RESUME_GIVEN)
        message = str(caught.exception)
        self.assertRegex(message, f"no checkpoint of the run in {model_dir} can be loaded; "
                         f"tried {tt.checkpoint_dir(model_dir, 40)} \\(.*\\); {older} "
                         f"\\({older}/trainer_state.json is not valid JSON")
        self.assertNotIn("\n", message)

    def test_run_in_the_layout_before_step_checkpoints_resumes(self):
        # Until this layout, checkpoints were checkpoints/epoch-<N>.* beside a model-dir
        # trainer_state.json naming the newest; such runs still resume exactly.
        model_dir = self.damaged_copy(shutil.rmtree)  # keep only step-20
        step_20 = tt.checkpoint_dir(model_dir, 20)
        for name in os.listdir(step_20):
            if name.startswith(checkpoints.VARIABLES_PREFIX):
                suffix = name[len(checkpoints.VARIABLES_PREFIX):]
                os.rename(os.path.join(step_20, name),
                          os.path.join(model_dir, "checkpoints", "epoch-1" + suffix))
        state = tt.read_json(os.path.join(step_20, checkpoints.STATE_FILE))
        with open(os.path.join(model_dir, checkpoints.STATE_FILE), "w", encoding="utf-8") as f:
            json.dump(dict(state, checkpoint="epoch-1"), f)
        shutil.rmtree(step_20)
        summary = resume(model_dir, 40)
        self.assertEqual(summary["steps"], 40)
        tt.assert_same_tensors(self, self.want, tt.step_tensors(model_dir, 40))

    def test_run_with_the_setting_names_before_0_2_resumes(self):
        # config.json of a run started before the renames names the decomposition interval
        # `inv_update_freq`: it resumes exactly, under today's name.
        model_dir = self.damaged_copy(shutil.rmtree)  # keep only step-20
        config_path = os.path.join(model_dir, checkpoints.CONFIG_FILE)
        config = tt.read_json(config_path)
        config["inv_update_freq"] = config.pop("decomposition_update_freq")
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(config, f)
        summary = resume(model_dir, 40)
        self.assertEqual(summary["config"]["decomposition_update_freq"], 10)
        self.assertNotIn("inv_update_freq", summary["config"])
        tt.assert_same_tensors(self, self.want, tt.step_tensors(model_dir, 40))

    def test_killed_while_writing_a_checkpoint(self):
        model_dir = stopped_at_step_20(os.path.join(self.create_tempdir().full_path, "run"))
        killed = tt.run_binary(f"--model_dir={model_dir}", "--resume", "--steps=40",
                               env={checkpoints.FAULT_ENV: "before_rename@40"})
        self.assertEqual(killed.returncode, -9, killed.stderr[-2000:])
        listing = sorted(os.listdir(os.path.join(model_dir, "checkpoints")))
        self.assertEqual(listing, [".partial-step-40", "step-20"])  # step-20 is the newest
        with self.assertLogs("absl", "WARNING") as logs:
            summary = resume(model_dir, 40)
        partial = os.path.join(model_dir, "checkpoints", ".partial-step-40")
        self.assertRegex("\n".join(logs.output), f"removing {partial} \\(.* MB\\), left by a "
                         "checkpoint write that did not finish")
        self.assertEqual(summary["steps"], 40)
        self.assertEqual(sorted(os.listdir(os.path.join(model_dir, "checkpoints"))),
                         ["step-20", "step-40"])
        tt.assert_same_tensors(self, self.want, tt.step_tensors(model_dir, 40))


class FloatValidationTest(parameterized.TestCase):
    """2: NaN and infinity are rejected for every float flag, every float argument of
    tfkfac.KFAC and of the pipelines, naming the argument, the value and the range."""

    def test_every_float_flag_is_covered(self):
        self.assertContainsSubset(
            {"learning_rate", "momentum", "weight_decay", "damping", "kl_clip", "echo_factor",
             "warmup_epochs", "lr_decay_factor", "lr_decay_power", "erasing_probability",
             "mixup_alpha", "read_latency", "target_accuracy", "lr_decay_epochs"},
            float_flags())

    @parameterized.product(name=float_flags(), value=["nan", "inf", "-inf"])
    def test_float_flag(self, name, value):
        config, explicitly_set = tt.config_from_argv(f"--{name}={value}")
        # "a finite number > 0", "in [0, 1)": each names the allowed range (and, for an
        # optional setting, what None does).
        with self.assertRaisesRegex(ValueError, f"^`{name}` must be (a finite number|in) .*; "
                                    f"received {value}( \\(None [a-z ]+\\))?$"):
            runner.check(config, explicitly_set)

    @parameterized.product(
        name=["learning_rate", "damping", "momentum", "factor_decay", "kl_clip",
              "diagonal_damping_multiplier", "factor_batch_fraction", "weight_decay"],
        value=[math.nan, math.inf])
    def test_kfac_argument(self, name, value):
        with self.assertRaisesRegex(ValueError, f"`{name}` must be .*received {value}"):
            tfkfac.KFAC(**{name: value})

    @parameterized.parameters(
        (dict(echo_factor=math.nan, echo_mode="batch"), "echo_factor", "nan"),
        (dict(read_latency=math.inf), "read_latency", "inf"),
        (dict(stddev=0.0), "stddev", "0.0"),
        (dict(mean=[0.5, math.nan]), "mean", "nan"),
    )
    def test_pipelines_build(self, arguments, name, value):
        with self.assertRaisesRegex(ValueError, f"`{name}` must be a finite number.*; "
                                    f"received {value}"):
            pipelines.build("fashion_mnist", batch_size=8, **arguments)

    def test_other_pipeline_functions(self):
        cases = [
            (lambda: pipelines.Augmentation(erasing_probability=math.nan),
             "erasing_probability", "nan"),
            (lambda: pipelines.Augmentation(mixup_alpha=math.inf), "mixup_alpha", "inf"),
            (lambda: pipelines.echo(math.inf), "echo_factor", "inf"),
            (lambda: pipelines.simulate_read_latency(math.nan), "seconds_per_example", "nan"),
            (lambda: augment.random_erasing(np.zeros((4, 4, 1), np.float32), [1, 2],
                                            probability=math.nan), "probability", "nan"),
            (lambda: augment.sample_beta([2], math.inf, [1, 2]), "alpha", "inf"),
        ]
        for make, name, value in cases:
            with self.subTest(name=name):
                with self.assertRaisesRegex(ValueError, f"`{name}` must be a finite number.*; "
                                            f"received {value}"):
                    make()


class PredictableFailureTest(absltest.TestCase):
    """5.-7.: an unprepared dataset, a model_dir that is a file or not writable, a batch
    larger than the shard, missing, damaged or changed IDX files are each one ValueError
    from `runner.check` (before any model is built), which the binary prints as a usage
    error (see UsageOutputTest)."""

    def check(self, **settings):
        runner.check(config_lib.TrainConfig(**dict(tt.SMALL, **settings)))

    def test_unprepared_tfds_dataset_says_how_to_prepare_it(self):
        data_dir = self.create_tempdir().full_path
        with self.assertRaisesRegex(
                ValueError, f"dataset cifar10 is not prepared in data_dir {data_dir}: prepare it "
                f"there first \\(`tfds build cifar10 --data_dir={data_dir}`"):
            self.check(dataset="cifar10", data_dir=data_dir, train_split="train",
                       eval_split="test")

    def test_model_dir_that_is_a_file_or_not_writable(self):
        a_file = self.create_tempfile().full_path
        with self.assertRaisesRegex(ValueError, f"model_dir {a_file} is a file, not a directory"):
            self.check(model_dir=a_file)
        inside_file = os.path.join(a_file, "run")
        with self.assertRaisesRegex(ValueError, f"cannot be created: {a_file} is a file"):
            self.check(model_dir=inside_file)
        # /proc refuses new entries even to root.
        with self.assertRaisesRegex(ValueError, "model_dir /proc/self/run cannot be created: "
                                    "/proc/self is not writable"):
            self.check(model_dir="/proc/self/run")

    def test_batch_larger_than_the_shard(self):
        with self.assertRaisesRegex(ValueError, r"batch_size=100000 is larger than one rank's "
                                    r"share \(640 examples"):
            self.check(batch_size=100000)

    def test_idx_errors_name_the_file(self):
        root = self.create_tempdir().full_path
        idx_dir = os.path.join(root, "idx")
        os.makedirs(idx_dir)
        write_small_idx_dir(idx_dir, num_train=64, num_test=16, gzipped=True)
        damaged = os.path.join(idx_dir, "train-images-idx3-ubyte.gz")
        with open(damaged, "rb") as f:
            data = f.read()
        with open(damaged, "wb") as f:
            f.write(data[:len(data) // 2])
        settings = dict(dataset="mnist", idx_dir=idx_dir, data_dir=os.path.join(root, "tfds"),
                        train_split="train", eval_split="test", batch_size=8)
        with self.assertRaisesRegex(ValueError, f"IDX file {damaged} is damaged: its gzip "
                                    "stream ends early"):
            self.check(**settings)
        os.remove(damaged)
        with self.assertRaisesRegex(ValueError, f"IDX file missing: looked for {damaged}"):
            self.check(**settings)

    def test_prepared_from_other_files_is_an_error_and_idx_dir_is_a_flag(self):
        root = self.create_tempdir().full_path
        first, second = os.path.join(root, "first"), os.path.join(root, "second")
        for seed, directory in enumerate((first, second)):
            os.makedirs(directory)
            write_small_idx_dir(directory, num_train=64, num_test=16, gzipped=True, seed=seed)
        data_dir = os.path.join(root, "tfds")
        config, explicitly_set = tt.config_from_argv(
            "--dataset=mnist", f"--idx_dir={first}", f"--data_dir={data_dir}",
            "--batch_size=8", "--train_split=train", "--eval_split=test")
        self.assertEqual(config.idx_dir, first)
        runner.check(config, explicitly_set)  # prepares mnist from `first`
        recorded = tt.read_json(os.path.join(
            idx_dataset.prepare_idx("mnist", data_dir=data_dir).data_dir,
            idx_dataset.SOURCES_FILE))
        self.assertEqual(recorded["idx_dir"], first)
        self.assertEqual(recorded["files"]["train-images-idx3-ubyte.gz"]["size"],
                         os.path.getsize(os.path.join(first, "train-images-idx3-ubyte.gz")))
        runner.check(config, explicitly_set)  # the same files again: fine
        with self.assertRaisesRegex(ValueError, f"mnist_idx in {data_dir}.* was prepared from "
                                    f"other IDX files \\(from {first}\\) than those in idx_dir "
                                    f"{second}: t10k-images-idx3-ubyte.gz"):
            runner.check(config_lib.TrainConfig(**dict(vars(config), idx_dir=second)))

    def test_idx_dir_with_another_dataset(self):
        with self.assertRaisesRegex(ValueError, "idx_dir only applies to the IDX datasets "
                                    "fashion_mnist, mnist, not dataset=cifar10"):
            self.check(dataset="cifar10", idx_dir="/tmp")


class SkippedStepsTest(parameterized.TestCase):
    """8: with mixed_float16, steps whose update the loss scale skipped are counted in
    skipped_steps (summary and summary.json): each skip halves the loss scale, so
    skipped steps = log2(initial scale / final scale) when the scale never grows."""

    @parameterized.parameters("sgd", "kfac")
    def test_loss_scale_skips_are_counted(self, optimizer):
        model_dir = self.create_tempdir().full_path
        config = config_lib.TrainConfig(model_dir=model_dir, model="mlp", optimizer=optimizer,
                                        precision="mixed_float16", steps=20, learning_rate=0.01,
                                        **tt.SMALL)
        try:
            trainer = runner.Trainer(config)
            scale = trainer.model.optimizer.dynamic_scale
            scale.assign(2.0 ** 24)  # float16 gradients overflow until it has halved enough
            summary = trainer.train()
        finally:
            pipelines.set_precision("float32")
        halvings = 24 - math.log2(float(scale.numpy()))
        self.assertGreater(summary["skipped_steps"], 0)
        self.assertEqual(summary["skipped_steps"], halvings)
        self.assertEqual(summary["skipped_steps"],
                         20 - int(trainer.optimizer.iterations.numpy()))
        on_disk = tt.read_json(os.path.join(model_dir, runner.SUMMARY_FILE))
        self.assertEqual(on_disk["skipped_steps"], summary["skipped_steps"])
        if optimizer == "kfac":  # K-FAC's own counters agree
            self.assertEqual(summary["kfac"]["counters"]["skipped_steps"],
                             summary["skipped_steps"])


class UsageOutputTest(parameterized.TestCase):
    """5., 6., 9.: the binary ends every mistake found before the run as a usage error
    (trainers/cli.py): exit code 2, the one-line hint, the error as its last line; no flag
    list, no traceback."""

    def assert_one_line_error(self, result, message):
        tt.assert_error(self, result, message)
        self.assertLessEqual(len(tt.own_lines(result.stderr)), 3)  # at most one log line

    def test_bad_flag_value_and_inconsistent_flags(self):
        bad_value, inconsistent = tt.run_binaries([["--steps=abc"],
                                                   ["--optimizer=sgd", "--damping=0.01"]])
        self.assert_one_line_error(bad_value, "flag --steps=abc: invalid literal")
        self.assert_one_line_error(
            inconsistent, "damping only applies to optimizer=kfac, not optimizer=sgd")

    def test_predictable_failures(self):
        root = self.create_tempdir().full_path
        a_file = self.create_tempfile().full_path
        empty = os.path.join(root, "empty")
        os.makedirs(empty)
        cases = [
            (["--dataset=cifar10", f"--data_dir={root}"], "dataset cifar10 is not prepared"),
            ([f"--model_dir={a_file}"], f"model_dir {a_file} is a file"),
            (["--batch_size=100000"], "batch_size=100000 is larger than one rank's share"),
            (["--resume", f"--model_dir={empty}"], f"resume: model_dir {empty} holds no run"),
            (["--learning_rate=nan", "--optimizer=sgd"], "`learning_rate` must be a finite"),
        ]
        results = tt.run_binaries([[*argv, "--model=mlp"] for argv, _ in cases])
        for (argv, message), result in zip(cases, results):
            with self.subTest(argv=argv):
                self.assert_one_line_error(result, message)

    def test_data_dir_is_created_only_under_an_existing_parent(self):
        root = self.create_tempdir().full_path
        idx_dir = os.path.join(root, "idx")
        os.makedirs(idx_dir)
        write_small_idx_dir(idx_dir, num_train=64, num_test=16, gzipped=True)
        settings = dict(dataset="mnist", idx_dir=idx_dir, train_split="train",
                        eval_split="test", batch_size=8)
        orphan = os.path.join(root, "no", "such", "dir")
        with self.assertRaisesRegex(ValueError, f"data_dir {orphan} does not exist and neither "
                                    f"does its parent {os.path.dirname(orphan)}"):
            runner.check(config_lib.TrainConfig(data_dir=orphan, **settings))
        self.assertFalse(os.path.exists(os.path.join(root, "no")))
        new = os.path.join(root, "new")
        with self.assertLogs("absl", "WARNING") as logs:
            runner.check(config_lib.TrainConfig(data_dir=new, **settings))
        self.assertIn(f"data_dir {new} did not exist; created it", "\n".join(logs.output))
        self.assertTrue(os.path.isdir(new))



def own_stderr(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def start_run(*argv):
    """The K-FAC run of `uninterrupted_run` (with `argv` added) started in the binary, in a
    new model_dir; (process, model_dir, log_dir)."""
    root = tempfile.mkdtemp(dir=absltest.get_default_test_tmpdir())
    model_dir, log_dir = os.path.join(root, "run"), os.path.join(root, "logs")
    os.makedirs(log_dir)
    process = tt.start_binary(f"--model_dir={model_dir}", "--steps=40", *KFAC_FLAGS, *argv,
                              log_dir=log_dir)
    return process, model_dir, log_dir


def signal_mid_epoch_2(signum, *argv):
    """Starts the run (with `argv` added) and signals it once the progress bar shows
    epoch 2 training (3 steps done); returns (model_dir, exit code, seconds from the
    signal to the exit, stderr lines). A generous grace period: a loaded machine is not
    the subject."""
    # 5 ms per example: a step takes at least 0.16 s.
    process, model_dir, log_dir = start_run("--read_latency=0.005", "--verbose=1",
                                            "--preemption_grace_seconds=300", *argv)
    # The bar is "\x1b[1m 3/20" or "\x1b[1m13/20" (no word boundary before 13): a bar
    # that skipped steps 3-9 (it redraws at most every 0.05 s) still matches.
    tt.wait_for(process, os.path.join(log_dir, "stdout"), r"Epoch 2/2.*(?<!\d)([3-9]|1\d)/20")
    sent = time.monotonic()
    process.send_signal(signum)
    returncode = process.wait(timeout=600)
    return (model_dir, returncode, time.monotonic() - sent,
            tt.own_lines(own_stderr(os.path.join(log_dir, "stderr"))))


def signal_past_the_grace_period():
    """Starts a run whose steps outlast its grace period and sends it SIGTERM once it
    trains; returns (model_dir, exit code, stderr lines)."""
    # 50 ms per example: a step takes 1.6 s, longer than the 0.3 s grace period.
    process, model_dir, log_dir = start_run("--read_latency=0.05",
                                            "--preemption_grace_seconds=0.3")
    # run_history.json is written once training has begun.
    tt.wait_for(process, os.path.join(model_dir, checkpoints.RUN_HISTORY_FILE))
    process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=600)
    return model_dir, returncode, tt.own_lines(own_stderr(os.path.join(log_dir, "stderr")))


def setUpModule():
    PreemptionTest.start_runs()


class PreemptionTest(absltest.TestCase):
    """SIGTERM (a job scheduler) or SIGINT (Ctrl-C) mid-epoch: the step in
    progress finishes, its checkpoint is written, the process exits with code 75 and
    one line saying how to continue; resuming ends with the variables and metrics of a
    run never stopped. Past the grace period the process ends with 128 + the signal,
    saying where a restart continues from. Real signals sent to real trainer processes;
    --read_latency only slows the input (the data and so the run stay the same). The
    three processes run at once, started by setUpModule, while the other tests run."""

    runs = None  # {scenario: the Future of its result}

    @classmethod
    def start_runs(cls):
        cls.runs = {
            "sigterm": in_background(signal_mid_epoch_2, signal.SIGTERM, "--noise_scale"),
            "sigint": in_background(signal_mid_epoch_2, signal.SIGINT),
            "past_grace": in_background(signal_past_the_grace_period)}

    def test_sigterm_mid_epoch_checkpoints_the_step_and_resume_is_exact(self):
        # With --noise_scale: the epoch the checkpoint cut keeps the noise scale of the
        # run never stopped (its sums over the measured steps are in the checkpoint).
        model_dir, returncode, seconds, lines = self.runs["sigterm"].result()
        self.assertEqual(returncode, preemption.EXIT_CODE, lines[-5:])
        step = int(re.search(r"holds step (\d+) of 40", lines[-1]).group(1))
        self.assertRegex(lines[-1], f"^trainers.train: preempted by SIGTERM \\(rank 0\\): "
                         f"checkpoint {tt.checkpoint_dir(model_dir, step)} holds step {step} "
                         f"of 40; continue with --resume --model_dir={model_dir} \\(or "
                         "--auto_resume\\); exit code 75$")
        self.assertTrue(20 < step < 40, step)  # in the middle of epoch 2
        self.assertTrue(os.path.isdir(tt.checkpoint_dir(model_dir, step)))
        self.assertNotIn("Traceback", "\n".join(lines))
        logging.info("SIGTERM -> checkpoint at step %d, exit code %d after %.1f s", step,
                     returncode, seconds)
        summary = resume(model_dir, 40)
        self.assertEqual(summary["steps"], 40)
        straight = uninterrupted_run(noise_scale=True)
        tt.assert_same_tensors(self, tt.step_tensors(straight, 40), tt.step_tensors(model_dir, 40))
        assert_same_metrics(self, model_dir, straight)

    def test_sigint_is_the_same_without_a_traceback(self):
        _, returncode, _, lines = self.runs["sigint"].result()
        self.assertEqual(returncode, preemption.EXIT_CODE, lines[-5:])
        self.assertRegex(lines[-1], "^trainers.train: preempted by SIGINT .* holds step "
                         "(2[1-9]|3[0-9]) of 40")
        self.assertFalse([line for line in lines if "Traceback" in line
                          or "KeyboardInterrupt" in line], lines)

    def test_past_the_grace_period_exits_with_the_signal_code(self):
        model_dir, returncode, lines = self.runs["past_grace"].result()
        self.assertEqual(returncode, 128 + signal.SIGTERM)
        self.assertEqual(lines[-1], "trainers.train: stopped by SIGTERM, and the 0.3 s grace "
                         "period passed before its checkpoint was written; exiting without a "
                         "new checkpoint; the run has no checkpoint yet: a restart starts it "
                         "over")
        # Nothing half-written that a restart could take for a checkpoint.
        self.assertFalse(checkpoints.candidates(model_dir))


def full_disk_error(model_dir):
    """The error of a run in `model_dir` whose step-40 checkpoint did not fit on the disk
    while step-20 did, as a regex."""
    return (f"cannot write {tt.checkpoint_dir(model_dir, 40)}: No space left on device "
            "\\(the partial write was removed\\); it needs about [0-9.]+ MB and [0-9.]+ [KMG]?B "
            f"are free there; safe to delete: {model_dir}/tensorboard \\(.*, TensorBoard "
            f"logs; metrics.csv holds the same numbers\\); keep "
            f"{tt.checkpoint_dir(model_dir, 20)}, the newest complete checkpoint "
            "\\(step 20\\): --resume continues from it$")


class DiskFaultTest(absltest.TestCase):
    """on a real full disk (a small tmpfs) a checkpoint write fails with one
    line naming the path, the bytes needed and free, what is safe to delete and what to
    keep; the partial write is removed, so with room made the run resumes exactly."""

    def setUp(self):
        super().setUp()
        self.mount_point = self.create_tempdir().full_path
        straight = uninterrupted_run()
        self.checkpoint_bytes = storage.tree_bytes(tt.checkpoint_dir(straight, 20))
        # Room for one checkpoint and the run's small files, not for a second checkpoint.
        size = int(self.checkpoint_bytes * 1.5)
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                  self.mount_point], capture_output=True, text=True)
        if mounted.returncode:
            self.skipTest(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
        self.addCleanup(subprocess.run, ["umount", "-l", self.mount_point], check=True)

    def test_full_disk_is_one_clear_error_and_blocks_no_resume(self):
        model_dir = stopped_at_step_20(os.path.join(self.mount_point, "run"))
        full = tt.run_binary(f"--model_dir={model_dir}", "--resume", "--steps=40")
        tt.assert_error(self, full, full_disk_error(model_dir), cli.FAILURE_EXIT_CODE)
        needed = float(re.search(r"needs about ([0-9.]+) MB", full.stderr).group(1))
        self.assertAlmostEqual(needed, self.checkpoint_bytes / 1e6, delta=0.1)
        self.assertEqual(os.listdir(os.path.join(model_dir, "checkpoints")), ["step-20"])
        # Room made (the file system grown), the same resume continues from step 20.
        subprocess.run(["mount", "-o", f"remount,size={4 * self.checkpoint_bytes}",
                        self.mount_point], check=True)
        self.assertEqual(resume(model_dir, 40)["steps"], 40)
        tt.assert_same_tensors(self, tt.step_tensors(uninterrupted_run(), 40),
                               tt.step_tensors(model_dir, 40))


class InjectedWriteFailureTest(absltest.TestCase):
    """Where no tmpfs can be mounted: the disk fills while the step-40
    checkpoint is written (the write stores part of its data, then raises what
    TensorFlow raises on ENOSPC). The run ends with the error of a real full disk,
    nothing of the write is left, and resuming ends with the variables of a run never
    stopped."""

    def test_failed_checkpoint_write_is_one_error_and_blocks_no_resume(self):
        model_dir = stopped_at_step_20(os.path.join(self.create_tempdir().full_path, "run"))
        real_write = tf.train.Checkpoint.write

        def write(checkpoint, prefix, *args, **kwargs):
            if "step-40" not in prefix:
                return real_write(checkpoint, prefix, *args, **kwargs)
            with open(f"{prefix}.data-00000-of-00001", "wb") as f:
                f.write(bytes(4096))  # what fitted before the disk was full
            raise tf.errors.ResourceExhaustedError(
                None, None, f"{prefix}.data-00000-of-00001; No space left on device")

        with mock.patch.object(tf.train.Checkpoint, "write", autospec=True, side_effect=write):
            with self.assertRaisesRegex(storage.WriteError, "^" + full_disk_error(model_dir)):
                resume(model_dir, 40)
        self.assertEqual(os.listdir(os.path.join(model_dir, "checkpoints")), ["step-20"])
        self.assertEqual(resume(model_dir, 40)["steps"], 40)
        tt.assert_same_tensors(self, tt.step_tensors(uninterrupted_run(), 40),
                               tt.step_tensors(model_dir, 40))


class ResumeBudgetTest(absltest.TestCase):
    """a run started with --steps and resumed with only --epochs trains to
    the new epochs (the new budget replaces the old one), recorded in run_history."""

    def test_epochs_given_on_resume_replace_the_steps_budget(self):
        model_dir = stopped_at_step_20(os.path.join(self.create_tempdir().full_path, "run"))
        summary = runner.run(config_lib.TrainConfig(model_dir=model_dir, resume=True, epochs=3,
                                                    verbose=0),
                             {"model_dir", "resume", "epochs", "verbose"})
        self.assertEqual((summary["steps"], summary["epochs"]), (3 * tt.STEPS_PER_EPOCH, 3))
        history = tt.read_json(os.path.join(model_dir, checkpoints.RUN_HISTORY_FILE))
        self.assertEqual(history[-1]["changed"], {"steps": [40, None], "epochs": [2, 3]})


def assert_same_metrics(test, model_dir, straight):
    """metrics.csv of `model_dir` is that of `straight`, noise_scale column included."""
    have = tt.read_csv(os.path.join(model_dir, "metrics.csv"))
    want = tt.read_csv(os.path.join(straight, "metrics.csv"))
    for row in have + want:
        row.pop("train_time_s")
    test.assertIn("noise_scale", want[-1])
    test.assertEqual(have, want)


class NoiseScaleResumeTest(absltest.TestCase):
    """`--noise_scale` with a checkpoint mid-epoch by `--steps`: the resumed run's
    metrics.csv, the noise scale of the epoch it continued included, equals the one of a
    run never stopped (the epoch's sums over its measured steps are checkpointed with
    it). By SIGTERM: PreemptionTest's run has --noise_scale."""

    def test_resumed_by_steps(self):
        model_dir = self.create_tempdir().full_path
        run(model_dir, steps=30, noise_scale=True, **KFAC)
        state = tt.read_json(os.path.join(tt.checkpoint_dir(model_dir, 30),
                                          checkpoints.STATE_FILE))
        self.assertLen(state["noise_scale_sums"], 5)
        self.assertEqual(state["noise_scale_sums"][0], 10)  # steps 20-29 measured
        resume(model_dir, 40)
        assert_same_metrics(self, model_dir, uninterrupted_run(noise_scale=True))


class DivergenceTest(absltest.TestCase):
    """SGD at a learning rate that diverges (1e30) stops after its first
    `fit` with one error saying so and what to change, instead of training on to exit
    code 0 with NaN weights; the weights that are not finite are not checkpointed."""

    def test_diverged_run_stops_with_one_error_and_no_checkpoint_of_it(self):
        model_dir = self.create_tempdir().full_path
        with self.assertRaisesRegex(
                errors.RunError, r"^training diverged: after step 20 the model's weights are "
                r"not finite \(loss (nan|inf)\); they were not checkpointed: the run has no "
                r"checkpoint yet: a restart starts it over; a smaller learning_rate than "
                r"1e\+30 \(or a warmup, warmup_epochs\) keeps it finite$"):
            run(model_dir, model="mlp", optimizer="sgd", learning_rate=1e30, steps=40)
        self.assertFalse(checkpoints.candidates(model_dir))


class AbsurdSizeTest(parameterized.TestCase):
    """sizes that would hang or exhaust memory before the first step are
    refused by the check before anything is built, with the allowed range."""

    @parameterized.parameters(
        (["--echo_mode=example_before_augment", "--echo_factor=1e9"],
         r"`echo_factor` must be a finite number in \[1, 100\]; received 1000000000.0"),
        (["--shuffle_buffer=1000000000000"],
         r"`shuffle_buffer` must be an integer in \[0, 10000000\]; received 1000000000000"),
        (["--crop_padding=100000"],
         r"`crop_padding` must be an integer in \[0, 28\] \(the shorter "
         r"side of the 28x28x1 images\); received 100000"),
        (["--seed=-1"], r"`seed` must be an integer in \[0, 4294967295\]; received -1"),
        (["--seed=9223372036854775808"], r"`seed` must be an integer in \[0, 4294967295\]"),
        (["--read_latency=1e9"], r"`read_latency` must be a finite number in \[0, 1\]"),
    )
    def test_refused_with_the_allowed_range(self, argv, message):
        config, explicitly_set = tt.config_from_argv("--model=mlp", *tt.SMALL_FLAGS, *argv)
        with self.assertRaisesRegex(ValueError, f"^{message}"):
            runner.check(config, explicitly_set)

    def test_binary_refuses_in_one_line(self):
        result = tt.run_binary("--model=mlp", "--echo_mode=example_before_augment",
                               "--echo_factor=1e9")
        tt.assert_error(self, result, r"`echo_factor` must be a finite number")


class PipelineArgumentTest(parameterized.TestCase):
    """every `pipelines.build` argument of a wrong type or out of range is
    refused in Python, naming the argument and what it must be, before any graph."""

    @parameterized.parameters(
        (dict(batch_size="32"), "batch_size",
         r"an integer in \[1, 2\*\*63 - 1\]; received '32'"),
        (dict(batch_size=True), "batch_size",
         r"an integer in \[1, 2\*\*63 - 1\]; received True"),
        (dict(split=5), "split", "a split name"),
        (dict(data_dir=5), "data_dir", r"a path \(str or os.PathLike\); received 5 \(None "),
        (dict(idx_dir=["a"]), "idx_dir",
         r"a path \(str or os.PathLike\); received \['a'\] \(None "),
        (dict(echo_mode=None), "echo_mode", "one of none, example_before_augment"),
        (dict(echo_mode="batch", echo_factor="2"), "echo_factor", "a finite number in"),
        (dict(echo_mode="batch", echo_factor=101), "echo_factor", "a finite number in"),
        (dict(shuffle_buffer=1e4), "shuffle_buffer", r"an integer in \[0, 10000000\]"),
        (dict(shuffle_buffer=10**12), "shuffle_buffer", r"an integer in \[0, 10000000\]"),
        (dict(augmentation="flip"), "augmentation", "a pipelines.Augmentation"),
        (dict(num_classes="10"), "num_classes",
         r"an integer in \[1, 2\*\*63 - 1\]; received '10' \(None "),
        (dict(mean="0.5"), "mean", "a finite number"),
        (dict(mean=[0.5, 0.5]), "mean", r"a number or a list of 1 \(one per channel of the "
         r"28x28x1 images\); received \[0.5, 0.5\]"),
        (dict(stddev=[]), "stddev", r"a number or a list of 1 \(one per channel"),
        (dict(seed="1"), "seed", r"an integer in \[0, 4294967295\]"),
        (dict(seed=2**70), "seed", r"an integer in \[0, 4294967295\]"),
        (dict(epoch=1.5), "epoch", "an integer >= 0"),
        (dict(num_epochs="2"), "num_epochs",
         r"an integer in \[1, 2\*\*63 - 1\]; received '2' \(None "),
        (dict(num_shards=0), "num_shards", r"an integer in \[1, 2\*\*63 - 1\]"),
        (dict(num_shards=2, shard_index=2), "shard_index", r"an integer in \[0, 1\]"),
        (dict(dtype="no_such_dtype"), "dtype", "a floating dtype"),
        (dict(cache="yes"), "cache", "True or False"),
        (dict(read_latency=1e9), "read_latency", r"a finite number in \[0, 1\]"),
        (dict(drop_remainder=None), "drop_remainder", "True or False"),
        (dict(skip_batches=-1), "skip_batches", "an integer >= 0"),
        (dict(fresh_flags=1), "fresh_flags", "True or False"),
    )
    def test_argument_named(self, arguments, name, allowed):
        with self.assertRaisesRegex(ValueError, f"^`{name}` must be {allowed}"):
            pipelines.build("fashion_mnist", **dict(dict(batch_size=8), **arguments))

    def test_augmentation_fields_and_crop_beyond_the_image(self):
        for fields, name in ((dict(flip="yes"), "flip"), (dict(crop_padding=2.0), "crop_padding"),
                             (dict(running_mixup=1, mixup_alpha=0.2), "running_mixup")):
            with self.assertRaisesRegex(ValueError, f"^`{name}` must be"):
                pipelines.Augmentation(**fields)
        with self.assertRaisesRegex(ValueError, r"^`crop_padding` must be an integer in \[0, 28\]"):
            pipelines.build("fashion_mnist", batch_size=8,
                            augmentation=pipelines.Augmentation(crop_padding=29))


class RunFileTest(parameterized.TestCase):
    """a damaged config.json or run_history.json is named with the reason and
    what to do; a reversed or empty split is named as such; a file where the trainer
    writes a directory (checkpoints/, tensorboard/), or the reverse, is refused before
    training. Each is one ValueError from `runner.check`, one line from the binary."""

    def copy_with(self, name, content):
        model_dir = os.path.join(self.create_tempdir().full_path, "run")
        shutil.copytree(uninterrupted_run(), model_dir)
        with open(os.path.join(model_dir, name), "w", encoding="utf-8") as f:
            f.write(content)
        return model_dir

    @parameterized.parameters(
        (checkpoints.CONFIG_FILE, '{"model": "mlp", "batch', r"is damaged \(not valid JSON: "
         r"Unterminated string .*\); it holds the settings the run started with: restore it, "
         "or start a new run in another model_dir"),
        (checkpoints.CONFIG_FILE, "[1, 2]", r"is damaged \(a JSON list, not an object\); it "
         "holds the settings"),
        (checkpoints.CONFIG_FILE, '{"batch_size": "abc"}', r'is damaged \(batch_size is "abc" '
         r"\(a string\), not an integer\); it holds the settings"),
        (checkpoints.RUN_HISTORY_FILE, "[{", r"is damaged \(not valid JSON: .*\); it only "
         "records what each start changed: delete it to resume with the settings of "
         "config.json"),
        (checkpoints.RUN_HISTORY_FILE, '[{"changed": {"steps": 5}}]', r"is damaged \(not a "
         r"list of starts with their changed settings as \[before, after\] pairs\)"),
        (checkpoints.RUN_HISTORY_FILE, '[{"changed": {"kl_clip": ["x", "y"]}}]',
         r'is damaged \(kl_clip is "y" \(a string\), not a number or null\)'),
    )
    def test_damaged_run_file_is_named(self, name, content, reason):
        model_dir = self.copy_with(name, content)
        config = config_lib.TrainConfig(model_dir=model_dir, resume=True, steps=50)
        with self.assertRaisesRegex(checkpoints.RunFileError,
                                    f"^{os.path.join(model_dir, name)} {reason}"):
            runner.check(config, RESUME_GIVEN)

    def test_binary_names_the_damaged_file_in_one_line(self):
        model_dir = self.copy_with(checkpoints.CONFIG_FILE, "{")
        result = tt.run_binary(f"--model_dir={model_dir}", "--resume", "--steps=50")
        tt.assert_error(self, result, f"{model_dir}/config.json is damaged \\(not valid JSON",
                        cli.FAILURE_EXIT_CODE)

    @parameterized.parameters("train[500:100]", "train[:0]")
    def test_reversed_or_empty_split(self, split):
        config = config_lib.TrainConfig(model="mlp", train_split=split)
        with self.assertRaisesRegex(ValueError, f"^train_split '{re.escape(split)}' selects no "
                                    r"examples: it is a reversed or empty slice \(\[a:b\] needs "
                                    "a < b\\)$"):
            runner.check(config)

    @parameterized.parameters(("checkpoints", "file"), ("tensorboard", "file"),
                              ("metrics.csv", "directory"), ("config.json", "directory"))
    def test_wrong_kind_of_entry_in_model_dir(self, name, made):
        model_dir = self.create_tempdir().full_path
        path = os.path.join(model_dir, name)
        if made == "file":
            open(path, "w", encoding="utf-8").close()
        else:
            os.makedirs(path)
        needed = "directory" if made == "file" else "file"
        config = config_lib.TrainConfig(model_dir=model_dir, **dict(tt.SMALL, **KFAC))
        with self.assertRaisesRegex(ValueError, f"^{path} is a {made}, but the trainer writes "
                                    f"its {name} {needed} there: move it away or choose "
                                    "another model_dir$"):
            runner.check(config)


if __name__ == "__main__":
    absltest.main()
