#!/usr/bin/env python
"""Plan where and how the six PPO tasks run: a ranked table of plans and the best one as a placement file.

    python tools/plan_placement.py --actor llama-7b --critic llama-7b --nodes 2 --gpus-per-node 8 \\
        --out plan.json
    python tools/plan_placement.py --actor llama-70b --critic llama-7b --nodes 16 --hardware h100
    python tools/plan_placement.py --actor tiny --critic tiny-critic --nodes 1 --gpus-per-node 4 \\
        --hardware cpu.json --placement examples/placement_4ranks.json --measured stages.json \\
        --write-hardware cpu_calibrated.json

The planner (rlhf/planner, docs/planner.md) searches model placements (which
models share ranks), GPU allocations and every task's (dp, pp, tp) over a cost
model and a list-scheduling simulation of one iteration, and prints the
fastest plans: predicted seconds per stage and per iteration, memory per GPU,
and why the pruned ones were pruned. ``--out`` writes the best plan in the
format ``pretrain_rlhf.py --placement`` reads.

A model is a planner preset (llama-7b, llama-13b, llama-34b, llama-70b: ReaL
Table 1), one of the job's presets (tiny, tiny-critic), a JSON file of
ModelConfig fields, or a Hugging Face model directory (or its config.json).

``--placement`` predicts one given plan instead of searching; with
``--measured`` (a JSON object of the trainer's stage seconds, e.g.
{"generation": 1.2, "inference": 0.4, "training": 2.0, "iteration": 3.8},
its time_<stage>_s metrics, and optionally each task call's seconds,
{"ref_inf": 0.1, ...}) it first fits the hardware file's mfu, per-layer
overhead and collective latency to that run (calibration) and
``--write-hardware`` saves them.
Bad input (a flag, a file, a plan that cannot fit) is refused with one line
naming it and exit status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from rlhf.cli import fraction_or_auto
from rlhf.cli import HelpFormatter, UsageError, check_out_path, report
from rlhf.models.config import MODEL_PRESETS, ModelConfig, ModelConfigError
from rlhf.planner.calibrate import DEFAULT_TERMS, OVERHEAD_TERMS, TERMS, calibrate
from rlhf.planner.cost import Cluster, Workload
from rlhf.planner.errors import PlannerError
from rlhf.planner.hardware import HARDWARE_PRESETS, load_hardware, save_hardware
from rlhf.planner.placement_search import PlacementSearchConfig, search_placements
from rlhf.planner.plan import STAGES, evaluate, plan_from_placement_file, stage_seconds
from rlhf.planner.shapes import LLAMA_SHAPES
from rlhf.tasks import TASKS

PROGRAM = "plan_placement.py"
MODEL_HELP = (f"a preset ({', '.join(LLAMA_SHAPES)}, {', '.join(MODEL_PRESETS)}), a JSON file of ModelConfig "
              "fields, or a Hugging Face model directory or its config.json")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROGRAM, description=__doc__, formatter_class=HelpFormatter)
    m = ap.add_argument_group("models")
    m.add_argument("--actor", required=True, metavar="MODEL", help=f"the actor: {MODEL_HELP}")
    m.add_argument("--critic", required=True, metavar="MODEL", help="the critic (same forms as --actor)")
    m.add_argument("--reference", metavar="MODEL", help="the reference model (default: the actor's shape)")
    m.add_argument("--reward", metavar="MODEL", help="the reward model (default: the critic's shape)")
    c = ap.add_argument_group("cluster")
    c.add_argument("--nodes", type=int, default=1, help="nodes")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (ranks) per node")
    c.add_argument("--hardware", default="h100",
                   help=f"a hardware preset ({', '.join(HARDWARE_PRESETS)}) or a hardware JSON file (format in "
                        "rlhf/planner/hardware.py and docs/planner.md)")
    p = ap.add_argument_group("PPO batch (the pretrain_rlhf.py flags of the same names)")
    p.add_argument("--rollout-batch-size", type=int, default=128, help="prompts per iteration")
    p.add_argument("--n-samples-per-prompt", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-prompt-len", type=int, default=512, help="prompt tokens")
    p.add_argument("--max-response-len", type=int, default=512, help="response tokens (decode steps)")
    p.add_argument("--ppo-mini-batch-size", type=int, default=128, help="samples per PPO mini-batch")
    p.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--ppo-epochs", type=int, default=1, help="passes over the samples per iteration")
    p.add_argument("--long-tail-median", type=int, default=0,
                   help="the long-tailed workload: response lengths lognormal around this median, capped at "
                        "--max-response-len (0: every response runs to --max-response-len)")
    s = ap.add_argument_group("search")
    s.add_argument("--intra-stage-fusion", action="store_true",
                   help="also try fused actor/critic training where the two share their ranks (with "
                        "--placement: the given plan runs fused)")
    s.add_argument("--inter-stage-fusion", action="store_true",
                   help="also try migrating generation's long tail and inferring on the freed ranks where all four "
                        "models share their ranks and actor_gen has dp >= 2 (with --placement: the given plan runs "
                        "fused); it gains only with --long-tail-median")
    s.add_argument("--migration-threshold", type=fraction_or_auto, default="auto", metavar="R|auto",
                   help="with --placement --inter-stage-fusion: the plan migrates at this fraction of unfinished "
                        "samples (auto: the fusion policy's choice; a search picks R per plan and prints it)")
    s.add_argument("--max-staleness", type=int, default=0, metavar="K",
                   help="also try asynchronous plans (pretrain_rlhf.py --max-staleness K: actor_gen on ranks of "
                        "its own, generating ahead of training), and say whether the best of them beats the best "
                        "synchronous one and by how much (with --placement: the given plan both ways)")
    s.add_argument("--partial-rollouts", action="store_true",
                   help="with --max-staleness K >= 2: the asynchronous plans run generation free between "
                        "iterations (pretrain_rlhf.py --partial-rollouts), so a batch's decode steps are its mean "
                        "response length, not its longest, but it has only K iterations for its longest sample "
                        "(gains with --long-tail-median)")
    s.add_argument("--options", type=int, default=PlacementSearchConfig.options,
                   help="fastest strategies kept per task (the leanest is kept too)")
    s.add_argument("--keep", type=int, default=PlacementSearchConfig.keep,
                   help="placements and allocations searched in full after the first scoring")
    s.add_argument("--proposals", type=int, default=PlacementSearchConfig.proposals,
                   help="annealing proposals per kept candidate (used when brute force would exceed "
                        "--brute-force-limit plans)")
    s.add_argument("--brute-force-limit", type=int, default=PlacementSearchConfig.brute_force_limit,
                   help="the most plans searched exhaustively")
    s.add_argument("--seed", type=int, default=0, help="seed of the annealing")
    o = ap.add_argument_group("output and calibration")
    o.add_argument("--top", type=int, default=10, help="ranked plans printed")
    o.add_argument("--show-pruned", type=int, default=5, help="pruned plans printed with their reason")
    o.add_argument("--out", type=Path, help="write the best plan here as a placement file (JSON)")
    o.add_argument("--placement", type=Path,
                   help="predict this placement file (JSON/YAML, all six tasks placed) instead of searching")
    o.add_argument("--measured", type=Path,
                   help="with --placement: a JSON object of measured stage seconds "
                        f"({', '.join(STAGES)}, iteration) and optionally task seconds ({', '.join(TASKS)}) "
                        "to calibrate the hardware file against")
    o.add_argument("--fit", default=",".join(DEFAULT_TERMS),
                   help=f"with --measured: the constants to fit, comma-separated, of {', '.join(TERMS)} (a tiny "
                        f"model on CPU: {','.join(OVERHEAD_TERMS)}) (default %(default)s)")
    o.add_argument("--write-hardware", type=Path, help="with --measured: write the calibrated hardware file here")
    return ap


def load_model(value: str, flag: str) -> ModelConfig:
    """A model shape from a preset, a JSON file of ModelConfig fields or an HF directory / config.json."""
    if value in LLAMA_SHAPES:
        return LLAMA_SHAPES[value]
    if value in MODEL_PRESETS:
        return MODEL_PRESETS[value]
    path = Path(value)
    hf_dir = path if path.is_dir() else path.parent if path.name == "config.json" else None
    try:
        if hf_dir is not None:
            from rlhf.checkpoint.hf import read_hf_config

            return read_hf_config(str(hf_dir)).config
        if path.suffix == ".json":
            return ModelConfig.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, ModelConfigError) as exc:
        raise UsageError(f"{flag} {value}: {' '.join(str(exc).split())}") from None
    raise UsageError(f"{flag} {value}: unknown model; give {MODEL_HELP}")


def check_inputs(args) -> tuple:
    """(models, workload, hardware, cluster) of the flags; UsageError naming the flag at fault."""
    for flag in ("nodes", "gpus_per_node", "rollout_batch_size", "n_samples_per_prompt", "max_prompt_len",
                 "max_response_len", "ppo_mini_batch_size", "micro_batch_size", "ppo_epochs", "options", "keep",
                 "brute_force_limit", "top"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')}: {getattr(args, flag)} must be a positive integer")
    actor, critic = load_model(args.actor, "--actor"), load_model(args.critic, "--critic")
    models = {"actor": actor, "critic": critic,
              "reference": load_model(args.reference, "--reference") if args.reference else actor,
              "reward": load_model(args.reward, "--reward") if args.reward else critic}
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if samples % args.ppo_mini_batch_size:
        raise UsageError(f"--ppo-mini-batch-size: {args.ppo_mini_batch_size} does not divide the {samples} samples "
                         "of an iteration (--rollout-batch-size x --n-samples-per-prompt)")
    if not 0 <= args.long_tail_median <= args.max_response_len:
        raise UsageError(f"--long-tail-median: {args.long_tail_median} must be in [0, --max-response-len "
                         f"{args.max_response_len}] (0: off)")
    wl = Workload(samples, args.max_prompt_len, args.max_response_len, samples // args.ppo_mini_batch_size,
                  args.micro_batch_size, args.ppo_epochs, args.long_tail_median)
    try:
        hw = load_hardware(args.hardware)
    except PlannerError as exc:
        raise UsageError(f"--hardware: {exc}") from None
    for flag in ("out", "write_hardware"):
        if getattr(args, flag) is not None:
            check_out_path(f"--{flag.replace('_', '-')}", getattr(args, flag))
    if args.max_staleness < 0:
        raise UsageError(f"--max-staleness: {args.max_staleness} must be >= 0 (0: synchronous)")
    if args.partial_rollouts and args.max_staleness < 2:
        raise UsageError(f"--partial-rollouts: needs --max-staleness >= 2 (got {args.max_staleness}): with K = 1 the "
                         "next batch cannot start before the meeting, so nothing runs beside a batch's tail")
    if args.measured and not args.placement:
        raise UsageError("--measured: needs --placement, the plan the measured run used")
    if args.migration_threshold is not None and not (args.placement and args.inter_stage_fusion):
        raise UsageError("--migration-threshold: needs --placement and --inter-stage-fusion (a search picks R per "
                         "plan)")
    if args.migration_threshold is not None and not 0 <= args.migration_threshold <= 1:
        raise UsageError(f"--migration-threshold: {args.migration_threshold} must be a fraction in [0, 1] or auto")
    return models, wl, hw, Cluster(args.nodes, args.gpus_per_node)


def placed_plan(args, cluster: Cluster):
    """``--placement`` as a plan run with the job's fusion flags; UsageError naming the file."""
    try:
        return plan_from_placement_file(args.placement, cluster, args.intra_stage_fusion, args.inter_stage_fusion,
                                        args.migration_threshold)
    except PlannerError as exc:
        raise UsageError(f"--placement {args.placement}: {exc}") from None


