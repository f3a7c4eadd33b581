"""verl's published fully-async setting (Qwen2.5-Math-7B, DAPO, 128 H20) simulated with the planner.

What: verl's docs/advance/fully_async.md ("Asynchronous Training on 7B Model") reports, on 128 GPUs, a
colocated synchronous step of 356.30 s (generation 177.85 s, old_log_prob 53.92 s, update_actor 113.81 s)
against 150.63 s for fully_async_policy on 64:64 GPUs (rollout:trainer; staleness_threshold 0.5,
partial_rollout True): 2.35x-2.67x in total time. This script predicts both with the planner
(rlhf/planner, docs/planner.md) and prints them beside the published numbers.

How: one iteration of 512 prompts x 16 samples = 8192 samples of 512 prompt tokens and up to 28672 response
tokens, trained in 16 mini-batches of 512 samples (32 prompts), one sample per micro-batch. Three plans,
each evaluated on a few fixed (dp, pp, tp) layouts, the fastest that fits a GPU kept:

- sync: every task on all 128 GPUs (16 nodes x 8);
- async lockstep: actor_gen alone on GPUs 0-63, everything else on 64-127, ``Plan(asynchronous=True)``
  (steady state: max(generation, learning) + the meeting);
- async partial: the same with ``partial_rollouts=True`` and ``max_staleness`` K (a batch decodes for its
  mean response length, but an iteration lasts at least 1/K of the lockstep batch: K iterations for its
  longest sample).

Three workloads: the long tail (the main row), uniform full-length responses (contrast), and the long tail
with training on packed sequences (our extension: actor_train timed at the mean response length).

Assumptions (ours, not verl's):

- H20: the h100 preset with gpu_flops 148e12 (dense bf16), hbm_bandwidth 4.0e12, gpu_memory 96 GiB; its
  links (NVLink 450e9 B/s per direction, network 50e9 B/s per GPU), mfu and hbm_efficiency kept.
- Qwen2.5-Math-7B has Qwen2.5-7B's shape: 28 layers, hidden 3584, ffn 18944, 28 heads, 4 KV heads,
  vocab 152064, QKV bias, untied embeddings (7.62e9 parameters).
- DAPO has no critic, reward model or reference: those models get the tiny presets (MODEL_PRESETS "tiny",
  "tiny-critic") and their calls (ref_inf, reward_inf, critic_inf, critic_train) 0 s through
  ``evaluate(..., durations=...)``. The rule-based reward is free. verl's synchronous old_log_prob pass
  (53.92 s, an actor forward) is not modelled; its asynchronous run uses the rollout's log-probs.
- Prompts are 512 tokens. Response lengths are the planner's lognormal (``Workload.long_tail_median``) with
  median 28672 // 8 = 3584 and sigma 0.8, capped at 28672. The planner uses the lengths for generation
  only: training and inference run every sample at full length (padding), except in the packed row.
- The planner counts generation's KV cache for the whole batch at full length. That is 8192 x 29184 tokens
  x 56 KiB over the generation GPUs, whatever the layout: it does not fit in 96 GiB. The timings assume
  it does, as vLLM's paged cache holds only running responses. A layout is kept when it fits without that
  KV; the table shows both.
- K = 2 (``--max-staleness``): the smallest K at which samples span updates. verl's staleness_threshold 0.5
  bounds the share of stale samples, not a sample's versions, so it has no exact K.

RLHFuse's 13B/33B long-tail setting is not simulated: its published table is not among the seed facts
(``--seed-facts``), and no number is invented for it.

Usage: ``python benchmarks/async_published.py [--prompt-len 512] [--response-len 28672] [--median 3584]
[--rollout-gpus 64] [--max-staleness 2] [--mfu 0.45] [--hbm-efficiency 0.6] [--seed-facts DIR]``
Last line: ``async_published: verl_sync_s=<x> verl_async_s=<y> simulated_speedup=<x/y> lockstep_speedup=<l>
packed_speedup=<p> published_sync_s=356.30 published_async_s=150.63 published_speedup=2.35-2.67``
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from rlhf.models.config import MODEL_PRESETS, ModelConfig
from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.planner import fused_generation
from rlhf.planner.cost import Cluster, Workload
from rlhf.planner.hardware import GiB, HARDWARE_PRESETS, Hardware
from rlhf.planner.plan import Plan, cached_cost, evaluate, memory_per_rank

PUBLISHED = {"sync_s": 356.30, "sync_gen_s": 177.85, "sync_old_log_prob_s": 53.92, "sync_update_s": 113.81,
             "async_s": 150.63, "async_gen_s": 33.14, "async_update_s": 113.16, "speedup": "2.35-2.67"}
"""verl docs/advance/fully_async.md, 128 H20: colocate sync and fully_async_policy 64:64, seconds per step."""
GPUS, GPUS_PER_NODE = 128, 8
PROMPTS, SAMPLES_PER_PROMPT, MINI_BATCH_PROMPTS = 512, 16, 32
ABSENT = ("ref_inf", "reward_inf", "critic_inf", "critic_train")
"""DAPO's missing calls: no reference, reward model or critic."""
GEN_TP = (1, 2, 4, 8)
TRAIN_PP_TP = ((1, 2), (1, 4), (1, 8), (2, 4))
MODES = (("sync", False, False), ("async lockstep", True, False), ("async partial", True, True))
QWEN25_7B = ModelConfig(num_layers=28, hidden_size=3584, ffn_hidden_size=18944, num_attention_heads=28,
                        num_kv_heads=4, vocab_size=152064, max_seq_len=32768, qkv_bias=True)
