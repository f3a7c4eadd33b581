"""Memory per rank: what the job measures against what the planner predicts, on CPU placements.

For each case (a world size and ``pretrain_rlhf.py`` flags) the job runs in-process on gloo ranks
(``rlhf.testing.distributed.launch``, ``rlhf.ppo.job.build_trainer``) for ``--iterations`` iterations;
each rank reports the parts ``StageMemory`` measured in the last one's training stage (parameters of
every model resident, KV cache, gradient buffers, optimizer state, activations saved for backward:
docs/training.md, "Memory per rank"). Beside it, ``rlhf.ppo.memory_plan.predicted_memory`` (the planner's
model, rlhf/planner/cost.py ``task_memory``, at the job's precision) for the same placement. It prints,
per case and part, the heaviest rank's measured and predicted bytes and their ratio, then the same for
each rank's total; docs/planner.md, "Memory: predicted against measured", has a run.

    python benchmarks/memory.py [--iterations 1] [--smollm2] [--bf16] [--no-tiny] [--quick]

``--smollm2`` adds SmolLM2-135M's shape (random weights) on 1, 2 and 4 ranks; ``--bf16`` runs every
case in bf16; ``--no-tiny`` leaves the tiny default's cases out. ``--quick`` (a check that it runs, not
a measurement) runs the tiny default's cases with SMALL_BATCH's flags, as the SmolLM2 cases run: 4
prompts x 2 samples, and the synthetic task's gold rule as the reward instead of a reward model
trained at start-up (so no reward model is resident). The last line is the summary,
e.g. ``memory: predicted / measured total per rank 0.99-1.01 over 4 placements``.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

SMOLLM2_SHAPE = {"num_layers": 30, "hidden_size": 576, "ffn_hidden_size": 1536, "num_attention_heads": 9,
                 "num_kv_heads": 3, "vocab_size": 49152, "max_seq_len": 8192, "rope_theta": 100000.0,
                 "norm_eps": 1e-5, "tie_embeddings": True}
"""SmolLM2-135M's config.json in ModelConfig fields (docs/real_model.md)."""
SMALL_BATCH = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--ppo-mini-batch-size", "8",
               "--micro-batch-size", "2", "--reward-fn", "rlhf.data.synthetic:gold_reward"]


SMOLLM2_4_RANKS = ["--actor-train", "tp=1,pp=2,dp=2", "--actor-gen", "tp=1,dp=4", "--critic-inf", "tp=1,dp=4"]
"""The built-in 4-rank plan with tp 1 wherever it has 2: SmolLM2's 9 heads admit no tp=2."""


def cases(tiny: bool, smollm2: bool, precision: list, quick: bool = False) -> list:
    """(name, world size, flags) of the placements compared, each run with the ``precision`` flags
    (and SMALL_BATCH's with ``quick``)."""
    out, small = [], (SMALL_BATCH if quick else [])
    if tiny:
        label = ", small batch, gold reward" if quick else ""
        out += [(f"tiny{label}, built-in 4-rank plan", 4, [*small]),
                (f"tiny{label}, 2 ranks data parallel", 2, [*small]),
                (f"tiny{label}, 1 rank, full recompute", 1, ["--recompute-granularity", "full", *small])]
    if smollm2:
        shape = Path(tempfile.mkdtemp(prefix="memory_bench_")) / "smollm2.json"
        shape.write_text(json.dumps(SMOLLM2_SHAPE))
        models = ["--actor-model", str(shape), "--critic-model", str(shape), *SMALL_BATCH]
        out += [("SmolLM2-135M shape, 1 rank", 1, models),
                ("SmolLM2-135M shape, 2 ranks data parallel", 2, models),
                ("SmolLM2-135M shape, 4 ranks (actor PP2xDP2, critic PP2xDP2 reversed)", 4,
                 [*models, *SMOLLM2_4_RANKS])]
    return [(f"{name}{', ' + ' '.join(precision) if precision else ''}", world, [*flags, *precision])
            for name, world, flags in out]


# -- on every rank -------------------------------------------------------------------
def measure(job_flags: list, iterations: int) -> dict:
    """This rank's measured training-stage parts after ``iterations`` iterations (collective)."""
    import torch.distributed as dist

    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.job import build_trainer
    from rlhf.ppo.layout import build_placement

    config = parse_args(job_flags)
    trainer = build_trainer(config, build_placement(config, dist.get_world_size()))
    for _ in range(iterations):
        trainer.step()
    return dict(trainer.memory.last_parts["training"])


# -- in the launching process --------------------------------------------------------
def compare(name: str, world: int, flags: list, iterations: int) -> float:
    """Print one case's parts; returns its predicted / measured total on the heaviest rank."""
    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.dry_run import short_bytes
    from rlhf.ppo.memory_plan import predicted_memory
    from rlhf.ppo.layout import build_placement
    from rlhf.testing.distributed import launch

    config = parse_args(flags)
    predicted = predicted_memory(config, build_placement(config, world))
    measured = dict(enumerate(launch(world, "memory:measure", timeout_s=1200, job_flags=flags,
                                     iterations=iterations)))
    print(f"{name} ({world} rank{'s' * (world > 1)}): heaviest rank, measured / predicted")
    for part in ("parameters", "gradients", "optimizer", "activations", "kv"):
        got, want = max(m[part] for m in measured.values()), max(p[part] for p in predicted.values())
        ratio = f"{want / got:5.2f}" if got else "    -"
        print(f"    {part:12s} {short_bytes(got):>11s} {short_bytes(want):>11s}  {ratio}")
    got = max(sum(m.values()) for m in measured.values())
    want = max(sum(p.values()) for p in predicted.values())
    print(f"    {'total':12s} {short_bytes(got):>11s} {short_bytes(want):>11s}  {want / got:5.2f}")
    return want / got


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=1)
    parser.add_argument("--smollm2", action="store_true", help="add SmolLM2-135M's shape on 1, 2 and 4 ranks")
    parser.add_argument("--no-tiny", dest="tiny", action="store_false", help="leave out the tiny default's cases")
    parser.add_argument("--bf16", action="store_true", help="run every case with --bf16 (docs/precision.md)")
    parser.add_argument("--quick", action="store_true",
                        help="a check that it runs, not a measurement: the tiny cases with 4 prompts x 2 samples "
                             "and the gold rule as the reward (no reward model trained at start-up), as the "
                             "SmolLM2 cases run")
    args = parser.parse_args(argv)
    precision = ["--bf16"] if args.bf16 else []
    ratios = [compare(name, world, flags, args.iterations)
              for name, world, flags in cases(args.tiny, args.smollm2, precision, args.quick)]
    print(f"memory: predicted / measured total per rank {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} "
          "placements")


if __name__ == "__main__":
    main()
