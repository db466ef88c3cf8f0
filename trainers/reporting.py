"""What a run measured, per step and per epoch, and the files that report it.

`StepTimer` times steps by phase, `TrainingClock` keeps the training time (paused while
evaluating), `RankAggregator` combines what the ranks measured, `EvaluationLog` keeps every
evaluation and notes when the target accuracy was first reached, and `running_metrics` /
`add_running_metrics` carry an epoch's running metrics across a checkpoint. `EpochRecorder`
drives them from `fit`'s callbacks, evaluates mid-epoch on request and adds the learning
rate, damping and fresh-example count to the epoch logs (so the progress bar, CSV and
TensorBoard all show them). `EpochWriter` turns that record into `metrics.csv` and
TensorBoard scalars; only the chief rank uses it. Everything the recorder keeps lives in
`RunCounters`, which the checkpoint stores, so a resumed run reports the same totals as an
uninterrupted one (and, with the epoch's running metrics and noise-scale sums, the same
rows).
"""

import csv
import dataclasses
import io
import json
import math
import os
import time
from typing import Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from trainers import errors, storage

EVAL_ACCURACY_KEY = "val_accuracy"
METRICS_FILE = "metrics.csv"
TENSORBOARD_SUBDIR = "tensorboard"
# What `tf.summary.scalar` attaches; written directly because that function lives in the
# `tensorboard` package, which tensorflow-cpu does not install. TensorBoard reads the
# events as ordinary scalars.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars"))


@dataclasses.dataclass
class RunCounters:
    """Totals of a run so far; plain JSON-able values so checkpoints can hold them."""

    epochs: int = 0
    steps: int = 0
    train_time_s: float = 0.0
    fresh_examples: int = 0
    # Per phase: [number of timed steps, their total seconds]; first steps excluded.
    step_time: Dict[str, List[float]] = dataclasses.field(default_factory=dict)
    to_target: Optional[Dict[str, float]] = None
    history: List[Dict[str, float]] = dataclasses.field(default_factory=list)
    # Every evaluation (mid-epoch ones and each epoch's end): the accuracy-vs-time curve.
    evaluations: List[Dict[str, float]] = dataclasses.field(default_factory=list)

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values):
        return cls(**values)

    def mean_step_time_s(self):
        """Mean seconds per step for each phase and over all timed steps."""
        return mean_step_times(self.step_time)


def mean_step_times(step_time):
    """{phase: mean seconds} and "all" from {phase: [count, total seconds]}."""
    means = {phase: total / count for phase, (count, total) in step_time.items() if count}
    count = sum(c for c, _ in step_time.values())
    if count:
        means["all"] = sum(t for _, t in step_time.values()) / count
    return means


class StepTimer(keras.callbacks.Callback):
    """Adds each training step's wall time to `totals[phase_fn()]` = [count, seconds],
    `phase_fn` naming the work of the step just finished.

    The first step of each phase seen by this timer traces and compiles, so it is not
    counted. A step's time runs from asking for its batch to its finished update, so
    waiting on the input pipeline is included.
    """

    def __init__(self, phase_fn, totals, first_step=0):
        super().__init__()
        self.step = first_step
        self.totals = totals
        self._phase_fn = phase_fn
        self._phases_seen = set()
        self._step_start = None

    def on_train_batch_begin(self, batch, logs=None):
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        elapsed = time.perf_counter() - self._step_start
        phase = self._phase_fn()
        self.step += 1
        if phase not in self._phases_seen:
            self._phases_seen.add(phase)
            return
        count, total = self.totals.get(phase, (0, 0.0))
        self.totals[phase] = [count + 1, total + elapsed]


class TrainingClock:
    """A run's training time, added up in `counters.train_time_s`: the clock runs from
    `start` to `stop`, so the trainer stops it around evaluation and time to target is
    training time."""

    def __init__(self, counters):
        self._counters = counters
        self._started = None

    def start(self):
        self._started = time.perf_counter()

    def stop(self):
        if self._started is not None:
            self._counters.train_time_s += time.perf_counter() - self._started
            self._started = None


