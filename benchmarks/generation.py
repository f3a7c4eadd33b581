"""Generation throughput and KV memory: our engine vs HF generate, side by side in one run.

One model (a random 4-layer, hidden-256 Llama, converted to ours so both
systems hold the same weights) and one long-tailed workload: most samples
want few new tokens, a few want the maximum. Lengths are forced per sample
(``max_new_tokens``, no stop tokens), so every system produces exactly the
same useful tokens; tokens/s counts those useful tokens only.

  1. transformers ``generate``, static batches of B (a batch runs until its
     longest sample is done; left padding for the prompts).
  2. our engine with continuous batching off (static batches of B).
  3. our engine with continuous batching (at most B running sequences).
  4. KV memory for one prompt with n=8 samples, prefix sharing on vs off.

    python benchmarks/generation.py [--samples 128] [--batch 16] [--threads 1] [--repeats 3]

The machine may be shared: each system runs ``--repeats`` times, interleaved,
and the fastest run of each is reported (noise only ever adds time). Small
values of the flags (e.g. ``--samples 8 --batch 4 --long 16 --repeats 1``) make
a quick check that it runs.

The last line is the summary: ``generation: tokens_per_s=<continuous batching>
vs_hf=<x>x vs_static=<y>x kv_sharing=<z>x`` (z: KV bytes without prefix sharing
over with it).
"""
from __future__ import annotations

import argparse
import os
import platform as host
import tempfile
import time

import torch

from rlhf import platform
from rlhf.engine import Engine, EngineConfig, Request, SamplingParams
from rlhf.models import ModelConfig

CFG = ModelConfig(num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=4, num_kv_heads=2,
                  vocab_size=2048, max_seq_len=512)


def workload(samples: int, long_len: int, seed: int = 0):
    """(prompt, max_new_tokens) pairs: ~90% want 8-48 tokens, ~10% want ``long_len``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(samples):
        prompt = torch.randint(3, CFG.vocab_size, (int(torch.randint(16, 48, (1,), generator=g)),), generator=g)
        new = long_len if i % 10 == 9 else int(torch.randint(8, 48, (1,), generator=g))
        out.append((prompt.tolist(), new))
    order = torch.randperm(samples, generator=g).tolist()
    return [out[i] for i in order]


def build_models(out_dir: str):
    """A random HF Llama and our megatron model with the same weights (via rlhf.checkpoint.hf)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.checkpoint.hf import load_hf_weights
    from rlhf.models.gpt import build_model
    from rlhf.parallel import Placement
    from rlhf.parallel.groups import build_task_groups, local_groups

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size, intermediate_size=CFG.ffn_hidden_size,
        num_hidden_layers=CFG.num_layers, num_attention_heads=CFG.num_attention_heads,
        num_key_value_heads=CFG.num_kv_heads, max_position_embeddings=CFG.max_seq_len,
        rms_norm_eps=CFG.norm_eps, tie_word_embeddings=False)).eval()
    hf.save_pretrained(out_dir, safe_serialization=True)
    platform.init_distributed()
    build_task_groups(Placement.from_plan({}, 1))
    groups = local_groups()
    ours = build_model(CFG, "lm", groups.pg_collection, groups.stage, seed=0)
    load_hf_weights(ours, groups, out_dir)
    return hf, ours, groups


@torch.no_grad()
def run_hf(hf, work, batch: int) -> tuple[float, int]:
    """Static batches through HF generate; returns (seconds, useful tokens)."""
    start, useful = time.perf_counter(), 0
    for i in range(0, len(work), batch):
        chunk = work[i:i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        new = max(n for _, n in chunk)
        out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                          pad_token_id=0)
        assert out.shape[1] == width + new
        useful += sum(n for _, n in chunk)
    return time.perf_counter() - start, useful


def run_engine(model, groups, work, batch: int, continuous: bool) -> tuple[float, int, Engine]:
    """All samples through our engine; returns (seconds, generated tokens, engine)."""
    cfg = EngineConfig(num_blocks=2048, block_size=16, max_tokens_per_step=2048, max_num_seqs=batch,
                       continuous_batching=continuous)
    engine = Engine(model, groups, CFG, cfg)
    reqs = [Request(f"q{i}", p, SamplingParams(max_new_tokens=n)) for i, (p, n) in enumerate(work)]
    start = time.perf_counter()
    results = engine.generate(reqs)
    seconds = time.perf_counter() - start
    assert [len(r.tokens) for r in results] == [n for _, n in work], "every sample must do the forced work"
    return seconds, sum(len(r.tokens) for r in results), engine