def print_table(ranked: list, top: int) -> None:
    print(f"{'#':>3} {'iter s':>9} {'reshard':>8} {'gen':>8} {'inf':>8} {'train':>8} {'GiB/GPU':>8}  plan")
    for i, ev in enumerate(ranked[:top], 1):
        st = stage_seconds(ev)
        cells = " ".join(f"{st.get(s, 0.0):8.2f}" for s in ("reshard", "generation", "inference", "training"))
        r = f" R={ev.migration_threshold:g}" if ev.plan.fuse_generation else ""
        print(f"{i:3d} {ev.seconds:9.2f} {cells} {ev.peak_memory / 2**30:8.1f}  {ev.plan.name}: "
              f"{ev.plan.describe()}{r}")


def run(args) -> None:
    models, wl, hw, cluster = check_inputs(args)
    try:
        if args.placement:
            plan = placed_plan(args, cluster)
            if args.measured:
                hw = calibrated(args, plan, models, wl, hw, cluster)
            ranked, pruned, how = [evaluate(plan, models, wl, hw, cluster)], [], "the given placement"
            if args.max_staleness:
                ranked.append(evaluate(replace(plan, name=f"{plan.name} async", asynchronous=True,
                                               partial_rollouts=args.partial_rollouts,
                                               max_staleness=args.max_staleness), models, wl, hw, cluster))
                ranked.sort(key=lambda ev: ev.seconds)
                how += ", synchronous and asynchronous"
        else:
            cfg = PlacementSearchConfig(options=args.options, keep=args.keep, brute_force_limit=args.brute_force_limit,
                               proposals=args.proposals, seed=args.seed, fuse_training=args.intra_stage_fusion,
                               fuse_generation=args.inter_stage_fusion, asynchronous=args.max_staleness > 0,
                               partial_rollouts=args.partial_rollouts, max_staleness=max(1, args.max_staleness))
            res = search_placements(models, wl, hw, cluster, cfg)
            ranked, pruned = res.ranked, res.pruned
            how = f"{res.method}, {res.evaluations} plans evaluated"
    except PlannerError as exc:
        raise UsageError(f"{exc}") from None
    print(f"{cluster.nodes} x {cluster.gpus_per_node} GPUs ({hw.name}); {wl.samples} samples of {wl.prompt_len} + "
          f"{wl.response_len} tokens, {wl.minibatches} mini-batches, micro-batches of {wl.micro_batch_size}; {how}")
    print_table(ranked, args.top)
    if args.max_staleness:
        print_winner(ranked)
    if pruned:
        print(f"pruned: {len(pruned)} (first {min(args.show_pruned, len(pruned))} shown)")
        for what, why in pruned[:args.show_pruned]:
            print(f"  {what}: {why}")
    if args.out:
        args.out.write_text(json.dumps(ranked[0].plan.placement(), indent=2) + "\n")
        print(f"best plan written to {args.out} (pretrain_rlhf.py --placement {args.out}"
              f"{''.join(' ' + f for f in job_flags(ranked[0], wl, args.max_staleness))})")


