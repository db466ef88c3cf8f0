"""Learning-rate schedules named by `--lr_schedule`, in optimizer steps.

Schedules are given in epochs on the command line and converted here with the run's
steps per epoch, so a flag means the same thing at every batch size and rank count.
"""

import math

import keras
from keras import ops

from trainers import config as config_lib


@keras.saving.register_keras_serializable(package="trainers")
class LinearWarmup(keras.optimizers.schedules.LearningRateSchedule):
    """Ramps `after` linearly from ~0 to its full value over `warmup_steps` (Goyal et al.).

    Large learning rates (and K-FAC's first, poorly estimated factors) can diverge in the
    first steps; the ramp multiplies whatever `after` gives, so decay keeps its timing.
    """

    def __init__(self, after, warmup_steps):
        if int(warmup_steps) < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        self.after = after
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        base = self.after(step) if callable(self.after) else ops.convert_to_tensor(
            self.after, "float32")
        return base * ops.minimum(1.0, (step + 1.0) / float(self.warmup_steps))

    def get_config(self):
        after = self.after
        if isinstance(after, keras.optimizers.schedules.LearningRateSchedule):
            after = keras.saving.serialize_keras_object(after)
        return {"after": after, "warmup_steps": self.warmup_steps}

    @classmethod
    def from_config(cls, config):
        after = config["after"]
        if isinstance(after, dict):
            after = keras.saving.deserialize_keras_object(after)
        return cls(after, config["warmup_steps"])


@keras.saving.register_keras_serializable(package="trainers")
class CosineDecay(keras.optimizers.schedules.LearningRateSchedule):
    """`learning_rate` until `start_step`, then half a cosine down to 0 at `end_step`
    (Loshchilov & Hutter's SGDR without restarts), 0 after.

    The decay starts where the warm-up ends (`LinearWarmup` multiplies the full rate it
    gives until then), so the ramp reaches the full rate and the cosine spans the rest of
    the run, the warm-up + cosine shape of AlgoPerf's baselines. Keras's own
    `CosineDecay` warms up from its initial rate at step 0, which would spend a step at
    rate 0 and differ from `LinearWarmup`'s ramp of the other schedules.
    """

    def __init__(self, learning_rate, start_step, end_step):
        if not 0 <= int(start_step) < int(end_step):
            raise ValueError(f"CosineDecay needs 0 <= start_step < end_step, got "
                             f"{start_step} and {end_step}")
        self.learning_rate = float(learning_rate)
        self.start_step = int(start_step)
        self.end_step = int(end_step)

    def __call__(self, step):
        progress = (ops.cast(step, "float32") - self.start_step) / float(
            self.end_step - self.start_step)
        progress = ops.clip(progress, 0.0, 1.0)
        return self.learning_rate * 0.5 * (1.0 + ops.cos(math.pi * progress))

    def get_config(self):
        return {"learning_rate": self.learning_rate, "start_step": self.start_step,
                "end_step": self.end_step}


def warmup_length(config, steps_per_epoch, total_steps):
    """The warm-up's steps: `warmup_epochs` in steps, at least 1 when it is on, else 0.
    Not given (None): SCHEDULE_FREE_WARMUP_SHARE of the run's `total_steps` for a
    schedule-free update rule (0 in runs shorter than 10 steps), 0 for the others."""
    if config.warmup_epochs is None:
        if config.update_rule() not in config_lib.SCHEDULE_FREE_OPTIMIZERS:
            return 0
        return int(round(config_lib.SCHEDULE_FREE_WARMUP_SHARE * total_steps))
    if config.warmup_epochs <= 0:
        return 0
    return max(1, int(round(config.warmup_epochs * steps_per_epoch)))


def build_learning_rate(config, steps_per_epoch, total_steps):
    """Returns a float or a `LearningRateSchedule` for `config.lr_schedule`.

    constant: `learning_rate` throughout. warmup: constant after `warmup_epochs`.
    step: multiplied by `lr_decay_factor` at each of `lr_decay_epochs`.
    polynomial: `(1 - step / total_steps) ** lr_decay_power`, reaching 0 at the end.
    cosine: after the warmup, half a cosine from `learning_rate` to 0 at the end.
    Any schedule starts with a linear warmup of `warmup_length` steps. "The end" is
    `total_steps`, the run's whole budget (`--steps`/`--epochs`), so a resumed run with
    the same budget keeps the schedule's end. Raises ValueError when the warmup does not
    end before the run does: the run would never train at `learning_rate`.
    """
    if steps_per_epoch < 1 or total_steps < 1:
        raise ValueError(f"steps_per_epoch and total_steps must be >= 1, got "
                         f"{steps_per_epoch} and {total_steps}")
    lr = float(config.learning_rate)
    warmup_steps = warmup_length(config, steps_per_epoch, total_steps)
    if warmup_steps >= total_steps:  # only a warmup_epochs given can be this long
        raise ValueError(f"lr_schedule={config.lr_schedule} reaches learning_rate only after the "
                         f"warmup, which must end before the run: warmup_epochs="
                         f"{config.warmup_epochs:g} is {warmup_steps} steps of the run's "
                         f"{total_steps} (--steps/--epochs)")
    if config.lr_schedule == "step":
        # Keras switches to the next value after a boundary; step k (0-based) is the first
        # step of epoch e when k = e * steps_per_epoch, so that step must already decay.
        boundaries = [int(round(e * steps_per_epoch)) - 1 for e in config.lr_decay_epochs]
        values = [lr * config.lr_decay_factor ** i for i in range(len(boundaries) + 1)]
        schedule = keras.optimizers.schedules.PiecewiseConstantDecay(boundaries, values)
    elif config.lr_schedule == "polynomial":
        schedule = keras.optimizers.schedules.PolynomialDecay(
            lr, decay_steps=total_steps, end_learning_rate=0.0, power=config.lr_decay_power)
    elif config.lr_schedule == "cosine":
        schedule = CosineDecay(lr, warmup_steps, total_steps)
    elif config.lr_schedule in ("constant", "warmup"):
        schedule = lr
    else:
        raise ValueError(f"lr_schedule must be one of constant, warmup, step, polynomial, "
                         f"cosine; got {config.lr_schedule!r}")
    if warmup_steps:
        schedule = LinearWarmup(schedule, warmup_steps)
    return schedule
