#!/usr/bin/env python
"""Generate completions for a JSONL file of prompts with our model (one process, CPU or GPU).

Each input line is {"prompt": "..."} (other fields are carried over); each output
line adds "completion" (decoded, special tokens skipped) and "completion_ids"
(generated ids, the EOS included when reached). --load takes our checkpoint root
or a Hugging Face model directory. All prompts go to the generation engine
(rlhf/engine: paged KV cache, continuous batching) at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# engine config / sampling field -> the flag that sets it (for error messages)
_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
          "top_p": "--top-p", "num_blocks": "--kv-blocks"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="our checkpoint root or an HF model directory")
    p.add_argument("--prompts", required=True, help='input JSONL, one {"prompt": "..."} per line')
    p.add_argument("--out", required=True, help="output JSONL (input fields + completion, completion_ids)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most per prompt")
    p.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer directory (default: the HF "
                   "directory itself, or <checkpoint root>/tokenizer)")
    p.add_argument("--model-name", default="actor", help="model to use from our checkpoint (default actor)")
    p.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: latest)")
    p.add_argument("--no-bos", action="store_true", help="do not prepend the tokenizer's BOS id")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores sampling flags)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy, like --greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass (1: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    p.add_argument("--kv-blocks", type=int, default=256, help="KV cache blocks of 16 tokens (default 256); "
                   "fewer blocks only means more preemption, never lost samples")
    return p


def read_prompts(path: str, tokenizer, add_bos: bool) -> tuple[list[dict], list[list[int]]]:
    """Records of a prompts JSONL file and their token ids; errors name file:line."""
    if not os.path.isfile(path):
        raise SystemExit(f"generate: --prompts {path}: no such file (expected JSONL with a 'prompt' per line)")
    records, ids = [], []
    bos = [tokenizer.bos_id] if add_bos and tokenizer.bos_id is not None else []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise SystemExit(f"generate: {path}:{line_no}: not JSON ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise SystemExit(f"generate: {path}:{line_no}: no string field 'prompt'")
            records.append(dict(record, _line=line_no))
            ids.append(bos + tokenizer.encode(record["prompt"]))
    return records, ids


def sampling_params(args, index: int, eos_id: int):
    """Engine sampling parameters of prompt ``index`` (temperature 0 is greedy)."""
    from rlhf.engine import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed + index, stop_token_ids=(eos_id,))


def main(argv: list[str] | None = None) -> int:
    from rlhf.checkpoint.hf import HFConversionError
    from rlhf.checkpoint.loading import load_unsharded_lm
    from rlhf.checkpoint.storage import CheckpointError
    from rlhf.data import TokenizerError, build_tokenizer
    from rlhf.engine import Engine, EngineConfig, EngineConfigError, NeverFitsError, Request

    args = build_parser().parse_args(argv)
    try:
        loaded = load_unsharded_lm(args.load, args.model_name, args.iteration)
    except (CheckpointError, HFConversionError) as e:
        raise SystemExit(f"generate: --load {args.load}: {e}") from None
    model, cfg, tok_dir = loaded.model, loaded.config, loaded.tokenizer_dir
    if args.tokenizer is None and tok_dir is None:
        raise SystemExit(f"generate: {args.load} has no tokenizer files; pass --tokenizer byte or a directory")
    try:
        tokenizer = build_tokenizer(args.tokenizer or tok_dir)
    except TokenizerError as e:
        raise SystemExit(f"generate: {'--tokenizer: ' if args.tokenizer else ''}{e}") from None
    records, prompt_ids = read_prompts(args.prompts, tokenizer, not args.no_bos)
    try:
        engine = Engine(model, None, cfg, EngineConfig(num_blocks=args.kv_blocks,
                                                       vocab_limit=min(tokenizer.vocab_size, cfg.vocab_size)))
        requests = [Request(str(i), tuple(ids), sampling_params(args, i, tokenizer.eos_id))
                    for i, ids in enumerate(prompt_ids)]
    except EngineConfigError as e:
        flag = _FLAGS.get(e.field_name)
        raise SystemExit(f"generate: {flag + ': ' if flag else ''}{e}") from None
    for record, request in zip(records, requests):
        try:
            engine.check_fits(request)
        except NeverFitsError as e:
            raise SystemExit(f"generate: {args.prompts}:{record['_line']}: {e}") from None
    results = engine.generate(requests)
    with open(args.out, "w", encoding="utf-8") as fout:
        for record, result in zip(records, results):
            record.pop("_line")
            ids = list(result.tokens)
            record.update(completion=tokenizer.decode(ids, skip_special_tokens=True), completion_ids=ids)
            fout.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"generate: {len(results)} completions -> {args.out} ({engine.stats.tokens_per_s:.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
