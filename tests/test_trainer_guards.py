"""The trainer never loses a user's work nor answers a mistake with a traceback:

- a checkpoint whose trainer state is not what the trainer writes is damage like any
  other: the run falls back to the older checkpoint, with the same warning; so is one
  swapped in from another run, named with the variables that differ;
- one run per model_dir at a time: a second trainer there ends with one line naming the
  process that holds it (two real trainer processes); the lock never follows a symbolic
  link nor overwrites a file it did not create (`LockFileTest`);
- a new run never overwrites files in its model_dir that no run of the trainer wrote;
- a warmup longer than the run and a data_dir that cannot be used are one-line errors;
  so are a setting given under its old and its new flag name with different values,
  overlap_reduction on one rank, and a resume's given setting that the run had otherwise
  (in those words, not a check of defaults the run does not have).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl.testing import absltest, parameterized

import trainer_testing as tt
from trainers import checkpoints, cli, config as config_lib, errors, run_lock, runner

# The smallest real run that leaves an epoch-end checkpoint (step-20) and a mid-epoch
# one (step-25, holding the epoch's running metrics).
SGD = dict(model="mlp", optimizer="sgd", learning_rate=0.01)


def run(model_dir, **settings):
    return runner.run(config_lib.TrainConfig(model_dir=model_dir,
                                             **dict(tt.SMALL, **dict(SGD, **settings))))


def resume(model_dir, steps):
    """`--resume --model_dir=D --steps=N` and nothing else."""
    return runner.run(config_lib.TrainConfig(model_dir=model_dir, steps=steps, resume=True,
                                             verbose=0),
                      {"model_dir", "resume", "steps", "verbose"})


class TrainerStateTest(parameterized.TestCase):
    """A `trainer_state.json` with a value of the wrong type or range makes its checkpoint
    unloadable, named with the value and its type, and the older one is used."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.base = os.path.join(absltest.get_default_test_tmpdir(), "state_base")
        shutil.rmtree(cls.base, ignore_errors=True)
        run(cls.base, steps=25)

    def damaged_copy(self, damage):
        """A copy of the run whose step-25 trainer state went through `damage(state)`."""
        model_dir = os.path.join(self.create_tempdir().full_path, "run")
        shutil.copytree(self.base, model_dir)
        path = os.path.join(tt.checkpoint_dir(model_dir, 25), checkpoints.STATE_FILE)
        state = tt.read_json(path)
        damaged = damage(state)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(state if damaged is None else damaged, f)
        return model_dir, path

    @parameterized.named_parameters(
        ("float_step", lambda s: s["counters"].update(steps=25.0),
         r"counters.steps is 25.0 \(a float\), not an integer"),
        ("string_step", lambda s: s["counters"].update(steps="25"),
         r'counters.steps is "25" \(a string\), not an integer'),
        ("unknown_counter", lambda s: s["counters"].update(best_loss=0.1),
         "counters holds unknown fields: best_loss"),
        ("null_fresh_examples", lambda s: s["counters"].update(fresh_examples=None),
         "counters.fresh_examples is null, not an integer"),
        ("history_of_wrong_type", lambda s: s["counters"].update(history={"epoch": 1}),
         r'counters.history is {"epoch": 1} \(an object\), not a list'),
        ("history_row_without_its_epoch",
         lambda s: s["counters"]["history"][0].__delitem__("epoch"),
         "counters.history\\[0\\] lacks epoch"),
        ("negative_time", lambda s: s["counters"].update(train_time_s=-3.5),
         r"counters.train_time_s is -3.5 \(a float\), not a finite number >= 0"),
        ("epoch_metrics_of_wrong_type", lambda s: s.update(epoch_metrics="abc"),
         r'epoch_metrics is "abc" \(a string\), not null or a list'),
        ("not_an_object", lambda s: [s], r"it is \[.*\.\.\. \(a list\), not an object"),
    )
    def test_falls_back_to_the_older_checkpoint(self, damage, reason):
        model_dir, path = self.damaged_copy(damage)
        state, loaded, failures = checkpoints.find_loadable(model_dir)
        self.assertEqual(loaded, tt.checkpoint_dir(model_dir, 20))
        self.assertEqual(state["counters"]["steps"], 20)
        [(step, failed, message)] = failures
        self.assertEqual((step, failed), (25, tt.checkpoint_dir(model_dir, 25)))
        self.assertRegex(message, f"^{path} is damaged: {reason}")

    def test_resume_warns_and_continues_from_the_older_checkpoint(self):
        model_dir, path = self.damaged_copy(lambda s: s["counters"].update(fresh_examples=None))
        with self.assertLogs("absl", "WARNING") as logs:
            summary = resume(model_dir, 30)
        warnings = "\n".join(logs.output)
        self.assertIn(f"checkpoint {tt.checkpoint_dir(model_dir, 25)} (step 25) cannot be "
                      f"loaded: {path} is damaged: counters.fresh_examples is null", warnings)
        self.assertIn(f"resuming from the older checkpoint {tt.checkpoint_dir(model_dir, 20)} "
                      "(step 20) instead: 5 steps of training (steps 20 to 25) are lost",
                      warnings)
        self.assertEqual(summary["steps"], 30)
        self.assertEqual(summary["fresh_examples"], 30 * tt.BATCH)

    def test_checkpoint_of_another_run_is_named_with_what_differs(self):
        """A step-25 checkpoint swapped in from a run of other settings (mixed_float16: a
        loss-scale optimizer): the warning names it and the variables that differ (not
        TensorFlow's RestoreV2 dtype message), and the run resumes from step 20."""
        other = os.path.join(self.create_tempdir().full_path, "other")
        run(other, steps=25, precision="mixed_float16")
        model_dir, _ = self.damaged_copy(lambda state: None)
        swapped = tt.checkpoint_dir(model_dir, 25)
        shutil.rmtree(swapped)
        shutil.copytree(tt.checkpoint_dir(other, 25), swapped)
        with self.assertLogs("absl", "WARNING") as logs:
            summary = resume(model_dir, 30)
        warnings = [line for line in logs.output if "cannot be loaded" in line]
        self.assertLen(warnings, 1, logs.output)
        self.assertRegex(warnings[0], (
            f"checkpoint {swapped} \\(step 25\\) cannot be loaded: variables "
            f"{swapped}/variables.\\* were written by another run \\(another model, optimizer "
            "or precision\\): it holds optimizer/\\S+ \\(and \\d+ more\\), which this run does "
            "not have; it has no optimizer/\\S+ \\(and \\d+ more\\) of this run$"))
        self.assertNotIn("RestoreV2", "\n".join(logs.output))
        self.assertEqual(summary["steps"], 30)

    def test_epoch_metrics_of_other_metrics_is_one_error(self):
        # The right types, but not this model's 4 metric variables (loss and accuracy
        # totals and counts): found when the epoch continues, as a RunError.
        model_dir, _ = self.damaged_copy(lambda s: s.update(epoch_metrics=[1.0, 2.0, 3.0]))
        with self.assertRaisesRegex(
                errors.RunError, r"^the checkpoint resumed from holds the epoch's running "
                r"metrics \(epoch_metrics\) as 3 values of shapes \[\(\), \(\), \(\)\], the "
                r"model has 4 metric variables"):
            resume(model_dir, 30)


