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
See docs/schedule_search.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf.schedule.anneal import AnnealConfig
from rlhf.schedule.cost_model import LLAMA, CostConfig, ModelShape, build_problem
from rlhf.schedule.io import load_problem, save_schedule
from rlhf.schedule.lower_bound import serial_peak_memory
from rlhf.schedule.problem import ProblemError
from rlhf.schedule.schedule import Schedule
from rlhf.schedule.search import SearchConfig, format_summary, search_mpi, world_comm

INT_KEYS = {"layers", "hidden", "ffn", "heads", "kv_heads", "tp", "pp", "mb"}


def parse_model(text: str) -> ModelShape:
    kv = {}
    for part in text.split(","):
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"--model part {part!r} is not key=value")
        k, v = part.split("=", 1)
        k = k.strip()
        if k in INT_KEYS:
            try:
                kv[k] = int(v)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"--model {k}={v.strip()!r} must be an integer") from None
        else:
            kv[k] = v.strip()
    size = kv.pop("size", None)
    if size is not None:
        if size not in LLAMA:
            raise argparse.ArgumentTypeError(f"--model size={size!r}: known sizes {sorted(LLAMA)}")
        kv = {**LLAMA[size], **kv}
    kv["microbatches"] = kv.pop("mb", None)
    try:
        return ModelShape(**kv)
    except (TypeError, ProblemError) as err:
        # argparse would print a bare "invalid value" for these; keep the reason
        raise argparse.ArgumentTypeError(
            f"--model {text!r}: {err} (keys: name, size or layers/hidden/ffn/heads[/kv_heads], "
            "tp, pp, mb, direction)") from None


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--problem", type=Path,
                     help="problem JSON (stages + models with per-stage latencies; format in "
                          "docs/schedule_search.md, 'Schedule file'); the cost-model flags below are then unused")
    src.add_argument("--model", type=parse_model, action="append",
                     help="model shape and layout (repeat per model), see above")
    ap.add_argument("--tokens", type=int, default=CostConfig.tokens_per_microbatch,
                    help="tokens per micro-batch (cost model; default %(default)s)")
    ap.add_argument("--seq-len", type=int, default=CostConfig.seq_len,
                    help="sequence length for the attention FLOPs (cost model; default %(default)s)")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPU count, checked to be a multiple of fused stages x the largest tp "
                         "(cost model; default: not checked)")
    ap.add_argument("--gpu-tflops", type=float, default=CostConfig.gpu_flops / 1e12,
                    help="peak TFLOP/s of one GPU (cost model; default %(default)g, A100 bf16)")
    ap.add_argument("--mfu", type=float, default=CostConfig.mfu,
                    help="model FLOPs utilisation in (0, 1] (cost model; default %(default)g)")
    ap.add_argument("--comm", type=float, default=0.0,
                    help="ms per stage-to-stage transfer (cost model; default 0)")
    ap.add_argument("--mem-cap", default=None,
                    help="per-stage activation cap: a number in the problem's memory unit, or "
                         "e.g. 1.25x for a multiple of the serial 1F1B peak (default: no cap)")
    ap.add_argument("--budget", type=float, default=30.0,
                    help="nominal seconds of makespan annealing (default %(default)g)")
    ap.add_argument("--memory-budget", type=float, default=10.0,
                    help="nominal seconds of the peak-memory pass (default %(default)g)")
    ap.add_argument("--t0-scale", type=float, default=1e-3,
                    help="makespan annealing's initial temperature / start makespan, > 0 "
                         "(default %(default)g; RLHFuse: 1, the greedy makespan)")
    ap.add_argument("--seed", type=int, default=0,
                    help="random seed; under mpiexec rank r uses seed + r (default %(default)s)")
    ap.add_argument("--out", type=Path, help="write the schedule JSON here")
    ap.add_argument("--plot", type=Path, help="write a Gantt chart PNG here")
    return ap.parse_args(argv)


def build(args):
    if args.problem is not None:
        try:
            return load_problem(args.problem)
        except (OSError, ValueError) as err:  # unreadable file, bad JSON, ProblemError
            raise ProblemError(f"--problem {args.problem}: {err}") from None
    flags = {"tokens_per_microbatch": "--tokens", "seq_len": "--seq-len", "gpu_flops": "--gpu-tflops",
             "mfu": "--mfu", "comm": "--comm", "gpus": "--gpus"}
    try:
        cfg = CostConfig(tokens_per_microbatch=args.tokens, seq_len=args.seq_len,
                         gpu_flops=args.gpu_tflops * 1e12, mfu=args.mfu, comm=args.comm, gpus=args.gpus)
    except ProblemError as err:
        flag = next((f for k, f in flags.items() if f"CostConfig.{k}=" in str(err)), "cost model")
        raise ProblemError(f"{flag}: {err}") from None
    return build_problem(args.model, cfg)


def resolve_cap(text, pb) -> float | None:
    if text is None:
        return None
    try:
        if text.endswith("x"):
            return float(text[:-1]) * max(serial_peak_memory(pb))
        return float(text)
    except ValueError:
        raise ProblemError(f"--mem-cap {text!r} must be a number ({pb.mem_unit}) or a multiple of "
                           "the serial 1F1B peak such as 1.25x") from None


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        pb = build(args)
        cap = resolve_cap(args.mem_cap, pb)
        if args.t0_scale <= 0:
            raise ProblemError(f"--t0-scale {args.t0_scale:g} must be > 0")
        if args.budget < 0 or args.memory_budget < 0:
            raise ProblemError(f"--budget {args.budget:g} and --memory-budget "
                               f"{args.memory_budget:g} must be >= 0 (nominal seconds)")
        cfg = SearchConfig(budget_s=args.budget, memory_budget_s=args.memory_budget,
                           seed=args.seed, mem_cap=cap, anneal=AnnealConfig(t0_scale=args.t0_scale))
        res = search_mpi(pb, cfg)
    except ProblemError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
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
