"""Checkpoints that survive faults: model and optimizer variables plus the trainer's state.

Each checkpoint is one directory `<model_dir>/checkpoints/step-<N>` (N = training steps
done) holding the variables (`tf.train.Checkpoint`: weights, BatchNorm statistics, the
optimizer's slots and K-FAC factors and decompositions, its step counter) and
`trainer_state.json` (counters, history, the epoch's running metrics and gradient noise
scale sums). K-FAC's own variables are saved and restored by their keys
(`KFAC.state_by_key`, under `KFAC_STATE`), and a checkpoint whose variables are not this
run's (another architecture or setting, names, dtypes or shapes) is refused before
anything is assigned, naming the first that differ. Checkpoints written before the keys
hold K-FAC's variables by position only: they are restored by position as before, after
the check of their `optimizer_keys.json` (the key and shape of each, `KFAC.saved_keys`),
if they have one. A checkpoint of another run that does not restore is named with the
first variables that differ, not with TensorFlow's RestoreV2 message. It is written
under a temporary name and renamed into place only when complete, so a crash during a
write never leaves a half-written checkpoint that looks like the newest; leftovers of
such a write are removed when the next run starts and before every save. A write that
fails (a full disk) removes its partial checkpoint and says what is safe to delete.

On resume the newest checkpoint that loads is used. One that does not (a truncated or
missing file, a trainer state that is not what the trainer writes: see `check_state`) is
reported by path with the reason, and the run falls back to the next older one with a
warning saying how many steps of training are lost; if none loads, `CheckpointError`
names every checkpoint tried and why. The two newest checkpoints are kept. A checkpoint
of a K-FAC run under placement "owner" by tfkfac 0.2.0, which saved no rebuild state,
loads as tfkfac loads it (its owners rebuild from the restored factors, with a warning).

Runs written before this layout (`checkpoints/epoch-<N>` with `trainer_state.json` in
the model dir) are still found and resumed.
"""

import json
import math
import os
import re
import shutil
import signal
import tempfile
import types
import typing

from absl import logging
import keras
import numpy as np
import tensorflow as tf

import tfkfac
from trainers import errors, reporting, storage

CHECKPOINT_SUBDIR = "checkpoints"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"
# What each start of the run set differently from config.json (see runner.py).
RUN_HISTORY_FILE = "run_history.json"
VARIABLES_PREFIX = "variables"
OPTIMIZER_KEYS_FILE = "optimizer_keys.json"  # in checkpoints by position (before the keys)
# The checkpoint's child holding K-FAC's variables by key. TensorFlow restores breadth
# first, children in sorted order, and binds each saved variable once: sorted before
# "model" and "optimizer", it binds K-FAC's variables by key before the optimizer's
# `_variables` list, which also holds them, could by position.
KFAC_STATE = "kfac_state"
_DIR_NAME = re.compile(r"^step-(\d+)$")
_TEMP_MARK = ".partial-"
# Test hook: "<point>" or "<point>@<step>" kills this process with SIGKILL at that point
# of a checkpoint write (points: after_variables, before_rename, after_rename), so tests
# can check what a crash mid-write leaves behind.
FAULT_ENV = "TRAINERS_CHECKPOINT_FAULT"
FAULT_POINTS = ("after_variables", "before_rename", "after_rename")


class CheckpointError(errors.RunError):
    """No checkpoint of a run can be loaded; the message names each one tried and why."""


class RunFileError(errors.RunError):
    """config.json or run_history.json cannot be read; the message names it and why."""


class _Unloadable(Exception):
    """Why one checkpoint cannot be loaded, naming the file (the message is the reason)."""


# What each run file is for and what to do when it is damaged, for its error message.
CONFIG_ROLE = ("it holds the settings the run started with: restore it, or start a new run "
                "in another model_dir")
HISTORY_ROLE = ("it only records what each start changed: delete it to resume with the "
                 f"settings of {CONFIG_FILE}")