class RankAggregator:
    """What each rank measured, combined over the ranks (identity on one process)."""

    def __init__(self, communicator):
        self._communicator = communicator

    def mean_metrics(self, metrics):
        """The scalar entries of `metrics` as their mean over ranks."""
        keys = sorted(key for key, value in metrics.items() if np.isscalar(value))
        values = [tf.constant(float(metrics[key]), tf.float64) for key in keys]
        averaged = self._communicator.grouped_allreduce_mean(values, category="metrics")
        return {key: float(value) for key, value in zip(keys, averaged)}

    def total_fresh_examples(self, count):
        """`count` fresh examples read by this process, summed over processes (mean x
        their count; a process feeds `len(local_ranks)` ranks from one stream)."""
        local = tf.constant(float(count), tf.float64)
        mean = self._communicator.grouped_allreduce_mean([local], category="metrics")[0]
        processes = self._communicator.size // len(self._communicator.local_ranks)
        return int(round(float(mean) * processes))


class EvaluationLog:
    """Every evaluation of a run, in `counters.evaluations` (the accuracy-vs-time curve),
    and the first to reach `target_accuracy`, in `counters.to_target`. With `give_up`
    (steps, accuracy), whether the run has given up: an evaluation after `steps` steps
    and none at `accuracy` or above by then, so a tuning trial that can no longer beat
    the best one so far stops there."""

    def __init__(self, counters, target_accuracy=None, give_up=None):
        self._counters = counters
        self._target_accuracy = target_accuracy
        self._give_up = give_up

    @property
    def target_reached(self):
        return self._counters.to_target is not None

    @property
    def gave_up(self):
        if self._give_up is None:
            return False
        steps, accuracy = self._give_up
        evaluations = self._counters.evaluations
        return (any(point["steps"] > steps for point in evaluations)
                and not any(point["steps"] <= steps
                            and point.get(EVAL_ACCURACY_KEY, -1.0) >= accuracy
                            for point in evaluations))

    def record(self, metrics, fresh_examples, epochs):
        """Adds an evaluation at the counters' current totals; returns whether it is the
        first to reach the target accuracy."""
        counters = self._counters
        point = {"steps": counters.steps, "epochs": epochs,
                 "train_time_s": counters.train_time_s, "fresh_examples": fresh_examples}
        point.update(metrics)
        counters.evaluations.append(point)
        accuracy = metrics.get(EVAL_ACCURACY_KEY)
        if (self._target_accuracy is None or self.target_reached or accuracy is None
                or accuracy < self._target_accuracy):
            return False
        counters.to_target = {"time_s": point["train_time_s"], "steps": point["steps"],
                              "epochs": epochs, "fresh_examples": fresh_examples,
                              "accuracy": float(accuracy)}
        return True


def running_metrics(model):
    """The model's metric variables (the epoch's running sums and counts so far), as
    lists a checkpoint can hold."""
    return [variable.numpy().tolist() for variable in getattr(model, "metrics_variables", [])]


def add_running_metrics(model, saved):
    """Adds `saved` (`running_metrics` of an epoch a checkpoint cut) to the model's metric
    variables, so a resumed run continues the epoch's means (every metric here is a mean
    of sums and counts). `errors.RunError` if they do not fit the model's variables."""
    variables = model.metrics_variables
    saved_shapes = [np.shape(value) for value in saved]
    shapes = [tuple(variable.shape) for variable in variables]
    if saved_shapes != shapes:
        raise errors.RunError(
            "the checkpoint resumed from holds the epoch's running metrics (epoch_metrics) "
            f"as {len(saved_shapes)} values of shapes {saved_shapes}, the model has "
            f"{len(shapes)} metric variables of shapes {shapes}: the checkpoint is damaged "
            "or was written for other metrics; delete it (the newest in checkpoints/) to "
            "resume from the one before")
    for variable, value in zip(variables, saved):
        variable.assign_add(np.asarray(value, variable.dtype))


