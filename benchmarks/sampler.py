"""`rlhf.engine.sampler.sample` alone on a decode step's logits, against the sampler of another git revision.

Times ``sample`` on [--rows, --vocab] float32 logits (SmolLM2's 49,152 ids by default) with every row at
temperature 1 (the RLHF workload of benchmarks/engine_step_split.py) and with rows mixing top-k, top-p,
temperatures and greedy. The working tree's sampler and the one of ``--against`` (a git revision, loaded
from ``git show``) run alternately in one process, so both see the same machine load; medians are printed.

    python benchmarks/sampler.py [--against c7b46ac] [--rows 128] [--vocab 49152] [--repeats 15] [--threads 2]

Last line per setting: ``sampler <setting>: new=<ms> old=<ms> speedup=<x>``.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def load_sampler_at(revision: str):
    """The module rlhf/engine/sampler.py as it was at git ``revision``."""
    text = subprocess.run(["git", "show", f"{revision}:rlhf/engine/sampler.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_at_revision.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("sampler_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def timed_sample(module, logits: torch.Tensor, params) -> float:
    """Seconds of one ``module.sample`` on ``logits`` in the API of its revision: rows keyed by seed and counter
    (`SampleInputs`, built inside the timing as the engine builds them each step) from 2026-12-06 on, a CPU
    generator per row (made outside it) before."""
    if hasattr(module, "SampleInputs"):
        start = time.perf_counter()
        module.sample(logits, module.SampleInputs.of(params, [p.seed for p in params], [0] * len(params)))
        return time.perf_counter() - start
    generators = [torch.Generator().manual_seed(p.seed) for p in params]
    start = time.perf_counter()
    module.sample(logits, params, generators)
    return time.perf_counter() - start


def settings(rows: int):
    """(name, params per row): the engine benchmark's plain temperature-1 rows, and a mix of every filter."""
    from rlhf.engine import SamplingParams
    plain = [SamplingParams(temperature=1.0, seed=i) for i in range(rows)]
    kinds = [dict(temperature=1.0), dict(temperature=0.7, top_k=50), dict(temperature=1.0, top_p=0.9),
             dict(temperature=0.8, top_k=100, top_p=0.95, logprobs_of="sampling"), dict()]
    mixed = [SamplingParams(seed=i, **kinds[i % len(kinds)]) for i in range(rows)]
    return [("temperature 1", plain), ("mixed top-k / top-p / T / greedy", mixed)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", default="c7b46ac", help="git revision of the old sampler (default %(default)s)")
    ap.add_argument("--rows", type=int, default=128, help="rows sampled per step (default %(default)s)")
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=15, help="timed calls per sampler (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from rlhf.engine import sampler as new
    old = load_sampler_at(args.against)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0)) * 4
    for name, params in settings(args.rows):
        seconds = {"new": [], "old": []}
        for repeat in range(args.repeats + 1):  # the first round warms up
            for label, module in (("new", new), ("old", old)):
                took = timed_sample(module, logits, params)
                if repeat:
                    seconds[label].append(took)
        ms = {label: 1000 * statistics.median(s) for label, s in seconds.items()}
        print(f"sampler {name}: new={ms['new']:.1f} ms old={ms['old']:.1f} ms "
              f"speedup={ms['old'] / ms['new']:.1f}x ({args.rows} x {args.vocab}, median of {args.repeats})")


if __name__ == "__main__":
    main()