class ModelDirLockTest(absltest.TestCase):
    """Two trainers started at once on one model_dir: one trains, the other ends with one
    line naming it (pid, host, start time); so does a --resume while it runs. The lock of
    a process killed with SIGKILL is free at once."""

    def start(self, model_dir):
        """A trainer that runs until killed (50 ms per example: 1.6 s per step)."""
        log_dir = self.create_tempdir().full_path
        process = tt.start_binary(f"--model_dir={model_dir}", "--steps=2000",
                                  "--read_latency=0.05", *tt.SMALL_FLAGS,
                                  *[f"--{name}={value}" for name, value in SGD.items()],
                                  log_dir=log_dir)
        self.addCleanup(process.wait)
        self.addCleanup(process.kill)
        return process, log_dir

    def test_one_run_per_model_dir(self):
        model_dir = os.path.join(self.create_tempdir().full_path, "run")
        started = [self.start(model_dir) for _ in range(2)]
        deadline = time.monotonic() + 300
        while all(process.poll() is None for process, _ in started):
            self.assertLess(time.monotonic(), deadline, "neither trainer ended")
            time.sleep(0.2)
        [(loser, log_dir)] = [entry for entry in started if entry[0].poll() is not None]
        [(winner, _)] = [entry for entry in started if entry[0] is not loser]
        with open(os.path.join(log_dir, "stderr"), encoding="utf-8") as f:
            stderr = f.read()
        in_use = (f"model_dir {model_dir} is in use by another run of the trainer \\(pid "
                  f"{winner.pid} on host {socket.gethostname()}, started "
                  r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d; it holds "
                  f"{run_lock.path(model_dir)}\\): wait for it to end, or choose another "
                  "--model_dir$")
        tt.assert_error(self, subprocess.CompletedProcess([], loser.returncode, "", stderr),
                        in_use, cli.FAILURE_EXIT_CODE)
        # A --resume once the run has a checkpoint: refused the same way.
        tt.wait_for(winner, tt.checkpoint_dir(model_dir, 20))
        tt.assert_error(self, tt.run_binary(f"--model_dir={model_dir}", "--resume"), in_use,
                        cli.FAILURE_EXIT_CODE)
        self.assertIsNone(winner.poll())
        winner.send_signal(signal.SIGKILL)
        winner.wait(timeout=60)
        with run_lock.holding(model_dir):  # the kernel released the dead process's lock
            pass


