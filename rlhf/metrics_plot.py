"""A metrics file read back (tools/plot_metrics.py): its records, the first and last windows' statistics, a plot.

The file is the JSON Lines that ``--metrics-file`` writes (rlhf/metrics.py,
``MetricsWriter``): one record per iteration. A key that only some iterations
have (train_reward.py's eval_* metrics) is averaged and plotted where it is.
Bad input is a UsageError naming the flag or ``file:line``.
"""

from __future__ import annotations

import json
import statistics

from rlhf.cli import UsageError


def read_metrics(path: str) -> list[dict]:
    """The records of a metrics file, in file order; errors name file:line."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except ValueError as e:
                        raise UsageError(f"{path}:{n}: not JSON ({e})") from None
    except OSError as e:
        raise UsageError(f"--metrics {path}: {e}") from None
    return records


def window_stats(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean."""
    sem = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return statistics.fmean(values), sem


def plot_metrics(path: str, keys: list[str], window: int, out: str, title: str = "") -> list[str]:
    """Plot ``keys`` of metrics file ``path`` per iteration into the PNG ``out``; returns one line per key:
    the mean and standard error of its first and last ``window`` values."""
    records = read_metrics(path)
    missing = [k for k in keys if all(r.get(k) is None for r in records)]
    if missing:
        raise UsageError(f"--keys {missing} not in {path} "
                         f"(it has {sorted(set().union(*records)) if records else 'no records'})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    lines = []
    for key in keys:  # a key some iterations lack (eval_*) is plotted where it is
        iterations, values = zip(*[(r["iteration"], r[key]) for r in records if r.get(key) is not None])
        values = list(values)
        ax.plot(iterations, values, marker="o", markersize=3, label=key)
        (m0, s0), (m1, s1) = window_stats(values[:window]), window_stats(values[-window:])
        lines.append(f"{key}: first {window} {m0:.4f} +- {s0:.4f}, last {window} {m1:.4f} +- {s1:.4f}")
    ax.set_xlabel("iteration")
    ax.legend()
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return lines
