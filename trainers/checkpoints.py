"""Per-epoch checkpoints: model and optimizer variables plus the trainer's own state.

Variables (weights, BatchNorm statistics, the optimizer's slots and K-FAC factors and
eigenbases, its step counter) go through `tf.train.Checkpoint`, which also restores
variables an optimizer creates lazily. The trainer's state (epochs done, counters,
history) is JSON in `trainer_state.json`, written after the variables and naming the
checkpoint it belongs to, so a crash between the two leaves the previous pair intact.
"""

import json
import os

import tensorflow as tf

from trainers import reporting

CHECKPOINT_SUBDIR = "checkpoints"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"


def state_path(model_dir):
    return os.path.join(model_dir, STATE_FILE)


def read_state(model_dir):
    """The trainer state of the last checkpoint in `model_dir`, or None if there is none."""
    path = state_path(model_dir)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_config(model_dir):
    """The config dict the run in `model_dir` was started with, or None."""
    path = os.path.join(model_dir, CONFIG_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class CheckpointStore:
    """Saves and restores one run's checkpoints in `<model_dir>/checkpoints`."""

    def __init__(self, model_dir, model, optimizer, max_to_keep=2):
        self.model_dir = model_dir
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
        self._manager = tf.train.CheckpointManager(
            self._checkpoint, os.path.join(model_dir, CHECKPOINT_SUBDIR),
            max_to_keep=max_to_keep, checkpoint_name="epoch")

    def save(self, epoch, state):
        """Checkpoints the variables as `epoch-<epoch>` and records `state` beside them."""
        prefix = self._manager.save(checkpoint_number=epoch)
        reporting.write_json(state_path(self.model_dir),
                             dict(state, checkpoint=os.path.basename(prefix)))

    def restore(self):
        """Restores the last checkpoint's variables; returns its trainer state, or None."""
        state = read_state(self.model_dir)
        if state is None:
            return None
        prefix = os.path.join(self.model_dir, CHECKPOINT_SUBDIR, state["checkpoint"])
        self._checkpoint.restore(prefix).assert_existing_objects_matched()
        return state
