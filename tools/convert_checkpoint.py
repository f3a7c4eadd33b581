#!/usr/bin/env python
"""Convert model checkpoints between Hugging Face directories and our RLHF checkpoints.

  hf-to-ours  an HF safetensors directory (LlamaForCausalLM, Qwen2ForCausalLM or their
              *ForSequenceClassification) -> <out>/iter_<N>/ (atomic, verified storage);
              tokenizer files, if any, are copied to <out>/tokenizer/
  ours-to-hf  one model of our checkpoint -> <out>/config.json + model.safetensors
              (+ tokenizer files from <root>/tokenizer/), loadable by transformers
  megatron-to-ours, megatron-to-hf
              a Megatron-LM torch_dist checkpoint directory (latest_checkpointed_iteration.txt,
              iter_NNNNNNN/; any tp/pp) -> our checkpoint root / an HF directory
  ours-to-megatron
              one model of our checkpoint -> a Megatron-LM torch_dist checkpoint directory that
              megatron-core's dist_checkpointing.load reads (docs/megatron_checkpoints.md)
  ours-to-peft  the LoRA adapters (and modules_to_save) of one model of our checkpoint -> PEFT's
              adapter_config.json + adapter_model.safetensors, for PeftModel.from_pretrained on the
              base that ours-to-hf exports (docs/lora.md)
  peft-to-ours  PEFT's adapter directory on its HF base -> our checkpoint root (base + adapters)
  gguf-to-hf, gguf-to-ours
              a llama.cpp GGUF file (Llama; any tensor type the gguf package dequantizes; needs
              pip install -e ".[gguf]") -> a float32 HF directory with its tokenizer / our
              checkpoint root (docs/real_model.md)

Runs in one process on CPU; needs no megatron and no process group.
"""

from __future__ import annotations

import argparse
import os
import sys

from rlhf.checkpoint import gguf, megatron, peft, storage
from rlhf.checkpoint.convert import (check_new_iteration, export_peft, export_saved_model, gguf_to_ours, hf_to_ours,
                                     import_peft, megatron_to_hf, megatron_to_ours, ours_to_megatron)
from rlhf.checkpoint.hf import FAMILIES, HFConversionError
from rlhf.cli import HelpFormatter, report
from rlhf.models.precision import DTYPES
from rlhf.tasks import KINDS


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
    b.add_argument("--family", choices=tuple(FAMILIES), default=None,
                   help="HF architecture family (default: qwen3_moe for an MoE, qwen3 with QK-norm, qwen2 with "
                        "QKV bias, else llama)")
    b.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="the exported weights' dtype (default: as saved; a --bf16 run saves its trained models' "
                        "fp32 main weights)")
    b.add_argument("--merge-adapters", action="store_true",
                   help="a model with LoRA adapters: export W + (alpha / r) B A (default: its base alone)")
    add_peft_parsers(sub)
    add_megatron_parsers(sub)
    add_gguf_parsers(sub)
    return p


PEFT_COMMANDS = {
    "ours-to-peft": lambda a: export_peft(a.load, a.out, a.model_name, a.iteration),
    "peft-to-ours": lambda a: import_peft(a.peft, a.hf, a.out, a.model_name, a.iteration),
}


def add_peft_parsers(sub) -> None:
    """The subcommands of PEFT_COMMANDS (rlhf/checkpoint/convert.py over peft.py)."""
    a = sub.add_parser("ours-to-peft", help="our checkpoint's LoRA adapters -> PEFT adapter directory",
                       formatter_class=HelpFormatter)
    a.add_argument("--load", required=True, help="our checkpoint root (the directory holding 'latest')")
    a.add_argument("--out", required=True, help="output PEFT adapter directory (created; files overwritten)")
    a.add_argument("--model-name", default="actor", help="which model of the checkpoint (trained with LoRA)")
    a.add_argument("--iteration", type=int, default=None, help="iteration to export (default: 'latest')")
    b = sub.add_parser("peft-to-ours", help="PEFT adapter directory + its HF base -> our checkpoint root",
                       formatter_class=HelpFormatter)
    b.add_argument("--peft", required=True, help="PEFT adapter directory (adapter_config.json, "
                   "adapter_model.safetensors; plain LoRA on a Llama's projections)")
    b.add_argument("--hf", required=True, help="the HF causal LM directory the adapters were trained on")
    b.add_argument("--out", required=True, help="our checkpoint root; written as <out>/iter_<N>, <out>/latest")
    b.add_argument("--model-name", default="actor", help="name of the model inside our checkpoint")
    b.add_argument("--iteration", type=int, default=0, help="iteration number of the new checkpoint")


MEGATRON_DIR_HELP = ("the directory Megatron-LM saved into with --ckpt-format torch_dist (its --save: "
                     "latest_checkpointed_iteration.txt and iter_NNNNNNN/), saved at any tp/pp")
