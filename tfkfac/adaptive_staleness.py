"""Adaptive stale statistics (docs/design.md §12): each block's factors are refreshed on
an interval of its own, which doubles while the block's factors change by less than a
threshold between refreshes and halves when they change more (SP-NGD, Osawa et al.,
TPAMI 2020, as Ueno et al. cite it), between the base factor interval and a cap.

`AdaptiveStaleness` keeps, per block, the interval, the next due step and whether the
block's factors were refreshed since its decompositions were last computed, as optimizer
variables (saved, so a resumed run decides as the uninterrupted one). Its decisions are
taken from the running factors, which every rank holds alike after the factors' reduction
over ranks, so every rank decides the same.
"""

import tensorflow as tf

from tfkfac import state as state_lib


def relative_change(old, new):
    """max over a block's factors of ||new - old||_F / ||old||_F (Osawa et al. CVPR'19
    eq. 19), in float64; infinite where ||old||_F is 0 (a block's first refresh)."""
    changes = []
    for before, after in zip(old, new):
        before = tf.cast(tf.reshape(before, [-1]), tf.float64)
        after = tf.cast(tf.reshape(after, [-1]), tf.float64)
        norm = tf.norm(before)
        changes.append(tf.where(norm > 0, tf.math.divide_no_nan(tf.norm(after - before), norm),
                                tf.constant(float("inf"), tf.float64)))
    return tf.reduce_max(tf.stack(changes))


def next_intervals(intervals, changes, threshold, base, cap):
    """Each block's interval after a refresh whose relative change was `changes`: doubled
    (at most `cap`, None: no cap) if below `threshold`, else halved; never below `base`
    (the factor interval at this step), which also wins over a smaller cap. An interval
    of 0 (no refresh yet) counts as `base`."""
    current = tf.maximum(intervals, base)
    grown = 2 * current if cap is None else tf.minimum(2 * current, tf.cast(cap, tf.int64))
    return tf.maximum(tf.where(changes < threshold, grown, current // 2), base)


class AdaptiveStaleness:
    """The per-block factor schedule of adaptive stale statistics: change `threshold`
    (α) and interval cap `max_interval` (None: no cap)."""

    def __init__(self, threshold, max_interval):
        self.threshold, self.max_interval = threshold, max_interval
        self.intervals = self.next_steps = self.undecomposed = None
        self.decomposed_dampings = None

    def create_state(self, add_variable, blocks):
        """The saved schedule: per block its interval (0 until its first refresh), the
        step its factors are next due and 1 while its factors were refreshed since its
        last decomposition. `add_variable(shape, name, dtype)` (`transform.StateContext`)."""
        self.intervals, self.next_steps, self.undecomposed = [
            add_variable((blocks,), name, "int64")
            for name in ("adaptive_factor_intervals", "adaptive_next_factor_steps",
                         "adaptive_undecomposed")]

    def create_rebuild_state(self, add_variable, blocks, dtype):
        """Under placement "owner": per block the damping of its last decomposition,
        which a resumed owner rebuilds it with (blocks are decomposed at different
        steps, so under a damping schedule with different dampings)."""
        self.decomposed_dampings = add_variable((blocks,), "adaptive_decomposed_damping", dtype)

    def saved_variables(self):
        return [(state_lib.key("adaptive_staleness", name), variable) for name, variable in (
            ("factor_intervals", self.intervals), ("next_factor_steps", self.next_steps),
            ("undecomposed", self.undecomposed))]

    def saved_rebuild_variables(self):
        if self.decomposed_dampings is None:
            return []
        return [(state_lib.key("adaptive_staleness", "decomposed_dampings"),
                 self.decomposed_dampings)]

    def due(self, step):
        """Per block, whether its factors are due at `step`."""
        return tf.cast(step, tf.int64) >= self.next_steps

    def refreshed(self, step, due, finite, changes, base):
        """After the factor update of `step`: the `due` blocks were refreshed if `finite`
        (their factors changed by `changes`); their intervals follow `next_intervals`
        and their next due step is `interval` steps on. A skipped (non-finite) update
        keeps the intervals. Returns the earliest next due step of any block."""
        step = tf.cast(step, tf.int64)
        base = tf.cast(base, tf.int64)
        updated = tf.logical_and(due, finite)
        intervals = tf.where(updated, next_intervals(self.intervals, changes, self.threshold,
                                                     base, self.max_interval),
                             self.intervals)
        self.intervals.assign(intervals)
        next_steps = tf.where(due, step + tf.maximum(intervals, base), self.next_steps)
        self.next_steps.assign(next_steps)
        self.undecomposed.assign(tf.where(updated, tf.ones_like(self.undecomposed),
                                          self.undecomposed))
        return tf.reduce_min(next_steps)

    def pending(self):
        """Per block, whether its factors were refreshed since its last decomposition."""
        return self.undecomposed > 0

    def decomposed(self, pending, damping):
        """The `pending` blocks were decomposed (with `damping`): none is pending now (a
        failed one would fail again on the same factors; it waits for its next refresh)."""
        self.undecomposed.assign(tf.zeros_like(self.undecomposed))
        if self.decomposed_dampings is not None:
            self.decomposed_dampings.assign(tf.where(
                pending, tf.cast(damping, self.decomposed_dampings.dtype),
                self.decomposed_dampings))
