"""The one range check for float arguments of the pipelines and the trainer's own flags.

`check_number` rejects NaN, infinity and anything outside the allowed range with a
ValueError that names the argument, the value received and the range, in the same form
as `tfkfac.validation` uses for the optimizer's arguments:
"`echo_factor` must be a finite number >= 1; received nan".
"""

import math
import numbers


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
