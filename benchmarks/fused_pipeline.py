"""Fused actor/critic pipeline: measured vs simulated makespans, and bubbles.

Actor pp4 "down" and critic pp4 "up" (reverse_pp) on 4 gloo ranks, each run
through the same executor with two schedules: serial 1F1B (the non-fused
baseline) and the annealed fused schedule.

1. Sleep mode: every FORWARD/BACKWARD is a calibrated sleep of its cost in
   the schedule (``--unit-ms`` per time unit), so two shared cores do not
   distort timing while the p2p messages still travel.  Prints predicted and
   measured makespans (median of ``--repeats`` runs after one warm-up),
   whether each is within 10% of the simulator, and the fused/serial
   speedups side by side.
2. Real mode: tiny megatron models (actor larger than critic).  Serial 1F1B
   runs first; its timeline gives per-stage F/B costs, the fused schedule is
   annealed on those, and the measured bubble fraction per rank
   (1 - compute time / makespan) is printed for both.

Both print the receive buffers that order-matched messaging holds at once
per rank (``compiler.early_buffers``); ``--tags per_pair`` sends every
message between two ranks under one tag (gloo then pairs them by order, as
NCCL does).

Usage: ``python benchmarks/fused_pipeline.py [--unit-ms 40] [--repeats 3]
[--tags per_message|per_pair] [--trace-dir DIR] [--skip-real]`` (DIR receives
Chrome traces, open in ui.perfetto.dev). Small values (``--unit-ms 5 --repeats
1``) make a quick check that it runs.

The last line is the summary: ``fused_pipeline: sleep_speedup=<measured>/<predicted>
sleep_within_10pct=<k>/2 real_speedup=<measured>/<predicted> real_bubbles=<serial>-><annealed>``
(fused over serial 1F1B; the mean bubble fraction over ranks; the real fields
``n/a`` with --skip-real).
"""
from __future__ import annotations

import argparse
import os
import platform as host
import statistics

from rlhf.tasks import TRAIN_TASK

PLAN = {"actor_train": {"ranks": "0-3", "pp": 4},
        "critic_train": {"ranks": "0-3", "pp": 4, "reverse_pp": True}}
MICROBATCHES = 4


def sleep_problem():
    from rlhf.schedule.problem import ModelSpec, Problem

    def spec(name, direction, f):
        return ModelSpec(name, 4, 1, MICROBATCHES, direction, [f] * 4, [2 * f] * 4, [1.0] * 4)
    return Problem(4, (spec("actor", "down", 1.0), spec("critic", "up", 0.5)))


def schedules(pb, budget_s: float = 0.2) -> dict:
    """{label: per-stage orders} for serial 1F1B and the searched (annealed) fused schedule."""
    from rlhf.schedule.generators import serial_1f1b
    from rlhf.schedule.search import SearchConfig, search

    fused = search(pb, SearchConfig(budget_s=budget_s, memory_budget_s=budget_s / 4)).orders
    return {"serial_1f1b": serial_1f1b(pb), "annealed": fused}


def _timed_runs(sched, runtimes, compute, repeats: int, trace_path, tags: str) -> list:
    """Gathered per-rank events of ``repeats`` runs after one warm-up."""
    from rlhf.pipeline.executor import run_step

    runs = []
    for i in range(repeats + 1):
        last = i == repeats
        res = run_step(sched, runtimes, compute, trace_path=trace_path if last else None,
                       gather_timeline=True, tags=tags)
        if i:
            runs.append(res.per_rank)
    return runs


def _trace(trace_dir, mode, label):
    return None if trace_dir is None else os.path.join(trace_dir, f"{mode}_{label}.json")


def early_buffers(sched, runtimes) -> list:
    """Per rank, the most messages held at once that arrived ahead of their receive."""
    from rlhf.pipeline.compiler import compile_all, early_buffers as held

    return [held(p) for p in compile_all(sched, {n: rt.mesh for n, rt in runtimes.items()}).values()]


def sleep_rank(unit_ms: float, repeats: int, tags: str, trace_dir=None) -> dict:
    """Per schedule: (predicted s, measured median s) with sleeps for compute; "buffers": per
    schedule, early receive buffers per rank."""
    import torch.distributed as dist

    from rlhf.parallel import Placement
    from rlhf.pipeline.executor import ModelRuntime, SleepCompute
    from rlhf.pipeline.timeline import makespan
    from rlhf.schedule.schedule import Schedule
    from rlhf.schedule.simulate import simulate

    pb, unit = sleep_problem(), unit_ms / 1000.0
    placement = Placement.from_plan(PLAN, dist.get_world_size())
    runtimes = {name: ModelRuntime(name, placement[task], [{}] * MICROBATCHES)
                for name, task in TRAIN_TASK.items()}
    compute = SleepCompute(pb, unit)
    out = {"buffers": {}}
    for label, orders in schedules(pb).items():
        sched = Schedule.from_orders(pb, orders)
        runs = _timed_runs(sched, runtimes, compute, repeats, _trace(trace_dir, "sleep", label), tags)
        out[label] = (simulate(pb, orders).makespan * unit,
                      statistics.median(makespan(r) for r in runs))
        out["buffers"][label] = early_buffers(sched, runtimes)
    return out


