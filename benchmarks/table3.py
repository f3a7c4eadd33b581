#!/usr/bin/env python
"""RLHFuse Table 3: fused actor/critic training schedules, ours vs the paper.

    mpiexec -n 2 python benchmarks/table3.py          # full run (about 13 min on 2 cores)
    python benchmarks/table3.py --quick               # short budgets, one process

Per setting: speedup over serial 1F1B of the greedy, annealed and
lower-bound makespans, and greedy / annealed peak activation memory relative
to serial 1F1B, beside the paper's numbers; then, for 65B/33B PP 16/8 with
32 micro-batches, the speedup reached under --mem-cap 1.0x, 1.25x, 1.5x and
without a cap.  Latencies come from rlhf.schedule.cost_model (LLaMA shapes,
tp 8 for every model, 4096 tokens per micro-batch).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time


from rlhf.schedule.cost_model import build_problem, llama
from rlhf.schedule.lower_bound import serial_peak_memory
from rlhf.schedule.search import SearchConfig, search_mpi

# (actor, critic, actor pp, critic pp, micro-batches): paper's
# (greedy, ours, optimal) speedup and (greedy, ours) memory
PAPER = [
    ("33B", "13B", 8, 4, 8, (1.29, 1.38, 1.38), (1.51, 1.0)),
    ("33B", "13B", 8, 4, 16, (1.12, 1.30, 1.30), (2.14, 1.0)),
    ("33B", "13B", 8, 4, 32, (1.10, 1.15, 1.15), (2.75, 1.26)),
    ("33B", "13B", 8, 8, 8, (1.4, 1.4, 1.4), (1.51, 1.0)),
    ("33B", "13B", 8, 8, 16, (1.15, 1.32, 1.32), (2.00, 1.19)),
    ("33B", "13B", 8, 8, 32, (1.08, 1.17, 1.17), (2.75, 1.31)),
    ("65B", "33B", 16, 8, 16, (1.28, 1.48, 1.48), (1.61, 1.0)),
    ("65B", "33B", 16, 8, 32, (1.14, 1.27, 1.27), (2.23, 1.0)),
    ("65B", "33B", 16, 8, 64, (1.12, 1.15, 1.15), (2.88, 1.26)),
    ("65B", "33B", 16, 16, 16, (1.27, 1.5, 1.5), (1.57, 1.0)),
    ("65B", "33B", 16, 16, 32, (1.16, 1.33, 1.33), (2.00, 1.22)),
    ("65B", "33B", 16, 16, 64, (1.09, 1.16, 1.17), (2.88, 1.47)),
]
CAP_SETTING = 7  # 65B/33B PP 16/8, 32 micro-batches
CAPS = (1.0, 1.25, 1.5)


def setting_problem(actor, critic, pp_a, pp_c, mb):
    return build_problem([llama("actor", actor, 8, pp_a, mb, "down"),
                          llama("critic", critic, 8, pp_c, mb, "up")])


def rank_and_size():
    try:
        from mpi4py import MPI
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    except ImportError:
        return 0, 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="short budgets, 3+1 nominal s per setting (about 1-2 min in all)")
    ap.add_argument("--budget", type=float, default=None,
                    help="nominal s of makespan annealing per setting (default 120, 3 with --quick)")
    ap.add_argument("--memory-budget", type=float, default=None,
                    help="nominal s of the memory pass per setting (default 30, 1 with --quick)")
    ap.add_argument("--only", type=str, default=None,
                    help=f"comma-separated setting indices 0-{len(PAPER) - 1}, rows of the table "
                         f"in order (default: all); the cap sweep runs only if {CAP_SETTING} is among them")
    ap.add_argument("--no-caps", action="store_true", help="skip the --mem-cap sweep")
    args = ap.parse_args(argv)
    if args.only is not None:
        try:
            only = [int(x) for x in args.only.split(",")]
        except ValueError:
            only = [-1]
        if not all(0 <= i < len(PAPER) for i in only):
            ap.error(f"--only {args.only!r}: give comma-separated integers in 0-{len(PAPER) - 1}")
    budget = args.budget if args.budget is not None else (3.0 if args.quick else 120.0)
    mbudget = args.memory_budget if args.memory_budget is not None else (1.0 if args.quick else 30.0)
    rank, size = rank_and_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# RLHFuse Table 3 on {platform.node()} ({os.cpu_count()} cores, {platform.processor() or platform.machine()}),"
        f" {size} MPI rank(s), budget {budget:g}+{mbudget:g} nominal s per setting")
    say(f"{'setting':<22}{'speedup greedy/ours/LB':>26}{'paper':>18}  {'mem greedy/ours':>16}"
        f"{'paper':>12}{'gap to LB':>11}{'time':>7}{'evals/s':>9}")
    if args.only is None:
        only = range(len(PAPER))
    within = beats = 0
    for idx in only:
        a, c, pa, pc, mb, sp_paper, mem_paper = PAPER[idx]
        pb = setting_problem(a, c, pa, pc, mb)
        tic = time.perf_counter()
        res = search_mpi(pb, SearchConfig(budget_s=budget, memory_budget_s=mbudget))
        secs = time.perf_counter() - tic
        ser, sp = res.serial_makespan, max(res.serial_peak_mem)
        gap = res.gap
        within += gap <= 0.01
        beats += res.makespan < res.greedy_makespan or res.greedy_makespan <= res.lower_bound * (1 + 1e-9)
        say(f"{f'{a}/{c} PP {pa}/{pc} mb{mb}':<22}"
            f"{ser / res.greedy_makespan:>10.2f}/{ser / res.makespan:.2f}/{ser / res.lower_bound:.2f}"
            f"{'/'.join(f'{x:g}' for x in sp_paper):>24}  "
            f"{max(res.greedy_peak_mem) / sp:>10.2f}/{max(res.peak_mem) / sp:.2f}"
            f"{'/'.join(f'{x:g}' for x in mem_paper):>15}{100 * gap:>10.2f}%{secs:>6.0f}s"
            f"{res.evals_per_second:>9.0f}", flush=True)
    say(f"# annealed within 1% of the lower bound in {within}/{len(only)} settings; "
        f"beats greedy (or greedy is optimal) in {beats}/{len(only)}")
    if args.no_caps or (args.only is not None and CAP_SETTING not in only):
        return 0
    a, c, pa, pc, mb, *_ = PAPER[CAP_SETTING]
    pb = setting_problem(a, c, pa, pc, mb)
    peak = max(serial_peak_memory(pb))
    say(f"# {a}/{c} PP {pa}/{pc} mb{mb} under a memory cap (x serial 1F1B peak {peak:.2f} {pb.mem_unit})")
    for cap in CAPS + (None,):
        tic = time.perf_counter()
        res = search_mpi(pb, SearchConfig(budget_s=budget, memory_budget_s=mbudget,
                                          mem_cap=None if cap is None else cap * peak))
        label = "no cap" if cap is None else f"cap {cap:g}x"
        say(f"{label:<10} speedup {res.serial_makespan / res.makespan:.3f} (LB {res.serial_makespan / res.lower_bound:.3f})"
            f"  peak {max(res.peak_mem) / peak:.2f}x  {time.perf_counter() - tic:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