def read_config(model_dir):
    """The config dict the run in `model_dir` was started with, or None.

    Raises `RunFileError` naming the file if it is not a readable JSON object."""
    path = os.path.join(model_dir, CONFIG_FILE)
    config = _read_run_file(path, CONFIG_ROLE)
    if config is not None and not isinstance(config, dict):
        raise RunFileError(f"{path} is damaged (a JSON {type(config).__name__}, not an "
                           f"object); {CONFIG_ROLE}")
    return config


def read_run_history(model_dir):
    """The list of the run's starts (see runner.py), or [] before the first.

    Raises `RunFileError` naming the file unless it is a list of starts, each with a
    `changed` object of `[before, after]` pairs."""
    path = os.path.join(model_dir, RUN_HISTORY_FILE)
    history = _read_run_file(path, HISTORY_ROLE)
    if history is None:
        return []
    if not (isinstance(history, list) and all(
            isinstance(entry, dict) and isinstance(entry.get("changed", {}), dict)
            and all(isinstance(pair, list) and len(pair) == 2
                    for pair in entry.get("changed", {}).values())
            for entry in history)):
        raise RunFileError(f"{path} is damaged (not a list of starts with their changed "
                           f"settings as [before, after] pairs); {HISTORY_ROLE}")
    return history


def _read_run_file(path, role):
    """The JSON value in `path`, or None if there is none; `RunFileError` naming the
    file, why it cannot be read and (`role`) what it is for and what to do."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as error:
        raise RunFileError(f"{path} cannot be read ({error.strerror}); {role}") from None
    except ValueError as error:  # bad JSON, or bytes that are not UTF-8
        raise RunFileError(f"{path} is damaged (not valid JSON: {error}); {role}") from None


def _read_json(path):
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def candidates(model_dir):
    """`[(step, checkpoint path, state file)]` of every complete checkpoint, newest first.

    The step of a new-layout checkpoint comes from its directory name, so a checkpoint
    whose state file is damaged is still listed (and reported when it fails to load).
    """
    directory = os.path.join(model_dir, CHECKPOINT_SUBDIR)
    found = []
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = _DIR_NAME.match(name)
            path = os.path.join(directory, name)
            if match and os.path.isdir(path):
                found.append((int(match.group(1)), path, os.path.join(path, STATE_FILE)))
    legacy = _legacy_candidate(model_dir)
    if legacy and all(step != legacy[0] for step, _, _ in found):
        found.append(legacy)
    return sorted(found, key=lambda item: item[0], reverse=True)


def _legacy_candidate(model_dir):
    """The pre-0.2 layout: `trainer_state.json` beside `checkpoints/epoch-<N>`."""
    state_file = os.path.join(model_dir, STATE_FILE)
    try:
        state = _read_json(state_file)
        prefix = os.path.join(model_dir, CHECKPOINT_SUBDIR, state["checkpoint"])
        return int(state["counters"]["steps"]), prefix, state_file
    except (OSError, ValueError, KeyError, TypeError):
        return None


def has_run(model_dir):
    """Whether `model_dir` holds any checkpoint (loadable or not) of a run."""
    return bool(candidates(model_dir)) or os.path.exists(os.path.join(model_dir, STATE_FILE))


def _prefix(path):
    """The variables' file prefix of a checkpoint directory (legacy: the path itself)."""
    return os.path.join(path, VARIABLES_PREFIX) if os.path.isdir(path) else path


def _first_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


_VALUE_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a float"),
                (str, "a string"), (list, "a list"), (dict, "an object"))
_EXPECTED_KINDS = {int: "an integer", float: "a number", str: "a string",
                   bool: "true or false", type(None): "null"}


