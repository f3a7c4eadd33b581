"""Execution planner: the seed papers' reproductions, and predicted against measured iterations on 4 CPU ranks.

(a) ReaL Table 1: the parameters of its four LLaMA-3-style shapes counted by
    rlhf.planner.shapes, against the table's totals and its counts without
    the output embedding.
(b) ReaL Tables 2-6 (rlhf.planner.real_appendix): its four plans' end-to-end
    seconds ("with CUDA graph") simulated from their measured call seconds,
    with the weight moves (reshard bytes between the layouts a model's
    weights move between, there and back as ReaL's runtime does) and the
    batch's transfers the cost model times, on REAL_HARDWARE (H100 with the
    links ReaL's reallocation estimator assumes); a plan counts when within
    10%. Then held out: the hardware file calibrated on one plan's call
    seconds (and iteration, for host_s) predicts the other plans' calls and
    iterations, for each choice of plan (median and largest call error
    each). Then the planner's own search per setting (7B+7B on 16 GPUs,
    70B+7B on 128) with the file calibrated on that setting's heuristic plan,
    beside ReaL's plans predicted by the same file. The tables are the shared
    seed facts (``--real-tables`` for another file of that format).
(c) HybridFlow Table 2: bytes each rank receives resharding 1-2-2 -> 1-1-2-2 and
    1-4-2 -> 1-2-2-2 (Llama-2 7B, bf16), in HybridFlow's rank order and in plain
    order, against (tp - t_g p_g) / (t_g p_g tp) x M. Counted by
    rlhf.planner.reshard_bytes; tests/test_planner_reshard.py checks that count
    against the real rlhf/parallel/reshard.py on 8 gloo ranks. A transition
    counts when the HybridFlow order meets the formula and the planner picks it.
(d) With ``--cpu-runs``: the tiny default job on 4 gloo ranks (one torch
    thread each, as benchmarks/e2e.py runs it) under the placements of
    CPU_PLANS, each the median of ``--iterations`` timed iterations (the
    slowest rank per stage; a task call from its last rank's start to its
    last rank's end), measured in ``--rounds`` interleaved rounds (the
    median over rounds reported, every round's iteration shown: the machine
    drifts by tens of percent between launches). The planner is calibrated
    on one profiling run, the first of CPU_PLANS, from its call seconds and
    iteration alone, and predicts every run's iteration. Reported: the
    table (stages measured / predicted), whether the predicted order equals
    the measured one, the largest relative error. ``--record FILE`` saves
    the measured table; ``--measured FILE`` reports from a saved one.

(e) Inter-stage fusion in the search: Llama-2 7B actor and critic on 2 x 8
    H100, 512 samples of 512 + up to 1024 tokens, long-tailed (median 128):
    the best plan without and with ``fuse_generation`` (rlhf.planner.fused_generation).

    python benchmarks/planner.py [--real-only] [--real-tables FILE]
                                 [--cpu-runs [--record FILE] | --measured FILE] [--iterations 5] [--warmup 2]
                                 [--rounds 3] [--quick]

``--real-only`` runs (a) and (b) alone (the 70B search takes minutes on 2 cores).
``--quick`` (a check that it runs, not a measurement) leaves the 70B+7B setting out of (b)'s search
(about 45 s on 2 cores; 7B+7B's runs) and searches (e) with ``PlacementSearchConfig(options=1)``
(one option per task instead of 3: about 1 s instead of 8).
The last line is the summary:
``planner: table1=<k>/4 table6=<k>/4 hybridflow=<k/2|n/a> cpu_rank_agreement=<yes|no|n/a> max_cpu_error=<x|n/a>
real_percall_median_error=<y>`` (y: the median of every held-out call's relative error, all four choices).
"""
from __future__ import annotations