class LockFileTest(absltest.TestCase):
    """The lock never follows a symbolic link and never writes into a file it did not
    create: a `.trainer.lock` that is a link (to a user's file, or to nothing), another
    kind of file, a second name of a file, or a file of other content is refused with one
    line naming it, before the run writes anything, and left as it was."""

    def assert_refused(self, model_dir, what, kept):
        """Taking the lock and checking a run there both raise naming the lock path and
        `what` it is; `kept()` holds after each."""
        message = (f"^{run_lock.path(model_dir)} {what}: the trainer takes its lock in a file "
                   "it creates itself and never follows a link or overwrites a file it did "
                   "not create; move it away, or choose another --model_dir$")
        with self.assertRaisesRegex(run_lock.LockFileError, message):
            with run_lock.holding(model_dir):
                self.fail("the lock was taken")
        kept()
        with self.assertRaisesRegex(ValueError, message):
            runner.check(config_lib.TrainConfig(model_dir=model_dir, **dict(tt.SMALL, **SGD)))
        kept()
        return message

    def test_a_link_to_a_users_file_is_not_followed(self):
        model_dir = self.create_tempdir().full_path
        mine = os.path.join(self.create_tempdir().full_path, "notes.txt")
        with open(mine, "w", encoding="utf-8") as f:
            f.write("my notes\n")

        def kept():
            with open(mine, encoding="utf-8") as f:
                self.assertEqual(f.read(), "my notes\n")
            self.assertEqual(os.readlink(run_lock.path(model_dir)), mine)

        os.symlink(mine, run_lock.path(model_dir))
        message = self.assert_refused(model_dir, f"is a symbolic link \\(to {mine}\\)", kept)
        result = tt.run_binary(f"--model_dir={model_dir}", "--steps=5", *tt.SMALL_FLAGS,
                               *[f"--{name}={value}" for name, value in SGD.items()])
        tt.assert_error(self, result, message[1:], cli.FAILURE_EXIT_CODE)
        kept()
        self.assertEqual(os.listdir(model_dir), [run_lock.LOCK_FILE])

    def test_a_link_to_nothing_creates_nothing(self):
        model_dir = self.create_tempdir().full_path
        target = os.path.join(self.create_tempdir().full_path, "elsewhere")
        os.symlink(target, run_lock.path(model_dir))
        self.assert_refused(model_dir, f"is a symbolic link \\(to {target}\\)",
                            lambda: self.assertFalse(os.path.lexists(target)))

    def test_a_file_it_did_not_create_is_not_overwritten(self):
        mine = os.path.join(self.create_tempdir().full_path, "mine.txt")
        with open(mine, "w", encoding="utf-8") as f:
            f.write('{"pid": 1, "host": "h", "started": "t"}\n')  # a lock's content, too
        for name, make, what in (
                ("other_content", lambda lock: shutil.copyfile(__file__, lock),
                 "holds something other than a lock of the trainer \\(its pid, host and "
                 "start time\\)"),
                ("hard_link", lambda lock: os.link(mine, lock),
                 "is a file with 2 hard links \\(another file's name too\\)"),
                ("fifo", os.mkfifo, "is not a regular file"),
                ("directory", os.mkdir, "is a directory")):
            with self.subTest(name):
                model_dir = self.create_tempdir().full_path
                lock = run_lock.path(model_dir)
                make(lock)
                before = os.lstat(lock)
                content = None
                if os.path.isfile(lock):
                    with open(lock, "rb") as f:
                        content = f.read()

                def kept(lock=lock, before=before, content=content):
                    after = os.lstat(lock)
                    self.assertEqual((after.st_mode, after.st_ino, after.st_mtime_ns),
                                     (before.st_mode, before.st_ino, before.st_mtime_ns))
                    if content is not None:
                        with open(lock, "rb") as f:
                            self.assertEqual(f.read(), content)

                self.assert_refused(model_dir, what if name != "directory" else
                                    "(is a directory|is not a regular file)", kept)

    def test_its_own_lock_file_is_taken_again(self):
        model_dir = self.create_tempdir().full_path
        for _ in range(2):  # created, then the one the first left
            with run_lock.holding(model_dir):
                self.assertTrue(run_lock.check(model_dir))
        with open(run_lock.path(model_dir), "w", encoding="utf-8"):
            pass  # empty: a holder stopped before writing its pid
        with run_lock.holding(model_dir):
            pass
        with open(run_lock.path(model_dir), encoding="utf-8") as f:
            self.assertEqual(json.load(f)["pid"], os.getpid())


