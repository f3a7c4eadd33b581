"""Execution planner: the seed papers' reproductions, and predicted against measured iterations on 4 CPU ranks.

(a) ReaL Table 1: the parameter counts of its four LLaMA configurations, counted
    from the shapes (rlhf.planner.models) against the published checkpoints' counts.
(b) ReaL Table 6: end-to-end seconds of its four "with CUDA graph" plans from the
    per-call times of its Tables 2-5, by the iteration simulator. The tables are
    read from ``--real-tables FILE`` (format below); without one the part is
    reported as not run.
(c) HybridFlow Table 2: bytes each rank receives resharding 1-2-2 -> 1-1-2-2 and
    1-4-2 -> 1-2-2-2 (Llama-2 7B, bf16), in HybridFlow's rank order and in plain
    order, against (tp - t_g p_g) / (t_g p_g tp) x M. Counted by
    rlhf.planner.reshard_bytes; tests/test_planner_reshard.py checks that count
    against the real rlhf/parallel/reshard.py on 8 gloo ranks. A transition
    counts when the HybridFlow order meets the formula and the planner picks it.
(d) With ``--cpu-runs``: the tiny default job on 4 gloo ranks (benchmarks/e2e.py's
    measurement) under several placements; the planner is calibrated on the
    first run's stage times and predicts every run's iteration. Reported: the
    table, whether the predicted order equals the measured one, the largest
    relative error.

``--real-tables`` JSON: a list of plans, each
``{"name": ..., "expected_s": 64.0, "calls": [{"name": "actor_gen", "ranks": [0, ...],
"seconds": 12.3, "inputs": [["reshard actor", 0.0]]}, ...]}``.

    python benchmarks/planner.py [--cpu-runs] [--iterations 3] [--warmup 1] [--real-tables FILE]

The last line is the summary:
``planner: table1=<k>/4 table6=<k>/4 hybridflow=<k>/2 cpu_rank_agreement=<yes|no|n/a> max_cpu_error=<x|n/a>``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform as host
import tempfile
from pathlib import Path

from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.planner.calibrate import calibrate, host_seconds, observations
from rlhf.planner.cost import Cluster, Workload
from rlhf.planner.hardware import Hardware
from rlhf.planner.models import PRESETS, parameter_count
from rlhf.planner.plan import Plan, evaluate
from rlhf.planner.reshard_bytes import (hybridflow_fraction, hybridflow_ranks, padded_rows, parallel_bytes,
                                        received_bytes)
from rlhf.planner.search import generation_order
from rlhf.planner.simulate import Call, schedule
from rlhf.tasks import TASKS

PUBLISHED = {"llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320, "llama-34b": 33_743_970_304,
             "llama-70b": 68_976_648_192}
"""Parameters of meta-llama/Llama-2-{7,13,70}b-hf and codellama/CodeLlama-34b-hf (ReaL Table 1's models)."""

TRANSITIONS = (("1-2-2 -> 1-1-2-2", ParallelStrategy(dp=2, tp=2), ParallelStrategy(dp=4, tp=1)),
               ("1-4-2 -> 1-2-2-2", ParallelStrategy(dp=2, tp=4), ParallelStrategy(dp=4, tp=2)))

CPU = Hardware("cpu-gloo-1-thread", gpu_flops=20e9, hbm_bandwidth=10e9, gpu_memory=8 * 2**30,
               intra_node_bandwidth=2e9, inter_node_bandwidth=2e9)
"""A first guess for one CPU core per rank; calibration replaces its efficiencies and overheads."""

CPU_PLANS = {
    "dp4 everywhere": {},
    "tp2 everywhere": {t: {"tp": 2} for t in TASKS},
    "actor | critic+ref+reward": {"actor_gen": {"ranks": "0-1"}, "actor_train": {"ranks": "0-1"},
                                  "ref_inf": {"ranks": "2-3"}, "reward_inf": {"ranks": "2-3"},
                                  "critic_inf": {"ranks": "2-3"}, "critic_train": {"ranks": "2-3"}},
    "pp2 training, tp2 generation": {"actor_train": {"pp": 2}, "critic_train": {"pp": 2},
                                     "actor_gen": {"tp": 2}},
}
"""Placements of the tiny default on 4 ranks; the first is the profiling run the planner is calibrated on."""


def table1() -> int:
    print("(a) ReaL Table 1: parameters from the shapes vs the published checkpoints")
    hits = 0
    for name, published in PUBLISHED.items():
        cfg = PRESETS[name]
        count = parameter_count(cfg, "lm")
        hits += count == published
        print(f"    {name:10s} {cfg.num_layers:3d} layers, hidden {cfg.hidden_size:5d}, ffn {cfg.ffn_hidden_size:5d}, "
              f"{cfg.num_attention_heads} heads ({cfg.num_kv_heads} KV), vocab {cfg.vocab_size}: {count:,} "
              f"{'==' if count == published else '!='} {published:,}")
    return hits


def table6(path: Path | None) -> int:
    print("(b) ReaL Table 6: simulated end-to-end seconds from per-call times")
    if path is None:
        print("    not run: ReaL's Tables 2-6 (per-call times, plans, end-to-end seconds) were not available "
              "offline when this was built; pass them with --real-tables FILE")
        return 0
    hits = 0
    for plan in json.loads(path.read_text()):
        calls = [Call(c["name"], c["ranks"], c["seconds"], [tuple(i) for i in c.get("inputs", [])])
                 for c in plan["calls"]]
        got = schedule(calls).seconds
        ok = abs(got - plan["expected_s"]) <= 0.1 * plan["expected_s"]
        hits += ok
        print(f"    {plan['name']:30s} simulated {got:8.1f} s, paper {plan['expected_s']:8.1f} s "
              f"({got / plan['expected_s'] - 1:+.1%}){'' if ok else '  > 10%'}")
    return hits


def hybridflow() -> int:
    print("(c) HybridFlow Table 2: bytes each rank receives, Llama-2 7B in bf16 (M = its tensor-parallel bytes)")
    cfg, hits = PRESETS["llama-7b"], 0
    models = {"actor": cfg}
    for name, train, gen in TRANSITIONS:
        world = train.size
        t = TaskMesh("actor_train", tuple(range(world)), train)
        nested = TaskMesh("actor_gen", hybridflow_ranks(t, gen), gen)
        plain = TaskMesh("actor_gen", tuple(range(world)), gen)
        m = parallel_bytes(cfg, "lm", padded_rows(cfg.vocab_size, (train.tp, gen.tp)))
        share = hybridflow_fraction(train, gen)
        got = {k: max(received_bytes(cfg, "lm", t, mesh).values()) for k, mesh in (("hf", nested), ("plain", plain))}
        norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 2  # replicated norms some ranks read from a peer
        picked = generation_order({"actor_train": t, "actor_gen": plain}, models)["actor_gen"].ranks == nested.ranks
        ok = got["hf"] - norms <= share * m <= got["hf"] and (picked or nested.ranks == plain.ranks)
        hits += ok
        print(f"    {name}: formula {share:.3f} M = {share * m / 1e9:.3f} GB; HybridFlow order "
              f"{got['hf'] / m:.3f} M (incl. {norms / 1e3:.0f} kB of norms), plain order {got['plain'] / m:.3f} M; "
              f"planner picks {'HybridFlow' if picked else 'plain'} order ({list(nested.ranks)})")
    return hits


def cpu_runs(iterations: int, warmup: int) -> tuple[str, str]:
    """Measure the CPU_PLANS, calibrate on the first, predict all: (rank agreement, max error)."""
    from e2e import STAGES, WORLD_SIZE, check_job, summarize

    from rlhf.testing.distributed import launch

    print(f"(d) 4 CPU ranks: the tiny default under {len(CPU_PLANS)} placements, {iterations} timed iterations "
          f"after {warmup} warm-up (median); machine {host.node()}, {os.cpu_count()} cores, load "
          f"{os.getloadavg()[0]:.2f}")
    rows, folder = [], tempfile.mkdtemp(prefix="planner_bench_")
    for name, plan in CPU_PLANS.items():
        path = Path(folder) / f"{len(rows)}.json"
        path.write_text(json.dumps(plan))
        flags = ["--placement", str(path)]
        config = check_job(flags)
        placement = config.build_placement(WORLD_SIZE)
        res = summarize(launch(WORLD_SIZE, "e2e:measure", timeout_s=900, job_flags=flags, iterations=iterations,
                               warmup=warmup))
        measured = {stage: res[stage] for stage, _ in STAGES} | {"iteration": res["iteration"]}
        rows.append((name, Plan(name, dict(placement.meshes)), measured, config))
    config = rows[0][3]
    ppo, gen = config.ppo, config.generation
    wl = Workload(ppo.rollout_batch_size * ppo.n_samples_per_prompt, gen.max_prompt_len, gen.max_response_len,
                  ppo.minibatches, ppo.micro_batch_size, ppo.ppo_epochs)
    models = {m: config.models[m] for m in ("actor", "critic", "reference", "reward")}
    cluster = Cluster(1, WORLD_SIZE)
    first_plan, first_measured = rows[0][1], rows[0][2]
    hw = calibrate(CPU, observations(evaluate(first_plan, models, wl, CPU, cluster).costs, first_measured),
                   host_seconds(first_measured))
    print(f"    calibrated on '{rows[0][0]}': mfu {hw.mfu:.3g}, hbm_efficiency {hw.hbm_efficiency:.3g}, "
          f"step_overhead_s {hw.step_overhead_s:.3g}, call_overhead_s {hw.call_overhead_s:.3g}, host_s {hw.host_s:.3g}")
    print(f"    {'placement':32s} {'measured s':>10} {'predicted s':>11} {'error':>7}")
    errors, predicted = [], []
    for name, plan, measured, _ in rows:
        p = evaluate(plan, models, wl, hw, cluster).seconds
        predicted.append(p)
        errors.append(abs(p / measured["iteration"] - 1))
        print(f"    {name:32s} {measured['iteration']:10.3f} {p:11.3f} {p / measured['iteration'] - 1:+7.1%}")
    order = lambda xs: sorted(range(len(xs)), key=xs.__getitem__)  # noqa: E731
    agree = order(predicted) == order([m["iteration"] for _, _, m, _ in rows])
    return ("yes" if agree else "no"), f"{max(errors):.3f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real-tables", type=Path, help="ReaL's per-call times and plans (JSON, format above)")
    ap.add_argument("--cpu-runs", action="store_true", help="run part (d): several minutes on 2 cores")
    ap.add_argument("--iterations", type=int, default=3, help="timed iterations per placement in (d)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed iterations before them in (d)")
    args = ap.parse_args(argv)
    t1, t6, hf = table1(), table6(args.real_tables), hybridflow()
    agree, error = cpu_runs(args.iterations, args.warmup) if args.cpu_runs else ("n/a", "n/a")
    if not args.cpu_runs:
        print("(d) 4 CPU ranks: not run (pass --cpu-runs)")
    print(f"planner: table1={t1}/4 table6={t6}/4 hybridflow={hf}/2 cpu_rank_agreement={agree} max_cpu_error={error}")


if __name__ == "__main__":
    main()