def add_noise_scale_sums(probe, saved):
    """Adds `saved` (a `tfkfac.noise_scale.NoiseScaleProbe`'s sums of an epoch a
    checkpoint cut) to `probe`'s, so a resumed run's noise scale of that epoch counts every
    step measured in it. `errors.RunError` if they do not fit the probe's sums."""
    shape = tuple(probe.sums.shape)
    if np.shape(saved) != shape:
        raise errors.RunError(
            "the checkpoint resumed from holds the epoch's gradient noise scale sums "
            f"(noise_scale_sums) as {len(saved)} values, the noise scale keeps {shape[0]}: "
            "the checkpoint is damaged or was written by another version; delete it (the "
            "newest in checkpoints/) to resume from the one before")
    probe.sums.assign_add(np.asarray(saved, probe.sums.dtype.as_numpy_dtype))


def add_history_row(counters, logs):
    """The epoch just ended as a row of `counters.history`: the run's totals and the
    epoch's logs. It replaces the row of an epoch a checkpoint had cut (whose rest has
    just run)."""
    row = {"epoch": counters.epochs, "steps": counters.steps,
           "train_time_s": counters.train_time_s}
    row.update({key: float(value) for key, value in logs.items()})
    if counters.history and counters.history[-1]["epoch"] == counters.epochs:
        counters.history[-1] = row
    else:
        counters.history.append(row)


# The smallest gap between two evaluations an `eval_spacing` places.
MIN_EVAL_GAP = 5


class EvaluationSchedule:
    """Which steps are evaluated mid-epoch: every `every` steps, or, with `spacing` > 0,
    steps s_0 = 0, s_(k+1) = s_k + max(MIN_EVAL_GAP, floor(spacing * s_k)), each gap at most
    `every` when that is given too. The steps are a function of the step count alone, so
    a resumed run evaluates where the uninterrupted one did."""

    def __init__(self, every, spacing):
        self._every, self._spacing = every, spacing
        self._next = 0

    def __call__(self, steps):
        if not self._spacing:
            return bool(self._every) and steps % self._every == 0
        while self._next < steps:
            gap = max(MIN_EVAL_GAP, math.floor(self._spacing * self._next))
            self._next += min(gap, self._every) if self._every else gap
        return self._next == steps


