"""Argument checks shared by `tfkfac.KFACConfig` and the trainer, with one wording.

Each check raises a ValueError that names the argument, the allowed values and what was
received; NaN and infinity are never allowed where a number is expected. A check is
`check(name, value)`; the factories below make the parameterized ones.
"""

import math
import numbers
import re

# Step counts and intervals are int64 in the optimizer's state and the trainer's counters.
INT64_MAX = 2**63 - 1


def is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite_number(name, value, low=None, high=None, low_open=False, high_open=False):
    """`value` is a finite real number in the stated range (open or closed ends)."""
    ok = is_number(value) and math.isfinite(value)
    below = ok and low is not None and (value <= low if low_open else value < low)
    above = ok and high is not None and (value >= high if high_open else value > high)
    if not ok or below or above:
        left = "" if low is None else ("(" if low_open else "[") + f"{low}, "
        right = "" if high is None else f"{high}" + (")" if high_open else "]")
        where = (f" in {left}{right}" if low is not None and high is not None else
                 f" {'>' if low_open else '>='} {low}" if low is not None else
                 f" {'<' if high_open else '<='} {high}" if high is not None else "")
        raise ValueError(f"`{name}` must be a finite number{where}; received {value!r}")


def positive(name, value):
    finite_number(name, value, low=0, low_open=True)


def positive_or_schedule(name, value):
    """A number > 0, or a callable of the step (checked where it is evaluated)."""
    if not callable(value):
        if not (is_number(value) and math.isfinite(value) and value > 0):
            raise ValueError(f"`{name}` must be a finite number > 0 or a schedule; "
                             f"received {value!r}")


def fraction(name, value):
    finite_number(name, value, 0, 1, high_open=True)


def share(name, value):
    finite_number(name, value, 0, 1, low_open=True)


def _is_step_count(value):
    return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
            and 1 <= value <= INT64_MAX)


def positive_integer(name, value):
    if not _is_step_count(value):
        raise ValueError(f"`{name}` must be a positive integer (at most 2**63 - 1); "
                         f"received {value!r}")


def interval(name, value):
    """A number of steps >= 1, or a callable of the step giving one."""
    if not (callable(value) or _is_step_count(value)):
        raise ValueError(f"`{name}` must be a positive integer (at most 2**63 - 1, the "
                         f"int64 step counter) or a callable of the step; received {value!r}")


def one_of(choices):
    choices = tuple(choices)

    def check(name, value):
        if not any(value is c or (type(value) is type(c) and value == c) for c in choices):
            raise ValueError(f"`{name}` must be one of {choices}; received {value!r}")
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
    return optional_check


def boolean(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False; received {value!r}")


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