import argparse
import json
import os
import platform as host
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from rlhf.models.config import padded_vocab_size
from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.planner.calibrate import OVERHEAD_TERMS, calibrate
from rlhf.planner.cost import Cluster, Workload
from rlhf.planner.errors import PlannerError
from rlhf.planner.hardware import HARDWARE_PRESETS
from rlhf.planner.placement_search import PlacementSearchConfig, generation_order, search_placements
from rlhf.planner.plan import STAGES, Plan, evaluate, stage_seconds
from rlhf.planner.real_appendix import (HELD_OUT_TERMS, REAL_HARDWARE, TABLES, RealAppendix, held_out, load_appendix,
                                        search_beside_real, simulate_table6)
from rlhf.planner.reshard_bytes import hybridflow_fraction, hybridflow_ranks, parallel_bytes, received_bytes
from rlhf.planner.shapes import LLAMA_SHAPES, parameter_count
from rlhf.tasks import TASKS

TRANSITIONS = (("1-2-2 -> 1-1-2-2", ParallelStrategy(dp=2, tp=2), ParallelStrategy(dp=4, tp=1)),
               ("1-4-2 -> 1-2-2-2", ParallelStrategy(dp=2, tp=4), ParallelStrategy(dp=4, tp=2)))

SHOWN = ("generation", "inference", "training", "reshard")
"""Stages the table breaks down."""

CPU_PLANS = {
    "profiling: tp2 ref_inf, pp2 critic_train": {"ref_inf": {"tp": 2}, "critic_train": {"pp": 2}},
    "built-in default": None,
    "dp4 everywhere": {},
    "tp2 everywhere": {t: {"tp": 2} for t in TASKS},
    "actor | critic+ref+reward": {"actor_gen": {"ranks": "0-1"}, "actor_train": {"ranks": "0-1"},
                                  "ref_inf": {"ranks": "2-3"}, "reward_inf": {"ranks": "2-3"},
                                  "critic_inf": {"ranks": "2-3"}, "critic_train": {"ranks": "2-3"}},
    "pp2 training, tp2 generation": {"actor_train": {"pp": 2}, "critic_train": {"pp": 2},
                                     "actor_gen": {"tp": 2}},
}
"""Placements of the tiny default on 4 ranks (None: the job's built-in plan, examples/placement_4ranks.json).
The first is the profiling run the planner is calibrated on, laid out so that each constant shows in a
call of its own: data-parallel generation (per-step overhead), reward_inf and critic_inf (per-call
overhead) and actor_train (per-update overhead), TP in ref_inf (collective latency), PP in critic_train."""


def table1(app: RealAppendix) -> int:
    print("(a) ReaL Table 1: parameters counted from its shapes (rlhf.planner.shapes) vs the table's")
    hits = 0
    for col, cfg in app.shapes.items():
        total, without_head = app.counts[col]
        count = parameter_count(cfg, "lm")
        ok = count == total and count - cfg.vocab_size * cfg.hidden_size == without_head
        hits += ok
        print(f"    {col:4s} {cfg.num_layers:3d} layers, hidden {cfg.hidden_size:5d}, ffn {cfg.ffn_hidden_size:5d}, "
              f"{cfg.num_attention_heads} heads ({cfg.num_kv_heads} KV), vocab {cfg.vocab_size}: {count:,} "
              f"{'==' if ok else '!='} {total:,} ({without_head:,} without the output embedding)")
    return hits


def table6(app: RealAppendix) -> int:
    print(f"(b) ReaL Table 6: end-to-end seconds from the measured call seconds, weight moves and transfers "
          f"timed by the cost model ({REAL_HARDWARE.name}: {REAL_HARDWARE.inter_node_bandwidth / 1e9:g} GB/s "
          f"between nodes, {REAL_HARDWARE.intra_node_bandwidth / 1e9:g} GB/s inside)")
    hits, simulated = 0, simulate_table6(app)
    for p in app.plans:
        ev = simulated[p.name]
        ok = abs(ev.seconds - p.end_to_end_s) <= 0.1 * p.end_to_end_s
        hits += ok
        t = ev.timeline
        moves = ", ".join(f"{n} {t.end[n] - t.start[n]:.2f}" for n in STAGES["reshard"] if n in t.start) or "none"
        print(f"    {p.name:28s} simulated {ev.seconds:6.1f} s, paper {p.end_to_end_s:6.1f} s "
              f"({ev.seconds / p.end_to_end_s - 1:+.1%}){'' if ok else '  > 10%'}; sum of calls "
              f"{sum(p.measured.values()):.1f} s; moves (s): {moves}")
    return hits