class NewRunTest(absltest.TestCase):
    """A new run refuses a model_dir holding files of the names it writes that no run of
    the trainer wrote, and leaves them as they were; a directory a run of the trainer
    started in (it leaves its lock file) is its own."""

    def test_users_own_files_are_refused_and_kept(self):
        model_dir = self.create_tempdir().full_path
        mine = os.path.join(model_dir, "metrics.csv")
        with open(mine, "w", encoding="utf-8") as f:
            f.write("my,own\n1,2\n")
        os.makedirs(os.path.join(model_dir, "tensorboard", "train"))
        message = (f"^model_dir {model_dir} holds tensorboard/, metrics.csv, which no run of "
                   "the trainer wrote: a new run there would overwrite them; choose another "
                   "--model_dir or an empty one, or move them away$")
        for resume_flag in ({}, {"auto_resume": True}):
            with self.assertRaisesRegex(ValueError, message):
                runner.check(config_lib.TrainConfig(model_dir=model_dir, **resume_flag,
                                                    **dict(tt.SMALL, **SGD)))
        result = tt.run_binary(f"--model_dir={model_dir}", "--steps=5", *tt.SMALL_FLAGS,
                               *[f"--{name}={value}" for name, value in SGD.items()])
        tt.assert_error(self, result, message[1:])
        with open(mine, encoding="utf-8") as f:
            self.assertEqual(f.read(), "my,own\n1,2\n")

    def test_files_of_an_earlier_run_of_the_trainer_are_its_own(self):
        # A run that stopped before its first checkpoint (diverged at step 20) leaves
        # config.json, run_history.json, metrics.csv and tensorboard/; a new run there
        # starts over, as after any run without a checkpoint.
        model_dir = self.create_tempdir().full_path
        with self.assertRaisesRegex(errors.RunError, "training diverged"):
            run(model_dir, steps=40, learning_rate=1e30)
        self.assertFalse(checkpoints.has_run(model_dir))
        with open(run_lock.path(model_dir), encoding="utf-8") as f:
            self.assertEqual(json.load(f)["pid"], os.getpid())
        self.assertEqual(run(model_dir, steps=5)["steps"], 5)


class RenamedFlagTest(parameterized.TestCase):
    """A setting given under its name before 0.2 and its name now with different values
    is a usage error naming both, whichever comes last; with the same value, or the old
    name alone, it is that value (tests/test_trainer.py: with a deprecation warning)."""

    @parameterized.parameters(
        ("eigen_wire_dtype", "decomposition_wire_dtype", "bfloat16", "float32", "bfloat16",
         "float32"),
        ("bn_damping_multiplier", "diagonal_damping_multiplier", "3", "5", "3.0", "5.0"),
        ("inv_update_freq", "decomposition_update_freq", "30", "40", "30", "40"))
    def test_both_names_with_different_values_is_an_error(self, old, new, old_text, new_text,
                                                          old_value, new_value):
        message = (f"^--{old} is the deprecated name of --{new}, and both were given, with "
                   f"different values \\(--{old}={old_value}, --{new}={new_value}\\): pass "
                   f"--{new} alone$")
        for argv in ([f"--{old}={old_text}", f"--{new}={new_text}"],
                     [f"--{new}={new_text}", f"--{old}={old_text}"]):
            with self.subTest(argv=argv), self.assertRaisesRegex(ValueError, message):
                tt.config_from_argv(*argv)
        with self.assertLogs("absl", "WARNING"):
            config, given = tt.config_from_argv(f"--{old}={old_text}", f"--{new}={old_text}")
        self.assertEqual(str(getattr(config, new)), old_value)
        self.assertIn(new, given)

    def test_binary_names_both_in_one_line(self):
        tt.assert_error(self, tt.run_binary("--model=mlp", "--eigen_wire_dtype=bfloat16",
                                            "--decomposition_wire_dtype=float32"),
                        "--eigen_wire_dtype is the deprecated name of "
                        "--decomposition_wire_dtype, and both were given")


