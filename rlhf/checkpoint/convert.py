"""Every cross-format conversion: HF, GGUF, PEFT and Megatron-LM checkpoints to and from ours, and
Megatron-LM to HF.

The top floor of rlhf.checkpoint: it reads and writes through the format modules (hf.py, gguf.py, peft.py,
megatron.py, rlhf_state.py) and sources.py, and none of them imports it. GGUF -> HF alone is gguf.py's
(:func:`rlhf.checkpoint.gguf.gguf_to_hf`). ``tools/convert_checkpoint.py`` is the command line over all of them.
"""

from __future__ import annotations

import os
import tempfile

import torch

from rlhf.checkpoint import gguf, storage
from rlhf.checkpoint.hf import HFConversionError, export_hf, read_hf_config, read_hf_state
from rlhf.checkpoint.megatron import check_new_path, open_megatron, read_megatron_state, save_megatron
from rlhf.checkpoint.peft import PeftConversionError, check_adapters, load_peft, merged_deltas, save_peft
from rlhf.checkpoint.rlhf_state import TOKENIZER_DIR, save_model, saved_lora_config
from rlhf.checkpoint.sources import HEAD, new_value_head, read_full_state
from rlhf.data import copy_tokenizer_files
from rlhf.models.lora import is_adapter


def hf_to_ours(hf_dir: str, out: str, model_name: str = "actor", role: str = "lm", iteration: int = 0,
               seed: int = 0) -> str:
    """Import an HF directory as model ``model_name`` of a new checkpoint; returns its path.

    role "value" takes the value head from ``score.weight`` of a sequence
    classifier, or draws a new one (:func:`new_value_head` from ``seed``) for a
    causal LM. Tokenizer files, if any, are copied to ``<out>/tokenizer``.
    """
    info = read_hf_config(hf_dir)
    full = read_hf_state(hf_dir, info, role)
    if info.config.tie_embeddings and role == "lm":  # one HF tensor, two of our (untied) weights: own storage
        full[HEAD] = full[HEAD].clone()
    if role == "value" and HEAD not in full:
        full[HEAD] = new_value_head(info.config, seed)
    path = save_model(out, iteration, model_name, info.config, role, full,
                      {"converted_from": os.path.abspath(hf_dir), "architecture": info.architecture})
    copy_tokenizer_files(hf_dir, os.path.join(out, TOKENIZER_DIR))
    return path


def gguf_to_ours(gguf_path: str, out: str, model_name: str = "actor", role: str = "lm", iteration: int = 0,
                 seed: int = 0) -> str:
    """Dequantize a GGUF file into a temporary HF directory and import that as :func:`hf_to_ours` does."""
    with tempfile.TemporaryDirectory(prefix="gguf-") as tmp:
        return hf_to_ours(gguf.gguf_to_hf(gguf_path, tmp), out, model_name, role, iteration, seed)


def check_new_iteration(out: str, iteration: int) -> None:
    """Refuse to import into an iteration that already exists under ``out`` (before any conversion work)."""
    if os.path.exists(storage.checkpoint_path(out, iteration)):
        raise HFConversionError(f"--out {out}: iteration {iteration} already exists there; "
                                "give another --out or --iteration")


def export_saved_model(root: str, out: str, model_name: str = "actor", iteration: int | None = None,
                       family: str | None = None, dtype: torch.dtype | None = None,
                       merge_adapters: bool = False) -> str:
    """Export model ``model_name`` of our checkpoint root ``root`` (``latest`` unless ``iteration``) as an
    HF directory: value models as ``*ForSequenceClassification``, with the checkpoint's tokenizer files
    (``<root>/tokenizer``), its weights in ``dtype`` (None: as saved); returns ``out``. A model with LoRA
    adapters is exported as its base (its trained modules_to_save included), or with ``merge_adapters`` as
    W + (alpha / r) B A."""
    cfg, role, full = read_full_state(root, model_name, iteration)
    lora = saved_lora_config(root, model_name, iteration) if merge_adapters else None
    if merge_adapters and lora is None:
        raise HFConversionError(f"--merge-adapters: model {model_name!r} of {root} has no LoRA adapters")
    export_hf(out, cfg, full, kind="sequence_classification" if role == "value" else "causal_lm", family=family,
              dtype=dtype, deltas=merged_deltas(full, lora) if lora else None)
    copy_tokenizer_files(os.path.join(root, TOKENIZER_DIR), out)
    return out


