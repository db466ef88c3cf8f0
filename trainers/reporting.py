"""What a run measured, per step and per epoch, and the files that report it.

`EpochRecorder` times steps and training, averages metrics over ranks, adds the learning
rate, damping and fresh-example count to the epoch logs (so the progress bar, CSV and
TensorBoard all show them) and notes when the target accuracy was first reached.
`EpochWriter` turns that record into `metrics.csv` and TensorBoard scalars; only the chief
rank uses it. Everything the recorder keeps lives in `RunCounters`, which the checkpoint
stores, so a resumed run reports the same totals as an uninterrupted one.
"""

import csv
import dataclasses
import json
import os
import time
from typing import Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

EVAL_ACCURACY_KEY = "val_accuracy"
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

    def to_dict(self):
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values):
        return cls(**values)

    def mean_step_time_s(self):
        """Mean seconds per step for each phase and over all timed steps."""
        means = {phase: total / count for phase, (count, total) in self.step_time.items()
                 if count}
        count = sum(c for c, _ in self.step_time.values())
        if count:
            means["all"] = sum(t for _, t in self.step_time.values()) / count
        return means


class EpochRecorder(keras.callbacks.Callback):
    """Measures a run and completes each epoch's logs.

    Args:
      counters: the `RunCounters` to update (restored ones when resuming).
      communicator: averages the epoch metrics over ranks (`grouped_allreduce_mean`).
      scalars_fn: returns extra per-epoch scalars, e.g. {"learning_rate": ..., "damping": ...}.
      fresh_examples_fn: returns the fresh examples this rank read in the current epoch.
      phase_fn: maps a global step index to the name of the work it did ("factor", ...).
      target_accuracy: eval accuracy whose first crossing is recorded, or None.
      stop_at_target: ends training once the target is reached.
    """

    def __init__(self, counters, communicator, scalars_fn, fresh_examples_fn, phase_fn,
                 target_accuracy=None, stop_at_target=False):
        super().__init__()
        self.counters = counters
        self._communicator = communicator
        self._scalars_fn = scalars_fn
        self._fresh_examples_fn = fresh_examples_fn
        self._phase_fn = phase_fn
        self._target_accuracy = target_accuracy
        self._stop_at_target = stop_at_target
        self._phases_seen = set()
        self._epoch_start = None
        self._epoch_train_time = None
        self._step_start = None

    @property
    def target_reached(self):
        return self.counters.to_target is not None

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.perf_counter()
        self._epoch_train_time = None

    def on_train_batch_begin(self, batch, logs=None):
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        elapsed = time.perf_counter() - self._step_start
        phase = self._phase_fn(self.counters.steps)
        self.counters.steps += 1
        # The first step of each phase in a process traces and compiles: not a step time.
        if phase not in self._phases_seen:
            self._phases_seen.add(phase)
            return
        count, total = self.counters.step_time.get(phase, (0, 0.0))
        self.counters.step_time[phase] = [count + 1, total + elapsed]

    def on_test_begin(self, logs=None):
        # Evaluation inside fit ends the epoch's training time.
        if self._epoch_start is not None and self._epoch_train_time is None:
            self._epoch_train_time = time.perf_counter() - self._epoch_start

    def on_epoch_end(self, epoch, logs=None):
        if self._epoch_train_time is None:
            self._epoch_train_time = time.perf_counter() - self._epoch_start
        counters = self.counters
        counters.epochs = epoch + 1
        counters.train_time_s += self._epoch_train_time
        logs.update(self._averaged(logs))
        counters.fresh_examples += self._global_fresh_examples()
        logs.update(self._scalars_fn())
        logs["fresh_examples"] = counters.fresh_examples
        row = {"epoch": counters.epochs, "steps": counters.steps,
               "train_time_s": counters.train_time_s}
        row.update({key: float(value) for key, value in logs.items()})
        counters.history.append(row)
        accuracy = logs.get(EVAL_ACCURACY_KEY)
        if (self._target_accuracy is not None and counters.to_target is None
                and accuracy is not None and accuracy >= self._target_accuracy):
            counters.to_target = {"time_s": counters.train_time_s, "steps": counters.steps,
                                  "epochs": counters.epochs,
                                  "fresh_examples": counters.fresh_examples,
                                  "accuracy": float(accuracy)}
            if self._stop_at_target:
                self.model.stop_training = True

    def _averaged(self, logs):
        """Epoch metrics as the mean over ranks (identity on one process)."""
        keys = sorted(key for key, value in logs.items() if np.isscalar(value))
        values = [tf.constant(float(logs[key]), tf.float64) for key in keys]
        averaged = self._communicator.grouped_allreduce_mean(values, category="metrics")
        return {key: float(value) for key, value in zip(keys, averaged)}

    def _global_fresh_examples(self):
        """The epoch's fresh examples summed over ranks: their mean times the rank count."""
        local = tf.constant(float(self._fresh_examples_fn()), tf.float64)
        mean = self._communicator.grouped_allreduce_mean([local], category="metrics")[0]
        return int(round(float(mean) * self._communicator.size))


class EpochWriter(keras.callbacks.Callback):
    """Writes the recorder's history to `metrics.csv` and TensorBoard scalars (chief only).

    The CSV is rewritten whole from the history each epoch, so after a resume it holds
    exactly the checkpointed epochs followed by the new ones.
    """

    def __init__(self, model_dir, recorder):
        super().__init__()
        self.csv_path = os.path.join(model_dir, "metrics.csv")
        self.tensorboard_dir = os.path.join(model_dir, "tensorboard")
        self._recorder = recorder
        self._summary_writer = None

    def on_epoch_end(self, epoch, logs=None):
        history = self._recorder.counters.history
        write_csv(self.csv_path, history)
        if self._summary_writer is None:
            self._summary_writer = tf.summary.create_file_writer(self.tensorboard_dir)
        row = history[-1]
        with self._summary_writer.as_default():
            for key, value in row.items():
                if key != "epoch":
                    tf.summary.write(key, tf.constant(value, tf.float32),
                                     step=int(row["epoch"]), metadata=_SCALAR_METADATA)
        self._summary_writer.flush()


def write_csv(path, rows):
    """Writes dict rows with the union of their keys as columns, in first-seen order."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path + ".tmp", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(path + ".tmp", path)


def write_json(path, value):
    """Writes JSON atomically (temp file + rename), so readers never see half a file."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)
