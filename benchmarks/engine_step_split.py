"""Where the engine's time goes on the RLHF workload: n sampled answers per prompt on SmolLM2-135M-Instruct.

One process runs our engine (rlhf/engine) on the example's chat-templated prompts (examples/smollm2), each
sampled ``--n`` times at temperature 1 to at most ``--max-new-tokens`` with the EOS stop, after one warm-up
call on two prompts. Wall-clock timers wrap the engine's parts: scheduling, building the step's inputs on
the host, the decoder's forward (inside it: the MLPs, the attention blocks and their paged-attention core;
the rest is the embedding, the norms and the LM head over the whole vocabulary), sampling, and the
per-step bookkeeping. Nested rows are part of the row above them. A last row times every weight matmul of
the decoder (``F.linear``: QKV, output projection, fc1, fc2, LM head), which the rows above share.

    python benchmarks/engine_step_split.py [--prompts 16] [--n 8] [--max-new-tokens 96] [--threads 2]

Last line: ``engine_step_split: tokens_per_s=<x> decoder=<%> mlp=<%> attention=<%> sample=<%> host=<%> matmuls=<%>``.
"""
from __future__ import annotations

import argparse
import functools
import time
from collections import Counter

import torch
from real_model_generate import smollm2_chat_prompts


def timed(seconds: Counter, name: str, fn):
    """``fn`` adding its wall seconds to ``seconds[name]``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="prompts (default %(default)s)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens at most per sample (default %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    args = ap.parse_args()
    from rlhf import platform

    platform.flush_denormals()  # as the programs do, before torch's first parallel op
    torch.set_num_threads(args.threads)
    from rlhf.checkpoint.loading import load_unsharded_lm
    from rlhf.engine import Engine, EngineConfig, Request, SamplingParams
    from rlhf.engine import decoder as decoder_module

    path, tok, prompts = smollm2_chat_prompts(args.prompts)
    loaded = load_unsharded_lm(path)
    engine = Engine(loaded.model, None, loaded.config,
                    EngineConfig.for_batch(args.prompts, args.n, max(map(len, prompts)) + args.max_new_tokens))
    seconds: Counter = Counter()
    rows = [("schedule", engine.scheduler, "schedule"), ("host inputs", engine, "_prepare"),
            ("decoder", engine.decoder, "forward"), ("  mlp", engine.decoder, "_mlp"),
            ("  attention block", engine.decoder, "_attention"), ("sample", decoder_module, "sample"),
            ("bookkeeping", engine, "_record")]
    for name, owner, attr in rows:
        setattr(owner, attr, timed(seconds, name, getattr(owner, attr)))
    core = type(engine.decoder.attention)  # CpuPagedAttention: the C++ kernel for decodes (rlhf/engine/attention.py)
    core.__call__ = timed(seconds, "    paged attention core", core.__call__)
    # every weight matmul of the decoder (QKV, output projection, fc1, fc2, LM head): F.linear, in this
    # process only the engine's
    torch.nn.functional.linear = timed(seconds, "decoder's weight matmuls", torch.nn.functional.linear)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, stop_token_ids=(tok.eos_token_id,),
                            n=args.n, seed=1)
    requests = [Request(str(i), tuple(p), params) for i, p in enumerate(prompts)]
    with torch.no_grad():
        engine.generate(requests[:2])  # warm-up
        seconds.clear()
        steps = engine.stats.steps
        start = time.perf_counter()
        out = engine.generate(requests)
        total = time.perf_counter() - start
    tokens = sum(len(r.tokens) for r in out)
    share = {name: 100 * seconds[name] / total for name, *_ in rows}
    for name in ("    paged attention core", "decoder's weight matmuls"):
        share[name] = 100 * seconds[name] / total
    share["  rest: embedding, norms, LM head"] = share["decoder"] - share["  mlp"] - share["  attention block"]
    print(f"{len(prompts)} prompts x {args.n} samples, temperature 1, <= {args.max_new_tokens} new tokens, "
          f"{args.threads} threads: {tokens} tokens in {total:.1f} s ({tokens / total:.1f} tokens/s), "
          f"{engine.stats.steps - steps} engine steps")
    print("| part | seconds | share |")
    print("|---|---|---|")
    for name in ("schedule", "host inputs", "decoder", "  mlp", "  attention block", "    paged attention core",
                 "  rest: embedding, norms, LM head", "sample", "bookkeeping", "decoder's weight matmuls"):
        print(f"| {name} | {share[name] * total / 100:.2f} | {share[name]:.1f}% |")
    host = share["schedule"] + share["host inputs"] + share["bookkeeping"]
    matmuls = share["decoder's weight matmuls"]
    print(f"engine_step_split: tokens_per_s={tokens / total:.1f} decoder={share['decoder']:.1f}% "
          f"mlp={share['  mlp']:.1f}% attention={share['  attention block']:.1f}% sample={share['sample']:.1f}% "
          f"host={host:.1f}% matmuls={matmuls:.1f}%")


if __name__ == "__main__":
    main()