MEGATRON_COMMANDS = {
    "megatron-to-ours": lambda a: megatron_to_ours(a.megatron, a.out, a.model_name, a.iteration),
    "megatron-to-hf": lambda a: megatron_to_hf(a.megatron, a.out, a.family),
    "ours-to-megatron": lambda a: ours_to_megatron(a.load, a.out, a.model_name, a.iteration),
}


def add_megatron_parsers(sub) -> None:
    """The subcommands of MEGATRON_COMMANDS (rlhf/checkpoint/convert.py over megatron.py)."""
    c = sub.add_parser("megatron-to-ours", help="Megatron-LM checkpoint directory -> our checkpoint root",
                       formatter_class=HelpFormatter)
    c.add_argument("--megatron", required=True, help=MEGATRON_DIR_HELP)
    c.add_argument("--out", required=True, help="our checkpoint root; written as <out>/iter_<N>, <out>/latest")
    c.add_argument("--model-name", default="actor", help="name of the model inside our checkpoint")
    c.add_argument("--iteration", type=int, default=None,
                   help="iteration of the new checkpoint (default: the Megatron-LM checkpoint's)")
    d = sub.add_parser("megatron-to-hf", help="Megatron-LM checkpoint directory -> HF directory",
                       formatter_class=HelpFormatter)
    d.add_argument("--megatron", required=True, help=MEGATRON_DIR_HELP)
    d.add_argument("--out", required=True, help="output HF directory (created; files overwritten)")
    d.add_argument("--family", choices=tuple(FAMILIES), default=None,
                   help="HF architecture family (default: qwen3_moe for an MoE, qwen3 with QK-norm, qwen2 with "
                        "QKV bias, else llama)")
    e = sub.add_parser("ours-to-megatron", help="our checkpoint root -> Megatron-LM checkpoint directory",
                       formatter_class=HelpFormatter)
    e.add_argument("--load", required=True, help="our checkpoint root (the directory holding 'latest')")
    e.add_argument("--out", required=True, help="the Megatron-LM checkpoint directory to write (iter_NNNNNNN/ "
                   "and latest_checkpointed_iteration.txt; an existing iteration is refused)")
    e.add_argument("--model-name", default="actor", help="which model of the checkpoint to export")
    e.add_argument("--iteration", type=int, default=None,
                   help="iteration to export (default: the one 'latest' names); also the Megatron-LM iteration")


GGUF_COMMANDS = {
    "gguf-to-hf": lambda a: gguf.gguf_to_hf(a.gguf, a.out),
    "gguf-to-ours": lambda a: gguf_to_ours(a.gguf, a.out, a.model_name, a.role, a.iteration, a.seed),
}


def add_gguf_parsers(sub) -> None:
    """The subcommands of GGUF_COMMANDS (rlhf/checkpoint/gguf.py)."""
    help_gguf = f"the .gguf file (architecture {', '.join(gguf.SUPPORTED_ARCHITECTURES)})"
    f = sub.add_parser("gguf-to-hf", help="GGUF file -> HF directory (float32)", formatter_class=HelpFormatter)
    f.add_argument("--gguf", required=True, help=help_gguf)
    f.add_argument("--out", required=True, help="output HF directory (created; files overwritten)")
    g = sub.add_parser("gguf-to-ours", help="GGUF file -> our checkpoint root", formatter_class=HelpFormatter)
    g.add_argument("--gguf", required=True, help=help_gguf)
    g.add_argument("--out", required=True, help="our checkpoint root; written as <out>/iter_<N>, <out>/latest")
    g.add_argument("--model-name", default="actor", help="name of the model inside our checkpoint")
    g.add_argument("--role", choices=KINDS, default="lm", help="lm: causal LM; value: a new value head")
    g.add_argument("--iteration", type=int, default=0, help="iteration number of the new checkpoint")
    g.add_argument("--seed", type=int, default=0, help="seed of a new value head (--role value)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.direction == "hf-to-ours":
            if not os.path.isdir(args.hf):
                raise HFConversionError(f"--hf {args.hf}: not a directory")
            check_new_iteration(args.out, args.iteration)
            print(hf_to_ours(args.hf, args.out, args.model_name, args.role, args.iteration, args.seed))
        elif args.direction in PEFT_COMMANDS:
            if args.direction == "peft-to-ours":
                check_new_iteration(args.out, args.iteration)
            print(PEFT_COMMANDS[args.direction](args))
        elif args.direction in MEGATRON_COMMANDS:
            print(MEGATRON_COMMANDS[args.direction](args))
        elif args.direction in GGUF_COMMANDS:
            if args.direction == "gguf-to-ours":
                check_new_iteration(args.out, args.iteration)
            print(GGUF_COMMANDS[args.direction](args))
        else:
            dtype = DTYPES[args.dtype] if args.dtype else None
            print(export_saved_model(args.load, args.out, args.model_name, args.iteration, args.family, dtype,
                                     args.merge_adapters))
    except (HFConversionError, storage.CheckpointError, megatron.MegatronCheckpointError,
            peft.PeftConversionError) as e:
        return report("convert_checkpoint.py", e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
