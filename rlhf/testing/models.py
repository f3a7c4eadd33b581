"""Unsharded reference models for tests: full weights from a seed, a model holding given weights, plain log-probs.

Every rank can build these alone (one-rank groups), so a test compares a
sharded computation against a single-process one with the same weights.
Call ``rlhf.parallel.groups.build_task_groups`` first (it makes the
one-rank groups ``local_groups`` returns).
"""

from __future__ import annotations

import torch

from rlhf.models.config import ModelConfig
from rlhf.models.gpt import build_model, stage_forward
from rlhf.parallel.groups import local_groups
from rlhf.parallel.reshard import gather_tp_full_weights


def full_weights(kind: str, cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The full weights (by global name) of a random ``kind`` model drawn from ``seed``."""
    local = local_groups()
    return gather_tp_full_weights(build_model(cfg, kind, local.pg_collection, local.stage, seed=seed), local)


def unsharded(kind: str, cfg: ModelConfig, full: dict) -> torch.nn.Module:
    """A single-process ``kind`` model holding the weights ``full``."""
    local = local_groups()
    model = build_model(cfg, kind, local.pg_collection, local.stage, seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(full[name])
    return model


def plain_logprobs(actor: torch.nn.Module, tokens: torch.Tensor, prompt_len: int, response_len: int,
                   temperature: float = 1.0) -> torch.Tensor:
    """[b, response_len] log-probs of the response tokens of ``tokens`` [b, T] by a plain log-softmax of
    logits / ``temperature``."""
    logits = stage_forward(actor, tokens).float() / temperature
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return lp[:, prompt_len - 1:prompt_len - 1 + response_len]