def real_held_out(app: RealAppendix) -> tuple[list, str]:
    """Each plan's calibration predicting the others; (the fits, the median error over all held-out calls)."""
    print(f"(b) held out: calibrated ({', '.join(HELD_OUT_TERMS)}; host_s from the iteration) on one plan, "
          "predicting the others' calls")
    fits = held_out(app)
    for h in fits:
        print(f"    calibrated on {h.calibrated_on}: " + ", ".join(
            f"{k} {getattr(h.hardware, k):.3g}" for k in HELD_OUT_TERMS + ("host_s",)))
        print(f"      {'plan':28s} {'call':15s} {'predicted s':>11} {'measured s':>10} {'error':>7}")
        for (plan, task), (got, want) in h.calls.items():
            if plan != h.calibrated_on:
                print(f"      {plan:28s} {task:15s} {got:11.2f} {want:10.2f} {got / want - 1:+7.1%}")
        for plan, (got, want) in h.iterations.items():
            label = "iteration (fit)" if plan == h.calibrated_on else "iteration"
            print(f"      {plan:28s} {label:15s} {got:11.2f} {want:10.2f} {got / want - 1:+7.1%}")
        print(f"      held-out calls: median error {h.median_error:.1%}, largest {h.largest_error:.1%}")
    overall = statistics.median(abs(e) for h in fits for e in h.errors())
    print(f"    all {sum(len(h.errors()) for h in fits)} held-out calls: median error {overall:.1%}")
    return fits, f"{overall:.3f}"


def real_search(app: RealAppendix, fits: list, settings: tuple | None = None) -> None:
    """The planner's search per setting (all, or ``settings``: ``7B+7B`` ...) beside ReaL's plans."""
    print("(b) the planner's own search beside ReaL's plans, all predicted by the file calibrated on the "
          "setting's heuristic plan" + (f" (settings {', '.join(settings)} only)" if settings else ""))
    for s in search_beside_real(app, fits, settings=settings):
        print(f"    {s.setting} ({s.best.plan.name.split(' [')[0]} at micro-batches of {s.micro_batch_size}): "
              f"planner {s.best.seconds:.1f} s; " + "; ".join(f"{n} {sec:.1f} s" for n, sec in s.real.items()))
        print(f"      planner: {s.best.plan.describe()}")
        for p in (p for p in app.plans if p.setting == s.setting and "searched" in p.name):
            print(f"      {p.name}: {p.plan.describe()} (micro-batches {p.plan.microbatches})")


def hybridflow() -> int:
    print("(c) HybridFlow Table 2: bytes each rank receives, Llama-2 7B in bf16 (M = its tensor-parallel bytes)")
    cfg, hits = LLAMA_SHAPES["llama-7b"], 0
    models = {"actor": cfg}
    for name, train, gen in TRANSITIONS:
        world = train.size
        t = TaskMesh("actor_train", tuple(range(world)), train)
        nested = TaskMesh("actor_gen", hybridflow_ranks(t, gen), gen)
        plain = TaskMesh("actor_gen", tuple(range(world)), gen)
        m = parallel_bytes(cfg, "lm", padded_vocab_size(cfg.vocab_size, 1, (train.tp, gen.tp)))
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


