"""Generation speed on the real SmolLM2-135M-Instruct: our engine vs transformers' generate, same prompts.

The prompts are the example's (examples/smollm2/arithmetic.py, chat-templated,
the first ``--prompts`` of seed 0), decoded greedily to at most
``--max-new-tokens`` with the EOS stop, all in one process on ``--threads``
torch threads (one: as each rank of the example runs):

  1. transformers ``generate``, one prompt at a time (batch 1; the token-exact oracle);
  2. transformers ``generate``, all prompts as one left-padded batch;
  3. our engine (rlhf/engine: paged KV cache, continuous batching), all prompts at once.

Tokens/s counts the generated tokens (the EOS included). Each system runs
``--repeats`` times, interleaved, and its fastest run counts (the machine is
shared; noise only adds time). The engine's tokens are checked against 1.

    python benchmarks/real_model_generate.py [--prompts 32] [--max-new-tokens 32] [--threads 1] [--repeats 2]

The last line is the summary, e.g.
``real_model_generate: engine 60.1 tokens/s, hf batch-1 10.2 (5.9x), hf batched 40.3 (1.5x); tokens equal 32/32``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import platform as host
import time
from pathlib import Path

import torch

ARITHMETIC = Path(__file__).resolve().parents[1] / "examples" / "smollm2" / "arithmetic.py"


def example_prompts(count: int) -> list[str]:
    """The example's first ``count`` prompt texts (seed 0)."""
    spec = importlib.util.spec_from_file_location("smollm2_arithmetic", ARITHMETIC)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [r["prompt"] for r in module.make_prompts(count, seed=0)]


def smollm2_chat_prompts(count: int):
    """(SmolLM2's HF directory, its tokenizer, the example's first ``count`` prompts chat-templated as ids)."""
    from transformers import AutoTokenizer

    from rlhf.checkpoint.gguf import smollm2_hf_dir

    path = smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(path)
    return path, tok, [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False) for p in example_prompts(count)]


def timed(fn):
    """(fn(), its wall seconds)."""
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def hf_one_at_a_time(model, prompts: list[list[int]], new: int, eos: int) -> list[list[int]]:
    """transformers' greedy tokens, one prompt per generate call."""
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new,
                             eos_token_id=eos, pad_token_id=eos)
        out.append(gen[0, len(ids):].tolist())
    return out


def hf_batched(model, prompts: list[list[int]], new: int, eos: int, **generate):
    """transformers' greedy tokens, all prompts in one left-padded generate call on the model's device (cut
    after the EOS); with ``generate`` options (``output_scores=True, return_dict_in_generate=True``) the
    tokens and generate's whole output."""
    width = max(map(len, prompts))
    dev = next(model.parameters()).device
    x = torch.tensor([[eos] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    out = model.generate(x, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=eos,
                         pad_token_id=eos, **generate)
    rows = (out.sequences if generate else out)[:, width:].tolist()
    tokens = [row[:row.index(eos) + 1] if eos in row else row for row in rows]
    return (tokens, out) if generate else tokens


def engine_generate(engine, prompts: list[list[int]], new: int, eos: int) -> list[list[int]]:
    """Our engine's greedy tokens, all prompts submitted at once."""
    from rlhf.engine import Request, SamplingParams

    params = SamplingParams(max_new_tokens=new, temperature=0.0, stop_token_ids=(eos,))
    return [list(r.tokens) for r in engine.generate([Request(str(i), tuple(p), params)
                                                      for i, p in enumerate(prompts)])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32, help="prompts (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens at most per prompt (default %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per system, fastest kept (default %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from rlhf.checkpoint.loading import load_unsharded_lm
    from rlhf.engine import Engine, EngineConfig

    path, tok, prompts = smollm2_chat_prompts(args.prompts)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    loaded = load_unsharded_lm(path)
    engine = Engine(loaded.model, None, loaded.config, EngineConfig(num_blocks=512))
    systems = {"hf batch-1": lambda: hf_one_at_a_time(hf, prompts, args.max_new_tokens, tok.eos_token_id),
               "hf batched": lambda: hf_batched(hf, prompts, args.max_new_tokens, tok.eos_token_id),
               "engine": lambda: engine_generate(engine, prompts, args.max_new_tokens, tok.eos_token_id)}
    best, tokens = {}, {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for name, fn in systems.items():
                tokens[name], seconds = timed(fn)
                best[name] = min(best.get(name, float("inf")), seconds)
    rate = {name: sum(map(len, tokens[name])) / best[name] for name in systems}
    equal = sum(a == b for a, b in zip(tokens["engine"], tokens["hf batch-1"]))
    print(f"machine: {host.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads}; "
          f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, greedy, "
          f"<= {args.max_new_tokens} new tokens")
    for name in systems:
        print(f"  {name:11s} {best[name]:7.2f} s  {sum(map(len, tokens[name])):5d} tokens  {rate[name]:7.1f} tokens/s")
    print(f"real_model_generate: engine {rate['engine']:.1f} tokens/s, hf batch-1 {rate['hf batch-1']:.1f} "
          f"({rate['engine'] / rate['hf batch-1']:.1f}x), hf batched {rate['hf batched']:.1f} "
          f"({rate['engine'] / rate['hf batched']:.1f}x); tokens equal {equal}/{len(prompts)}")


if __name__ == "__main__":
    main()
