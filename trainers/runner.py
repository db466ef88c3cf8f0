"""Runs one training job from a `TrainConfig`: the trainer binary and the benchmarks call
`run`, so both train exactly the same way.

Training is counted in steps. Each `fit` call covers (the rest of) one epoch, whose
data is built from (seed, epoch): the data order of epoch e never depends on how many
epochs this process ran before. A run resumed from a checkpoint taken mid-epoch starts
that epoch's stream at the batch where the checkpoint was taken, so a resumed run sees
the same batches, and ends with the same variables, as an uninterrupted one, and stops
at exactly the `--steps` (or `--epochs`) asked.

What may change on resume is `config.RESUME_MAY_CHANGE_FIELDS` (the budget, so a
schedule's end; evaluation cadence and target; paths); every other setting must stay,
and fields the caller did not give are taken from the run. `config.json` keeps the
settings the run was started with; each start appends what it changed to
`run_history.json`.
"""

import dataclasses
import datetime
import json
import math
import os
import re
import tempfile
import typing

from absl import logging
import keras
import numpy as np

import pipelines
import tfkfac
from tfkfac import distributed, schedule_free
from trainers import agreement, checkpoints, config as config_lib, data as data_lib, errors
from trainers import data_parallel, distribution, lr_schedules, models
from trainers import preemption as preemption_lib, reporting, run_lock

SUMMARY_FILE = "summary.json"
# What a run writes in its model_dir: name -> whether it is a directory.
_RUN_LAYOUT = {checkpoints.CHECKPOINT_SUBDIR: True, reporting.TENSORBOARD_SUBDIR: True,
               checkpoints.CONFIG_FILE: False, checkpoints.RUN_HISTORY_FILE: False,
               reporting.METRICS_FILE: False, SUMMARY_FILE: False}
# Fields of a config that say how it was started, not what the run is.
_INVOCATION_FIELDS = ("resume", "auto_resume", "model_dir", "verbose", "distribution")
# Fields ranks may set differently: where each reads its data and keeps its files, how
# it was invoked (the step it resumes from is compared instead), what it prints.
_PER_RANK_FIELDS = _INVOCATION_FIELDS + ("data_dir", "idx_dir", "preemption_grace_seconds",
                                         "startup_timeout_seconds")


@dataclasses.dataclass(frozen=True)
class CheckedRun:
    """A run `prepare` accepted, with what it made and read to check it, so that the
    `Trainer` builds no second communicator and reads no metadata twice."""

    config: config_lib.TrainConfig  # the config to run (a resume's settings resolved)
    engine: distribution.Engine  # the run's strategy and its one communicator
    split_sizes: tuple  # `data.split_sizes(config)`: (info, train, eval examples)


def prepare(config, explicitly_set=None):
    """The one check of a run: everything a user can get wrong, found before anything is
    built. Raises ValueError naming the problem; returns the `CheckedRun`.

    `explicitly_set` names the config fields the user gave (e.g. flags present on the
    command line); None means all of them (a config built in code). On resume, the
    fields not given are taken from the run in `model_dir`, and given ones that differ
    from the run must be in `config.RESUME_MAY_CHANGE_FIELDS`. The returned config has
    `resume` set exactly when a run is continued (`auto_resume` finds one or `resume`).
    The run's engine is made once the settings it needs are checked (under multi_worker
    it waits for every worker): the checks after it need its number of ranks.
    """
    given = set(explicitly_set) if explicitly_set is not None else None
    _validate_given(config, given)
    engine = distribution.Engine(config.distribution, config.startup_timeout_seconds,
                                 hierarchical=config.hierarchical_reduction)
    if (config.optimizer == "kfac" and config.overlap_reduction
            and engine.communicator.size == 1):
        raise ValueError(
            "overlap_reduction overlaps the reduction of K-FAC's factors over ranks with the "
            f"preconditioning; this run has 1 rank (distribution={engine.name}), where "
            "nothing is reduced: drop overlap_reduction, or train on several ranks "
            "(horovodrun, or python -m trainers.launch)")
    model_dir = config.resolved_model_dir()
    _check_model_dir_usable(model_dir)
    resuming = _resuming(config, model_dir)
    if resuming:
        config = _resumed_config(config, given, model_dir)
        config.validate(given or ())  # the run's settings with the given ones: together
    else:
        _check_nothing_overwritten(model_dir)
    split_sizes = data_lib.split_sizes(config)
    info, train_examples, _ = split_sizes
    data_lib.check_pipeline(config, info)
    steps_per_epoch = data_lib.steps_per_epoch(config, train_examples,
                                               engine.communicator.size)
    total = config.steps or config.epochs * steps_per_epoch
    # A schedule that cannot fit the run (a warmup as long as it) is a usage error too.
    lr_schedules.build_learning_rate(config, steps_per_epoch, total)
    if resuming:
        state = checkpoints.read_state(model_dir)  # CheckpointError if none loads
        if state and state["counters"]["steps"] > total:
            raise ValueError(f"the run in {model_dir} has trained {state['counters']['steps']}"
                             f" steps already, more than the {total} asked (--steps/--epochs)")
    return CheckedRun(config, engine, split_sizes)


