"""Inter-stage fusion: generation + inference time against the migration threshold R.

(a) The simulation of RLHFuse Figure 9 (pure, `rlhf.fusion.policy`): 8
    generation instances, a batch of 512 samples from the long-tailed
    workload (lognormal response lengths, median 128, p99.9 ~ 12x the
    median), generation + inference time (mean over ``--batches`` fresh
    batches) for R = 5..95%, next to unfused. The policy picks R from an
    earlier sample of lengths (four iterations' worth); the sweep's best is
    measured on the fresh batches. The paper finds about 20%.

Parts (b) (4 ranks, calibrated sleeps) and (c) (real tiny models) need the
inference side of the fusion runtime, which is not built yet: their fields in
the summary line read ``n/a``.

Usage: ``python benchmarks/inter_stage.py [--batches 32] [--seed 0]``
"""
from __future__ import annotations

import argparse
import random
import statistics

from rlhf.fusion.policy import (SWEEP, GenerationCost, LengthDistribution, choose_threshold, long_tailed_lengths,
                                simulate)

BATCH = 512
COST = GenerationCost(instances=8, step_s=0.03, b_sat=32, infer_s=0.2, migrate_s=0.1)
"""Assumed costs: a 30 ms decode step flat up to 32 running samples; 0.2 s of ref+reward+critic inference
per sample on one instance's ranks (unfused inference ~ 13 s after ~ 45 s of generation); 0.1 s per
migrated sample (KV transfer or re-prefill)."""


def figure9(batches: int, seed: int) -> dict:
    """Sweep table, unfused time, the policy's R and the sweep's best on ``batches`` fresh batches."""
    rng = random.Random(seed)
    fresh = [long_tailed_lengths(BATCH, rng) for _ in range(batches)]
    rows = []
    for r in SWEEP:
        runs = [simulate(b, COST, r) for b in fresh]
        rows.append((r, statistics.mean(x.total_s for x in runs), statistics.mean(x.generation_s for x in runs),
                     statistics.mean(x.m for x in runs), statistics.mean(x.migrated for x in runs)))
    unfused = [simulate(b, COST, 0.0) for b in fresh]
    history = LengthDistribution(long_tailed_lengths(4 * BATCH, random.Random(seed + 1)))
    choice = choose_threshold(history, COST, BATCH, seed=seed + 2)
    best = min(rows, key=lambda row: (row[1], row[0]))
    unfused_s = statistics.mean(x.total_s for x in unfused)
    return {"rows": rows, "unfused_s": unfused_s, "unfused_gen_s": statistics.mean(x.generation_s for x in unfused),
            "chosen": choice.threshold, "best": best[0],
            "chosen_s": dict((row[0], row[1]) for row in rows)[choice.threshold], "best_s": best[1]}


def print_figure9(res: dict, batches: int) -> None:
    print(f"(a) simulation, RLHFuse Figure 9: {COST.instances} instances, batch {BATCH}, long-tailed lengths "
          f"(lognormal median 128, sigma 0.8, cap 2048), mean of {batches} batches")
    print(f"    cost model: step {COST.step_s * 1e3:g} ms flat up to B_sat={COST.b_sat}, inference "
          f"{COST.infer_s:g} s/sample/instance, migration {COST.migrate_s:g} s/sample")
    print(f"    {'R':>5} {'gen+inf s':>10} {'gen s':>8} {'m':>5} {'migrated':>9} {'vs unfused':>10}")
    for r, total, gen, m, moved in res["rows"]:
        mark = "  <- best" if r == res["best"] else ""
        mark += "  <- policy" if r == res["chosen"] else ""
        print(f"    {r:5.0%} {total:10.2f} {gen:8.2f} {m:5.1f} {moved:9.1f} {res['unfused_s'] / total:10.3f}{mark}")
    print(f"    unfused {res['unfused_s']:.2f} s (generation {res['unfused_gen_s']:.2f} s); "
          f"policy R={res['chosen']:.0%} ({res['chosen_s']:.2f} s), sweep best R={res['best']:.0%} ({res['best_s']:.2f} s); the paper: ~20%")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=32, help="fresh batches averaged per R (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the simulated workload (default %(default)s)")
    args = ap.parse_args(argv)
    if args.batches < 1:
        ap.error(f"--batches {args.batches} must be >= 1")
    res = figure9(args.batches, args.seed)
    print_figure9(res, args.batches)
    print("(b) sleep-calibrated 4-rank run and (c) real tiny models: not run (inference on the freed ranks "
          "is not built yet)")
    print(f"inter-stage: R={res['chosen']:.2f} best_R={res['best']:.2f} "
          f"sim_speedup={res['unfused_s'] / res['chosen_s']:.3f} measured_speedup=n/a measured/predicted=n/a")


if __name__ == "__main__":
    main()
