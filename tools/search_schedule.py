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

from rlhf.cli import HelpFormatter, UsageError, check_out_path, check_range, quiet_unless_first_rank, report
from rlhf.schedule.anneal import AnnealConfig
from rlhf.schedule.cost_model import LLAMA, CostConfig, ModelShape, build_problem
from rlhf.schedule.io import load_problem, save_schedule
from rlhf.schedule.lower_bound import min_peak_memory, serial_peak_memory
from rlhf.schedule.problem import Problem, ProblemError
from rlhf.schedule.schedule import Schedule
from rlhf.schedule.search import SearchConfig, format_summary, search_mpi, start_pool, world_comm

PROGRAM = "search_schedule.py"
INT_KEYS = {"layers", "hidden", "ffn", "heads", "kv_heads", "tp", "pp", "mb"}
MODEL_KEYS = "name, size or layers/hidden/ffn/heads[/kv_heads], tp, pp, mb, direction"
MAX_BUDGET = 1e6
"""Largest --budget / --memory-budget in nominal seconds (the proposal count must stay a practical number)."""


def parse_model(text: str) -> ModelShape:
    """One ``--model`` value (key=value pairs) as a ModelShape; UsageError naming the flag and the bad pair."""
    kv = {}
    for part in text.split(","):
        k, eq, v = (x.strip() for x in part.partition("="))
        if not eq:
            raise UsageError(f"--model: part {part!r} of {text!r} is not key=value; keys: {MODEL_KEYS}")
        if k in INT_KEYS:
            try:
                kv[k] = int(v)
            except ValueError:
                raise UsageError(f"--model: {k}={v!r} must be an integer") from None
        else:
            kv[k] = v
    size = kv.pop("size", None)
    if size is not None:
        if size not in LLAMA:
            raise UsageError(f"--model: size={size!r} is not a LLaMA preset; known sizes {sorted(LLAMA)}")
        kv = {**LLAMA[size], **kv}
    kv["microbatches"] = kv.pop("mb", None)
    try:
        return ModelShape(**kv)
    except (TypeError, ProblemError) as err:  # a missing or unknown key, a bad value
        raise UsageError(f"--model: {text!r}: {err}; keys: {MODEL_KEYS}") from None


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
    ap.add_argument("--budget", type=float, default=30.0,
                    help="nominal seconds of makespan annealing, in [0, 1e6] (default %(default)g)")
    ap.add_argument("--memory-budget", type=float, default=10.0,
                    help="nominal seconds of the memory phase (cap ladder, then the peak-memory pass), "
                         "in [0, 1e6]; makespan seconds left by an early stop at the lower bound are added "
                         "(default %(default)g)")
    ap.add_argument("--makespan-slack", type=float, default=SearchConfig.makespan_slack,
                    help="how much the memory phase may lengthen the best makespan found, as a fraction "
                         "in [0, 1] (never beyond 1%% over the lower bound unless the best already is; "
                         "default %(default)g, 0: the fastest schedule, then the least memory)")
    ap.add_argument("--t0-scale", type=float, default=1e-3,
                    help="makespan annealing's initial temperature / start makespan, > 0 "
                         "(default %(default)g; RLHFuse: 1, the greedy makespan)")
    ap.add_argument("--seed", type=int, default=0,
                    help="random seed; under mpiexec rank r uses seed + r (default %(default)s)")
    ap.add_argument("--out", type=Path, help="write the schedule JSON here (its folder must exist)")
    ap.add_argument("--plot", type=Path, help="write a Gantt chart PNG here (its folder must exist)")
    return ap.parse_args(argv)


