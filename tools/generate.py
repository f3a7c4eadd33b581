#!/usr/bin/env python
"""Generate completions for a JSONL file of prompts with our model (one process, CPU or GPU).

Each input line is {"prompt": "..."} (other fields are carried over); each output
line adds "completion" (decoded, special tokens skipped; an id the tokenizer has no token for, as when
the model's vocabulary is larger than --tokenizer byte's 259, shows as U+FFFD) and "completion_ids"
(generated ids, the stop token included when reached: the tokenizer's EOS or an
eos_token_id of its directory's generation_config.json). --load takes our checkpoint root
or a Hugging Face model directory. Prompts are tokenized as the tokenizer's own
rules say (an HF tokenizer as AutoTokenizer(dir)(text): a BOS only where it adds
one; the byte tokenizer prepends its BOS); --add-bos / --no-bos override that.
All prompts go to the generation engine (rlhf/engine: paged KV cache,
continuous batching) at once.
"""

from __future__ import annotations

import argparse
import sys

from rlhf.cli import HelpFormatter, UsageError, report


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
    p.add_argument("--seed", type=int, default=0, help="sampling seed in [0, 2**32-1] (prompt i's seed is mixed "
                   "from it and i)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="the model's (and KV cache's) dtype; log-probs stay fp32 (default: fp32)")
    p.add_argument("--kv-blocks", type=int, default=256, help="KV cache blocks of 16 tokens; "
                   "fewer blocks only means more preemption, never lost samples")
    p.add_argument("--cuda-graphs", action="store_true", help="on a GPU, replay decode steps (padded to static "
                   "shapes) as CUDA graphs; no effect on the CPU (docs/engine.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rlhf import platform
    from rlhf.engine.completions import generate_completions  # after the flags: --help needs no torch

    platform.flush_denormals()
    try:
        return generate_completions(args)
    except UsageError as e:
        return report("generate.py", e)


if __name__ == "__main__":
    sys.exit(main())
