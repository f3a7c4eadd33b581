#!/usr/bin/env python
"""Our fused schedule against an exact solver on the same problem: how far is the optimum?

    pip install ortools        # not a dependency of the project: this check alone uses it
    python benchmarks/schedule_exact.py --setting 6 --latency-model 0 --seconds 60
    python benchmarks/schedule_exact.py --setting 7 --latency-model 3 --mem-cap 1.5x --seconds 120

A Table 3 row (benchmarks/table3.py's PAPER; ``--latency-model`` draws its latencies from
rlhf.schedule.latency_models, default the cost model's) is searched as benchmarks/table3.py does (one
process, ``--budget``/``--memory-budget`` nominal s), then given to Google OR-Tools' CP-SAT: one interval
per subtask, the chains as precedences, one no-overlap per fused stage, each stage's micro-batches of one
queue in order (some optimal schedule has that form: rlhf.schedule.problem.in_microbatch_order), with
``--mem-cap`` a cumulative per stage (an activation held from the end of its F to the end of its B), and
our schedule as the hint. Times are rounded to 1/100000 of our lower bound; memory is rounded down, and
the cap up by one unit in 1000, so CP-SAT's schedule can sit up to 0.1% above the cap: it is re-simulated
and its real peak printed. The last line:

    schedule-exact: ours=<gap> cpsat=<gap> cpsat_bound=<gap> status=<OPTIMAL|FEASIBLE|...>

gaps above our lower bound (rlhf.schedule.lower_bound); a CP-SAT bound above ours tightens the bound for
this problem, and an OPTIMAL status makes its schedule the optimum (within the rounding).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from rlhf.schedule.inputs import UsageError, parse_ceiling
from rlhf.schedule.latency_models import COST_MODEL, latency_model
from rlhf.schedule.lower_bound import makespan_lower_bound, serial_peak_memory
from rlhf.schedule.problem import in_microbatch_order
from rlhf.schedule.search import SearchConfig, search
from rlhf.schedule.simulate import simulate, stage_peak_memory

TIME_UNITS = 100000  # our lower bound in CP-SAT's integer time
MEM_UNITS = 1000  # the cap in CP-SAT's integer memory


def table3_module():
    """benchmarks/table3.py (its settings and problems), loaded by path beside this file."""
    spec = importlib.util.spec_from_file_location("table3", Path(__file__).resolve().with_name("table3.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv):
    table3 = table3_module()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", type=int, default=6, help=f"Table 3 row, 0-{len(table3.PAPER) - 1} (default 6)")
    ap.add_argument("--latency-model", type=int, default=None, help="latency model seed (default: the cost model)")
    ap.add_argument("--mem-cap", default=None, help="a cap such as 1.5x of the serial 1F1B peak (default: none)")
    ap.add_argument("--seconds", type=float, default=60.0, help="CP-SAT's time limit (default 60)")
    ap.add_argument("--workers", type=int, default=2, help="CP-SAT's threads (default 2)")
    ap.add_argument("--budget", type=float, default=25.0, help="our search's nominal s (default 25)")
    ap.add_argument("--memory-budget", type=float, default=40.0, help="its memory phase's (default 40)")
    args = ap.parse_args(argv)
    if not 0 <= args.setting < len(table3.PAPER):
        ap.error(f"--setting {args.setting}: give a row index in 0-{len(table3.PAPER) - 1}")
    try:  # the same rule as --mem-ceiling: a multiple of the serial 1F1B peak, at least 1x
        cap_x = None if args.mem_cap is None else parse_ceiling(args.mem_cap)
    except UsageError as err:
        ap.error(str(err).replace("--mem-ceiling", "--mem-cap"))
    a, c, pa, pc, mb, *_ = table3.PAPER[args.setting]
    model = COST_MODEL if args.latency_model is None else latency_model(args.latency_model)
    return args, table3.setting_problem(a, c, pa, pc, mb, model), cap_x, f"{a}/{c} PP {pa}/{pc} mb{mb}"


def integer_times(pb, orders, dur):
    """Start times of ``orders`` with the integer durations ``dur`` (a feasible hint for CP-SAT)."""
    pred, end = pb.arrays.pred, [-1] * pb.num_nodes
    ptr, free, moved = [0] * pb.stages, [0] * pb.stages, True
    while moved:
        moved = False
        for s, order in enumerate(orders):
            while ptr[s] < len(order):
                v = order[ptr[s]]
                p = pred[v]
                if p >= 0 and end[p] < 0:
                    break
                end[v] = max(free[s], end[p] if p >= 0 else 0) + dur[v]
                free[s], ptr[s], moved = end[v], ptr[s] + 1, True
    return [e - d for e, d in zip(end, dur)]


def solve(pb, hint, cap, seconds, workers):
    """(status name, makespan, bound, per-stage orders) of CP-SAT on ``pb`` (times in our units)."""
    from ortools.sat.python import cp_model

    arr, lb = pb.arrays, makespan_lower_bound(pb)
    scale = TIME_UNITS / lb
    dur = [max(1, round(d * scale)) for d in arr.dur]
    horizon = sum(dur)
    m = cp_model.CpModel()
    start = [m.NewIntVar(0, horizon, f"s{v}") for v in range(pb.num_nodes)]
    box = [m.NewFixedSizeIntervalVar(start[v], dur[v], f"i{v}") for v in range(pb.num_nodes)]
    for v, p in enumerate(arr.pred):
        if p >= 0:
            m.Add(start[v] >= start[p] + dur[p] + round(arr.lag[v] * scale))
    for s in range(pb.stages):
        m.AddNoOverlap([box[v] for v in range(pb.num_nodes) if arr.stage[v] == s])
    for i, spec in enumerate(pb.models):  # each queue in micro-batch order
        for p in range(spec.pipelines):
            for j in range(spec.pp):
                for fwd in (True, False):
                    ids = [pb.node_id_fast(i, p, b, j, fwd) for b in range(spec.microbatches)]
                    for x, y in zip(ids, ids[1:]):
                        m.Add(start[y] >= start[x] + dur[x])
    if cap is not None:
        units = MEM_UNITS / cap
        for s in range(pb.stages):
            held, demand = [], []
            for f in range(pb.num_nodes):
                if arr.stage[f] == s and arr.is_fwd[f]:
                    b = arr.partner[f]
                    size = m.NewIntVar(0, horizon, "")
                    held.append(m.NewIntervalVar(start[f] + dur[f], size, start[b] + dur[b], ""))
                    demand.append(int(arr.mem[f] * units))
            m.AddCumulative(held, demand, MEM_UNITS + 1)
    makespan = m.NewIntVar(0, horizon, "makespan")
    for v in range(pb.num_nodes):
        m.Add(makespan >= start[v] + dur[v])
    m.Minimize(makespan)
    for v, t in enumerate(integer_times(pb, hint, dur)):
        m.AddHint(start[v], t)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = workers
    status = solver.Solve(m)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return name, float("nan"), solver.BestObjectiveBound() / scale, None
    stages = [[v for v in range(pb.num_nodes) if arr.stage[v] == s] for s in range(pb.stages)]
    orders = [sorted(o, key=lambda v: solver.Value(start[v])) for o in stages]
    return name, solver.ObjectiveValue() / scale, solver.BestObjectiveBound() / scale, orders


def main(argv=None) -> int:
    args, pb, cap_x, label = parse_args(argv)
    try:
        import ortools  # noqa: F401
    except ImportError:
        print("schedule_exact.py: needs Google OR-Tools (pip install ortools); it is not a dependency of the "
              "project", file=sys.stderr)
        return 2
    lb, serial = makespan_lower_bound(pb), max(serial_peak_memory(pb))
    cap = None if cap_x is None else cap_x * serial
    tic = time.perf_counter()
    ours = search(pb, SearchConfig(budget_s=args.budget, memory_budget_s=args.memory_budget, mem_cap=cap))
    print(f"# {label}, {pb.num_nodes} subtasks, cap {args.mem_cap or 'none (ceiling 2x)'}: ours "
          f"{100 * ours.gap:.2f}% above the bound at {max(ours.peak_mem) / serial:.2f}x "
          f"({time.perf_counter() - tic:.0f} s)", flush=True)
    tic = time.perf_counter()
    status, best, bound, orders = solve(pb, in_microbatch_order(pb, ours.orders), cap, args.seconds, args.workers)
    cpsat = bound_gap = float("nan")
    if orders is not None:
        sim = simulate(pb, orders)
        cpsat = sim.makespan / lb - 1
        print(f"# CP-SAT {status} in {time.perf_counter() - tic:.0f} s: {100 * cpsat:.2f}% above the bound at "
              f"{max(stage_peak_memory(pb, orders)) / serial:.3f}x (re-simulated; its own makespan "
              f"{100 * (best / lb - 1):.2f}%)")
    bound_gap = bound / lb - 1
    print(f"schedule-exact: ours={100 * ours.gap:.2f}% cpsat={100 * cpsat:.2f}% cpsat_bound={100 * bound_gap:.2f}% "
          f"status={status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
