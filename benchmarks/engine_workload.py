"""The RLHF generation workload: n sampled answers per prompt, ours against transformers and the matmul limit.

SmolLM2-135M-Instruct answers ``--prompts`` open-ended chat prompts ``--n`` times each, at temperature 1
(no top-k, no top-p), all in one process on ``--threads`` torch threads, in every case of
``--max-new-tokens`` x ``--lengths``:

* ``natural``: each answer stops at the EOS or at the limit: the long tail the model itself makes;
* ``drawn``: no EOS stop; each answer's length is drawn from a log-normal (median a quarter of the limit,
  capped at it; seeded), as a declared workload's long tail.

Systems:

1. our engine (rlhf/engine): all requests at once, one prefill per prompt shared by its n samples;
2. transformers' ``generate`` with ``num_return_sequences=n``, the prompts in one left-padded batch. It
   decodes every row until the longest one ends, so only its useful tokens are counted: a row's tokens
   up to and including its first EOS (``natural``), or its drawn length (``drawn``).

The matmul limit: the fastest of several 2048 x 2048 x 2048 fp32 matmuls on the same threads, measured
in the same run (before and after the systems, the best kept), divided by the FLOPs a token costs in
the model's weight matmuls (2 x the weights of the Q/K/V, output, MLP and LM-head projections). It
leaves out attention's own FLOPs, so ``limit_fraction`` understates how close a system is to the
machine. For scale, it also times those matmuls alone on a full decode batch (``--prompts`` x ``--n``
rows, torch's F.linear): no decode step of that batch can be faster. Denormal floats are flushed in the
whole process (rlhf.platform.flush_denormals), for both systems alike.

    python benchmarks/engine_workload.py [--prompts 16] [--n 8] [--max-new-tokens 96,512]
        [--lengths natural,drawn] [--threads 2] [--repeats 1] [--seed 0] [--skip-hf]

One line per case, then the summary of the case with the lowest ``limit_fraction``:
``engine_workload: engine=<tok/s> hf=<tok/s> ratio=<x> limit_fraction=<y>`` (its case named after it).
"""
from __future__ import annotations

import argparse
import os
import platform as host
import time

import torch

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system, for a curious teenager.",
    "What are the pros and cons of working from home? Give a balanced view.",
    "Describe your ideal weekend in a big city you have never visited.",
    "Write a letter from a cat to its owner complaining about the new dog.",
    "Explain the difference between weather and climate with examples.",
    "Give me a recipe for a vegetarian dinner and explain each step.",
    "Why do people enjoy scary movies? Discuss a few theories.",
    "Write a poem about the first snow of winter.",
    "How does a bill become a law? Explain it simply.",
    "Describe the life cycle of a star from birth to death.",
    "What advice would you give to someone starting their first job?",
    "Write a dialogue between a robot and a child about friendship.",
    "Explain how the internet works, from typing a web address to seeing the page.",
    "Tell me about the history of tea and how it spread around the world.",
    "Plan a three-day hiking trip and explain what to pack and why.",
)


def chat_prompts(count: int):
    """(SmolLM2's HF directory, its tokenizer, the first ``count`` of PROMPTS chat-templated as ids)."""
    from transformers import AutoTokenizer

    from rlhf.checkpoint.gguf import smollm2_hf_dir

    if not 1 <= count <= len(PROMPTS):
        raise SystemExit(f"--prompts must be in [1, {len(PROMPTS)}], got {count}")
    path = smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(path)
    return path, tok, [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False) for p in PROMPTS[:count]]


def drawn_lengths(count: int, limit: int, seed: int) -> list[int]:
    """``count`` long-tailed lengths in [1, limit]: log-normal with median limit / 4 and sigma 1, capped."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.randn(count, generator=g, dtype=torch.float64)) * limit / 4
    return [int(min(limit, max(1, round(v)))) for v in x.tolist()]


def matmul_gflops(threads: int, size: int = 2048, tries: int = 5) -> float:
    """The best fp32 GFLOP/s of ``size``-cubed matmuls on ``threads`` torch threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = min(timed(lambda: a @ b)[1] for _ in range(tries))
    return 2 * size ** 3 / best / 1e9


def matmul_flops_per_token(cfg) -> int:
    """FLOPs of one token in the model's weight matmuls (attention projections, MLP, LM head)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = 3 * cfg.hidden_size * cfg.ffn_hidden_size  # SwiGLU: gate, up and down
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + mlp
    return 2 * (cfg.num_layers * per_layer + cfg.vocab_size * cfg.hidden_size)


def matmul_ceiling(cfg, rows: int, threads: int, tries: int = 5) -> float:
    """Tokens/s of the model's weight matmuls alone on ``rows`` rows (a full decode batch), as torch runs
    them (F.linear, fp32), with nothing else: what a decode step of that batch could reach at best."""
    torch.set_num_threads(threads)
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * f, h), (h, f)]
    seconds = 0.0
    for (out, inp), count in [(s, cfg.num_layers) for s in shapes] + [((cfg.vocab_size, h), 1)]:
        x, w = torch.randn(rows, inp), torch.randn(out, inp)
        torch.nn.functional.linear(x, w)
        seconds += count * min(timed(lambda: torch.nn.functional.linear(x, w))[1] for _ in range(tries))
    return rows / seconds


def timed(fn):
    """(fn(), its wall seconds)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def engine_useful_tokens(engine, prompts, n: int, limit: int, lengths, eos: int, seed: int) -> int:
    """Our engine's generated tokens (EOS included) for every prompt's n samples."""
    from rlhf.engine import Request, SamplingParams, mixed_seed

    requests = []
    for i, p in enumerate(prompts):
        own = tuple(lengths[i * n:(i + 1) * n]) if lengths else ()
        params = SamplingParams(max_new_tokens=limit, temperature=1.0, n=n, seed=mixed_seed(seed, i),
                                stop_token_ids=() if lengths else (eos,), sample_max_new_tokens=own)
        requests.append(Request(str(i), tuple(p), params))
    return sum(len(r.tokens) for r in engine.generate(requests))