def _validate_given(config, given):
    """`config.validate`; where it fails on a start that continues a run, the fields not
    `given` are the run's own, not the defaults it checked: the run's settings with the
    given ones are checked instead, so a failure names what was given (a given setting the
    run did not have is named later, by `_resumed_config`)."""
    try:
        config.validate(given or ())
    except ValueError:
        model_dir = config.resolved_model_dir()
        if given is None or not (config.resume or config.auto_resume) or not (
                checkpoints.has_run(model_dir)):
            raise
        _resumed_config(config, given, model_dir, keep_settings=False).validate(given)


def check(config, explicitly_set=None):
    """`prepare` for a caller that wants only the checks: returns the config to run."""
    return prepare(config, explicitly_set).config


def _check_model_dir_usable(model_dir):
    """A model_dir that is a file, or that cannot be created or written, is an error; so
    is a file where the trainer writes a directory (checkpoints/, tensorboard/), or the
    reverse."""
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
        raise ValueError(f"model_dir {model_dir} is a file, not a directory")
    for name, is_directory in _RUN_LAYOUT.items():
        path = os.path.join(model_dir, name)
        if os.path.exists(path) and os.path.isdir(path) != is_directory:
            what, needed = ("a file", "directory") if is_directory else ("a directory", "file")
            raise ValueError(f"{path} is {what}, but the trainer writes its {name} {needed} "
                             "there: move it away or choose another model_dir")
    existing = model_dir
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"model_dir {model_dir} cannot be created: {existing} is a file")
    try:  # a real write: permissions, read-only file systems, /proc and the like
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as error:
        what = "is" if existing == model_dir else f"cannot be created: {existing} is"
        raise ValueError(f"model_dir {model_dir} {what} not writable "
                         f"({error.strerror or error})") from None
    run_lock.check(model_dir)  # a lock path taken by a link or a file of the user's


def _resuming(config, model_dir):
    """Whether this start continues the run in `model_dir`; refuses to mix two runs."""
    has_run = checkpoints.has_run(model_dir)
    if config.auto_resume:
        return has_run
    if config.resume:
        if not os.path.isdir(model_dir):
            raise ValueError(f"resume: model_dir {model_dir} does not exist, so there is no "
                             "run to resume (auto_resume starts one when there is none)")
        if not has_run:
            raise ValueError(f"resume: model_dir {model_dir} holds no run to resume (no "
                             f"{checkpoints.CHECKPOINT_SUBDIR}/step-*); auto_resume starts "
                             "one when there is none")
        return True
    if has_run:
        raise ValueError(f"model_dir {model_dir} already holds a checkpoint; pass --resume to "
                         "continue that run or choose another --model_dir")
    return False


