"""Reference GAE: the recursive loop over time (verl / OpenRLHF style),
vectorised over the batch and extended to skip inner-masked tokens.

Used by tests/test_gae.py (exactness) and benchmarks/gae.py (speed, memory).
Not part of the library: ``rlhf.algorithms.compute_gae`` is the implementation.
"""
from typing import Tuple, Union

import torch

Scalar = Union[float, torch.Tensor]


@torch.no_grad()
def gae_loop(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: Scalar, lam: Scalar
) -> Tuple[torch.Tensor, torch.Tensor]:
    """[B, T] inputs -> (advantages, returns) [B, T]; 0 at masked tokens.

    gamma and lam are floats or [B] tensors (one setting per row, so a test can
    check many settings with one pass of the loop).

    A masked token keeps the running (next value, next advantage) of the next
    valid token untouched, so the recursion skips it.
    """
    valid = mask > 0
    batch, length = rewards.shape
    next_value = rewards.new_zeros(batch)
    last_gae = rewards.new_zeros(batch)
    advantages_reversed = []
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        last_gae = torch.where(valid[:, t], gae, last_gae)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages_reversed.append(torch.where(valid[:, t], gae, torch.zeros_like(gae)))
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = torch.where(valid, advantages + values, torch.zeros_like(values))
    return advantages, returns
