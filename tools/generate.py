#!/usr/bin/env python
"""Generate completions for a JSONL file of prompts with our model (one process, CPU or GPU).

Each input line is {"prompt": "..."} (other fields are carried over); each output
line adds "completion" (decoded, special tokens skipped) and "completion_ids"
(generated ids, the EOS included when reached). --load takes our checkpoint root
or a Hugging Face model directory. Prompts are tokenized as the tokenizer's own
rules say (an HF tokenizer as AutoTokenizer(dir)(text): a BOS only where it adds
one; the byte tokenizer prepends its BOS); --add-bos / --no-bos override that.
All prompts go to the generation engine (rlhf/engine: paged KV cache,
continuous batching) at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import NamedTuple

from rlhf.cli import HelpFormatter, UsageError, check_out_path, check_range, report

# engine config / sampling field -> the flag that sets it (for error messages)
_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
          "top_p": "--top-p", "num_blocks": "--kv-blocks"}
MAX_SEED = 2**32 - 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--load", required=True, help="our checkpoint root or an HF model directory")
    p.add_argument("--prompts", required=True, help='input JSONL, one {"prompt": "..."} per line '
                   "(or Parquet with a 'prompt' column)")
    p.add_argument("--out", required=True, help="output JSONL (input fields + completion, completion_ids)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most per prompt")
    p.add_argument("--tokenizer", default=None, help="'byte' or a tokenizer directory (default: the HF "
                   "directory itself, or <checkpoint root>/tokenizer)")
    p.add_argument("--model-name", default="actor", help="model to use from our checkpoint")
    p.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: latest)")
    bos = p.add_mutually_exclusive_group()  # default (neither): the tokenizer's own rules
    bos.add_argument("--add-bos", dest="add_bos", action="store_const", const=True, default=None,
                     help="put the tokenizer's BOS first even where the tokenizer does not add it (default: "
                     "tokenize as the tokenizer does, i.e. AutoTokenizer(dir)(text) for an HF tokenizer)")
    bos.add_argument("--no-bos", dest="add_bos", action="store_const", const=False,
                     help="encode the prompt text alone: no BOS (nor any other special token) added")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (ignores sampling flags)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy, like --greedy)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass (1: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed in [0, 2**32-1] (prompt i uses seed + i)")
    p.add_argument("--kv-blocks", type=int, default=256, help="KV cache blocks of 16 tokens; "
                   "fewer blocks only means more preemption, never lost samples")
    return p


class PromptLine(NamedTuple):
    """One record of the prompts file, where it is, and its prompt's token ids."""

    line: int
    record: dict
    ids: list[int]


def read_prompts(path: str, tokenizer, add_bos: bool | None, vocab_size: int | None = None) -> list[PromptLine]:
    """The records of a prompts file with their token ids; errors name file:line.

    ``add_bos``: None tokenizes as the tokenizer's own rules say, True puts its
    BOS first, False adds nothing (``rlhf.data.encode_prompt``). Ids at or above
    ``vocab_size`` (the model's) are refused: the model has no embedding for them.
    """
    from rlhf.data import PromptDataError, encode_prompt, load_prompt_records

    prompts = []
    try:
        for line, record, problem in load_prompt_records(path):
            if problem is None and not (isinstance(record, dict) and isinstance(record.get("prompt"), str)):
                problem = "no string field 'prompt'"
            if problem is not None:
                raise UsageError(f"{path}:{line}: {problem}")
            ids = encode_prompt(tokenizer, record["prompt"], add_bos)
            if not ids:
                raise UsageError(f"{path}:{line}: the prompt has no tokens (empty text, no BOS added)")
            if vocab_size is not None and max(ids) >= vocab_size:
                raise UsageError(f"{path}:{line}: token id {max(ids)} of the tokenizer is outside the model's "
                                 f"vocabulary (vocab_size={vocab_size}); pass the model's own tokenizer (--tokenizer)")
            prompts.append(PromptLine(line, record, ids))
    except PromptDataError as e:
        raise UsageError(f"--prompts {e} (expected JSONL or Parquet with a 'prompt' per record)") from None
    if not prompts:
        raise UsageError(f"--prompts {path}: no prompts in the file (expected one {{\"prompt\": ...}} per line)")
    return prompts


def sampling_params(args, index: int, eos_id: int):
    """Engine sampling parameters of prompt ``index`` (temperature 0 is greedy)."""
    from rlhf.engine import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed + index, stop_token_ids=(eos_id,))


def main(argv: list[str] | None = None) -> int:
    try:
        return generate(build_parser().parse_args(argv))
    except UsageError as e:
        return report("generate.py", e)


def engine_config(args):
    """The engine config of the flags, with the sampling flags checked too, before any work (UsageError naming
    the flag); the seed must fit torch's generator with one seed per prompt."""
    from rlhf.engine import EngineConfig, EngineConfigError

    check_range("--seed", args.seed, 0, MAX_SEED)
    try:
        sampling_params(args, 0, eos_id=0)
        return EngineConfig(num_blocks=args.kv_blocks)
    except EngineConfigError as e:
        flag = _FLAGS.get(e.field_name)
        raise UsageError(f"{flag + ': ' if flag else ''}{e}") from None


def generate(args) -> int:
    """Generate completions for ``args.prompts`` into ``args.out``; bad input raises UsageError."""
    from rlhf.checkpoint.hf import HFConversionError
    from rlhf.checkpoint.loading import load_unsharded_lm
    from rlhf.checkpoint.storage import CheckpointError
    from rlhf.data import TokenizerError, build_tokenizer
    from rlhf.engine import Engine, NeverFitsError, Request

    engine_cfg = engine_config(args)
    check_out_path("--out", args.out)
    try:
        loaded = load_unsharded_lm(args.load, args.model_name, args.iteration)
    except (CheckpointError, HFConversionError) as e:
        raise UsageError(f"--load {args.load}: {e}") from None
    model, cfg, tok_dir = loaded.model, loaded.config, loaded.tokenizer_dir
    if args.tokenizer is None and tok_dir is None:
        raise UsageError(f"--load {args.load}: no tokenizer files saved with the model; pass --tokenizer byte "
                         "or a tokenizer directory")
    try:
        tokenizer = build_tokenizer(args.tokenizer or tok_dir)
    except TokenizerError as e:
        raise UsageError(f"{'--tokenizer: ' if args.tokenizer else ''}{e}") from None
    prompts = read_prompts(args.prompts, tokenizer, args.add_bos, cfg.vocab_size)
    engine = Engine(model, None, cfg, engine_cfg)
    requests = [Request(str(i), tuple(p.ids), sampling_params(args, i, tokenizer.eos_id))
                for i, p in enumerate(prompts)]
    for prompt, request in zip(prompts, requests):
        try:
            engine.check_fits(request)
        except NeverFitsError as e:
            raise UsageError(f"{args.prompts}:{prompt.line}: {e}") from None
    results = engine.generate(requests)
    with open(args.out, "w", encoding="utf-8") as fout:
        for prompt, result in zip(prompts, results):
            ids = list(result.tokens)
            record = dict(prompt.record, completion=tokenizer.decode(ids, skip_special_tokens=True),
                          completion_ids=ids)
            fout.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"generate: {len(results)} completions -> {args.out} ({engine.stats.tokens_per_s:.0f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
