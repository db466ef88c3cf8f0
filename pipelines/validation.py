"""The one place the pipelines' arguments (and the trainer's flags of the same names)
are checked, and the largest sizes they accept.

Each check raises a ValueError that names the argument, the value received and what is
allowed, in the same form as `tfkfac.validation` uses for the optimizer's arguments:
"`echo_factor` must be a finite number in [1, 100]; received 1000000000.0". A wrong
type is refused here, in Python, rather than deep inside a tf.data graph.
"""

import math
import numbers
import os

# Largest sizes accepted. Beyond them a run does not train better, it only hangs or runs
# out of memory before its first step:
# - an echo factor of 100 already makes 99% of the stream repeats; example echoing
#   tiles chunks of up to 256 examples e times, so memory grows with e;
# - TensorFlow allocates a shuffle buffer's slots up front: 10^7 slots take 0.23 GB
#   and 0.6 s before the first element, 10^8 take 2.3 GB and 41 s (measured, TF 2.21);
#   10^7 shuffles ImageNet-1k's 1.28 million training images whole;
# - seeds are numpy's range (0 to 2^32 - 1), which Keras's seeding needs;
# - read_latency simulates storage for benchmarks; a second per example is already
#   slower than any disk.
MAX_ECHO_FACTOR = 100
MAX_SHUFFLE_BUFFER = 10_000_000
MAX_SEED = 2**32 - 1
MAX_READ_LATENCY = 1.0


def _bound(low, high, low_open, high_open):
    """The allowed range in words: ">= 1", "> 0", "in [0, 1]", "in (0, 1)"."""
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_number(name, value, low=None, high=None, low_open=False, high_open=False,
                 allow_none=False):
    """Returns `value` as a float if it is a finite number in the range, else raises.

    Args:
      name: the argument's name as the caller spells it (a flag or a keyword).
      value: what was received.
      low, high: the bounds (None: unbounded on that side).
      low_open, high_open: exclude the bound itself.
      allow_none: None is accepted (and returned) as "unset".
    """
    if value is None and allow_none:
        return None
    allowed = _bound(low, high, low_open, high_open) if (low, high) != (None, None) else ""
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ValueError(f"`{name}` must be a finite number{' ' + allowed if allowed else ''}"
                         f"{' or None' if allow_none else ''}; received {value!r}")
    return float(value)


def check_int(name, value, low=None, high=None, allow_none=False):
    """Returns `value` if it is an int (a bool is not) in [low, high], else raises."""
    if value is None and allow_none:
        return None
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if ok and low is not None:
        ok = value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        if high is None:
            allowed = f" >= {low}" if low is not None else ""
        else:
            allowed = f" in [{low}, {high}]"
        raise ValueError(f"`{name}` must be an int{allowed}{' or None' if allow_none else ''}"
                         f"; received {value!r}")
    return int(value)


def check_bool(name, value):
    """Returns `value` if it is True or False, else raises."""
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False; received {value!r}")
    return value


def check_one_of(name, value, allowed):
    """Returns `value` if it is one of `allowed`, else raises listing them."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(allowed)}; received {value!r}")
    return value


def check_path(name, value):
    """Returns `value` if it is None, a str or an os.PathLike, else raises."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"`{name}` must be a path (str) or None; received {value!r}")
    return value
