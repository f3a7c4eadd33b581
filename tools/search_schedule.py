#!/usr/bin/env python
"""Search a fused actor/critic pipeline schedule (RLHFuse section 5).

    python tools/search_schedule.py --problem problem.json --out sched.json
    python tools/search_schedule.py \\
        --model name=actor,size=65B,tp=8,pp=16,mb=16,direction=down \\
        --model name=critic,size=33B,tp=8,pp=8,mb=16,direction=up \\
        --mem-cap 1.25x --out sched.json --plot gantt.png
    mpiexec -n 2 python tools/search_schedule.py ...   # one search per rank, best kept

``--model`` takes key=value pairs: name, size (LLaMA preset 7B/13B/33B/65B)
or layers/hidden/ffn/heads[/kv_heads], tp, pp, mb (micro-batches of the global
batch), direction (down/up).  ``--mem-cap`` is absolute (problem memory unit)
or relative to the serial 1F1B peak with an ``x`` suffix.  Budgets are
nominal seconds turned into a fixed proposal count: same seeds, same result.
Bad input (a flag, the problem file, an output path, an infeasible cap) is
refused before the search starts with one line naming it, printed once under
mpiexec, and exit status 2.  See docs/schedule_search.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf.cli import HelpFormatter, UsageError, quiet_unless_first_rank, report, wait_for_first_rank_report
from rlhf.schedule import search
from rlhf.schedule.anneal import AnnealConfig
from rlhf.schedule.cost_model import CostConfig
from rlhf.schedule.inputs import check_inputs
from rlhf.schedule.io import save_schedule
from rlhf.schedule.schedule import Schedule

PROGRAM = "search_schedule.py"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROGRAM, description=__doc__, formatter_class=HelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--problem", type=Path,
                     help="problem JSON (stages + models with per-stage latencies; format in "
                          "docs/schedule_search.md, 'Schedule file'); the cost-model flags below are then unused")
    src.add_argument("--model", action="append",
                     help="model shape and layout (repeat per model), see above")
    ap.add_argument("--tokens", type=int, default=CostConfig.tokens_per_microbatch,
                    help="tokens per micro-batch (cost model; default %(default)s)")
    ap.add_argument("--seq-len", type=int, default=CostConfig.seq_len,
                    help="sequence length for the attention FLOPs (cost model; default %(default)s)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPU count, checked to be a multiple of fused stages x the largest tp "
                         "(default: not checked; cost model)")
    ap.add_argument("--gpu-tflops", type=float, default=CostConfig.gpu_flops / 1e12,
                    help="peak TFLOP/s of one GPU (cost model; default %(default)g, A100 bf16)")
    ap.add_argument("--mfu", type=float, default=CostConfig.mfu,
                    help="model FLOPs utilisation in (0, 1] (cost model; default %(default)g)")
    ap.add_argument("--comm", type=float, default=0.0,
                    help="ms per stage-to-stage transfer (cost model; default %(default)g)")
    ap.add_argument("--mem-cap", default=None,
                    help="per-stage activation cap: a number in the problem's memory unit, or "
                         "e.g. 1.25x for a multiple of the serial 1F1B peak; a cap below the largest single "
                         "activation on a stage is refused (default: the problem file's mem_cap, else no cap)")
    ap.add_argument("--mem-ceiling", default="2x",
                    help="without a cap, the most activation memory any phase may hold, as a multiple of the "
                         "serial 1F1B peak (e.g. 1.5x, at least 1x), or 'none' for no bound: the fastest schedule "
                         "found is kept however much memory it holds (default %(default)s)")
    ap.add_argument("--budget", type=float, default=30.0,
                    help="nominal seconds of makespan annealing, in [0, 1e6] (default %(default)g)")
    ap.add_argument("--memory-budget", type=float, default=10.0,
                    help="nominal seconds of the memory phase (cap ladder, the peak-memory pass, then a speed pass "
                         "within the peak reached), in [0, 1e6]; makespan seconds left by an early stop are added "
                         "(default %(default)g)")
    ap.add_argument("--makespan-slack", type=float, default=search.SearchConfig.makespan_slack,
                    help="how much the memory phase may lengthen the best makespan found, as a fraction "
                         "in [0, 1] (never beyond 1%% over the lower bound unless the best already is; with a "
                         "slack the makespan phase stops where a faster schedule would only tighten that limit; "
                         "default %(default)g, 0: the fastest schedule, then the least memory)")
    ap.add_argument("--t0-scale", type=float, default=1e-3,
                    help="makespan annealing's initial temperature / start makespan, > 0 "
                         "(default %(default)g; RLHFuse: 1, the greedy makespan)")
    ap.add_argument("--seed", type=int, default=0,
                    help="random seed; under mpiexec rank r uses seed + r (default %(default)s)")
    ap.add_argument("--out", type=Path, help="write the schedule JSON here (its folder must exist)")
    ap.add_argument("--plot", type=Path, help="write a Gantt chart PNG here (its folder must exist)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    try:
        with quiet_unless_first_rank():  # under mpiexec every rank parses the same flags
            args = parse_args(argv)
        pb, cap, ceiling = check_inputs(args)
    except UsageError as err:
        status = report(PROGRAM, err)
        wait_for_first_rank_report()
        return status
    cfg = search.SearchConfig(budget_s=args.budget, memory_budget_s=args.memory_budget, seed=args.seed,
                              mem_cap=cap, mem_ceiling=ceiling, makespan_slack=args.makespan_slack,
                              anneal=AnnealConfig(t0_scale=args.t0_scale))
    res = search.search_mpi(pb, cfg)
    comm = search.world_comm()
    if comm is not None and comm.Get_rank() != 0:
        return 0
    print(search.format_summary(res))
    if args.out:
        out_pb = pb.with_mem_cap(cap) if cap is not None else pb
        save_schedule(args.out, Schedule.from_orders(out_pb, res.orders, res.metrics()))
        print(f"schedule written to {args.out}")
    if args.plot:
        from rlhf.schedule.plot import gantt
        gantt(pb, res.orders, args.plot,
              f"{' / '.join(m.name for m in pb.models)}: makespan {res.makespan:.0f} {pb.time_unit}, "
              f"{res.serial_makespan / res.makespan:.2f}x over serial 1F1B")
        print(f"Gantt chart written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
