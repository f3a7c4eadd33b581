"""Whether a run learned: the rise of a per-iteration metric in standard errors.

The learning tests (the tiny default in bf16, asynchronous) compare the mean of the
last ``window`` iterations with the first ``window``'s, in standard errors of the
difference of the two means (Welch), and ask for more than 3.
"""
from __future__ import annotations

import math
import statistics


def rise_in_standard_errors(values: list[float], window: int = 10) -> float:
    """(mean of the last ``window`` - mean of the first ``window``) / the standard error of that difference."""
    if len(values) < 2 * window:
        raise ValueError(f"{len(values)} values: need at least 2 x window = {2 * window}")
    first, last = values[:window], values[-window:]
    error = math.sqrt(statistics.variance(first) / window + statistics.variance(last) / window)
    return (statistics.mean(last) - statistics.mean(first)) / error
