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
import sys

from rlhf.cli import HelpFormatter, UsageError, report
from rlhf.metrics_plot import plot_metrics


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--metrics", required=True,
                   help="JSON Lines written by pretrain_rlhf.py or train_reward.py --metrics-file")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--keys", nargs="+", default=["reward_mean", "gold_reward_mean"], help="metrics to plot")
    p.add_argument("--window", type=int, default=10, help="iterations averaged at the start and the end")
    p.add_argument("--title", default="", help="plot title")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.window < 1:
        p.error(f"--window {args.window} must be >= 1")
    try:
        lines = plot_metrics(args.metrics, args.keys, args.window, args.out, args.title)
    except UsageError as e:
        return report("plot_metrics.py", e)
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
