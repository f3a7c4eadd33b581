#!/usr/bin/env python
"""Write synthetic preference records (JSONL) whose order follows a hidden rule, for train_reward.py.

    python tools/synthetic_preferences.py --out train.jsonl --pairs 20000 --seed 0
    python tools/synthetic_preferences.py --out eval.jsonl --pairs 600 --seed 1

Each line is {"prompt", "chosen", "rejected"}: a prompt of the built-in synthetic
task (upper-case words) and two printable-ASCII answers; the chosen one has the
larger fraction of lower-case letters (the task's gold rule), which the file does
not state. Pairs the rule scores equal are left out, so a file may hold fewer
than --pairs lines (rlhf.data.synthetic.preference_records).
"""

from __future__ import annotations

import argparse
import json
import sys

from rlhf.cli import HelpFormatter, UsageError, report
from rlhf.data.synthetic import preference_records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--pairs", type=int, default=20000, help="pairs to draw (ties are left out)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the answers")
    p.add_argument("--max-len", type=int, default=32, help="longest answer in bytes")
    args = p.parse_args(argv)
    try:
        if args.pairs < 1 or args.max_len < 1:
            raise UsageError(f"--pairs {args.pairs} and --max-len {args.max_len} must be >= 1")
        records = preference_records(args.pairs, args.seed, args.max_len)
        try:
            with open(args.out, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        except OSError as exc:
            raise UsageError(f"--out {args.out}: {exc}") from None
    except UsageError as exc:
        return report("synthetic_preferences.py", exc)
    print(f"{args.out}: {len(records)} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
