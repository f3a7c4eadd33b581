"""Data parallelism: averaging a model's gradients over its task's DP group."""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def average_gradients(module: torch.nn.Module, dp_group) -> None:
    """Average accumulated gradients over ``dp_group`` with one flat all-reduce.

    Parameters without a gradient get zeros first, so every replica
    contributes the same flat layout.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    dp = dist.get_world_size(dp_group)
    if dp == 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=dp_group)
    flat /= dp
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))
