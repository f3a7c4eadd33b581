#!/usr/bin/env python
"""Plot metrics of a training run (the --metrics-file JSON Lines) per iteration.

    python tools/plot_metrics.py --metrics metrics.jsonl --out reward.png \\
        --keys reward_mean gold_reward_mean

Prints, per key, the mean and standard error of the first and the last N
iterations (--window, default 10). A key that only some iterations have
(train_reward.py's eval_* metrics) is plotted and averaged where it is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from rlhf.cli import HelpFormatter, UsageError, report


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


def main(argv=None) -> int:
    try:
        return plot(argv)
    except UsageError as e:
        return report("plot_metrics.py", e)


def plot(argv=None) -> int:
    """Parse the flags, plot, print the window statistics; bad input raises UsageError."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--metrics", required=True,
                   help="JSON Lines written by pretrain_rlhf.py or train_reward.py --metrics-file")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--keys", nargs="+", default=["reward_mean", "gold_reward_mean"], help="metrics to plot")
    p.add_argument("--window", type=int, default=10, help="iterations averaged at the start and the end")
    p.add_argument("--title", default="", help="plot title")
    args = p.parse_args(argv)
    if args.window < 1:
        p.error(f"--window {args.window} must be >= 1")
    records = read_metrics(args.metrics)
    missing = [k for k in args.keys if all(r.get(k) is None for r in records)]
    if missing:
        raise UsageError(f"--keys {missing} not in {args.metrics} "
                         f"(it has {sorted(set().union(*records)) if records else 'no records'})")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in args.keys:  # a key some iterations lack (eval_*) is plotted where it is
        iterations, values = zip(*[(r["iteration"], r[key]) for r in records if r.get(key) is not None])
        values = list(values)
        ax.plot(iterations, values, marker="o", markersize=3, label=key)
        (m0, s0), (m1, s1) = window_stats(values[:args.window]), window_stats(values[-args.window:])
        print(f"{key}: first {args.window} {m0:.4f} +- {s0:.4f}, last {args.window} {m1:.4f} +- {s1:.4f}")
    ax.set_xlabel("iteration")
    ax.legend()
    ax.grid(alpha=0.3)
    if args.title:
        ax.set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