def kv_memory(model, groups, prompt_len: int = 100, new: int = 64) -> dict[bool, int]:
    """Peak KV bytes for one prompt with n=8 samples, prefix sharing on / off."""
    out = {}
    for share in (True, False):
        engine = Engine(model, groups, CFG, EngineConfig(num_blocks=512, block_size=16, prefix_sharing=share))
        params = SamplingParams(max_new_tokens=new, temperature=1.0, n=8, seed=1)
        engine.generate([Request("p", list(range(3, 3 + prompt_len)), params)])
        out[share] = engine.stats.peak_blocks_used * engine.decoder.kv_bytes_per_block()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=128, help="workload size (default %(default)s)")
    ap.add_argument("--batch", type=int, default=16,
                    help="static batch size, and the engine's max running sequences (default %(default)s)")
    ap.add_argument("--long", type=int, default=256,
                    help="max_new_tokens of the long-tail samples, every 10th (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="interleaved runs per system, the fastest is reported (default %(default)s)")
    args = ap.parse_args()
    for flag in ("samples", "batch", "long", "threads", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} {getattr(args, flag)} must be >= 1")
    torch.set_num_threads(args.threads)
    work = workload(args.samples, args.long)
    with tempfile.TemporaryDirectory() as d:
        hf, ours, groups = build_models(d)
    run_engine(ours, groups, work[:4], 4, True)  # warm-up
    t_hf = t_static = t_cb = float("inf")
    for _ in range(args.repeats):
        t, tok_hf = run_hf(hf, work, args.batch)
        t_hf = min(t_hf, t)
        t, tok_static, _ = run_engine(ours, groups, work, args.batch, continuous=False)
        t_static = min(t_static, t)
        t, tok_cb, engine = run_engine(ours, groups, work, args.batch, continuous=True)
        t_cb = min(t_cb, t)
    assert tok_hf == tok_static == tok_cb
    mem = kv_memory(ours, groups)
    rate = {k: tok_cb / t for k, t in (("hf", t_hf), ("static", t_static), ("cb", t_cb))}
    lens = sorted(n for _, n in work)
    print(f"machine: {host.processor() or host.machine()}, {os.cpu_count()} cpus, torch threads {args.threads}, "
          f"torch {torch.__version__}")
    print(f"model: {CFG.num_layers} layers, hidden {CFG.hidden_size}, vocab {CFG.vocab_size}; workload: "
          f"{len(work)} samples, new tokens median {lens[len(lens) // 2]}, max {lens[-1]}, total {tok_cb}; "
          f"batch {args.batch}; best of {args.repeats} runs each")
    print(f"{'system':38s} {'seconds':>8s} {'tokens/s':>9s}")
    for name, key, t in (("HF generate (static batches)", "hf", t_hf),
                         ("engine, continuous batching off", "static", t_static),
                         ("engine, continuous batching", "cb", t_cb)):
        print(f"{name:38s} {t:8.2f} {rate[key]:9.1f}")
    print(f"speed-up vs HF generate:          {rate['cb'] / rate['hf']:.2f}x  (target >= 3x)")
    print(f"speed-up from continuous batching: {rate['cb'] / rate['static']:.2f}x  (target >= 1.5x)")
    print(f"engine: {engine.stats.steps} steps, mean running batch "
          f"{sum(engine.stats.batch_sizes) / engine.stats.steps:.1f}, peak KV blocks {engine.stats.peak_blocks_used}")
    print(f"KV memory, n=8 samples of a 100-token prompt (+64 new): prefix sharing {mem[True] / 2**20:.2f} MiB, "
          f"without {mem[False] / 2**20:.2f} MiB ({mem[False] / mem[True]:.2f}x)")
    print(f"generation: tokens_per_s={rate['cb']:.1f} vs_hf={rate['cb'] / rate['hf']:.2f}x "
          f"vs_static={rate['cb'] / rate['static']:.2f}x kv_sharing={mem[False] / mem[True]:.2f}x")


if __name__ == "__main__":
    main()
