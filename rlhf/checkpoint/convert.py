"""Import a Hugging Face directory or a GGUF file as one model of a new checkpoint of ours.

The other directions live with their formats: ours -> HF is
:func:`rlhf.checkpoint.hf.export_saved_model`, GGUF -> HF
:func:`rlhf.checkpoint.gguf.gguf_to_hf`, Megatron-LM both ways
:mod:`rlhf.checkpoint.megatron`. ``tools/convert_checkpoint.py`` is the command line over all of them.
"""

from __future__ import annotations

import os
import tempfile

from rlhf.checkpoint import gguf, storage
from rlhf.checkpoint.hf import HFConversionError, read_hf_config, read_hf_state
from rlhf.checkpoint.rlhf_state import TOKENIZER_DIR, save_model
from rlhf.checkpoint.sources import HEAD, new_value_head
from rlhf.data import copy_tokenizer_files


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
