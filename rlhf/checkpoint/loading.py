"""Load one LM, unsharded on this rank, from an HF directory or our checkpoint (inference tools)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rlhf.checkpoint.hf import load_hf_weights, read_hf_config
from rlhf.checkpoint.rlhf_state import TOKENIZER_DIR, ModelSlot, load_rlhf_state, saved_model_config
from rlhf.checkpoint.storage import CheckpointError
from rlhf.data.tokenizer import is_tokenizer_dir
from rlhf.models.config import ModelConfig


@dataclass
class LoadedModel:
    """An eval-mode model with its shape and where its tokenizer files are (None: none saved)."""

    model: torch.nn.Module
    config: ModelConfig
    tokenizer_dir: str | None


def is_hf_dir(path: str) -> bool:
    """True for a Hugging Face model directory (it has a config.json)."""
    return os.path.isfile(os.path.join(path, "config.json"))


def load_unsharded_lm(path: str, model_name: str = "actor", iteration: int | None = None) -> LoadedModel:
    """The LM at ``path`` (HF directory or our checkpoint root) as one unsharded model on this rank.

    Initialises torch.distributed (one process is a world of one) and the
    one-rank groups the model needs. Raises CheckpointError / HFConversionError
    for unreadable input, CheckpointError too when ``model_name`` is not an LM.
    """
    from rlhf import platform
    from rlhf.models.gpt import build_model
    from rlhf.parallel import Placement
    from rlhf.parallel.groups import build_task_groups, local_groups

    platform.init_distributed()
    build_task_groups(Placement.from_plan({}, 1))
    groups = local_groups()
    if is_hf_dir(path):
        cfg = read_hf_config(path).config
        model = build_model(cfg, "lm", groups.pg_collection, groups.stage)
        load_hf_weights(model, groups, path, "lm")
        return LoadedModel(model.eval(), cfg, path)
    cfg, role = saved_model_config(path, model_name, iteration)
    if role != "lm":
        raise CheckpointError(f"model {model_name!r} has role {role!r}; generation needs an LM "
                              "(role 'lm', e.g. actor; choose it with --model-name)")
    model = build_model(cfg, "lm", groups.pg_collection, groups.stage)
    load_rlhf_state(path, {model_name: ModelSlot(cfg, role, model, groups)}, iteration, restore_rng=False)
    tok_dir = os.path.join(path, TOKENIZER_DIR)
    return LoadedModel(model.eval(), cfg, tok_dir if is_tokenizer_dir(tok_dir) else None)
