#!/usr/bin/env python
"""Generate completions for a JSONL file of prompts with our model (one process, CPU or GPU).

Each input line is {"prompt": "..."} (other fields are carried over); each output
line adds "completion" (decoded, special tokens skipped) and "completion_ids"
(generated ids, the EOS included when reached). --load takes our checkpoint root
or a Hugging Face model directory. Decoding recomputes the full sequence for
every token (no KV cache): the generation engine (rlhf/engine) replaces
`decode` later.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import torch  # noqa: E402

TOKENIZER_DIR = "tokenizer"  # where convert_checkpoint.py puts an imported model's tokenizer


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is picked from the last position's logits."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use --greedy for argmax)")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


def make_picker(cfg: SamplingConfig) -> Callable[[torch.Tensor], int]:
    """logits [V] -> next token id (greedy argmax, or temperature / top-k / top-p sampling)."""
    gen = torch.Generator().manual_seed(cfg.seed)

    def pick(logits: torch.Tensor) -> int:
        logits = logits.float()
        if cfg.greedy:
            return int(logits.argmax())
        logits = logits / cfg.temperature
        if cfg.top_k:
            kth = logits.topk(min(cfg.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if cfg.top_p < 1:
            sorted_logits, order = logits.sort(descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) >= cfg.top_p  # keep the smallest prefix reaching top_p
            logits = logits.scatter(0, order[drop], float("-inf"))
        return int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=gen))

    return pick


@torch.no_grad()
def decode(forward: Callable[[torch.Tensor], torch.Tensor], prompt_ids: list[int], max_new_tokens: int,
           eos_id: int, pick: Callable[[torch.Tensor], int], max_len: int) -> list[int]:
    """New token ids after ``prompt_ids``: full recomputation each step, stop at EOS / limits.

    forward: ids [1, s] -> logits [1, s, V].
    """
    if len(prompt_ids) >= max_len:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the context of {max_len}")
    ids = list(prompt_ids)
    out: list[int] = []
    while len(out) < max_new_tokens and len(ids) < max_len:
        token = pick(forward(torch.tensor([ids]))[0, -1])
        out.append(token)
        ids.append(token)
        if token == eos_id:
            break
    return out


def _is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def load_model(path: str, model_name: str = "actor", iteration: int | None = None):
    """(model, config, tokenizer dir or None) of an HF directory or our checkpoint, unsharded, one rank."""
    from rlhf import platform
    from rlhf.checkpoint.hf import load_hf_weights, read_hf_config
    from rlhf.checkpoint.rlhf_state import ModelSlot, load_rlhf_state, saved_model_config
    from rlhf.models.gpt import build_model
    from rlhf.parallel import Placement
    from rlhf.parallel.groups import build_task_groups, local_groups

    platform.init_distributed()
    build_task_groups(Placement.from_plan({}, 1))
    groups = local_groups()
    if _is_hf_dir(path):
        cfg = read_hf_config(path).config
        model = build_model(cfg, "lm", groups)
        load_hf_weights(model, groups, path, "lm")
        return model.eval(), cfg, path
    cfg, role = saved_model_config(path, model_name, iteration)
    if role != "lm":
        raise ValueError(f"{path}: model {model_name!r} has role {role!r}; generation needs an LM")
    model = build_model(cfg, "lm", groups)
    load_rlhf_state(path, {model_name: ModelSlot(cfg, role, model, groups)}, iteration, restore_rng=False)
    tok_dir = os.path.join(path, TOKENIZER_DIR)
    return model.eval(), cfg, tok_dir if os.path.isdir(tok_dir) else None


def _forward_fn(model, vocab: int):
    """ids -> logits, with ids the tokenizer cannot decode (padded vocab) masked out."""
    from rlhf.models.gpt import stage_forward

    def forward(ids):
        logits = stage_forward(model, ids.to(next(model.parameters()).device))
        logits[..., vocab:] = float("-inf")
        return logits

    return forward


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
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass (1: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    return p


def main(argv: list[str] | None = None) -> int:
    from rlhf.data import build_tokenizer

    args = build_parser().parse_args(argv)
    sampling = SamplingConfig(args.greedy, args.temperature, args.top_k, args.top_p, args.seed)
    model, cfg, tok_dir = load_model(args.load, args.model_name, args.iteration)
    if args.tokenizer is None and tok_dir is None:
        raise SystemExit(f"generate: {args.load} has no tokenizer files; pass --tokenizer byte or a directory")
    tokenizer = build_tokenizer(args.tokenizer or tok_dir)
    forward, pick = _forward_fn(model, tokenizer.vocab_size), make_picker(sampling)
    with open(args.prompts, encoding="utf-8") as fin, open(args.out, "w", encoding="utf-8") as fout:
        for line_no, line in enumerate(fin, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record.get("prompt"), str):
                raise SystemExit(f"generate: {args.prompts}:{line_no}: no string field 'prompt'")
            bos = [] if args.no_bos or tokenizer.bos_id is None else [tokenizer.bos_id]
            try:
                ids = decode(forward, bos + tokenizer.encode(record["prompt"]), args.max_new_tokens,
                             tokenizer.eos_id, pick, cfg.max_seq_len)
            except ValueError as e:
                raise SystemExit(f"generate: {args.prompts}:{line_no}: {e}") from None
            record.update(completion=tokenizer.decode(ids, skip_special_tokens=True), completion_ids=ids)
            fout.write(json.dumps(record, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
