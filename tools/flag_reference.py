#!/usr/bin/env python
"""Write or check docs/flags.md, the flag reference generated from the entry points' argparse parsers.

    python tools/flag_reference.py --write   # after adding or changing a flag
    python tools/flag_reference.py --check   # exit 1 when the file differs from the parsers (the suite runs it)
"""
from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from rlhf.ppo.arguments import build_parser
from rlhf.cli import markdown_reference
from rlhf.reward_model.arguments import build_parser as build_reward_parser

DEFAULT_FILE = Path(__file__).resolve().parents[1] / "docs" / "flags.md"
HEADER = """# Flag reference

Every flag of the entry points, as their `--help` prints it. Generated from the argparse parsers by
`python tools/flag_reference.py --write`: do not edit by hand (the test suite fails when this file
differs from the parsers). How to launch: docs/launch.md.
"""


def render() -> str:
    """The whole reference: pretrain_rlhf.py's flags, then train_reward.py's."""
    return "\n".join([HEADER, markdown_reference(build_parser()), markdown_reference(build_reward_parser())])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the reference")
    mode.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    ap.add_argument("--file", type=Path, default=DEFAULT_FILE, help="the reference file (default: docs/flags.md)")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        args.file.write_text(text)
        print(f"wrote {args.file}")
        return 0
    current = args.file.read_text() if args.file.is_file() else ""
    if current == text:
        return 0
    diff = difflib.unified_diff(current.splitlines(), text.splitlines(), str(args.file), "the parsers", lineterm="")
    print("\n".join(list(diff)[:40]), file=sys.stderr)
    print(f"{args.file} is stale; run: python tools/flag_reference.py --write", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