SEED_FACTS = Path(__file__).resolve().parents[2] / "shared" / "seed-facts"


def h20(mfu: float = 0.45, hbm_efficiency: float = 0.6) -> Hardware:
    """Our H20: the h100 preset with H20's dense bf16 peak, HBM bandwidth and memory."""
    return replace(HARDWARE_PRESETS["h100"], name="h20", gpu_flops=148e12, hbm_bandwidth=4.0e12,
                   gpu_memory=96 * GiB, mfu=mfu, hbm_efficiency=hbm_efficiency)


def dapo_models() -> dict:
    """The actor's shape, and tiny stand-ins for the models DAPO does not have."""
    return {"actor": QWEN25_7B, "reference": MODEL_PRESETS["tiny"], "critic": MODEL_PRESETS["tiny-critic"],
            "reward": MODEL_PRESETS["tiny-critic"]}


def verl_workload(prompt_len: int = 512, response_len: int = 28672, median: int = 28672 // 8) -> Workload:
    """One verl step: 512 prompts x 16 samples, 16 mini-batches of 32 prompts, one sample per micro-batch."""
    samples = PROMPTS * SAMPLES_PER_PROMPT
    return Workload(samples=samples, prompt_len=prompt_len, response_len=response_len,
                    minibatches=samples // (MINI_BATCH_PROMPTS * SAMPLES_PER_PROMPT), micro_batch_size=1,
                    long_tail_median=median)


def mean_response_len(wl: Workload) -> float:
    """The mean of the response lengths the planner draws for ``wl``."""
    lengths = fused_generation.workload_lengths(wl).lengths
    return sum(lengths) / len(lengths)


def candidates(gen_ranks: range, learn_ranks: range, minibatch: int) -> list[dict]:
    """Meshes of every (generation tp, training (pp, tp)) tried: actor_gen on ``gen_ranks``, actor_train and
    the absent tasks (dp over all) on ``learn_ranks``."""
    out = []
    n_gen, n_learn = len(gen_ranks), len(learn_ranks)
    for gen_tp in (t for t in GEN_TP if n_gen % t == 0):
        for pp, tp in TRAIN_PP_TP:
            dp = n_learn // (pp * tp)
            if n_learn % (pp * tp) or minibatch % dp:
                continue
            meshes = {"actor_gen": TaskMesh("actor_gen", tuple(gen_ranks), ParallelStrategy(dp=n_gen // gen_tp,
                                                                                            tp=gen_tp)),
                      "actor_train": TaskMesh("actor_train", tuple(learn_ranks), ParallelStrategy(dp, pp, tp))}
            out.append(meshes | {t: TaskMesh(t, tuple(learn_ranks), ParallelStrategy(dp=n_learn)) for t in ABSENT})
    return out


def peak_without_kv(ev) -> float:
    """The plan's peak bytes per GPU with generation's KV cache left out."""
    costs = {t: replace(c, transient_bytes=c.transient_bytes - c.memory["kv"]) for t, c in ev.costs.items()}
    return max(memory_per_rank(ev.plan, costs).values())


def choose(mode: tuple, layouts: list[dict], wl: Workload, hw: Hardware, packed: Workload | None,
           max_staleness: int) -> tuple:
    """The fastest of ``layouts`` under ``mode`` that fits without generation's KV (else the fastest), and
    the layouts refused for memory as (description, GiB). ``packed``: time actor_train on that workload."""
    name, asynchronous, partial = mode
    models, cluster = dapo_models(), Cluster(GPUS // GPUS_PER_NODE, GPUS_PER_NODE)
    limit = hw.gpu_memory * hw.memory_headroom
    fitting, others, refused = [], [], []
    for meshes in layouts:
        durations = dict.fromkeys(ABSENT, 0.0)
        if packed is not None:
            durations["actor_train"] = cached_cost("actor_train", QWEN25_7B, "lm", meshes["actor_train"], packed,
                                                   hw, cluster).seconds
        plan = Plan(name, meshes, asynchronous=asynchronous, partial_rollouts=partial,
                    max_staleness=max_staleness)
        ev = evaluate(plan, models, wl, hw, cluster, durations)
        peak = peak_without_kv(ev)
        if peak <= limit:
            fitting.append(ev)
        else:
            others.append(ev)
            refused.append((layout(ev), peak / GiB))
    best = min(fitting or others, key=lambda e: e.seconds)
    return best, refused


def layout(ev) -> str:
    """Generation's and training's ranks and strategies."""
    parts = []
    for task in ("actor_gen", "actor_train"):
        mesh = ev.plan.meshes[task]
        parts.append(f"{task.split('_')[1]} {mesh.ranks[0]}-{mesh.ranks[-1]} {mesh.strategy}")
    return ", ".join(parts)


def _short(s: ParallelStrategy) -> str:
    """``dp16xtp8``: the strategy without pp when it is 1."""
    return f"dp{s.dp}" + (f"xpp{s.pp}" if s.pp > 1 else "") + f"xtp{s.tp}"


def _span(ev, call: str) -> float:
    return ev.timeline.end[call] - ev.timeline.start[call]


def _published(mode: str) -> tuple:
    """(published s/step, published speedup) beside a mode; lockstep (staleness without partial rollouts)
    has no published time."""
    return {"sync": (PUBLISHED["sync_s"], 1.0), "async lockstep": (None, None),
            "async partial": (PUBLISHED["async_s"], PUBLISHED["sync_s"] / PUBLISHED["async_s"])}[mode]


def _row(workload: str, mode: str, gpus: str, ev, sync_s: float, hw: Hardware) -> dict:
    """One table row: the plan's layout, seconds, speedup over ``sync_s``, memory, the published numbers."""
    published_s, published_speedup = _published(mode)
    return {"workload": workload, "mode": mode, "gpus": gpus, "layout": layout(ev),
            "strategies": " / ".join(_short(ev.plan.meshes[t].strategy) for t in ("actor_gen", "actor_train")),
            "generation_s": _span(ev, "actor_gen"), "training_s": _span(ev, "actor_train"),
            "iteration_s": ev.seconds, "speedup": sync_s / ev.seconds,
            "memory_gib": peak_without_kv(ev) / GiB, "peak_gib": ev.peak_memory / GiB,
            "kv_gib": ev.costs["actor_gen"].memory["kv"] / GiB,
            "fits": ev.peak_memory <= hw.gpu_memory * hw.memory_headroom,
            "published_s": published_s, "published_speedup": published_speedup}


def published_rows(prompt_len: int = 512, response_len: int = 28672, median: int = 28672 // 8,
                   rollout_gpus: int = 64, max_staleness: int = 2, mfu: float = 0.45,
                   hbm_efficiency: float = 0.6) -> list[dict]:
    """One dict per (workload, mode): the chosen layout, its simulated seconds and memory, the speedup over
    the same workload's sync plan, and the published numbers beside it (see the module docstring)."""
    hw = h20(mfu, hbm_efficiency)
    tail = verl_workload(prompt_len, response_len, median)
    uniform = replace(tail, long_tail_median=0)
    packed = replace(tail, response_len=round(mean_response_len(tail)), long_tail_median=0)
    workloads = [("long tail", tail, None), ("uniform", uniform, None), ("long tail, packed", tail, packed)]
    minibatch = tail.samples // tail.minibatches
    layouts = {"sync": candidates(range(GPUS), range(GPUS), minibatch),
               "async": candidates(range(rollout_gpus), range(rollout_gpus, GPUS), minibatch)}
    if not layouts["async"]:
        raise ValueError(f"no tried layout of the {GPUS - rollout_gpus} learner GPUs has a dp dividing the "
                         f"mini-batch of {minibatch} samples (the job's rule); give other --rollout-gpus")
    rows = []
    for label, wl, train_wl in workloads:
        sync_s = None
        for mode in MODES:
            ev, refused = choose(mode, layouts[mode[0].split()[0]], wl, hw, train_wl, max_staleness)
            sync_s = sync_s or ev.seconds
            gpus = str(GPUS) if mode[0] == "sync" else f"{rollout_gpus}:{GPUS - rollout_gpus}"
            rows.append(_row(label, mode[0], gpus, ev, sync_s, hw) | {
                "refused": refused, "max_staleness": max_staleness, "median": median, "mean_len": packed.response_len})
    return rows


def table(rows: list[dict]) -> list[str]:
    """The rows as a markdown table (lines under 120 characters)."""
    out = ["| workload | plan (GPUs) | gen / train | gen s | train s | s/iter | speedup | GiB (+KV) | "
           "published s | published x |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pub_s = "-" if r["published_s"] is None else f"{r['published_s']:.2f}"
        pub_x = "-" if r["published_speedup"] is None else f"{r['published_speedup']:.2f}"
        k = f", K={r['max_staleness']}" if r["mode"] == "async partial" else ""
        out.append(f"| {r['workload']} | {r['mode'].removeprefix('async ')} ({r['gpus']}{k}) | {r['strategies']} | "
                   f"{r['generation_s']:.0f} | {r['training_s']:.0f} | {r['iteration_s']:.0f} | {r['speedup']:.2f} | "
                   f"{r['memory_gib']:.0f} ({r['peak_gib']:.0f}) | {pub_s} | {pub_x} |")
    return out


def winners(rows: list[dict]) -> list[str]:
    """Per workload: the fastest plan and its margin over the runner-up."""
    out = []
    for label in dict.fromkeys(r["workload"] for r in rows):
        mine = sorted((r for r in rows if r["workload"] == label), key=lambda r: r["iteration_s"])
        out.append(f"- {label}: {mine[0]['mode']} wins, {mine[1]['iteration_s'] / mine[0]['iteration_s']:.2f}x "
                   f"the next ({mine[1]['mode']})")
    return out


def rlhfuse_line(seed_facts: Path) -> str:
    """Whether RLHFuse's long-tail table is among the seed facts (it is never simulated here)."""
    found = [p.name for p in seed_facts.glob("*") if "rlhfuse" in p.name.lower()] if seed_facts.is_dir() else []
    if found:
        return f"RLHFuse 13B/33B long tail: {', '.join(found)} in {seed_facts}, not read by this script; not simulated"
    return (f"RLHFuse 13B/33B long tail: its published table is missing from the seed facts ({seed_facts}); "
            "that row is not simulated")


def notes(rows: list[dict], hw: Hardware) -> list[str]:
    """Memory: what the generation KV and the refused layouts need against a GPU's usable bytes."""
    limit = hw.gpu_memory * hw.memory_headroom / GiB
    kv = {r["gpus"]: r["kv_gib"] for r in rows}
    out = [f"memory: a GPU may use {limit:.1f} GiB; generation's KV (whole batch, full length) needs "
           + ", ".join(f"{v:.1f} GiB per GPU on {k}" for k, v in kv.items())
           + " on every layout; timings assume it fits (paged KV holds running responses only)"]
    refused = {name: gib for r in rows for name, gib in r["refused"]}
    if refused:
        name, gib = max(refused.items(), key=lambda kv: kv[1])
        out.append(f"refused for memory without the KV: {len(refused)} layouts, e.g. {name}: {gib:.1f} GiB")
    if not all(r["fits"] for r in rows):
        out.append("no plan fits with the KV counted: the table is what the planner predicts if it did")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Assumptions and the rows: see the module docstring.")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per sample (verl does not say; "
                                                                  "default %(default)s)")
    ap.add_argument("--response-len", type=int, default=28672, help="max_response_length, the decode steps of "
                                                                      "the longest response (default %(default)s)")
    ap.add_argument("--median", type=int, default=None, help="median of the lognormal response lengths "
                                                             "(default: --response-len // 8)")
    ap.add_argument("--rollout-gpus", type=int, default=64, help="GPUs of generation alone in the asynchronous "
                                                                 "plans, whole nodes; the rest train "
                                                                 "(default %(default)s, verl's 64:64)")
    ap.add_argument("--max-staleness", type=int, default=2, help="K of the asynchronous plans: with partial "
                                                                   "rollouts a batch has K iterations for its "
                                                                   "longest sample (default %(default)s)")
    ap.add_argument("--mfu", type=float, default=0.45, help="fraction of the bf16 peak training, inference and "
                                                            "prefill reach (default %(default)s)")
    ap.add_argument("--hbm-efficiency", type=float, default=0.6, help="fraction of the HBM bandwidth a decode "
                                                                      "step reaches (default %(default)s)")
    ap.add_argument("--seed-facts", type=Path, default=SEED_FACTS, help="folder of the papers' published tables, "
                                                                        "checked for RLHFuse's (default "
                                                                        "%(default)s)")
    args = ap.parse_args(argv)
    median = args.response_len // 8 if args.median is None else args.median
    if args.prompt_len < 1 or args.response_len < 1 or not 1 <= median <= args.response_len:
        ap.error(f"--prompt-len and --response-len must be >= 1 and --median in [1, {args.response_len}]")
    if args.rollout_gpus % GPUS_PER_NODE or not 0 < args.rollout_gpus < GPUS:
        ap.error(f"--rollout-gpus {args.rollout_gpus} must be whole nodes of {GPUS_PER_NODE} in (0, {GPUS})")
    if args.max_staleness < 1:
        ap.error(f"--max-staleness {args.max_staleness} must be >= 1")
    if not (0 < args.mfu <= 1 and 0 < args.hbm_efficiency <= 1):
        ap.error("--mfu and --hbm-efficiency must be fractions in (0, 1]")
    try:
        rows = published_rows(args.prompt_len, args.response_len, median, args.rollout_gpus, args.max_staleness,
                              args.mfu, args.hbm_efficiency)
    except ValueError as exc:
        ap.error(str(exc))
    hw = h20(args.mfu, args.hbm_efficiency)
    print(f"verl fully async, Qwen2.5-Math-7B DAPO on {GPUS} H20 (ours: {hw.gpu_flops / 1e12:.0f} TFLOP/s bf16, "
          f"{hw.hbm_bandwidth / 1e12:.1f} TB/s, {hw.gpu_memory / GiB:.0f} GiB, mfu {hw.mfu}, hbm {hw.hbm_efficiency}); "
          f"{PROMPTS * SAMPLES_PER_PROMPT} samples of {args.prompt_len} + <= {args.response_len} tokens, "
          f"16 mini-batches")
    print(f"long tail: lognormal lengths, median {median}; uniform: all {args.response_len}; packed: training "
          f"at the mean length {rows[0]['mean_len']}; speedup: the workload's sync s over the row's; GiB: per GPU "
          "without generation's KV (with it)")
    print("\n".join(table(rows)))
    print(f"published (verl, 128 H20): sync {PUBLISHED['sync_s']:.2f} s/step = gen {PUBLISHED['sync_gen_s']} + "
          f"old_log_prob {PUBLISHED['sync_old_log_prob_s']} + update_actor {PUBLISHED['sync_update_s']}; "
          f"fully async 64:64 {PUBLISHED['async_s']} s/step (gen {PUBLISHED['async_gen_s']}, update_actor "
          f"{PUBLISHED['async_update_s']}), {PUBLISHED['speedup']}x in total time")
    print("where each wins (simulated):")
    print("\n".join(winners(rows)))
    print("\n".join(notes(rows, hw)))
    print(rlhfuse_line(args.seed_facts))
    main_rows = {r["mode"]: r for r in rows if r["workload"] == rows[0]["workload"]}
    packed = {r["mode"]: r for r in rows if "packed" in r["workload"]}
    sync_s, async_s = main_rows["sync"]["iteration_s"], main_rows["async partial"]["iteration_s"]
    print(f"async_published: verl_sync_s={sync_s:.1f} verl_async_s={async_s:.1f} "
          f"simulated_speedup={sync_s / async_s:.2f} lockstep_speedup={main_rows['async lockstep']['speedup']:.2f} "
          f"packed_speedup={packed['async partial']['speedup']:.2f} published_sync_s={PUBLISHED['sync_s']:.2f} "
          f"published_async_s={PUBLISHED['async_s']:.2f} published_speedup={PUBLISHED['speedup']}")


if __name__ == "__main__":
    main()
