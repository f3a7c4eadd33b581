"""Plain-value checks shared by every validation layer (config dataclasses, placement plans, schedule
problems, command-line numbers): types are checked, never coerced. Standard library only, so the
pure layers (rlhf/schedule, rlhf/planner) can use them.
"""

from __future__ import annotations

import math
import numbers


def is_int(value) -> bool:
    """A true integer: a bool, 2.0 or "2" is not one."""
    return isinstance(value, int) and not isinstance(value, bool)


def finite_float(value) -> float | None:
    """``value`` as a float if it is a finite real number (not a bool, not a string, not NaN or
    Infinity, not an integer too large for a float), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