class OneLineUsageErrorTest(absltest.TestCase):
    """A warmup as long as the run or longer, a data_dir that cannot be created or is a
    link to nothing, overlap_reduction on one rank, and a resume that changes a setting of
    the run are a ValueError naming the setting (the binary: one line)."""

    def test_warmup_longer_than_the_run(self):
        for schedule in ("warmup", "constant"):
            config = config_lib.TrainConfig(lr_schedule=schedule, warmup_epochs=1000, steps=20,
                                            **dict(tt.SMALL, **SGD))
            with self.assertRaisesRegex(
                    ValueError, f"^lr_schedule={schedule} reaches learning_rate only after the "
                    "warmup, which must end before the run: warmup_epochs=1000 is 20000 steps "
                    r"of the run's 20 \(--steps/--epochs\)$"):
                runner.check(config)

    def test_overlap_reduction_on_one_rank(self):
        message = ("^overlap_reduction overlaps the reduction of K-FAC's factors over ranks "
                   "with the preconditioning; this run has 1 rank \\(distribution=none\\), where "
                   "nothing is reduced: drop overlap_reduction, or train on several ranks "
                   "\\(horovodrun, or python -m trainers.launch\\)$")
        with self.assertRaisesRegex(ValueError, message):
            runner.check(config_lib.TrainConfig(model="mlp", overlap_reduction=True,
                                                **tt.SMALL))
        tt.assert_error(self, tt.run_binary("--model=mlp", "--overlap_reduction",
                                            *tt.SMALL_FLAGS), message[1:])

    def test_resume_judges_the_given_settings_against_the_runs(self):
        """A run with fisher=sampled, fisher_seed=3, resumed with another --fisher_seed: the
        error is that the run's setting changed, not that fisher_seed needs
        fisher=sampled (the default the flags alone would have); the same seed given again
        is accepted."""
        model_dir = os.path.join(self.create_tempdir().full_path, "run")
        run(model_dir, steps=5, optimizer="kfac", fisher="sampled", fisher_seed=3)
        given = {"model_dir", "resume", "steps", "fisher_seed"}
        resumed = lambda seed: config_lib.TrainConfig(model_dir=model_dir, resume=True, steps=10,
                                                      fisher_seed=seed)
        with self.assertRaisesRegex(ValueError, f"^resume must keep the settings of the run in "
                                    f"{model_dir}; changed: fisher_seed \\(3 -> 4\\); only "
                                    "these may change: "):
            runner.check(resumed(4), given)
        config = runner.check(resumed(3), given)
        self.assertEqual((config.fisher, config.fisher_seed), ("sampled", 3))

    def test_data_dir_that_cannot_be_used(self):
        dangling = os.path.join(self.create_tempdir().full_path, "data")
        os.symlink(os.path.join(os.path.dirname(dangling), "gone"), dangling)
        cases = [("/proc/self/tfds", "^data_dir /proc/self/tfds does not exist and cannot be "
                  "created: No such file or directory; choose a directory this user can "
                  "write, or one it can create$"),
                 (dangling, f"^data_dir {dangling} is a symbolic link to "
                  f"{os.path.dirname(dangling)}/gone, which does not exist$")]
        for data_dir, message in cases:
            with self.assertRaisesRegex(ValueError, message):
                runner.check(config_lib.TrainConfig(data_dir=data_dir,
                                                    **dict(tt.SMALL, **SGD)))
        tt.assert_error(self, tt.run_binary("--data_dir=/proc/self/tfds", "--model=mlp"),
                        cases[0][1][1:])


if __name__ == "__main__":
    absltest.main()