def _check_nothing_overwritten(model_dir):
    """A new run writes the files of `_RUN_LAYOUT`; where files of those names are in
    `model_dir` but no run of the trainer started there (none left its
    `run_lock.LOCK_FILE`), they are the user's own: an error naming them, not overwritten."""
    if run_lock.check(model_dir):
        return  # a run of the trainer started here: the files are its own
    paths = {name + ("/" if is_directory else ""): os.path.join(model_dir, name)
             for name, is_directory in _RUN_LAYOUT.items()}
    theirs = [name for name, path in paths.items()
              if os.path.isfile(path) or (os.path.isdir(path) and os.listdir(path))]
    if theirs:
        raise ValueError(
            f"model_dir {model_dir} holds {', '.join(theirs)}, which no run of the trainer "
            "wrote: a new run there would overwrite them; choose another --model_dir or an "
            "empty one, or move them away")


def saved_settings(model_dir):
    """The settings the run in `model_dir` last ran with (config.json updated by what
    run_history.json records as changed), or None if it has no config.json. A value of
    the wrong type is a `checkpoints.RunFileError` naming the file and the setting."""
    saved = checkpoints.read_config(model_dir)
    history = checkpoints.read_run_history(model_dir)
    if saved is None:
        return None
    # Written by an earlier version: today's names, and the values of fields added since.
    saved = {**config_lib.EARLIER_DEFAULTS,
             **{config_lib.RENAMED_FIELDS.get(name, name): value for name, value in saved.items()}}
    _check_saved_types(os.path.join(model_dir, checkpoints.CONFIG_FILE), saved,
                       checkpoints.CONFIG_ROLE)
    if history:
        changed = {config_lib.RENAMED_FIELDS.get(name, name): now
                   for name, (_, now) in history[-1].get("changed", {}).items()}
        _check_saved_types(os.path.join(model_dir, checkpoints.RUN_HISTORY_FILE), changed,
                           checkpoints.HISTORY_ROLE)
        saved.update(changed)
    return saved


def _check_saved_types(path, values, role):
    """Each known setting in `values` (read from `path`) must have its field's type."""
    hints = typing.get_type_hints(config_lib.TrainConfig)
    for name, value in values.items():
        problem = checkpoints.json_mismatch(hints[name], value, name) if name in hints else None
        if problem:
            raise checkpoints.RunFileError(f"{path} is damaged ({problem}); {role}")


def _resumed_config(config, given, model_dir, keep_settings=True):
    """`config` with the settings of the run in `model_dir` in place of those not `given`;
    a ValueError naming the given ones that differ from the run's and may not change
    (unless not `keep_settings`)."""
    saved = saved_settings(model_dir)
    if saved is None:
        logging.warning("%s has no %s; resuming without checking the settings match",
                        model_dir, checkpoints.CONFIG_FILE)
        return dataclasses.replace(config, resume=True, auto_resume=False)
    values = {}
    changed = []
    for field in dataclasses.fields(config_lib.TrainConfig):
        name, mine = field.name, getattr(config, field.name)
        theirs = saved.get(name, field.default)
        if name in _INVOCATION_FIELDS or given is None or name in given:
            values[name] = mine
            if (name not in config_lib.RESUME_MAY_CHANGE_FIELDS
                    and _jsonable(mine) != theirs):
                changed.append(f"{name} ({theirs!r} -> {mine!r})")
        else:
            values[name] = tuple(theirs) if isinstance(theirs, list) else theirs
    if given is not None and "epochs" in given and "steps" not in given:
        values["steps"] = None  # a new --epochs budget replaces the run's --steps
    if changed and keep_settings:
        raise ValueError(
            f"resume must keep the settings of the run in {model_dir}; changed: "
            f"{', '.join(changed)}; only these may change: "
            f"{', '.join(n for n in config_lib.RESUME_MAY_CHANGE_FIELDS if n not in _INVOCATION_FIELDS)}")
    values.update(resume=True, auto_resume=False)  # from here on: a plain resume
    return config_lib.TrainConfig(**values)


def run(config, explicitly_set=None):
    """Trains as `config` (a `TrainConfig`, or `prepare`'s `CheckedRun`) says and returns
    the run summary (also in `summary.json`).

    Distributed (`config.distribution`), every process calls this; only rank 0's writes
    files and prints logs. SIGTERM or SIGINT stop the run after the step in progress with
    a checkpoint of it and raise `preemption.Preempted` (exit code 75); see
    `trainers/preemption.py`.
    """
    with preemption_lib.Preemption() as preemption:
        return Trainer(config, explicitly_set, preemption).train()