# -- real tiny models ------------------------------------------------------------
def _lm_loss(logits, mb, groups, packed=None):
    from rlhf.models.logprobs import vocab_parallel_log_probs

    return -vocab_parallel_log_probs(logits[:, :-1], mb.tokens[:, 1:], groups.tp).mean()


def _value_loss(values, mb, groups, packed=None):
    return values.square().mean()


def _real_runtimes(groups) -> dict:
    """Actor: 8 layers, hidden 256; critic: 4 layers, hidden 128 (micro-batches 2 x 64 tokens)."""
    import torch

    from rlhf.batch import Batch
    from rlhf.models import ModelConfig
    from rlhf.models.gpt import build_model
    from rlhf.optim import ModelOptimizer, OptimizerConfig
    from rlhf.pipeline.executor import ModelRuntime

    shapes = {"actor": (ModelConfig(num_layers=8, hidden_size=256, ffn_hidden_size=512, vocab_size=256,
                                    max_seq_len=64), "lm", _lm_loss),
              "critic": (ModelConfig(num_layers=4, hidden_size=128, ffn_hidden_size=256, vocab_size=256,
                                     max_seq_len=64), "value", _value_loss)}
    gen = torch.Generator().manual_seed(0)
    n = 2 * MICROBATCHES  # micro-batches of 2 samples x 64 tokens (a 1-token prompt + 63 response tokens)
    mbs = Batch(tokens=torch.randint(0, 256, (n, 64), generator=gen), pad_id=0,
                prompt_lengths=torch.ones(n, dtype=torch.int64), response_lengths=torch.full((n,), 63),
                prompt_ids=torch.arange(n), sample_indices=torch.zeros(n, dtype=torch.int64),
                finish_reasons=("length",) * n).split(MICROBATCHES)
    out = {}
    for name, (cfg, kind, loss) in shapes.items():
        g = groups[TRAIN_TASK[name]]
        module = build_model(cfg, kind, g.pg_collection, g.stage, seed=1)
        sgd = ModelOptimizer(module, g, OptimizerConfig(optimizer="sgd", lr=1e-4, clip_grad=0.0))
        out[name] = ModelRuntime(name, g.mesh, mbs, module, g, sgd, loss, cfg.hidden_size)
    return out


def fitted_problem(runs: list, placement):
    """A Problem whose per-stage F/B costs (ms) are the mean measured durations."""
    from rlhf.schedule.problem import ModelSpec, Problem

    specs = []
    for m in sleep_problem().models:
        mesh = placement[TRAIN_TASK[m.name]]
        cost = {}
        for op in ("F", "B"):
            for j in range(m.pp):
                rank = mesh.rank(j, 0, 0)
                durs = [e[3] - e[2] for per_rank in runs for r, evs in per_rank if r == rank
                        for e in evs if e[0].split()[0] == m.name and e[0].split()[1][0] == op]
                cost[op, j] = 1000.0 * statistics.mean(durs)
        specs.append(ModelSpec(m.name, m.pp, 1, m.microbatches, m.direction,
                               [cost["F", j] for j in range(m.pp)], [cost["B", j] for j in range(m.pp)],
                               m.act_mem))
    return Problem(4, tuple(specs))


def _summary(pb, orders, runs) -> dict:
    from rlhf.pipeline.timeline import bubble_fractions, makespan
    from rlhf.schedule.simulate import simulate

    bubbles = [bubble_fractions(r) for r in runs]
    return {"predicted_s": simulate(pb, orders).makespan / 1000.0,
            "measured_s": statistics.median(makespan(r) for r in runs),
            "bubbles": {rank: statistics.mean(b[rank] for b in bubbles) for rank in bubbles[0]}}


def real_rank(repeats: int, tags: str, trace_dir=None) -> dict:
    """Serial 1F1B, then the fused schedule annealed on the costs measured in it."""
    import torch.distributed as dist

    from rlhf.parallel import Placement
    from rlhf.parallel.groups import build_task_groups
    from rlhf.schedule.generators import serial_1f1b
    from rlhf.schedule.schedule import Schedule

    placement = Placement.from_plan(PLAN, dist.get_world_size())
    runtimes = _real_runtimes(build_task_groups(placement))
    base = sleep_problem()
    serial_runs = _timed_runs(Schedule.from_orders(base, serial_1f1b(base)), runtimes, None, repeats,
                              _trace(trace_dir, "real", "serial_1f1b"), tags)
    pb = fitted_problem(serial_runs, placement)  # same on every rank: events were all-gathered
    fused = Schedule.from_orders(pb, schedules(pb)["annealed"])
    fused_runs = _timed_runs(fused, runtimes, None, repeats, _trace(trace_dir, "real", "annealed"), tags)
    return {"serial_1f1b": _summary(pb, serial_1f1b(pb), serial_runs),
            "annealed": _summary(pb, fused.orders, fused_runs),
            "costs_ms": {m.name: (m.fwd, m.bwd) for m in pb.models},
            "buffers": early_buffers(fused, runtimes)}