def describe(value):
    """A JSON value as its file shows it, and its kind: '"200" (a string)', 'null'."""
    text = json.dumps(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    kind = next((name for kind, name in _VALUE_KINDS if isinstance(value, kind)), None)
    return f"{text} ({kind})" if kind else text


def _expected_kind(annotation):
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_expected_kind(arg) for arg in typing.get_args(annotation))
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "an object"
    return _EXPECTED_KINDS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def json_mismatch(annotation, value, name):
    """None if the JSON `value` (read back from a run's file) can stand for a value
    annotated `annotation`; else a phrase naming the first part that cannot and what it
    is: 'counters.history[2].loss is "x" (a string), not a number'."""
    if annotation is typing.Any:  # a class since Python 3.11, but isinstance refuses it
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):  # Optional[...]
        problems = [json_mismatch(arg, value, name) for arg in args]
        if None in problems:
            return None
        # A container of the right kind with a bad item: name the item.
        deeper = [problem for problem in problems if not problem.startswith(f"{name} is ")]
        if deeper:
            return deeper[0]
    elif origin in (list, tuple) and isinstance(value, list):  # tuples are JSON lists
        return next(filter(None, (json_mismatch(args[0], item, f"{name}[{index}]")
                                  for index, item in enumerate(value))), None)
    elif origin is dict and isinstance(value, dict):
        return next(filter(None, (json_mismatch(args[1], item, f"{name}.{key}")
                                  for key, item in value.items())), None)
    elif origin is None and _fits(annotation, value):
        return None
    return f"{name} is {describe(value)}, not {_expected_kind(annotation)}"


def _fits(annotation, value):
    """Whether a JSON value is of the plain type `annotation` (an int is a float too)."""
    if isinstance(value, bool) and annotation is not bool:
        return False
    if annotation is float:
        return isinstance(value, (int, float))
    if annotation is type(None):
        return value is None
    return isinstance(value, annotation) if isinstance(annotation, type) else True


# What `check_state` asks of `RunCounters` beyond its fields' types: counts and seconds
# are >= 0 (seconds finite); the rows hold what the reports read from them.
_COUNTS = ("epochs", "steps", "fresh_examples")
_ROW_KEYS = {"history": reporting.LEADING_COLUMNS,
             "evaluations": ("steps", "epochs", "train_time_s", "fresh_examples"),
             "to_target": ("time_s", "steps", "epochs", "fresh_examples", "accuracy")}
# Counters an earlier version did not write yet; a checkpoint without them gets the default.
_COUNTERS_ADDED_LATER = ("evaluations",)


def check_state(state, legacy=False):
    """Raises ValueError naming the first value of a trainer state (a checkpoint's
    `trainer_state.json`) that is not what the trainer writes: `counters`
    (`reporting.RunCounters`: every field, of its type, counts >= 0, finite seconds) and
    `epoch_metrics` (null, or the metric variables' values as numbers or lists of them),
    `noise_scale_sums` (absent, null, or the epoch's gradient noise scale sums as
    numbers), plus `checkpoint` (its variables' name) in the `legacy` layout."""
    if not isinstance(state, dict):
        raise ValueError(f"it is {describe(state)}, not an object")
    known = ("counters", "epoch_metrics", "noise_scale_sums") + (
        ("checkpoint",) if legacy else ())
    unknown = sorted(set(state).difference(known))
    if unknown:
        raise ValueError(f"it holds unknown fields: {', '.join(unknown)}")
    if "counters" not in state:
        raise ValueError("it has no counters")
    _check_counters(state["counters"])
    metrics = state.get("epoch_metrics")
    if metrics is not None and not (isinstance(metrics, list) and all(
            _numbers(value) for value in metrics)):
        raise ValueError(f"epoch_metrics is {describe(metrics)}, not null or a list of the "
                         "metric variables' values (numbers or lists of them)")
    sums = state.get("noise_scale_sums")
    if sums is not None and not (isinstance(sums, list) and all(
            _numbers(value) and not isinstance(value, list) for value in sums)):
        raise ValueError(f"noise_scale_sums is {describe(sums)}, not null or a list of "
                         "numbers")
    if legacy and not isinstance(state.get("checkpoint"), str):
        raise ValueError(f"checkpoint is {describe(state.get('checkpoint'))}, not a string")


