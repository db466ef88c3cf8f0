"""Argument checks of `tfkfac` and of this repository's pipelines and trainer, with one
wording per kind of check.

Each check raises a ValueError "`name` must be <allowed>; received <value>", naming the
argument, the allowed values and what was received, and otherwise returns the value, so
a caller may check and use it in one expression. NaN and infinity are never allowed
where a number is expected. A check is `check(name, value, ...)`; `one_of` and
`optional` make checks of `(name, value)` from a choice list or another check.
"""

import math
import numbers
import os
import re

# Step counts and intervals are int64 in the optimizer's state and the trainer's counters.
INT64_MAX = 2**63 - 1


def is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _bound(value):
    """A range's end in words: ints as they are (2**63 - 1 by name), floats shortest."""
    if value == INT64_MAX:
        return "2**63 - 1"
    return str(value) if _is_integer(value) else f"{value:g}"


def _allowed_range(low, high, low_open=False, high_open=False):
    """" in [0, 1)", " > 0", " <= 100", or "" when unbounded."""
    if low is not None and high is not None:
        return (f" in {'(' if low_open else '['}{_bound(low)}, "
                f"{_bound(high)}{')' if high_open else ']'}")
    if low is not None:
        return f" {'>' if low_open else '>='} {_bound(low)}"
    if high is not None:
        return f" {'<' if high_open else '<='} {_bound(high)}"
    return ""


def _in_range(value, low, high, low_open=False, high_open=False):
    return ((low is None or (value > low if low_open else value >= low))
            and (high is None or (value < high if high_open else value <= high)))


def _refuse(name, allowed, value):
    raise ValueError(f"`{name}` must be {allowed}; received {value!r}")


def finite_number(name, value, low=None, high=None, low_open=False, high_open=False):
    """`value` is a finite real number in the stated range (open or closed ends)."""
    if not (is_number(value) and math.isfinite(value)
            and _in_range(value, low, high, low_open, high_open)):
        _refuse(name, "a finite number" + _allowed_range(low, high, low_open, high_open),
                value)
    return value


def positive(name, value):
    return finite_number(name, value, low=0, low_open=True)


def positive_or_schedule(name, value):
    """A number > 0, or a callable of the step (checked where it is evaluated)."""
    if not (callable(value) or (is_number(value) and math.isfinite(value) and value > 0)):
        _refuse(name, "a finite number > 0 or a schedule", value)
    return value


def fraction(name, value):
    return finite_number(name, value, 0, 1, high_open=True)


def share(name, value):
    return finite_number(name, value, 0, 1, low_open=True)


def integer(name, value, low=None, high=None):
    """`value` is an int (a bool is not) in [low, high] (None: unbounded on that side)."""
    if not (_is_integer(value) and _in_range(value, low, high)):
        _refuse(name, "an integer" + _allowed_range(low, high), value)
    return value


def positive_integer(name, value):
    """A count of steps, examples or classes: from 1 to the int64 counters' largest."""
    return integer(name, value, 1, INT64_MAX)


def interval(name, value):
    """A number of steps >= 1, or a callable of the step giving one."""
    if not (callable(value) or (_is_integer(value) and _in_range(value, 1, INT64_MAX))):
        _refuse(name, "an integer" + _allowed_range(1, INT64_MAX) + " or a callable of the "
                "step", value)
    return value


def one_of(choices):
    choices = tuple(choices)

    def check(name, value):
        if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
            _refuse(name, "one of " + ", ".join(str(c) for c in choices), value)
        return value
    check.choices = choices  # for whoever lists them (the trainer's flags)
    return check


def optional(check, meaning):
    """`check`, or None, which `meaning` says what it does (e.g. "disables it")."""
    def optional_check(name, value):
        if value is not None:
            try:
                check(name, value)
            except ValueError as error:
                raise ValueError(f"{error} (None {meaning})") from None
        return value
    return optional_check


def boolean(name, value):
    if not isinstance(value, bool):
        _refuse(name, "True or False", value)
    return value


def path(name, value):
    if not isinstance(value, (str, os.PathLike)):
        _refuse(name, "a path (str or os.PathLike)", value)
    return value


def patterns(name, value):
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"`{name}` must be a list of regular expressions; received "
                         f"{value!r}" + (f" (write [{value!r}])" if isinstance(value, str)
                                         else ""))
    for pattern in value:
        try:
            re.compile(pattern)
        except (TypeError, re.error) as error:
            raise ValueError(f"`{name}` must be regular expressions (strings) matching layer "
                             f"names or class names; received {pattern!r} ({error})") from None
    return value