# -- report ------------------------------------------------------------------------
def _speedup(res: dict) -> str:
    """``measured/predicted`` fused-over-serial speedup of a mode's makespans."""
    (ps, ms), (pf, mf) = res["serial_1f1b"], res["annealed"]
    return f"{ms / mf:.3f}/{ps / pf:.3f}"


def _print_makespans(title: str, res: dict, check: bool = True) -> None:
    print(title)
    print(f"  {'schedule':<12} {'predicted ms':>12} {'measured ms':>12} {'meas/pred':>10}"
          + (f" {'within 10%':>10}" if check else ""))
    for label in ("serial_1f1b", "annealed"):
        pred, meas = res[label]
        ok = f" {'yes' if abs(meas / pred - 1) <= 0.10 else 'NO':>10}" if check else ""
        print(f"  {label:<12} {pred * 1e3:12.1f} {meas * 1e3:12.1f} {meas / pred:10.3f}{ok}")
    (ps, ms), (pf, mf) = res["serial_1f1b"], res["annealed"]
    print(f"  fused/serial speedup: predicted {ps / pf:.3f}   measured {ms / mf:.3f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--unit-ms", type=float, default=40.0,
                    help="sleep mode: ms slept per schedule time unit (default %(default)g)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per schedule after a warm-up; the median is reported (default %(default)s)")
    ap.add_argument("--trace-dir", default=None,
                    help="write Chrome traces of each schedule's last run here (default: none)")
    ap.add_argument("--tags", choices=("per_message", "per_pair"), default="per_message",
                    help="one tag per message, or one per rank pair (order matching, as NCCL) "
                         "(default %(default)s)")
    ap.add_argument("--skip-real", action="store_true", help="sleep mode only (skip the tiny models)")
    args = ap.parse_args(argv)
    if args.unit_ms <= 0:
        ap.error(f"--unit-ms {args.unit_ms:g} must be > 0")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats} must be >= 1")
    from rlhf.testing.distributed import launch

    print(f"machine: {host.node()} {host.machine()}, {os.cpu_count()} cores, 4 gloo ranks; "
          f"actor pp4 down + critic pp4 up, {MICROBATCHES} micro-batches each; tags {args.tags}")
    sleep = launch(4, "fused_pipeline:sleep_rank", unit_ms=args.unit_ms, repeats=args.repeats,
                   tags=args.tags, trace_dir=args.trace_dir)[0]
    _print_makespans(f"sleep mode (1 time unit = {args.unit_ms:g} ms; actor F/B = 1/2, critic 0.5/1; "
                     f"median of {args.repeats}):", sleep)
    print("  early receive buffers per rank (order matching): "
          + "; ".join(f"{label} {b}" for label, b in sleep["buffers"].items()))
    within = sum(abs(meas / pred - 1) <= 0.10 for pred, meas in (sleep[k] for k in ("serial_1f1b", "annealed")))
    summary = f"fused_pipeline: sleep_speedup={_speedup(sleep)} sleep_within_10pct={within}/2"
    if args.skip_real:
        print(f"{summary} real_speedup=n/a real_bubbles=n/a")
        return
    real = launch(4, "fused_pipeline:real_rank", repeats=args.repeats, tags=args.tags,
                  trace_dir=args.trace_dir)[0]
    print("real tiny models (F/B ms per stage, measured in serial 1F1B): "
          + "; ".join(f"{n} F {[round(x, 1) for x in f]} B {[round(x, 1) for x in b]}"
                      for n, (f, b) in real["costs_ms"].items()))
    _print_makespans("  makespans (4 ranks share 2 cores: contention and p2p latency are not in the "
                     "simulator, so no 10% check here):",
                     {k: (real[k]["predicted_s"], real[k]["measured_s"]) for k in ("serial_1f1b", "annealed")},
                     check=False)
    print("  bubble fraction per rank (1 - compute / makespan):")
    for label in ("serial_1f1b", "annealed"):
        b = real[label]["bubbles"]
        print(f"  {label:<12} " + "  ".join(f"rank{r} {b[r]:.3f}" for r in sorted(b))
              + f"   mean {statistics.mean(b.values()):.3f}")
    print(f"  early receive buffers per rank, annealed: {real['buffers']}")
    bubbles = {k: statistics.mean(real[k]["bubbles"].values()) for k in ("serial_1f1b", "annealed")}
    print(f"{summary} real_speedup="
          f"{_speedup({k: (real[k]['predicted_s'], real[k]['measured_s']) for k in ('serial_1f1b', 'annealed')})} "
          f"real_bubbles={bubbles['serial_1f1b']:.3f}->{bubbles['annealed']:.3f}")


if __name__ == "__main__":
    main()
