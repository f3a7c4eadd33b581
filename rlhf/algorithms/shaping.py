"""Reward shaping by response length: DAPO's soft overlong punishment (Yu et al. 2025, section 3.4).

With a generation budget of ``max_len`` tokens and a buffer of ``buffer``
tokens before it, a response of length L gets

    0                                   L <= max_len - buffer
    -coef * (L - (max_len - buffer)) / buffer   max_len - buffer < L <= max_len

added to its score, so answers that run into the budget are discouraged
smoothly instead of by a cliff (DAPO's third case, L > max_len, cannot
occur: the engine stops at the budget).
"""

from __future__ import annotations

import torch


def overlong_penalty(response_lengths: torch.Tensor, max_len: int, buffer: int, coef: float) -> torch.Tensor:
    """[N] float32 penalties (<= 0) for responses of ``response_lengths`` [N] tokens (module docstring)."""
    if not 1 <= buffer <= max_len:
        raise ValueError(f"overlong buffer {buffer} must be in [1, max_len={max_len}]")
    over = (response_lengths.float() - (max_len - buffer)).clamp(min=0.0) / buffer
    return -coef * over.clamp(max=1.0)
