"""Ranks agree or stop: every rank's run-defining settings are compared before training
(Horovod ranks, or tf.distribute workers), and any difference ends the job with one line.

Each rank parses its own flags and reads its own storage. Ranks that differ in a
setting that shapes the run (model, batch, K-FAC settings, data split, the step a
resumed run continues from) would issue different collectives and hang, or train
something else than asked without a sign. `agree` hashes this rank's settings and
gathers the hashes (one small allgather); only when they differ are the settings
themselves gathered, and every rank raises the same `RanksDisagree` naming each
setting that differs with every rank's value. A tf.distribute worker that stopped before
the comparison ends the others with one line naming it (`distribution.StartupError`).
"""

import hashlib
import json

import numpy as np
import tensorflow as tf

from trainers import distribution, errors


class RanksDisagree(errors.RunError):
    """Ranks were started with different run-defining settings (or storage)."""


def agree(communicator, settings, context=None):
    """Returns when every rank holds the same `settings` (a JSON-able dict); otherwise
    raises `RanksDisagree` on every rank. A collective: every rank must call it.

    `context` (JSON-able, not compared) is gathered with the settings on a mismatch;
    its `model_dir` entry is named when ranks disagree on `resume_step`.
    """
    if communicator.size == 1:
        return
    text = json.dumps(settings, sort_keys=True)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
    with distribution.reporting_lost_workers("before the workers compared their settings"):
        digests = communicator.allgather(tf.constant([digest], tf.int64)).numpy()
        if len(set(digests.tolist())) == 1:
            return
        ranks = [json.loads(part) for part in _gather_text(
            communicator, json.dumps({"settings": settings, "context": context or {}}))]
    raise RanksDisagree(_describe([rank["settings"] for rank in ranks],
                                  [rank["context"] for rank in ranks]))


def _gather_text(communicator, text):
    """Every rank's `text`, in rank order (two allgathers: lengths, then bytes)."""
    data = np.frombuffer(text.encode(), np.uint8)
    lengths = communicator.allgather(tf.constant([data.size], tf.int64)).numpy()
    gathered = communicator.allgather(tf.constant(data)).numpy().tobytes()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return [gathered[start:end].decode() for start, end in zip(offsets[:-1], offsets[1:])]


def _by_value(values):
    """"rank 0: 128, rank 1: 64", ranks holding the same value listed together."""
    groups = {}
    for rank, value in enumerate(values):
        groups.setdefault(json.dumps(value, sort_keys=True), []).append(rank)
    return ", ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {shown}"
        for shown, ranks in groups.items())


def _describe(settings, contexts):
    names = sorted({name for rank in settings for name in rank})
    differing = [name for name in names
                 if len({json.dumps(rank.get(name), sort_keys=True) for rank in settings}) > 1]
    message = "ranks disagree on " + "; ".join(
        f"{name} ({_by_value([rank.get(name) for rank in settings])})" for name in differing)
    if "resume_step" in differing:
        message += (
            "; each rank resumes from the newest checkpoint in its own model_dir ("
            + _by_value([context.get("model_dir") for context in contexts])
            + "), which rank 0 writes: give every rank the same storage")
    return message + "; every rank must run with the same settings"
