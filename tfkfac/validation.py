"""The one place K-FAC's arguments are checked, for the optimizer and the trainer alike.

Each check raises a ValueError that names the argument, the allowed values and what was
received; NaN and infinity are never allowed where a number is expected.
"""

import math
import numbers
import re

import keras

from tfkfac import blocks, placement
from tfkfac.distributed import packing

METHODS = ("eigen", "inverse")
STATE_DTYPES = ("float32", "float64")
FACTOR_EXAMPLES = ("all", "fresh")
XLA_CHOICES = (True, False, "auto")


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive(name, value):
    if callable(value):
        return
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"`{name}` must be a finite number > 0 or a schedule; "
                         f"received {value!r}")


def _fraction(name, value):
    if not (_is_number(value) and 0 <= value < 1):
        raise ValueError(f"`{name}` must be in [0, 1); received {value!r}")


def _share(name, value):
    if not (_is_number(value) and 0 < value <= 1):
        raise ValueError(f"`{name}` must be in (0, 1]; received {value!r}")


def _frequency(name, value):
    if callable(value):
        return
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"`{name}` must be a positive integer or a callable of the step; "
                         f"received {value!r}")


def _one_of(choices):
    def check(name, value):
        if value not in choices:
            raise ValueError(f"`{name}` must be one of {tuple(choices)}; received {value!r}")
    return check


def _kl_clip(name, value):
    if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"`{name}` must be a finite number > 0 or None (disabled); "
                         f"received {value!r}")


def _bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False; received {value!r}")


def _inner_optimizer(name, value):
    if value is not None and not isinstance(value, keras.optimizers.Optimizer):
        raise ValueError(f"`{name}` must be a keras.optimizers.Optimizer or None; "
                         f"received {type(value).__name__}")


def _weight_decay(name, value):
    if value is not None and not (_is_number(value) and math.isfinite(value) and value >= 0):
        raise ValueError(f"`{name}` must be a finite number >= 0 or None; received {value!r}")


def _patterns(name, value):
    if isinstance(value, str):
        raise ValueError(f"`{name}` must be a list of regular expressions; received the "
                         f"string {value!r} (write [{value!r}])")
    for pattern in value:
        try:
            re.compile(pattern)
        except (TypeError, re.error) as error:
            raise ValueError(f"`{name}` must be regular expressions (strings) matching layer "
                             f"names or class names; received {pattern!r} ({error})") from None


RULES = {
    "learning_rate": _positive,
    "damping": _positive,
    "bn_damping_multiplier": _positive,
    "momentum": _fraction,
    "factor_decay": _fraction,
    "kl_clip": _kl_clip,
    "factor_update_freq": _frequency,
    "inv_update_freq": _frequency,
    "method": _one_of(METHODS),
    "placement": _one_of(placement.PLACEMENTS),
    "weight_sharing": _one_of(blocks.WEIGHT_SHARING),
    "factor_wire_dtype": _one_of(tuple(packing.WIRE_DTYPES)),
    "decomposition_wire_dtype": _one_of(tuple(packing.WIRE_DTYPES)),
    "state_dtype": _one_of(STATE_DTYPES),
    "factor_examples": _one_of(FACTOR_EXAMPLES),
    "factor_batch_fraction": _share,
    "product_dtype": _one_of(blocks.PRODUCT_DTYPES),
    "xla": _one_of(XLA_CHOICES),
    "phase_clocks": _bool,
    "inner_optimizer": _inner_optimizer,
    "skip_layers": _patterns,
    "weight_decay": _weight_decay,
}


def validate(**arguments):
    """Check the given K-FAC arguments (any subset of `RULES`) and how they combine."""
    for name, value in arguments.items():
        RULES[name](name, value)
    factor_freq = arguments.get("factor_update_freq", 1)
    inv_freq = arguments.get("inv_update_freq", 1)
    if not callable(factor_freq) and not callable(inv_freq) and inv_freq % factor_freq:
        raise ValueError(
            "`inv_update_freq` must be a multiple of `factor_update_freq` so that "
            "decompositions use freshly updated factors; received "
            f"inv_update_freq={inv_freq}, factor_update_freq={factor_freq}")
    if (arguments.get("inner_optimizer") is not None
            and arguments.get("weight_decay") is not None):
        raise ValueError("Set `weight_decay` on the `inner_optimizer`, not on KFAC: the "
                         "inner optimizer applies the update.")
