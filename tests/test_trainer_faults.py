"""Faults and bad input of the trainer and its data path (issue 15), on short real runs
(MLP, slices of Fashion-MNIST). Each class names the findings of the issue it checks:

1. `--resume` trains exactly to `--steps`/`--epochs`, mid-epoch too, without rewriting
   config.json; 3. `--resume` with no run is an error, `--auto_resume` starts one;
4. damaged checkpoints fall back to the newest one that loads, a process killed while
   writing one loses nothing that was complete; 2. NaN and infinity are rejected for
   every float flag and float argument; 5.-7. predictable failures are one line and exit
   code 1; 8. loss-scale-skipped steps are counted; 9. usage errors end with the error
   line, metrics.csv keeps its columns, data_dir is created only under an existing parent.
"""

import json
import math
import os
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags
from absl.testing import absltest, parameterized
import numpy as np

import pipelines
import tfkfac
from idx_testing import write_small_idx_dir
from pipelines import augment, idx_dataset
import trainer_testing as tt
from trainers import checkpoints, config as config_lib, runner, train

FLAGS = flags.FLAGS
KFAC = dict(model="mlp", factor_update_freq=5, decomposition_update_freq=10,
            learning_rate=0.01)
# What a user types on resume; everything else comes from the run itself.
RESUME_GIVEN = {"model_dir", "resume", "steps"}


def run(model_dir, explicitly_set=None, **settings):
    return runner.run(config_lib.TrainConfig(model_dir=model_dir, **dict(tt.SMALL, **settings)),
                      explicitly_set)


def resume(model_dir, steps):
    """`--resume --model_dir=D --steps=N` and nothing else."""
    return runner.run(config_lib.TrainConfig(model_dir=model_dir, steps=steps, resume=True,
                                             verbose=0), RESUME_GIVEN | {"verbose"})


def assert_same_tensors(test, want, have):
    test.assertEqual(sorted(want), sorted(have))
    for key, value in want.items():
        if "phase_seconds" not in key:  # wall-clock totals, not training state
            np.testing.assert_array_equal(have[key], value, err_msg=key)


def float_flags():
    """Every float-valued flag of trainers.train (list flags of floats included)."""
    names = [flag.name for flag in FLAGS.get_key_flags_for_module(train)
             if flag.flag_type() == "float"]
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
        assert_same_tensors(self, tt.step_tensors(self.straight, 50),
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
        cls.base = os.path.join(absltest.get_default_test_tmpdir(), "fault_base")
        shutil.rmtree(cls.base, ignore_errors=True)
        run(cls.base, steps=40, **KFAC)  # checkpoints step-20 and step-40
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
        assert_same_tensors(self, self.want, tt.step_tensors(model_dir, 40))

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
        assert_same_tensors(self, self.want, tt.step_tensors(model_dir, 40))

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
        assert_same_tensors(self, self.want, tt.step_tensors(model_dir, 40))

    def test_killed_while_writing_a_checkpoint(self):
        model_dir = os.path.join(self.create_tempdir().full_path, "run")
        argv = [f"--model_dir={model_dir}", "--steps=40", "--model=mlp", "--learning_rate=0.01",
                "--factor_update_freq=5", "--decomposition_update_freq=10", *tt.SMALL_FLAGS]
        killed = tt.run_binary(*argv, env={checkpoints.FAULT_ENV: "before_rename@40"})
        self.assertEqual(killed.returncode, -9, killed.stderr[-2000:])
        listing = sorted(os.listdir(os.path.join(model_dir, "checkpoints")))
        self.assertEqual(listing, [".partial-step-40", "step-20"])  # step-20 is the newest
        with self.assertLogs("absl", "WARNING") as logs:
            summary = resume(model_dir, 40)
        self.assertIn("ignoring the unfinished checkpoint write", "\n".join(logs.output))
        self.assertEqual(summary["steps"], 40)
        self.assertEqual(sorted(os.listdir(os.path.join(model_dir, "checkpoints"))),
                         ["step-20", "step-40"])
        assert_same_tensors(self, self.want, tt.step_tensors(model_dir, 40))


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
        # "a finite number > 0", "in [0, 1)": each names the allowed range.
        with self.assertRaisesRegex(ValueError, f"^`{name}` must be (a finite number|in) .*; "
                                    f"received {value}$"):
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
    from `runner.check` (before any model is built), which the binary prints as one
    line with exit code 1 (see UsageOutputTest)."""

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


class UsageOutputTest(parameterized.TestCase):
    """5., 6., 9.: the binary ends every predictable error with exit code 1 and the
    error as its last line, after at most a one-line hint; no flag list, no traceback."""

    def assert_one_line_error(self, result, message):
        self.assertEqual(result.returncode, 1, result.stderr[-3000:])
        lines = tt.own_lines(result.stderr)
        self.assertNotIn("Traceback", result.stderr)
        self.assertRegex(lines[-1], "^trainers.train: error: " + message)
        self.assertEqual(lines[-2], train.USAGE_HINT)
        self.assertLessEqual(len(lines), 3, lines)  # at most one log line before them

    def test_bad_flag_value_and_inconsistent_flags(self):
        self.assert_one_line_error(tt.run_binary("--steps=abc"),
                                   "flag --steps=abc: invalid literal")
        self.assert_one_line_error(
            tt.run_binary("--optimizer=sgd", "--damping=0.01"),
            "damping only applies to optimizer=kfac, not optimizer=sgd")

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
        for argv, message in cases:
            with self.subTest(argv=argv):
                self.assert_one_line_error(tt.run_binary(*argv, "--model=mlp"), message)

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


if __name__ == "__main__":
    absltest.main()