def inter_stage(options: int = PlacementSearchConfig.options) -> None:
    """(e), searching with ``options`` options per task (PlacementSearchConfig)."""
    print("(e) inter-stage fusion in the search: 7B/7B on 2 x 8 H100, 512 samples of 512 + up to 1024 tokens, "
          "lengths lognormal around 128" + ("" if options == PlacementSearchConfig.options
                                            else f" ({options} option(s) per task)"))
    models = {m: LLAMA_SHAPES["llama-7b"] for m in ("actor", "reference", "reward", "critic")}
    wl = Workload(512, 512, 1024, 4, 4, long_tail_median=128)
    best = {fused: search_placements(models, wl, HARDWARE_PRESETS["h100"], Cluster(2, 8),
                                     PlacementSearchConfig(options=options, fuse_generation=fused)).best
            for fused in (False, True)}
    for fused, ev in best.items():
        st = stage_seconds(ev)
        r = f", R={ev.migration_threshold:g}" if ev.plan.fuse_generation else ""
        print(f"    {'fused' if fused else 'plain':5s}: {ev.seconds:6.2f} s (generation {st['generation']:.2f} s, "
              f"inference {st['inference']:.2f} s{r}), actor_gen {ev.plan.meshes['actor_gen'].strategy}")
    print(f"    predicted speedup {best[False].seconds / best[True].seconds:.3f}x")


def measure(job_flags: list, iterations: int, warmup: int) -> list:
    """This rank's ``time_<stage>_s`` and ``time_iteration_s`` of each timed iteration, and the (start, end)
    of each of its task calls (collective: every rank runs it), read right after ``Trainer.step()``."""
    import torch.distributed as dist

    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.job import build_trainer
    from rlhf.ppo.layout import build_placement

    config = parse_args(job_flags)
    trainer = build_trainer(config, build_placement(config, dist.get_world_size()))
    calls = time_calls(trainer)
    for _ in range(warmup):
        trainer.step()
    records = []
    for _ in range(iterations):
        calls.clear()
        trainer.step()
        records.append({"stages": trainer.timer.metrics(), "calls": {task: list(c) for task, c in calls.items()}})
    return records


def time_calls(trainer) -> dict:
    """The (start, end) of each task call on this rank, on the machine-wide monotonic clock, in call order
    (the dict returned, filled as the trainer runs): the engine's ``generate``, the inference runner's
    ``infer`` per task and the executor's ``run_step`` per trained model, wrapped where the trainer looks
    them up."""
    import rlhf.ppo.update

    intervals: dict = {}

    def timed(fn, name_of):
        def wrapper(*args, **kwargs):
            start = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                intervals.setdefault(name_of(*args), []).append((start, time.monotonic()))
        return wrapper

    if trainer.engine is not None:
        trainer.engine.generate = timed(trainer.engine.generate, lambda *_: "actor_gen")
    trainer.inference.infer = timed(trainer.inference.infer, lambda task, *_: task)
    rlhf.ppo.update.run_step = timed(rlhf.ppo.update.run_step,
                                     lambda _, runtimes: "+".join(f"{m}_train" for m in runtimes))
    return intervals


def call_seconds(ranks: list) -> float:
    """A task's seconds in one iteration from each of its ranks' (start, end) list: per call, from the
    last rank's start to the last rank's end (what the planner models: a call runs once all its ranks are
    in; an early rank's wait for the others is the previous call's skew), summed over its calls."""
    return sum(max(e for _, e in nth) - max(s for s, _ in nth) for nth in zip(*ranks))


def median_stages(per_rank: list) -> dict:
    """Seconds per stage and per iteration (the slowest rank's in each timed iteration, what the metrics
    file's ``time_*_s`` report) and per task (``call_seconds``), each the median over the iterations."""
    rows = []
    for i in range(len(per_rank[0])):
        stages = [rank[i]["stages"] for rank in per_rank]
        row = {k[len("time_"):-len("_s")]: max(st.get(k, 0.0) for st in stages) for k in sorted(set().union(*stages))}
        tasks = sorted({t for rank in per_rank for t in rank[i]["calls"]})
        rows.append(row | {t: call_seconds([rank[i]["calls"][t] for rank in per_rank if t in rank[i]["calls"]])
                           for t in tasks})
    return {k: statistics.median(row.get(k, 0.0) for row in rows) for k in sorted(set().union(*rows))}