def _check_counters(counters):
    """`check_state` of the `counters`: `reporting.RunCounters.to_dict()`'s fields."""
    hints = typing.get_type_hints(reporting.RunCounters)
    problem = json_mismatch(typing.Dict[str, typing.Any], counters, "counters")
    if problem:
        raise ValueError(problem)
    unknown = sorted(set(counters).difference(hints))
    if unknown:
        raise ValueError(f"counters holds unknown fields: {', '.join(unknown)}")
    missing = [name for name in hints if name not in counters
               and name not in _COUNTERS_ADDED_LATER]
    if missing:
        raise ValueError(f"counters lacks {', '.join(missing)}")
    for name, value in counters.items():
        problem = json_mismatch(hints[name], value, f"counters.{name}")
        if problem:
            raise ValueError(problem)
    seconds = [("train_time_s", counters["train_time_s"])]
    for phase, pair in counters["step_time"].items():
        if len(pair) != 2 or json_mismatch(int, pair[0], phase):
            raise ValueError(f"counters.step_time.{phase} is {describe(pair)}, not [steps "
                             "timed, their seconds]")
        seconds.append((f"step_time.{phase}", pair[1]))
    for name, value in [(name, counters[name]) for name in _COUNTS] + seconds:
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"counters.{name} is {describe(value)}, not a finite number >= 0")
    for field, keys in _ROW_KEYS.items():
        rows = counters.get(field)
        named = ({field: rows} if isinstance(rows, dict) else
                 {f"{field}[{index}]": row for index, row in enumerate(rows or [])})
        for where, row in named.items():
            absent = [key for key in keys if key not in row]
            if absent:
                raise ValueError(f"counters.{where} lacks {', '.join(absent)}")


