#!/usr/bin/env python
"""Convert model checkpoints between Hugging Face directories and our RLHF checkpoints.

  hf-to-ours  an HF safetensors directory (LlamaForCausalLM, Qwen2ForCausalLM or their
              *ForSequenceClassification) -> <out>/iter_<N>/ (atomic, verified storage);
              tokenizer files, if any, are copied to <out>/tokenizer/
  ours-to-hf  one model of our checkpoint -> <out>/config.json + model.safetensors
              (+ tokenizer files from <root>/tokenizer/), loadable by transformers

Runs in one process on CPU; needs no megatron and no process group.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from rlhf.checkpoint import storage
from rlhf.checkpoint.hf import HFConversionError, read_hf_config, read_hf_state
from rlhf.checkpoint.hf import export_saved_model as ours_to_hf  # ours-to-hf: tests call it under this name too
from rlhf.checkpoint.rlhf_state import TOKENIZER_DIR, ModelSlot, stage_files
from rlhf.cli import HelpFormatter, report
from rlhf.data import copy_tokenizer_files
from rlhf.tasks import KINDS


def hf_to_ours(hf_dir: str, out: str, model_name: str = "actor", role: str = "lm", iteration: int = 0,
               seed: int = 0) -> str:
    """Import an HF directory as model ``model_name`` of a new checkpoint; returns its path.

    role "value" takes the value head from ``score.weight`` of a sequence
    classifier, or draws a new one (normal, std ``initializer_range``, ``seed``)
    for a causal LM.
    """
    info = read_hf_config(hf_dir)
    full = read_hf_state(hf_dir, info, role)
    if role == "value" and "output_layer.weight" not in full:
        gen = torch.Generator().manual_seed(seed)
        full["output_layer.weight"] = torch.randn(1, info.config.hidden_size, generator=gen) * info.config.init_std
    shards, json_files = stage_files(model_name, ModelSlot(info.config, role), full)
    path = storage.save_checkpoint(out, iteration, shards=shards, json_files=json_files,
                                   state={"data_position": {}, "extra": {"converted_from": os.path.abspath(hf_dir),
                                                                         "architecture": info.architecture}})
    copy_tokenizer_files(hf_dir, os.path.join(out, TOKENIZER_DIR))
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-ours", help="HF directory -> our checkpoint root", formatter_class=HelpFormatter)
    a.add_argument("--hf", required=True, help="HF model directory (config.json + model.safetensors "
                   "or model.safetensors.index.json)")
    a.add_argument("--out", required=True, help="our checkpoint root; written as <out>/iter_<N>, <out>/latest")
    a.add_argument("--model-name", default="actor", help="name of the model inside our checkpoint "
                   "(actor, critic, reference, reward; default: actor)")
    a.add_argument("--role", choices=KINDS, default="lm",
                   help="lm: causal LM (actor/reference); value: critic/reward, value head from "
                        "score.weight of a *ForSequenceClassification checkpoint, or new for a causal LM")
    a.add_argument("--iteration", type=int, default=0, help="iteration number of the new checkpoint")
    a.add_argument("--seed", type=int, default=0, help="seed of a new value head (--role value from a causal LM)")
    b = sub.add_parser("ours-to-hf", help="our checkpoint root -> HF directory", formatter_class=HelpFormatter)
    b.add_argument("--load", required=True, help="our checkpoint root (the directory holding 'latest')")
    b.add_argument("--out", required=True, help="output HF directory (created; files overwritten)")
    b.add_argument("--model-name", default="actor", help="which model of the checkpoint to export")
    b.add_argument("--iteration", type=int, default=None, help="iteration to export (default: the one 'latest' names)")
    b.add_argument("--family", choices=("llama", "qwen2"), default=None,
                   help="HF architecture family (default: qwen2 when the model has QKV bias, else llama)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.direction == "hf-to-ours":
            if not os.path.isdir(args.hf):
                raise HFConversionError(f"--hf {args.hf}: not a directory")
            if os.path.exists(storage.checkpoint_path(args.out, args.iteration)):
                raise HFConversionError(f"--out {args.out}: iteration {args.iteration} already exists there; "
                                        "give another --out or --iteration")
            print(hf_to_ours(args.hf, args.out, args.model_name, args.role, args.iteration, args.seed))
        else:
            print(ours_to_hf(args.load, args.out, args.model_name, args.iteration, args.family))
    except (HFConversionError, storage.CheckpointError) as e:
        return report("convert_checkpoint.py", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