class Trainer:
    """One run's assembled pieces: data, model, optimizer, checkpoints, counters.

    Building it restores the newest loadable checkpoint when the run is resumed and
    gives every rank rank 0's variables; `train()` then runs the steps left. Benchmarks
    use the pieces (`model`, `data`, ...) to time steps without a second training loop.
    """

    def __init__(self, config, explicitly_set=None, preemption=None):
        """`config`: a `TrainConfig`, checked here by `prepare`, or the `CheckedRun` of
        a `prepare` already made (then nothing is checked or read again)."""
        self._preemption = preemption  # None: signals keep their usual effect
        checked = (config if isinstance(config, CheckedRun)
                   else prepare(config, explicitly_set))
        self.engine = checked.engine
        self.communicator = self.engine.communicator
        self.chief = self.communicator.rank == 0
        config = self.config = checked.config
        self.model_dir = config.resolved_model_dir()

        input_dtype = pipelines.set_precision(config.precision)
        # Each process reads its shard, a batch per replica it runs (one per rank).
        data_settings = (dataclasses.replace(config, batch_size=config.batch_size *
                                             self.engine.replicas_per_process),
                         self.engine.process_index, self.engine.processes, input_dtype)
        self.data = data_lib.TrainingData(*data_settings, sizes=checked.split_sizes)
        self.total_steps = config.steps or config.epochs * self.data.steps_per_epoch
        self.num_epochs = math.ceil(self.total_steps / self.data.steps_per_epoch)
        # Before anything (the model's broadcast) communicates: ranks launched with
        # different settings, data or storage end here with one line instead of a hang.
        agreement.agree(self.communicator, self._run_defining_settings(),
                        {"model_dir": self.model_dir})

        with self.engine.strategy.scope():
            self.model = models.build_model(config.model, self.data.input_shape,
                                            self.data.num_classes, config.seed)
            self.optimizer = _build_optimizer(config, self.data.steps_per_epoch,
                                              self.total_steps, self.communicator,
                                              self.model.output_names[0])
            if config.optimizer == "kfac":
                try:
                    self.optimizer.attach(self.model)
                except ValueError as error:  # a setting tfkfac refuses for this model
                    raise errors.RunError(str(error)) from None
            self.model.compile(optimizer=self.optimizer, jit_compile=config.xla,
                               **_loss_and_metrics(config))
            # Create every optimizer variable now: the checkpoint and the broadcast need them.
            self.model.optimizer.build(self.model.trainable_variables)
        # Callbacks of every evaluation: ScheduleFreeAdamW's runs at its averaged weights,
        # with BatchNormalization statistics from a training stream of its own.
        self._evaluation_callbacks = [] if schedule_free.update_rule(self.optimizer) is None \
            else [tfkfac.AveragedWeights(self.optimizer, lambda: data_lib.TrainingData(
                *data_settings, sizes=checked.split_sizes).train(0))]

        self._store = checkpoints.CheckpointStore(self.model_dir, self.model,
                                                  self.model.optimizer)
        # What this start was decided on (a new run, or the checkpoint to resume); `train`
        # makes sure it still holds once it has the model_dir to itself.
        self._checkpoints_seen = checkpoints.candidates(self.model_dir)
        state = self._store.restore(report=self.chief) if config.resume else None
        self.counters = (reporting.RunCounters.from_dict(state["counters"]) if state
                         else reporting.RunCounters())
        self._epoch_metrics = state.get("epoch_metrics") if state else None
        self._noise_scale_sums = state.get("noise_scale_sums") if state else None
        # The step each rank actually restored (one may have fallen back to an older one).
        agreement.agree(self.communicator, {"resume_step": self.counters.steps},
                        {"model_dir": self.model_dir})
        # Every rank starts from rank 0's initial (or restored) variables.
        self.communicator.broadcast_variables(self.model.variables +
                                              self.model.optimizer.variables)

    def _run_defining_settings(self):
        """What every rank must share: the settings but per-rank paths and how the run
        was invoked, the data as this rank sees it, and the step it would resume from
        (its newest checkpoint)."""
        settings = {name: value for name, value in self.config.to_dict().items()
                    if name not in _PER_RANK_FIELDS}
        newest = checkpoints.candidates(self.model_dir)
        settings.update(
            resume_step=newest[0][0] if self.config.resume and newest else 0,
            train_examples=self.data.train_examples, eval_examples=self.data.eval_examples,
            steps_per_epoch=self.data.steps_per_epoch)
        return json.loads(json.dumps(settings))  # tuples as JSON lists

    def _record_start(self):
        """config.json for a new run; for every start, what it changed, in run_history."""
        config = json.loads(json.dumps(self.config.to_dict()))  # tuples as JSON lists
        history_path = os.path.join(self.model_dir, checkpoints.RUN_HISTORY_FILE)
        original = checkpoints.read_config(self.model_dir) if self.config.resume else None
        if original is None:
            reporting.write_json(os.path.join(self.model_dir, checkpoints.CONFIG_FILE), config,
                                 self._store.space_advice)
            original, history = config, []
        else:
            history = checkpoints.read_run_history(self.model_dir)
        changed = {name: [original.get(name), value] for name, value in config.items()
                   if name not in _INVOCATION_FIELDS and original.get(name) != value}
        history.append({"started": datetime.datetime.now().isoformat(timespec="seconds"),
                        "from_step": self.counters.steps, "changed": changed})
        reporting.write_json(history_path, history, self._store.space_advice)

    def train(self):
        """Runs the steps left, checkpointing after each epoch (and at the end); returns
        the run summary. The chief, which writes the run's files, holds the model_dir's
        lock (`run_lock`) meanwhile: another run there ends with `run_lock.ModelDirInUse`."""
        if not self.chief:
            return self._train()
        with run_lock.holding(self.model_dir):
            if checkpoints.candidates(self.model_dir) != self._checkpoints_seen:
                raise errors.RunError(f"another run wrote checkpoints in {self.model_dir} while "
                                      "this one was starting; start this one again")
            return self._train()

    def _train(self):
        """`train` once the run's files are this process's to write."""
        config = self.config
        steps_per_epoch = self.data.steps_per_epoch
        if self._preemption is not None:
            self._preemption.start(self.communicator, config.preemption_grace_seconds,
                                   self._store.resume_hint)
        if self.chief:
            os.makedirs(self.model_dir, exist_ok=True)
            self._store.remove_unfinished()  # they may fill the disk the next writes need
            self._record_start()
        eval_data = self.engine.distribute(self.data.evaluation(), config.batch_size)
        noise_scale = (tfkfac.GradientNoiseScale(config.noise_scale_interval)
                       if config.noise_scale else None)
        recorder = reporting.EpochRecorder(
            self.counters, self.communicator,
            scalars_fn=lambda: _optimizer_scalars(config, self.optimizer),
            fresh_examples_fn=self.data.fresh_examples,
            phase_fn=phase_fn(self.optimizer),
            evaluate_fn=lambda: self._evaluate_mid_epoch(eval_data),
            eval_every_steps=config.eval_every_steps, eval_spacing=config.eval_spacing,
            target_accuracy=config.target_accuracy,
            stop_at_target=config.stop_at_target,
            give_up=self._give_up(),
            steps_per_epoch=steps_per_epoch, epoch_metrics=self._epoch_metrics,
            noise_scale=noise_scale, noise_scale_sums=self._noise_scale_sums)
        callbacks = [recorder] + self._evaluation_callbacks  # evaluated with the clock stopped
        if self.chief:
            callbacks.append(reporting.EpochWriter(self.model_dir, recorder,
                                                   self._store.space_advice))
            if config.verbose:  # last, so it shows the logs the recorder completed
                callbacks.append(reporting.RunProgressBar(self.num_epochs))
        if self._preemption is not None:  # after the recorder has counted the step
            callbacks.insert(1, self._preemption)
        if noise_scale is not None:  # first: the recorder keeps the logs it adds
            callbacks.insert(0, noise_scale)
        if self.counters.steps >= self.total_steps and self.chief:
            logging.warning("the run in %s has trained the %d steps asked already; nothing "
                            "left to train", self.model_dir, self.total_steps)
        while self.counters.steps < self.total_steps:
            if (config.stop_at_target and recorder.target_reached) or recorder.gave_up:
                break
            epoch, done_in_epoch = divmod(self.counters.steps, steps_per_epoch)
            before = self.counters.steps
            # A signal since the last checkpoint (which holds this step) stops the run
            # before another step; the callback checks after each step.
            self._stop_if_preempted(agreed_only=True)  # no need to build the data
            train_data = self.engine.distribute(
                self.data.train(epoch, skip_batches=done_in_epoch), config.batch_size)
            self._stop_if_preempted()
            try:
                self.model.fit(
                    train_data, epochs=epoch + 1, initial_epoch=epoch,
                    steps_per_epoch=min(steps_per_epoch - done_in_epoch,
                                        self.total_steps - self.counters.steps),
                    validation_data=eval_data, callbacks=callbacks, shuffle=False,
                    verbose=config.verbose if self.chief else 0)
            except preemption_lib.StopNow:
                recorder.cut_epoch()
            if self.counters.steps == before:
                raise RuntimeError(f"fit trained no step at step {before}")
            self._stop_if_diverged()
            if self.chief:
                mid_epoch = self.counters.steps % steps_per_epoch != 0
                state = {"counters": self.counters.to_dict(),
                         "epoch_metrics": recorder.epoch_metrics if mid_epoch else None}
                if mid_epoch and recorder.noise_scale_sums is not None:
                    state["noise_scale_sums"] = recorder.noise_scale_sums
                self._store.save(self.counters.steps, state)

        summary = self.summary()
        if self.chief:
            reporting.write_json(os.path.join(self.model_dir, SUMMARY_FILE), summary,
                                 self._store.space_advice)
            _print_summary(summary)
        return summary

    def _give_up(self):
        """The (steps, accuracy) a run stops without (`reporting.EvaluationLog`), or None."""
        config = self.config
        return (None if config.give_up_steps is None
                else (config.give_up_steps, config.give_up_accuracy))

    def _stop_if_preempted(self, agreed_only=False):
        """Raises `preemption.Preempted` on every rank if any was signalled (a collective
        unless `agreed_only`: then only a stop the ranks agreed on already counts); the
        checkpoint of the current step is written already."""
        if self._preemption is None or not (
                self._preemption.agreed if agreed_only else self._preemption.stop_agreed()):
            return
        if self.chief:
            step = self.counters.steps
            self._preemption.report(step, self.total_steps,
                                    self._store.path(step) if step else None, self.model_dir)
        self._preemption.wait_for_every_rank()
        raise preemption_lib.Preempted(self.counters.steps)

    def _stop_if_diverged(self):
        """Raises `errors.RunError` if the weights are no longer finite (a learning rate
        that diverges): every later step would be NaN, so the run stops before they are
        checkpointed. Every rank holds the same weights, so every rank stops here."""
        if all(np.isfinite(weight.numpy()).all() for weight in self.model.weights):
            return
        loss = self.counters.history[-1].get("loss") if self.counters.history else None
        raise errors.RunError(
            f"training diverged: after step {self.counters.steps} the model's weights are not "
            f"finite{'' if loss is None else f' (loss {loss})'}; they were not checkpointed: "
            f"{self._store.resume_hint()}; a smaller learning_rate than "
            f"{self.config.learning_rate:g} (or a warmup, warmup_epochs) keeps it finite")

    def _evaluate_mid_epoch(self, eval_data):
        """Eval metrics ("val_" names, like fit's), leaving the running training metrics
        of the epoch as they were (`evaluate` resets the metrics it shares with fit)."""
        metric_variables = self.model.metrics_variables
        saved = [variable.numpy() for variable in metric_variables]
        results = self.model.evaluate(eval_data, verbose=0, return_dict=True,
                                      callbacks=self._evaluation_callbacks)
        for variable, value in zip(metric_variables, saved):
            variable.assign(value)
        return {f"val_{name}": value for name, value in results.items()}

    def summary(self):
        """The run so far: final metrics, totals, time to target, step times, history."""
        config, counters = self.config, self.counters
        final = counters.history[-1] if counters.history else {}
        summary = {
            "model_dir": self.model_dir,
            "config": config.to_dict(),
            "num_ranks": self.communicator.size,
            "eval_split": config.eval_split,
            "final_eval_accuracy": final.get(reporting.EVAL_ACCURACY_KEY),
            "final_metrics": final,
            "epochs": counters.epochs,
            "steps": counters.steps,
            "train_time_s": counters.train_time_s,
            "fresh_examples": counters.fresh_examples,
            "target_accuracy": config.target_accuracy,
            "to_target": counters.to_target,
            "gave_up": reporting.EvaluationLog(counters, give_up=self._give_up()).gave_up,
            "mean_step_time_s": counters.mean_step_time_s(),
            # Steps whose update was not applied: a loss-scale overflow (mixed_float16)
            # or K-FAC's non-finite-gradient guard. Applied updates are what the
            # optimizer's (checkpointed) step counter counts.
            "skipped_steps": counters.steps - int(self.optimizer.iterations.numpy()),
            "history": counters.history,
            "evaluations": counters.evaluations,
        }
        if config.optimizer == "kfac":
            summary["kfac"] = self.optimizer.summary()
        return summary


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