def run_placements(iterations: int, warmup: int, rounds: int) -> dict:
    """Measure every CPU_PLANS entry on 4 gloo ranks ``rounds`` times, the placements interleaved (a slow
    drift of the machine then hits them alike); per placement the median over rounds of each time, and
    every round's iteration seconds: the recorded table (JSON-ready)."""
    from e2e import WORLD_SIZE, check_job

    from rlhf.testing.distributed import launch

    folder, measured = Path(tempfile.mkdtemp(prefix="planner_bench_")), {name: [] for name in CPU_PLANS}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for r in range(rounds):
        for i, (name, plan) in enumerate(CPU_PLANS.items()):
            flags = []
            if plan is not None:
                (folder / f"{i}.json").write_text(json.dumps(plan))
                flags = ["--placement", str(folder / f"{i}.json")]
            check_job(flags)
            per_rank = launch(WORLD_SIZE, "planner:measure", timeout_s=900, job_flags=flags, iterations=iterations,
                              warmup=warmup)
            measured[name].append(median_stages(per_rank))
            print(f"    round {r + 1}/{rounds} '{name}': iteration {measured[name][-1]['iteration']:.3f} s (load "
                  f"{os.getloadavg()[0]:.2f})", flush=True)
    runs = {name: {"plan": plan, "rounds": [m["iteration"] for m in measured[name]],
                   "seconds": {k: statistics.median(m.get(k, 0.0) for m in measured[name]) for k in measured[name][0]}}
            for name, plan in CPU_PLANS.items()}
    return {"measured": started, "machine": host.node(), "cores": os.cpu_count(), "world_size": WORLD_SIZE,
            "iterations": iterations, "warmup": warmup, "rounds": rounds, "runs": runs}


def cpu_table(table: dict) -> tuple[str, str]:
    """Calibrate on the table's first run, predict every run's iteration: (rank agreement, the largest
    relative error of any run, the profiling run's included)."""
    from e2e import WORLD_SIZE, check_job

    from rlhf.ppo.layout import build_placement

    runs = list(table["runs"].items())
    configs = {}
    for name, run in runs:
        path = Path(tempfile.mkdtemp(prefix="planner_bench_")) / "plan.json"
        path.write_text(json.dumps(run["plan"]))
        configs[name] = check_job([] if run["plan"] is None else ["--placement", str(path)])
    config = configs[runs[0][0]]
    ppo, gen = config.ppo, config.generation
    wl = Workload(ppo.rollout_batch_size * ppo.n_samples_per_prompt, gen.max_prompt_len, gen.max_response_len,
                  ppo.minibatches, ppo.micro_batch_size, ppo.ppo_epochs)
    models = {m: config.models[m] for m in ("actor", "critic", "reference", "reward")}
    cluster = Cluster(1, WORLD_SIZE)
    plans = {name: Plan(name, dict(build_placement(configs[name], WORLD_SIZE).meshes)) for name, _ in runs}
    profile, profiled = runs[0]
    start = replace(HARDWARE_PRESETS["cpu"], shared_cores=table["cores"])  # the 4 ranks share the machine's cores
    hw = calibrate(start, plans[profile], models, wl, cluster, profiled["seconds"], OVERHEAD_TERMS)
    print(f"    calibrated on '{profile}' (its call seconds; host_s from its iteration): "
          + ", ".join(f"{k} {getattr(hw, k):.3g}" for k in OVERHEAD_TERMS + ("host_s",))
          + f" (mfu {hw.mfu:g} kept; {hw.shared_cores:g} cores shared)")
    print(f"    {'placement':56s} {'measured s':>10} {'predicted s':>11} {'error':>7}   stages measured / predicted")
    errors, predicted, measured = [], [], []
    for name, run in runs:
        ev = evaluate(plans[name], models, wl, hw, cluster)
        stages = stage_seconds(ev)
        got, want = ev.seconds, run["seconds"]["iteration"]
        predicted.append(got)
        measured.append(want)
        errors.append(abs(got / want - 1))
        detail = " ".join(f"{s[:3]} {run['seconds'].get(s, 0.0):.3f}/{stages[s]:.3f}" for s in SHOWN)
        label = f"{name} (profiling run)" if name == profile else name
        print(f"    {label:56s} {want:10.3f} {got:11.3f} {got / want - 1:+7.1%}   {detail}")
        if len(run.get("rounds", ())) > 1:
            print(f"    {'':56s} {'':10s} {'':11s} {'':7s}   rounds measured: "
                  + " ".join(f"{x:.3f}" for x in run["rounds"]))
        calls = " ".join(f"{t} {run['seconds'][t]:.3f}/{ev.timeline.end[t] - ev.timeline.start[t]:.3f}"
                         for t in TASKS if t in run["seconds"])
        print(f"    {'':56s} {'':10s} {'':11s} {'':7s}   calls measured / predicted: {calls}")
    order = lambda xs: sorted(range(len(xs)), key=xs.__getitem__)  # noqa: E731
    agree = order(predicted) == order(measured)
    return ("yes" if agree else "no"), f"{max(errors):.3f}"