def build(args) -> Problem:
    """The problem of ``--problem`` or of the ``--model`` flags and the cost model (UsageError naming the flag)."""
    if args.problem is not None:
        try:
            return load_problem(args.problem)
        except ProblemError as err:  # unreadable file, bad JSON, a bad value (named)
            raise UsageError(f"--problem: {err}") from None
    flags = {"tokens_per_microbatch": "--tokens", "seq_len": "--seq-len", "gpu_flops": "--gpu-tflops",
             "mfu": "--mfu", "comm": "--comm", "gpus": "--gpus"}
    try:
        cfg = CostConfig(tokens_per_microbatch=args.tokens, seq_len=args.seq_len,
                         gpu_flops=args.gpu_tflops * 1e12, mfu=args.mfu, comm=args.comm, gpus=args.gpus)
    except ProblemError as err:
        flag = next((f for k, f in flags.items() if f"CostConfig.{k}=" in str(err)), "cost model")
        raise UsageError(f"{flag}: {err}") from None
    try:
        return build_problem([parse_model(text) for text in args.model], cfg)
    except ProblemError as err:
        raise UsageError(f"{'--gpus' if str(err).startswith('gpus=') else '--model'}: {err}") from None


def resolve_cap(args, pb: Problem) -> tuple:
    """(the activation cap per stage or None, what set it): ``--mem-cap`` (absolute, or ``1.25x`` of the
    serial 1F1B peak), else the problem file's ``mem_cap``."""
    text = args.mem_cap
    if text is None:
        return pb.mem_cap, f"--problem {args.problem}: mem_cap"
    valid = f"a number ({pb.mem_unit}) or a multiple of the serial 1F1B peak such as 1.25x"
    try:
        number = float(text[:-1] if text.endswith("x") else text)
    except ValueError:
        raise UsageError(f"--mem-cap: {text!r} is not a number; give {valid}") from None
    if not text.endswith("x"):
        return check_range("--mem-cap", number, 0, low_open=True, unit=pb.mem_unit), "--mem-cap"
    check_range("--mem-cap", number, 0, low_open=True, unit="(times the serial 1F1B peak, e.g. 1.25x)")
    serial = max(serial_peak_memory(pb))
    if serial == 0:
        raise UsageError(f"--mem-cap: {text} of a serial 1F1B peak of 0: the problem holds no activation memory "
                         "(act_mem is 0); drop --mem-cap")
    return number * serial, "--mem-cap"


def check_cap(pb: Problem, cap, flag: str) -> None:
    """Refuse a cap that no schedule meets (below :func:`min_peak_memory`), or one that none of the search's
    start schedules meets, before the search starts; the message gives the feasible minimum."""
    if cap is None:
        return
    unit, need, serial = pb.mem_unit, max(min_peak_memory(pb)), max(serial_peak_memory(pb))
    if cap < need - 1e-9:
        raise UsageError(f"{flag}: {cap:g} {unit} is below the feasible minimum {need:g} {unit} (the largest "
                         f"activation of one micro-batch on one stage); give at least {need:g} (serial 1F1B "
                         f"needs {serial:g}, 1x)")
    if cap < serial - 1e-9 and not start_pool(pb, cap):
        raise UsageError(f"{flag}: the search finds no start schedule within {cap:g} {unit} (the feasible minimum "
                         f"is {need:g}); give a larger cap, at most the serial 1F1B peak {serial:g} (1x), which "
                         "always works")


def check_inputs(args) -> tuple:
    """(problem, cap) of the flags, with every number and output path checked before the search starts."""
    check_range("--budget", args.budget, 0, MAX_BUDGET, unit="nominal seconds")
    check_range("--memory-budget", args.memory_budget, 0, MAX_BUDGET, unit="nominal seconds")
    check_range("--t0-scale", args.t0_scale, 0, low_open=True)
    check_range("--makespan-slack", args.makespan_slack, 0, 1)
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path is not None:
            check_out_path(flag, path)
    pb = build(args)
    cap, flag = resolve_cap(args, pb)
    check_cap(pb, cap, flag)
    return pb, cap


def main(argv=None) -> int:
    try:
        with quiet_unless_first_rank():  # under mpiexec every rank parses the same flags
            args = parse_args(argv)
        pb, cap = check_inputs(args)
    except UsageError as err:
        return report(PROGRAM, err)
    cfg = SearchConfig(budget_s=args.budget, memory_budget_s=args.memory_budget, seed=args.seed, mem_cap=cap,
                       makespan_slack=args.makespan_slack, anneal=AnnealConfig(t0_scale=args.t0_scale))
    res = search_mpi(pb, cfg)
    comm = world_comm()
    if comm is not None and comm.Get_rank() != 0:
        return 0
    print(format_summary(res))
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