# Keras's optimizers of config.FIRST_ORDER_OPTIMIZERS (ScheduleFreeAdamW: tfkfac's, its
# averaging step corrected, tfkfac/schedule_free.py).
_KERAS_OPTIMIZERS = {"sgd": keras.optimizers.SGD, "adam": keras.optimizers.Adam,
                     "adamw": keras.optimizers.AdamW, "muon": keras.optimizers.Muon,
                     "schedule_free_adamw": tfkfac.ScheduleFreeAdamW,
                     "lamb": keras.optimizers.Lamb}


def _build_optimizer(config, steps_per_epoch, total_steps, communicator, output_layer=None):
    """The run's optimizer. `output_layer`: the name of the model's output layer, which
    Muon leaves to its AdamW step (needed for optimizer=muon)."""
    rule = config.update_rule()
    if rule in config_lib.SCHEDULE_FREE_OPTIMIZERS:  # its own warm-up (`_options`) only
        learning_rate = float(config.learning_rate)
    else:
        learning_rate = lr_schedules.build_learning_rate(config, steps_per_epoch, total_steps)
    options = _options(rule, config, steps_per_epoch, output_layer, total_steps)
    if config.optimizer == "kfac":
        # K-FAC averages gradients (and factors) over ranks itself, before its inner
        # optimizer sees them.
        return tfkfac.KFAC(inner_optimizer=_KERAS_OPTIMIZERS[rule](learning_rate, **options),
                           config=config.kfac_config(), communicator=communicator)
    return data_parallel.averaging(_KERAS_OPTIMIZERS[rule], communicator)(learning_rate,
                                                                          **options)