def real_part(path: Path, search_settings: tuple | None = None) -> tuple[int, int, str]:
    """(a) and (b): (Table 1 hits, Table 6 hits, the held-out calls' median error); none when the tables are
    not readable. ``search_settings``: the settings the planner searches (default all)."""
    try:
        app = load_appendix(path)
    except PlannerError as exc:
        print(f"(a), (b) ReaL's tables: not run: {exc}")
        return 0, 0, "n/a"
    t1, t6 = table1(app), table6(app)
    fits, median = real_held_out(app)
    real_search(app, fits, search_settings)
    return t1, t6, median


def cpu_part(args) -> tuple[str, str]:
    """(d): (rank agreement, largest error), or n/a when neither --cpu-runs nor --measured is given."""
    if not (args.cpu_runs or args.measured):
        print("(d) 4 CPU ranks: not run (pass --cpu-runs, or --measured FILE)")
        return "n/a", "n/a"
    if args.measured:
        table = json.loads(args.measured.read_text())
    else:
        print(f"(d) 4 CPU ranks: the tiny default under {len(CPU_PLANS)} placements, {args.rounds} rounds of "
              f"{args.iterations} timed iterations after {args.warmup} warm-up; machine {host.node()}, "
              f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}", flush=True)
        table = run_placements(args.iterations, args.warmup, args.rounds)
        if args.record:
            args.record.write_text(json.dumps(table, indent=1) + "\n")
    print(f"(d) 4 CPU ranks, measured {table['measured']} on {table['machine']}, {table['cores']} cores (median of "
          f"{table['iterations']} iterations after {table['warmup']} warm-up, slowest rank per stage; median of "
          f"{table.get('rounds', 1)} interleaved rounds):")
    return cpu_table(table)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real-tables", type=Path, default=TABLES,
                    help="ReaL's appendix tables (JSON in the format of the shared seed facts; default %(default)s)")
    ap.add_argument("--real-only", action="store_true", help="run (a) and (b) alone")
    ap.add_argument("--cpu-runs", action="store_true", help="run part (d): several minutes on 2 cores")
    ap.add_argument("--record", type=Path, help="with --cpu-runs: write the measured table here (JSON)")
    ap.add_argument("--measured", type=Path, help="part (d) from a table --record wrote, without running")
    ap.add_argument("--iterations", type=int, default=5, help="timed iterations per placement in (d)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations before them in (d)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="in (d), measure every placement this many times, interleaved; report the median")
    ap.add_argument("--quick", action="store_true",
                    help="a check that it runs, not a measurement: (b)'s search for 7B+7B only (not 70B+7B), (e) "
                         "searched with one option per task")
    args = ap.parse_args(argv)
    t1, t6, median = real_part(args.real_tables, ("7B+7B",) if args.quick else None)
    hf, agree, error = "n/a", "n/a", "n/a"
    if not args.real_only:
        hf = f"{hybridflow()}/2"
        inter_stage(1 if args.quick else PlacementSearchConfig.options)
        agree, error = cpu_part(args)
    print(f"planner: table1={t1}/4 table6={t6}/4 hybridflow={hf} cpu_rank_agreement={agree} max_cpu_error={error} "
          f"real_percall_median_error={median}")


if __name__ == "__main__":
    main()