def hf_useful_tokens(model, prompts, n: int, limit: int, lengths, eos: int, seed: int) -> int:
    """transformers' useful tokens: rows cut after their first EOS (natural) or at their drawn length."""
    torch.manual_seed(seed)
    width = max(map(len, prompts))
    x = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(x, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         num_return_sequences=n, max_new_tokens=max(lengths) if lengths else limit,
                         eos_token_id=None if lengths else eos, pad_token_id=eos)
    rows = out[:, width:].tolist()
    if lengths:
        return sum(min(len(row), cut) for row, cut in zip(rows, lengths))
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in rows)


def run_case(systems, repeats: int) -> dict[str, tuple[int, float]]:
    """Each system's (useful tokens, fastest seconds) over ``repeats`` interleaved runs."""
    best: dict[str, tuple[int, float]] = {}
    for _ in range(repeats):
        for name, fn in systems.items():
            tokens, seconds = timed(fn)
            if name not in best or seconds < best[name][1]:
                best[name] = (tokens, seconds)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="prompts, at most 16 (default %(default)s)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (default %(default)s)")
    ap.add_argument("--max-new-tokens", default="96,512", help="comma-separated limits (default %(default)s)")
    ap.add_argument("--lengths", default="natural,drawn", help="natural and/or drawn (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per system, fastest kept (default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="sampling and drawn-length seed (default %(default)s)")
    ap.add_argument("--skip-hf", action="store_true", help="time our engine only (transformers' 512-token cases "
                    "take 15-20 minutes each on 2 cores); ratios print as -")
    args = ap.parse_args()
    limits = [int(v) for v in args.max_new_tokens.split(",")]
    kinds = args.lengths.split(",")
    if set(kinds) - {"natural", "drawn"}:
        raise SystemExit(f"--lengths takes natural and/or drawn, got {args.lengths!r}")
    from rlhf import platform

    platform.flush_denormals()
    peak = matmul_gflops(args.threads)
    from transformers import AutoModelForCausalLM

    from rlhf.checkpoint.loading import load_unsharded_lm
    from rlhf.engine import Engine, EngineConfig

    path, tok, prompts = chat_prompts(args.prompts)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    loaded = load_unsharded_lm(path)
    rows = args.prompts * args.n
    longest = max(map(len, prompts)) + max(limits)
    engine = Engine(loaded.model, None, loaded.config, EngineConfig.for_batch(args.prompts, args.n, longest))
    flops = matmul_flops_per_token(loaded.config)
    eos = tok.eos_token_id
    print(f"machine: {host.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads}; {args.prompts} prompts "
          f"of {min(map(len, prompts))}-{max(map(len, prompts))} tokens x {args.n} samples, temperature 1; "
          f"{flops / 1e6:.0f} MFLOP per token in weight matmuls")
    results = []
    with torch.no_grad():
        for limit in limits:
            for kind in kinds:
                lengths = drawn_lengths(rows, limit, args.seed) if kind == "drawn" else None
                systems = {
                    "engine": lambda: engine_useful_tokens(engine, prompts, args.n, limit, lengths, eos, args.seed),
                    "hf": lambda: hf_useful_tokens(hf, prompts, args.n, limit, lengths, eos, args.seed)}
                if args.skip_hf:
                    del systems["hf"]
                best = run_case(systems, args.repeats)
                peak = max(peak, matmul_gflops(args.threads))
                results.append((f"{limit}/{kind}", {k: t / s for k, (t, s) in best.items()}, best))
                print(f"  <= {limit} new tokens, {kind} lengths: " + ", ".join(
                    f"{k} {t} tokens in {s:.1f} s ({t / s:.1f} tokens/s)" for k, (t, s) in best.items()), flush=True)
    limit_rate = peak * 1e9 / flops
    ceiling = matmul_ceiling(loaded.config, rows, args.threads)
    print(f"matmul limit: {peak:.1f} GFLOP/s -> {limit_rate:.0f} tokens/s; the weight matmuls alone on {rows} rows "
          f"(F.linear): {ceiling:.0f} tokens/s = {ceiling / limit_rate:.2f} of the limit")
    print("| case | engine tokens/s | hf tokens/s | engine / hf | engine / limit |")
    print("|---|---|---|---|---|")
    for case, rate, _ in results:
        hf_rate, ratio = _versus_hf(rate)
        print(f"| {case} | {rate['engine']:.1f} | {hf_rate} | {ratio} | {rate['engine'] / limit_rate:.2f} |")
    case, rate, _ = min(results, key=lambda r: r[1]["engine"])
    hf_rate, ratio = _versus_hf(rate)
    print(f"engine_workload: engine={rate['engine']:.1f} hf={hf_rate} ratio={ratio} "
          f"limit_fraction={rate['engine'] / limit_rate:.2f} case={case}")


def _versus_hf(rate: dict) -> tuple[str, str]:
    """(transformers' tokens/s, engine / transformers) as printed; "-" when it was not run (--skip-hf)."""
    if "hf" not in rate:
        return "-", "-"
    return f"{rate['hf']:.1f}", f"{rate['engine'] / rate['hf']:.2f}"


if __name__ == "__main__":
    main()