def _options(name, config, steps_per_epoch, output_layer, total_steps=None):
    """Keyword arguments of Keras's optimizer `name`: --momentum and --nesterov for SGD;
    --weight_decay when set (unset, each keeps its own default), for Muon on both of its
    steps; Muon's exclusions (`muon_exclusions`); ScheduleFreeAdamW's warm-up of
    --warmup_epochs (not given: 5% of the run's `total_steps`, needed then)."""
    options = {} if config.weight_decay is None else {"weight_decay": config.weight_decay}
    if name == "sgd":
        options.update(momentum=config.momentum, nesterov=config.nesterov)
    elif name == "muon":
        if config.weight_decay is not None:
            options["adam_weight_decay"] = config.weight_decay
        options["exclude_layers"] = muon_exclusions(output_layer)
        if config.model in config_lib.MODELS_WITHOUT_MUON_WEIGHTS:
            logging.warning("optimizer=muon orthogonalizes no weight of model=%s (Keras's Muon "
                            "takes 2-D kernels only, and its only one is the output layer's): "
                            "every weight takes Muon's AdamW step", config.model)
    elif name == "schedule_free_adamw":
        options["warmup_steps"] = lr_schedules.warmup_length(config, steps_per_epoch,
                                                             total_steps)
    return options


def muon_exclusions(output_layer):
    """Muon's `exclude_layers`: patterns of the variables it gives its AdamW step besides
    those it always does (not 2-D; embeddings, by its default). As its docstring asks, the
    output layer; and every bias, which Keras's rule "2-D" would otherwise orthogonalize
    where a layer keeps one per head (MultiHeadAttention's (heads, head size)), though the
    docstring leaves vectors to AdamW."""
    if not output_layer:
        raise ValueError("optimizer=muon needs the name of the model's output layer, which it "
                         "leaves to its AdamW step")
    return [f"^{re.escape(output_layer)}/", "(^|/)bias$"]