class EpochRecorder(keras.callbacks.Callback):
    """Keeps a run's `RunCounters` as `fit` calls back, and completes each epoch's logs.

    It times steps (`StepTimer`), runs the training clock only while training
    (`TrainingClock`), evaluates every `eval_every_steps` steps besides `fit`'s own
    evaluation at each epoch's end and logs each one (`EvaluationLog`), averages metrics
    over ranks (`RankAggregator`), and adds the learning rate, damping and
    fresh-example count to the epoch logs, so the progress bar, CSV and TensorBoard all
    show them. Each callback runs its collectives (metric means, fresh-example sums) in
    the same order on every rank.

    Args:
      counters: the `RunCounters` to update (restored ones when resuming).
      communicator: averages metrics over ranks (`grouped_allreduce_mean`).
      scalars_fn: returns extra per-epoch scalars, e.g. {"learning_rate": ..., "damping": ...}.
      fresh_examples_fn: returns the fresh examples this rank read in the current epoch.
      phase_fn: names the work of the step just finished ("factors", ...).
      evaluate_fn: returns this rank's eval metrics ({"val_accuracy": ...}) mid-epoch.
      eval_every_steps, eval_spacing: evaluate mid-epoch too, at the steps of
        `EvaluationSchedule` (both 0: only at epoch ends).
      target_accuracy: eval accuracy whose first crossing is recorded, or None.
      stop_at_target: ends training once the target is reached.
      give_up: (steps, accuracy): ends training once it has given up (`EvaluationLog`).
      steps_per_epoch: the run's steps per epoch; evaluation points are placed at
        `steps / steps_per_epoch` epochs (default: within each `fit` call's own steps).
      epoch_metrics: the model's metric variables (running sums and counts) saved
        when a checkpoint cut an epoch, added back when a resumed run continues it;
        `epoch_metrics` holds them again after each `fit` (read before evaluating).
      noise_scale: the run's `tfkfac.GradientNoiseScale` callback, or None. Its sums
        over the epoch's measured steps cross a checkpoint like the metrics: saved ones
        (`noise_scale_sums`) are added back when a resumed run continues the epoch, so
        its noise scale is the one of a run never stopped; `noise_scale_sums` holds them
        again after each `fit`.
    """

    def __init__(self, counters, communicator, scalars_fn, fresh_examples_fn, phase_fn,
                 evaluate_fn=None, eval_every_steps=0, eval_spacing=0.0, target_accuracy=None,
                 stop_at_target=False, give_up=None, steps_per_epoch=None,
                 epoch_metrics=None, noise_scale=None, noise_scale_sums=None):
        super().__init__()
        self.counters = counters
        self.epoch_metrics = None
        self._metrics_to_restore = epoch_metrics
        self.noise_scale_sums = None
        self._noise_scale = noise_scale
        self._noise_sums_to_restore = noise_scale_sums if noise_scale is not None else None
        self._timer = StepTimer(phase_fn, counters.step_time, first_step=counters.steps)
        self._clock = TrainingClock(counters)
        self._ranks = RankAggregator(communicator)
        self._evaluations = EvaluationLog(counters, target_accuracy, give_up)
        self._scalars_fn = scalars_fn
        self._fresh_examples_fn = fresh_examples_fn
        self._evaluate_fn = evaluate_fn
        self._evaluation_due = EvaluationSchedule(eval_every_steps, eval_spacing)
        self._stop_at_target = stop_at_target
        self._steps_per_epoch = steps_per_epoch
        self._epoch_steps = 0

    @property
    def target_reached(self):
        return self._evaluations.target_reached

    @property
    def gave_up(self):
        return self._evaluations.gave_up

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_steps = 0
        self._clock.start()

    def on_train_batch_begin(self, batch, logs=None):
        self._timer.on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self._metrics_to_restore is not None:
            # After the first step: Keras has built all of the compiled metrics' variables.
            add_running_metrics(self.model, self._metrics_to_restore)
            self._metrics_to_restore = None
        if self._noise_sums_to_restore is not None:  # after the epoch's reset of the probe
            add_noise_scale_sums(self._noise_scale.probe, self._noise_sums_to_restore)
            self._noise_sums_to_restore = None
        self._timer.on_train_batch_end(batch, logs)
        self.counters.steps = self._timer.step
        self._epoch_steps += 1
        last_of_epoch = self._epoch_steps == self.params.get("steps")
        if (self._evaluation_due(self.counters.steps)
                and not last_of_epoch):  # fit itself evaluates after the last step
            self._evaluate_mid_epoch()

    def on_test_begin(self, logs=None):
        self._clock.stop()  # fit's own evaluation after the epoch's last step
        # The epoch's running training metrics, before evaluation resets them: a
        # checkpoint taken mid-epoch stores them for the run that continues it.
        self.epoch_metrics = running_metrics(self.model)
        self.noise_scale_sums = self._running_noise_scale_sums()

    def on_epoch_end(self, epoch, logs=None):
        self._clock.stop()
        counters = self.counters
        counters.epochs = epoch + 1
        logs.update(self._ranks.mean_metrics(logs))
        counters.fresh_examples += self._ranks.total_fresh_examples(self._fresh_examples_fn())
        logs.update(self._scalars_fn())
        logs["fresh_examples"] = counters.fresh_examples
        add_history_row(counters, logs)
        epochs = (counters.steps / self._steps_per_epoch if self._steps_per_epoch
                  else counters.epochs)
        self._record_evaluation({k: v for k, v in logs.items() if k.startswith("val_")},
                                counters.fresh_examples, epochs)

    def cut_epoch(self):
        """Training stopped before the epoch's end (preemption, see preemption.py): the
        clock stops, the fresh examples read so far are counted and the epoch's running
        metrics kept in `epoch_metrics` for the checkpoint, as `on_test_begin` and
        `on_epoch_end` do; the epoch gets no history row, since it is not over."""
        self._clock.stop()
        self.counters.fresh_examples += self._ranks.total_fresh_examples(
            self._fresh_examples_fn())
        self.epoch_metrics = running_metrics(self.model)
        self.noise_scale_sums = self._running_noise_scale_sums()

    def _running_noise_scale_sums(self):
        probe = getattr(self._noise_scale, "probe", None)
        return None if probe is None else [float(value) for value in probe.sums.numpy()]

    def _evaluate_mid_epoch(self):
        """Evaluates with the training clock stopped."""
        self._clock.stop()
        metrics = self._ranks.mean_metrics(self._evaluate_fn())
        fresh = self.counters.fresh_examples + self._ranks.total_fresh_examples(
            self._fresh_examples_fn())
        self._record_evaluation(metrics, fresh, self._epochs_at(self._epoch_steps))
        self._clock.start()

    def _epochs_at(self, step_in_fit):
        """Epochs done (fractional) after `step_in_fit` steps of the current fit."""
        if self._steps_per_epoch:
            return self.counters.steps / self._steps_per_epoch
        return self.counters.epochs + step_in_fit / self.params["steps"]

    def _record_evaluation(self, metrics, fresh_examples, epochs):
        reached = self._evaluations.record(metrics, fresh_examples, epochs)
        if (reached and self._stop_at_target) or self._evaluations.gave_up:
            self.model.stop_training = True


