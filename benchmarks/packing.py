"""Sequence packing (--max-tokens-per-microbatch) against padded micro-batches: training and inference tokens/s.

One rank runs the trainer's inference (reference, reward model, critic) and PPO update (actor and
critic, one mini-batch) on the same fixed samples twice from the same weights: padded, in micro-batches
of ``--micro-batch-size`` samples padded to their longest, and packed, in micro-batches of at most
``micro-batch-size x (prompt + response cap)`` tokens (the padded run's largest micro-batch: the same peak
activation memory), each packed into one row. Two workloads of ``--samples`` samples: uniform (every
response at the cap) and long-tailed (lognormal response lengths of median cap / 8, rlhf.fusion.policy's
long_tailed_lengths). Tokens/s counts real tokens (prompt + response) over the stage's seconds, the median
of ``--repeats`` timed passes after one untimed one. ``max_abs_diff``: the largest difference between
the padded and packed runs' trained weights after their first (untimed) pass, over both workloads.

Usage: ``python benchmarks/packing.py [--samples 32] [--prompt-len 16] [--response-len 240]
[--micro-batch-size 8] [--repeats 3]``
Last line: ``packing: train_speedup=<x> infer_speedup=<y> max_abs_diff=<d>`` (the long-tailed workload's
speedups).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

MODEL = dict(num_layers=4, hidden_size=128, ffn_hidden_size=512, num_attention_heads=8, num_kv_heads=4,
             vocab_size=512)


def _samples(count: int, prompt_len: int, response_lens: list, vocab: int) -> list:
    """Random prompts and responses of the given lengths, as the engine reports them."""
    from rlhf.engine.types import SampleResult

    g = torch.Generator().manual_seed(7)
    out = []
    for i, r in enumerate(response_lens):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
        response = torch.randint(3, vocab, (r,), generator=g).tolist()
        out.append(SampleResult(str(i), 0, tuple(prompt), tuple(response), tuple([-1.0] * r), "length", 0.0))
    return out


def _trainer(cfg, full: dict, max_tokens, args):
    """A one-rank trainer of model shape ``cfg`` for both models, from weights ``full``."""
    from rlhf.config import RunConfig
    from rlhf.parallel import Placement
    from rlhf.ppo.config import GenerationConfig, JobConfig, ModelsConfig, PPOConfig
    from rlhf.ppo.trainer import Trainer

    config = JobConfig(models=ModelsConfig(actor=cfg, critic=cfg), run=RunConfig(iterations=1, seed=3),
                       generation=GenerationConfig(max_prompt_len=args.prompt_len, max_response_len=args.response_len),
                       ppo=PPOConfig(rollout_batch_size=args.samples, n_samples_per_prompt=1,
                                     ppo_mini_batch_size=args.samples, micro_batch_size=args.micro_batch_size,
                                     max_tokens_per_microbatch=max_tokens, lr=1e-4))
    plan = {task: {"ranks": [0]} for task in ("actor_gen", "actor_train", "critic_train", "ref_inf", "reward_inf",
                                              "critic_inf")}
    return Trainer(config, Placement.from_plan(plan, 1), prompts=None, tokenizer=None, initial_weights=full)


def run_rank(args: dict) -> dict:
    """Both workloads, padded and packed, on this one rank: tokens, seconds per timed pass by stage, and
    the largest difference of the first pass's trained weights."""
    from rlhf.batch import Batch
    from rlhf.fusion.policy import long_tailed_lengths
    from rlhf.models import ModelConfig
    from rlhf.parallel import Placement
    from rlhf.parallel.groups import build_task_groups
    from rlhf.testing.models import full_weights

    args = argparse.Namespace(**args)
    build_task_groups(Placement.from_plan({"actor_train": {"ranks": [0]}}, 1))  # the one-rank groups
    cfg = ModelConfig(**MODEL, max_seq_len=args.prompt_len + args.response_len)
    full = {"actor": full_weights("lm", cfg, 1), "critic": full_weights("value", cfg, 2),
            "reward": full_weights("value", cfg, 3)}
    workloads = {"uniform": [args.response_len] * args.samples,
                 "long-tailed": long_tailed_lengths(args.samples, random.Random(5), median=args.response_len / 8,
                                                    cap=args.response_len)}
    out = {}
    for workload, lengths in workloads.items():
        samples = _samples(args.samples, args.prompt_len, lengths, cfg.vocab_size)
        batch = Batch.from_samples(samples, pad_id=0, prompt_ids={str(i): i for i in range(len(samples))})
        budget = args.micro_batch_size * (args.prompt_len + args.response_len)
        trained = {}
        for mode, max_tokens in (("padded", None), ("packed", budget)):
            trainer = _trainer(cfg, full, max_tokens, args)
            seconds = {"inference": [], "training": []}
            for rep in range(args.repeats + 1):
                start = time.perf_counter()
                inferred = trainer.infer(batch)
                middle = time.perf_counter()
                trainer.update(trainer.advantages(inferred)[0])
                end = time.perf_counter()
                if rep:  # the first pass warms up, and its trained weights are compared
                    seconds["inference"].append(middle - start)
                    seconds["training"].append(end - middle)
                else:
                    trained[mode] = {name: {k: v.detach().clone() for k, v in trainer.models[task].state_dict().items()
                                            if torch.is_tensor(v) and v.is_floating_point()}
                                     for name, task in (("actor", "actor_train"), ("critic", "critic_train"))}
            out[(workload, mode)] = {stage: statistics.median(s) for stage, s in seconds.items()}
        out[(workload, "tokens")] = int(batch.sequence_lengths.sum())
        out[(workload, "diff")] = max((trained["packed"][m][k] - trained["padded"][m][k]).abs().max().item()
                                      for m in trained["padded"] for k in trained["padded"][m])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=32, help="samples per workload (default %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=16, help="prompt tokens of every sample (default %(default)s)")
    ap.add_argument("--response-len", type=int, default=240, help="response length cap (default %(default)s)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="samples per padded micro-batch (default "
                                                                   "%(default)s)")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per run (default %(default)s)")
    args = ap.parse_args(argv)
    from rlhf.testing.distributed import launch

    r = launch(1, "packing:run_rank", timeout_s=1800, args=vars(args))[0]
    print(f"1 rank; {args.samples} samples of {args.prompt_len} prompt tokens and responses up to "
          f"{args.response_len}; padded: micro-batches of {args.micro_batch_size} samples; packed: "
          f"{args.micro_batch_size * (args.prompt_len + args.response_len)} tokens; median of {args.repeats} passes")
    print("| workload | real tokens | stage | padded tokens/s | packed tokens/s | speedup |")
    print("|---|---|---|---|---|---|")
    speedups = {}
    for workload in ("uniform", "long-tailed"):
        tokens = r[(workload, "tokens")]
        for stage in ("training", "inference"):
            padded, packed = r[(workload, "padded")][stage], r[(workload, "packed")][stage]
            speedups[(workload, stage)] = padded / packed
            print(f"| {workload} | {tokens} | {stage} | {tokens / padded:.0f} | {tokens / packed:.0f} | "
                  f"{padded / packed:.2f} |")
    diff = max(r[(w, "diff")] for w in ("uniform", "long-tailed"))
    print(f"packing: train_speedup={speedups[('long-tailed', 'training')]:.2f} "
          f"infer_speedup={speedups[('long-tailed', 'inference')]:.2f} max_abs_diff={diff:.2e}")


if __name__ == "__main__":
    main()