def print_winner(ranked: list) -> None:
    """Which of the best asynchronous and the best synchronous plan is faster, and by how much."""
    best = {mode: next((ev for ev in ranked if ev.plan.asynchronous == mode), None) for mode in (True, False)}
    if None in best.values():
        missing = "asynchronous" if best[True] is None else "synchronous"
        print(f"no {missing} plan fits (see pruned)")
        return
    fast, slow = sorted(best.values(), key=lambda ev: ev.seconds)
    modes = ("asynchronous", "synchronous") if fast.plan.asynchronous else ("synchronous", "asynchronous")
    print(f"{modes[0]} wins: {slow.seconds / fast.seconds:.2f}x the best {modes[1]} plan's iteration (steady state)")


def job_flags(ev, wl: Workload, max_staleness: int = 0) -> list[str]:
    """The pretrain_rlhf.py flags besides --placement that run ``ev``'s plan as predicted."""
    flags = ["--intra-stage-fusion"] if ev.plan.fuse_training else []
    if ev.plan.asynchronous:
        flags.append(f"--max-staleness {max_staleness}")
    if ev.plan.partial_rollouts:
        flags.append("--partial-rollouts")
    if ev.plan.fuse_generation:
        flags += ["--inter-stage-fusion", f"--migration-threshold {ev.migration_threshold:g}"]
    if wl.long_tail_median:
        flags.append(f"--long-tail-median {wl.long_tail_median}")
    return flags


def calibrated(args, plan, models, wl, hw, cluster):
    """The hardware file fitted to ``--measured`` on ``plan``; written to ``--write-hardware`` if given."""
    terms = tuple(t.strip() for t in args.fit.split(","))
    wrong = [t for t in terms if t not in TERMS]
    if wrong:
        raise UsageError(f"--fit: cannot fit {', '.join(wrong)}; give some of {', '.join(TERMS)}")
    try:
        measured = json.loads(args.measured.read_text())
        if not isinstance(measured, dict):
            raise ValueError("expected a JSON object of stage seconds")
        hw = calibrate(hw, plan, models, wl, cluster, measured, terms)
    except (OSError, ValueError, PlannerError) as exc:
        raise UsageError(f"--measured {args.measured}: {' '.join(str(exc).split())}") from None
    print("calibrated: " + ", ".join(f"{k} {getattr(hw, k):.4g}" for k in terms + ("host_s",)))
    if args.write_hardware:
        save_hardware(hw, args.write_hardware)
        print(f"hardware file written to {args.write_hardware}")
    return hw


def main(argv=None) -> int:
    try:
        run(build_parser().parse_args(argv))
    except UsageError as exc:
        return report(PROGRAM, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