class RunProgressBar(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, counting the run's epochs: the trainer calls `fit` once per
    epoch, so Keras alone would print "Epoch 3/3" for the third of ten."""

    def __init__(self, num_epochs):
        super().__init__()
        self._num_epochs = num_epochs

    def set_params(self, params):
        super().set_params(dict(params, epochs=self._num_epochs))


class EpochWriter(keras.callbacks.Callback):
    """Writes the recorder's history to `metrics.csv` and TensorBoard scalars (chief only).

    The CSV is rewritten whole from the history each epoch, so after a resume it holds
    exactly the checkpointed epochs followed by the new ones. A failed write raises
    `storage.WriteError`; `advice` returns what of the run is safe to delete.
    """

    def __init__(self, model_dir, recorder, advice=None):
        super().__init__()
        self.csv_path = os.path.join(model_dir, METRICS_FILE)
        self.tensorboard_dir = os.path.join(model_dir, TENSORBOARD_SUBDIR)
        self._recorder = recorder
        self._advice = advice
        self._summary_writer = None

    def on_epoch_end(self, epoch, logs=None):
        history = self._recorder.counters.history
        write_csv(self.csv_path, history, self._advice)
        row = history[-1]
        # An event holds the scalar, its tag and metadata: well under 256 bytes.
        with storage.failing_cleanly(self.tensorboard_dir, 256 * len(row), advice=self._advice):
            if self._summary_writer is None:
                self._summary_writer = tf.summary.create_file_writer(self.tensorboard_dir)
            with self._summary_writer.as_default():
                for key, value in row.items():
                    if key != "epoch":
                        tf.summary.write(key, tf.constant(value, tf.float32),
                                         step=int(row["epoch"]), metadata=_SCALAR_METADATA)
            self._summary_writer.flush()


# metrics.csv's first columns; the others follow in alphabetical order, so the columns
# never depend on the order a dict was built or read back from a checkpoint in.
LEADING_COLUMNS = ("epoch", "steps", "train_time_s")


def write_csv(path, rows, advice=None):
    """Writes dict rows with the union of their keys as columns: `LEADING_COLUMNS`, then
    the rest sorted; atomically (temp file + rename). A failed write raises
    `storage.WriteError` (with `advice`, see `storage.failing_cleanly`)."""
    keys = {key for row in rows for key in row}
    columns = [key for key in LEADING_COLUMNS if key in keys] + sorted(
        keys.difference(LEADING_COLUMNS))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    _write_text(path, text.getvalue(), advice)


def write_json(path, value, advice=None):
    """Writes JSON atomically (temp file + rename), so readers never see half a file. A
    failed write raises `storage.WriteError` (with `advice`)."""
    _write_text(path, json.dumps(value, indent=2, sort_keys=True) + "\n", advice)


def _write_text(path, text, advice):
    temporary = path + ".tmp"
    with storage.failing_cleanly(path, len(text.encode("utf-8")), leftovers=[temporary],
                                 advice=advice):
        with open(temporary, "w", newline="", encoding="utf-8") as f:
            f.write(text)
        os.replace(temporary, path)