def _loss_and_metrics(config):
    if models.is_autoencoder(config.model):
        # Martens & Grosse report the squared error summed over pixels, averaged over images.
        squared_error = keras.metrics.MeanMetricWrapper(
            lambda target, output: keras.ops.sum(keras.ops.square(target - output), axis=-1),
            name="squared_error")
        return {"loss": keras.losses.BinaryCrossentropy(), "metrics": [squared_error]}
    if config.mixup_alpha > 0:  # mixup makes the labels one-hot mixtures
        return {"loss": keras.losses.CategoricalCrossentropy(from_logits=True),
                "metrics": [keras.metrics.CategoricalAccuracy(name="accuracy")]}
    return {"loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            "metrics": [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]}


def _optimizer_scalars(config, optimizer):
    """The learning rate (and K-FAC damping) in force after the epoch's last step."""
    # (a mirrored variable under a tf.distribute strategy, which float() does not take)
    scalars = {"learning_rate": float(keras.ops.convert_to_numpy(optimizer.learning_rate))}
    if config.optimizer == "kfac":
        scalars["damping"] = optimizer.current_damping()
    return scalars


def phase_fn(optimizer):
    """Names the work of the step just finished, for step times per phase: for K-FAC from
    its counters (what the graph did), one "step" kind for the other optimizers."""
    if not isinstance(optimizer, tfkfac.KFAC):
        return lambda: "step"
    last = optimizer.counters()  # after a restore: the restored counts

    def phase():
        counters = optimizer.counters()
        done = [counters[name] > last.get(name, 0)
                for name in ("factor_updates", "decomposition_updates")]
        last.update(counters)
        return {(True, True): "factors_and_decompositions", (False, True): "decompositions",
                (True, False): "factors", (False, False): "stale"}[tuple(done)]
    return phase


def _print_summary(summary):
    final = summary["final_metrics"]
    metric = ("accuracy", final.get("val_accuracy")) if "val_accuracy" in final else (
        "squared error", final.get("val_squared_error"))
    print(f"{summary['eval_split']} {metric[0]}: {metric[1]:.4f} after {summary['epochs']} "
          f"epochs, {summary['steps']} steps, {summary['train_time_s']:.1f} s of training")
    if summary["target_accuracy"] is not None:
        reached = summary["to_target"]
        print(f"target accuracy {summary['target_accuracy']}: " + (
            f"reached after {reached['time_s']:.1f} s, {reached['steps']} steps, "
            f"{reached['fresh_examples']} fresh examples" if reached else "not reached"))
    if summary["gave_up"]:
        config = summary["config"]
        print(f"gave up: no evaluation reached {config['give_up_accuracy']} by step "
              f"{config['give_up_steps']}")
    if summary["skipped_steps"]:
        print(f"{summary['skipped_steps']} of {summary['steps']} steps skipped their update "
              "(loss-scale overflow or non-finite gradients)")
    print(f"logs: {summary['model_dir']} (metrics.csv, tensorboard/, {SUMMARY_FILE}, "
          f"{checkpoints.CHECKPOINT_SUBDIR}/)")
