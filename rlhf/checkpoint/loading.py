"""Load one LM, unsharded on this rank, from a model directory (inference tools).

The directory is whatever :func:`rlhf.checkpoint.sources.open_source` reads (an
HF directory, a Megatron-LM checkpoint or our checkpoint root): sources.py tells
them apart and reads the tensors; this module builds the model and fills it. It sits above sources.py;
nothing in rlhf.checkpoint imports it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.checkpoint.sources import open_source, read_weights
from rlhf.models.config import ModelConfig


@dataclass
class LoadedModel:
    """An eval-mode model with its shape and where its tokenizer files are (None: none saved)."""

    model: torch.nn.Module
    config: ModelConfig
    tokenizer_dir: str | None


def load_unsharded_lm(path: str, model_name: str = "actor", iteration: int | None = None,
                      dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The LM at ``path`` as one unsharded model on this rank, its parameters in ``dtype``.

    ``model_name`` and ``iteration`` choose within our checkpoint (default: model
    "actor" of the iteration ``latest`` names). Checks the directory first, then
    initialises torch.distributed (one process is a world of one) and the one-rank
    groups the model needs. Raises ModelSourceError when ``path`` holds no LM,
    CheckpointError / HFConversionError / MegatronCheckpointError for unreadable tensors.
    """
    from rlhf import platform
    from rlhf.models.gpt import build_model
    from rlhf.models.naming import named_global_parameters
    from rlhf.parallel import Placement
    from rlhf.parallel.groups import build_task_groups, local_groups
    from rlhf.parallel.reshard import load_full_weights

    source = open_source(path, "actor", model_name=model_name, iteration=iteration)
    platform.init_distributed()
    build_task_groups(Placement.from_plan({}, 1))
    groups = local_groups()
    model = build_model(source.config, "lm", groups.pg_collection, groups.stage, dtype=dtype)
    load_full_weights(model, groups, read_weights(source, list(named_global_parameters(model)), head_seed=0))
    return LoadedModel(model.eval(), source.config, source.tokenizer_dir())