def export_peft(root: str, out: str, model_name: str = "actor", iteration: int | None = None) -> str:
    """Model ``model_name`` of our checkpoint root ``root``'s adapters (and modules_to_save) as PEFT's files
    in ``out``, loadable by ``peft.PeftModel.from_pretrained`` on its base (ours-to-hf); returns ``out``."""
    lora = saved_lora_config(root, model_name, iteration)
    if lora is None:
        raise PeftConversionError(f"--model-name {model_name}: the model in {root} has no LoRA adapters "
                                  "(trained without --lora-rank)")
    cfg, _, full = read_full_state(root, model_name, iteration, with_base=False)  # no base needed (nor read)
    return save_peft(out, full, lora, vocab_size=cfg.vocab_size)


def import_peft(peft_dir: str, hf_dir: str, out: str, model_name: str = "actor", iteration: int = 0) -> str:
    """PEFT's adapter files in ``peft_dir`` on the HF causal LM ``hf_dir`` -> our checkpoint root ``out``
    (its base, adapters and modules_to_save, and the LoRA config); returns the checkpoint directory."""
    lora, state = load_peft(peft_dir)
    info = read_hf_config(hf_dir)
    check_adapters(state, lora, info.config, f"--peft {peft_dir} on --hf {hf_dir}")
    full = read_hf_state(hf_dir, info, "lm")
    for name, tensor in state.items():
        if not is_adapter(name):  # a module to save: its HF rows, padded as the base
            if name not in full or tensor.shape[1:] != full[name].shape[1:] or len(tensor) > len(full[name]):
                raise PeftConversionError(f"--peft {peft_dir}: {name} of shape {tuple(tensor.shape)} does not fit "
                                          f"the model's {tuple(full[name].shape) if name in full else 'nothing'}")
            tensor = torch.cat([tensor.to(full[name].dtype), full[name][len(tensor):]])
        full[name] = tensor
    return save_model(out, iteration, model_name, info.config, "lm", full, lora=lora)


def megatron_to_hf(src: str, out: str, family: str | None = None) -> str:
    """Export Megatron-LM checkpoint directory ``src`` as an HF directory loadable by transformers (a value
    model as ``*ForSequenceClassification``), with its tokenizer files if it saved any; returns ``out``."""
    ckpt = open_megatron(src)
    kind = "sequence_classification" if ckpt.role == "value" else "causal_lm"
    export_hf(out, ckpt.config, read_megatron_state(ckpt), kind=kind, family=family)
    copy_tokenizer_files(ckpt.tokenizer_dir(), out)
    return out


def megatron_to_ours(src: str, out: str, model_name: str = "actor", iteration: int | None = None) -> str:
    """Import Megatron-LM checkpoint directory ``src`` as model ``model_name`` of a new checkpoint of ours
    (iteration: the Megatron-LM one unless given); returns its directory."""
    ckpt = open_megatron(src)
    iteration = ckpt.iteration if iteration is None else iteration
    check_new_path(storage.checkpoint_path(out, iteration))
    path = save_model(out, iteration, model_name, ckpt.config, ckpt.role, read_megatron_state(ckpt),
                      {"converted_from": os.path.abspath(ckpt.path), "format": "megatron-lm torch_dist"})
    copy_tokenizer_files(ckpt.tokenizer_dir(), os.path.join(out, TOKENIZER_DIR))
    return path


def ours_to_megatron(root: str, out: str, model_name: str = "actor", iteration: int | None = None) -> str:
    """Export model ``model_name`` of our checkpoint root (``latest`` unless ``iteration``) as a Megatron-LM
    checkpoint directory ``out`` of the same iteration, with ``<root>/tokenizer``; returns its iteration
    directory."""
    it = storage.resolve_checkpoint(root, iteration)
    cfg, role, full = read_full_state(root, model_name, it)
    path = save_megatron(out, cfg, role, full, it)
    copy_tokenizer_files(os.path.join(root, TOKENIZER_DIR), os.path.join(path, "tokenizer"))
    return path