def _numbers(value):
    """Whether `value` is a number or a (nested) list of numbers: a variable's value."""
    if isinstance(value, list):
        return all(_numbers(item) for item in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _load_state(step, path, state_file):
    """The checkpoint's trainer state, checked (`check_state`), after reading every saved
    tensor (their checksums catch truncated or damaged files). Raises with the reason if
    anything fails."""
    if not os.path.exists(state_file):
        raise _Unloadable(f"{state_file} is missing")
    with open(state_file, encoding="utf-8") as f:
        try:
            state = json.load(f)
        except ValueError as error:
            raise _Unloadable(f"{state_file} is not valid JSON ({error})") from None
    try:
        check_state(state, legacy=not os.path.isdir(path))
    except ValueError as error:
        raise _Unloadable(f"{state_file} is damaged: {error}") from None
    if state["counters"]["steps"] != step:
        raise _Unloadable(f"{state_file} is for step {state['counters']['steps']}, not {step}")
    prefix = _prefix(path)
    try:
        reader = tf.train.load_checkpoint(prefix)
        for key in reader.get_variable_to_shape_map():
            reader.get_tensor(key)
    except Exception as error:  # pylint: disable=broad-except
        files = ", ".join(sorted(tf.io.gfile.glob(prefix + ".*"))) or "no files"
        raise _Unloadable(f"variables {prefix}.* ({files}) cannot be read: "
                          f"{_first_line(error)}") from None
    return state


# A damaged file fails in many ways (TensorFlow's reader raises IndexError for a short
# data file, DataLossError for a bad checksum, ...); any failure marks the checkpoint as
# not loadable, and its reason is reported.
_LOAD_ERRORS = (Exception,)


def find_loadable(model_dir, try_restore=None):
    """Returns `(state, path, failures)` of the newest checkpoint that loads, where
    `failures` lists `(step, path, reason)` of the newer ones that did not; or
    `(None, None, [])` when the run has no checkpoint. `try_restore(prefix)`, if given,
    also restores the variables and may raise. Raises `CheckpointError` if none loads."""
    failures = []
    for step, path, state_file in candidates(model_dir):
        try:
            state = _load_state(step, path, state_file)
            if try_restore is not None:
                try_restore(_prefix(path))
            return state, path, failures
        except _LOAD_ERRORS as error:
            failures.append((step, path, str(error) if isinstance(error, _Unloadable)
                             else _first_line(error)))
    if failures:
        raise CheckpointError(
            f"no checkpoint of the run in {model_dir} can be loaded; tried "
            + "; ".join(f"{path} ({reason})" for _, path, reason in failures))
    if os.path.exists(os.path.join(model_dir, STATE_FILE)):
        raise CheckpointError(f"{os.path.join(model_dir, STATE_FILE)} names no checkpoint "
                              "that exists; the run cannot be resumed")
    return None, None, []


def read_state(model_dir):
    """The trainer state of the newest loadable checkpoint in `model_dir`, or None."""
    return find_loadable(model_dir)[0]


def _saved_keys(prefix):
    """The keys of the tensors a `tf.train.Checkpoint` saved at `prefix`."""
    return {name for name, _ in tf.train.list_variables(prefix)}


_VALUE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
_OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"  # a save's key that is no variable


def _saved_variables(prefix):
    """{key: "dtype[shape]"} of the variables saved at `prefix` (their object graph aside),
    keys without `_VALUE_SUFFIX`."""
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    return {key.removesuffix(_VALUE_SUFFIX): f"{dtypes[key].name}{list(shape)}"
            for key, shape in reader.get_variable_to_shape_map().items()
            if key != _OBJECT_GRAPH}


def _difference(saved, ours):
    """How the variables `saved` ({key: "dtype[shape]"}) differ from `ours`, as a phrase,
    or None when they are the same."""
    changed = sorted(key for key in saved.keys() & ours.keys() if saved[key] != ours[key])
    missing, extra = sorted(ours.keys() - saved.keys()), sorted(saved.keys() - ours.keys())
    more = lambda keys: f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
    parts = []
    if changed:
        parts.append(f"it holds {changed[0]} as {saved[changed[0]]}, this run's is "
                     f"{ours[changed[0]]}{more(changed)}")
    if extra:
        parts.append(f"it holds {extra[0]}{more(extra)}, which this run does not have")
    if missing:
        parts.append(f"it has no {missing[0]}{more(missing)} of this run")
    return "; ".join(parts) or None


def _fault(point, step):
    wanted = os.environ.get(FAULT_ENV, "")
    name, _, at_step = wanted.partition("@")
    if name == point and (not at_step or int(at_step) == step):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_tree(directory):
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory):
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class CheckpointStore:
    """Saves and restores one run's checkpoints in `<model_dir>/checkpoints`."""

    def __init__(self, model_dir, model, optimizer, max_to_keep=2):
        self.model_dir = model_dir
        self.directory = os.path.join(model_dir, CHECKPOINT_SUBDIR)
        self.max_to_keep = max_to_keep
        self._optimizer = optimizer
        kfac, _ = _kfac_of(optimizer)
        named = {} if kfac is None else {KFAC_STATE: kfac.state_by_key()}
        self._checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, **named)
        # The layout of checkpoints written before the keys, to read them.
        self._by_position = tf.train.Checkpoint(model=model, optimizer=optimizer)
        variables = {id(v): v for v in model.variables + optimizer.variables}.values()
        # What a checkpoint's data file holds (its index and state file add a few KB).
        self._variable_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                                   for v in variables)

    def path(self, step):
        """Where checkpoint `step` is (once written)."""
        return os.path.join(self.directory, f"step-{step}")

    def save(self, step, state):
        """Writes checkpoint `step-<step>` (variables and `state`) atomically: complete
        under a temporary name first, then renamed; older ones beyond `max_to_keep` go.

        Leftovers of writes a stopped process did not finish are removed first. A write
        that fails (a full disk, an I/O error) removes its partial checkpoint and raises
        `storage.WriteError` saying how much room it needs and what is safe to delete;
        the newest complete checkpoint stays as it was.
        """
        os.makedirs(self.directory, exist_ok=True)
        self.remove_unfinished()
        final = self.path(step)
        name = os.path.basename(final)
        temporary = os.path.join(self.directory, f"{_TEMP_MARK}{name}")
        replaced = os.path.join(self.directory, f"{_TEMP_MARK}old-{name}")
        kfac, _ = _kfac_of(self._optimizer)
        if kfac is not None:
            kfac.state_by_key()  # with the variables made since the store was
        with storage.failing_cleanly(final, self._variable_bytes + 8192,
                                     leftovers=[temporary], advice=self.space_advice):
            try:
                os.makedirs(temporary)
                self._checkpoint.write(os.path.join(temporary, VARIABLES_PREFIX))
                _fault("after_variables", step)
                # No temp file of its own: the directory is renamed into place whole.
                with open(os.path.join(temporary, STATE_FILE), "w", encoding="utf-8") as f:
                    json.dump(state, f, indent=2, sort_keys=True)
                _fsync_tree(temporary)
                _fault("before_rename", step)
                if os.path.exists(final):  # the same step again (a resume with nothing left)
                    os.rename(final, replaced)
                os.rename(temporary, final)
                _fsync_dir(self.directory)
            finally:
                if os.path.exists(replaced) and not os.path.exists(final):
                    os.rename(replaced, final)  # a failed rename keeps the one there was
        storage.remove(replaced)
        _fault("after_rename", step)
        self._prune(keep=final)
        return final

    def remove_unfinished(self):
        """Removes what writes that did not finish left in the checkpoint directory (a
        process stopped mid-write, or a write that failed); logs each one removed."""
        if not os.path.isdir(self.directory):
            return
        for name in sorted(os.listdir(self.directory)):
            if name.startswith(_TEMP_MARK):
                path = os.path.join(self.directory, name)
                logging.warning("removing %s (%s), left by a checkpoint write that did not "
                                "finish", path, storage.human_bytes(storage.tree_bytes(path)))
                storage.remove(path)

    def space_advice(self):
        """What of the run is safe to delete to make room, and what must be kept, as one
        phrase for `storage.WriteError`."""
        complete = [(step, path) for step, path, _ in candidates(self.model_dir)
                    if os.path.dirname(path) == self.directory and os.path.isdir(path)]
        deletable = [f"{path} ({storage.human_bytes(storage.tree_bytes(path))}, an older "
                     "checkpoint)" for _, path in complete[1:]]
        logs = os.path.join(self.model_dir, reporting.TENSORBOARD_SUBDIR)
        if os.path.isdir(logs):
            deletable.append(f"{logs} ({storage.human_bytes(storage.tree_bytes(logs))}, "
                             f"TensorBoard logs; {reporting.METRICS_FILE} holds the same "
                             "numbers)")
        advice = ("safe to delete: " + ", ".join(deletable) if deletable
                  else "nothing of this run is safe to delete: free space on that file system")
        if complete:
            step, path = complete[0]
            advice += (f"; keep {path}, the newest complete checkpoint (step {step}): "
                       "--resume continues from it")
        return advice

    def resume_hint(self):
        """Where a restart of the run continues from, as a phrase."""
        complete = [(step, path) for step, path, _ in candidates(self.model_dir)
                    if os.path.isdir(path)]
        if not complete:
            return "the run has no checkpoint yet: a restart starts it over"
        step, path = complete[0]
        return f"--resume continues from {path} (step {step})"

    def _prune(self, keep):
        complete = [path for _, path, _ in candidates(self.model_dir)
                    if os.path.dirname(path) == self.directory and os.path.isdir(path)]
        for path in complete[self.max_to_keep:]:
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)

    def _restore_variables(self, prefix):
        """Restores the variables saved at `prefix`, K-FAC's by key; refuses, before
        assigning any, a checkpoint whose variables (keys, dtypes, shapes) are not this
        run's, naming the first that differ (`_Unloadable`). A checkpoint written before
        the keys is restored by position: refused, before assigning any, if its
        `optimizer_keys.json` does not name this K-FAC optimizer's variables; then an
        AssertionError unless every variable of the model and the optimizer had a value
        there, but for a K-FAC optimizer's rebuild state (placement "owner") when the
        save predates it, as tfkfac 0.2.0's do: the owner then rebuilds its
        decompositions from the restored factors at its first step, with tfkfac's
        warning, as after tfkfac reads it."""
        saved = _saved_variables(prefix)
        checkpoint = self._checkpoint
        if _kfac_of(self._optimizer)[0] is not None:
            if any(key.startswith(KFAC_STATE + "/") for key in saved):
                difference = self._difference(saved, checkpoint)
                if difference is not None:
                    raise self._written_by_another_run(prefix, difference)
            else:  # written before the keys
                checkpoint = self._by_position
                self._check_optimizer_keys(os.path.join(os.path.dirname(prefix),
                                                        OPTIMIZER_KEYS_FILE))
        try:
            checkpoint.read(prefix).assert_existing_objects_matched()
            return
        except Exception as error:  # pylint: disable=broad-except
            if isinstance(error, AssertionError) and self._lacks_only_rebuild_state(prefix):
                return
            difference = self._difference(saved, checkpoint)
            if difference is None:
                raise
        raise self._written_by_another_run(prefix, difference)

    @staticmethod
    def _written_by_another_run(prefix, difference):
        return _Unloadable(f"variables {prefix}.* were written by another run (another "
                           f"model, optimizer or precision): {difference}")

    def _difference(self, saved, checkpoint):
        """How the variables `saved` ({key: "dtype[shape]"}) differ from those a save of
        `checkpoint` would hold now, as a phrase (None when they do not, or when the
        comparison's save fails, e.g. for want of room). TensorFlow's words (RestoreV2's
        dtype message, a list of unrestored objects) do not say what happened."""
        try:
            with tempfile.TemporaryDirectory() as directory:
                return _difference(saved, _saved_variables(
                    checkpoint.write(os.path.join(directory, "now"))))
        except Exception:  # pylint: disable=broad-except
            return None

    def _check_optimizer_keys(self, keys_file):
        """`_Unloadable` naming the variables that differ when `keys_file` (absent in
        checkpoints written before it) does not name this K-FAC optimizer's variables."""
        optimizer, _ = _kfac_of(self._optimizer)
        if not os.path.exists(keys_file):
            return
        try:
            with open(keys_file, encoding="utf-8") as f:
                saved = json.load(f)["keys"]
            optimizer.check_saved_keys(saved)
        except (ValueError, KeyError, TypeError) as error:
            raise _Unloadable(f"{keys_file}: {error}") from None

    def _lacks_only_rebuild_state(self, prefix):
        """Whether the save at `prefix` (by position) holds every variable a save of the
        model and the optimizer by position would, but a K-FAC optimizer's rebuild state
        (`KFAC.rebuild_state`, the last of its variables, which a checkpoint by position
        keys `<optimizer>/_variables/<index>`: docs/design.md §10)."""
        optimizer, path = _kfac_of(self._optimizer)
        if optimizer is None or not optimizer.rebuild_state():
            return False
        count = len(optimizer.variables)
        rebuild = {f"{path}/_variables/{index}/.ATTRIBUTES/VARIABLE_VALUE"
                   for index in range(count - len(optimizer.rebuild_state()), count)}
        with tempfile.TemporaryDirectory() as directory:
            wanted = _saved_keys(self._by_position.write(os.path.join(directory, "now")))
        return rebuild <= wanted and _saved_keys(prefix) == wanted - rebuild

    def restore(self, report=True):
        """Restores the newest checkpoint that loads and returns its trainer state (None
        when the run has none). Newer ones that fail are reported (when `report`) with
        path, reason and the steps of training lost; `CheckpointError` if none loads."""

        state, path, failures = find_loadable(self.model_dir, self._restore_variables)
        if report and failures:
            for step, failed, reason in failures:
                logging.warning("checkpoint %s (step %d) cannot be loaded: %s", failed, step,
                                reason)
            newest = failures[0][0]
            step = state["counters"]["steps"]
            logging.warning("resuming from the older checkpoint %s (step %d) instead: %d "
                            "steps of training (steps %d to %d) are lost and will be redone",
                            path, step, newest - step, step, newest)
        return state


def _kfac_of(optimizer):
    """(the K-FAC optimizer of `optimizer`, unwrapped from a LossScaleOptimizer, and its
    path in a checkpoint), or (None, None)."""
    path = "optimizer"
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer, path = optimizer.inner_optimizer, f"{path}/inner_optimizer"
    return (optimizer, path) if isinstance(optimizer, tfkfac.KFAC) else (None, None)
