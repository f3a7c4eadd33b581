"""Generalised Advantage Estimation in matrix form (owns GAE and discounted returns).

GAE is a reverse linear recurrence over the valid tokens of each row::

    delta_t = r_t + gamma * V_{t'} - V_t        (t' = next valid token, V = 0 past the end)
    A_t     = delta_t + gamma * lam * A_{t'}
    R_t     = A_t + V_t

Instead of a Python loop over time (T sequential steps) it is evaluated as a
*blocked discounted suffix sum* with c = gamma * lam::

    time ─►  | block 0 (K) | block 1 (K) | ... | block n-1 (K) |
    local[b, i] = sum_{i<=j<K} c^(j-i) x[b, j]        one [B*n, K] x [K, K] matmul
    A[b, i]     = local[b, i] + c^(K-i) * A[b+1, 0]    carry from the next block

The carries ``A[b, 0]`` obey the same recurrence one level up (element
``local[b, 0]``, factor ``c^K``), so they are solved by the same routine on a
sequence K times shorter: ``ceil(log_K T)`` levels, no T x T matrix, cost
O(B * T * K). Coefficients are plain powers ``c^m`` with ``0 <= m <= K`` (computed
in float64, underflow to 0 is harmless), so any c in [0, 1] is safe for any T.

Masks (right padding, plus holes inside a response such as tool output): a token
with ``mask == 0`` gets advantage 0 and return 0, its reward and value are
ignored, and it does not break the recursion: next-value and next-advantage come
from the next *valid* token, and discounting counts valid tokens only. This is
implemented by compaction: valid tokens of each row are moved, in order, to the
front (a scatter to ``cumsum(mask) - 1``), the dense scan runs on the compacted
rows, and results are gathered back::

    mask      1 1 0 0 1 1 0 0        compacted  x0 x1 x4 x5 0 0 0 0
    x         x0 x1 . . x4 x5 . .    (scan runs here, zeros past the end)
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch

# Block size along time, from `benchmarks/gae.py --sweep-blocks` on a 2-core CPU
# (B=64): K=16..128 are within 10% at T <= 4096; K=32 is fastest at T=16384.
DEFAULT_BLOCK = 32


@functools.lru_cache(maxsize=64)
def _suffix_coefficients(
    factor: float, size: int, dtype: torch.dtype, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Within-block matrix M^T ([size, size], M[i, j] = factor^(j-i) for j >= i)
    and carry vector p ([size], p[i] = factor^(size-i)). Cached: read-only."""
    idx = torch.arange(size, dtype=torch.float64)
    expo = idx[None, :] - idx[:, None]  # expo[i, j] = j - i
    base = torch.tensor(factor, dtype=torch.float64)
    mat = torch.where(expo >= 0, base.pow(expo.clamp(min=0)), torch.zeros((), dtype=torch.float64))
    carry = base.pow(size - idx)
    return mat.t().contiguous().to(device=device, dtype=dtype), carry.to(device=device, dtype=dtype)


def discounted_suffix_sum(x: torch.Tensor, factor: float, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """y[:, t] = sum_{j >= t} factor^(j - t) * x[:, j] along the last dim.

    Args:
        x: [B, T] float tensor (dense: no mask).
        factor: discount in [0, 1].
        block: block size K; work is O(B*T*K), recursion depth ceil(log_K T).
    Returns:
        [B, T] tensor, same dtype as ``x``.
    """
    if not 0.0 <= factor <= 1.0:
        raise ValueError(f"factor={factor} must lie in [0, 1]")
    if block < 2:
        raise ValueError(f"block={block} must be >= 2")
    batch, length = x.shape
    if length <= block:
        mat_t, _ = _suffix_coefficients(factor, length, x.dtype, x.device)
        return x @ mat_t
    n_blocks = -(-length // block)
    if n_blocks * block != length:  # callers on the hot path pre-pad (no copy)
        x = torch.nn.functional.pad(x, (0, n_blocks * block - length))
    mat_t, carry_coef = _suffix_coefficients(factor, block, x.dtype, x.device)
    local = (x.reshape(batch * n_blocks, block) @ mat_t).view(batch, n_blocks, block)
    # Full value at each block start: same recurrence, one level up.
    heads = discounted_suffix_sum(local[:, :, 0].contiguous(), factor**block, block)
    next_head = torch.nn.functional.pad(heads[:, 1:], (0, 1))  # [B, n]; 0 after the last block
    out = local.addcmul_(next_head.unsqueeze(-1), carry_coef)  # local + next_head * c^(K-i)
    return out.view(batch, n_blocks * block)[:, :length]


def _padded_width(length: int, block: int) -> int:
    """Compacted row width: at least T + 1 (column T is the masked tokens' slot,
    read back as 0) and a multiple of ``block`` so the scan needs no padding copy."""
    return -(-(length + 1) // block) * block


def _compaction_index(mask: torch.Tensor) -> torch.Tensor:
    """dest [B, T] int64: destination column of each token after compaction.
    Valid tokens go to cumsum(mask) - 1, masked ones to column T."""
    valid = mask if mask.dtype == torch.bool else mask > 0
    slot = mask.shape[1]
    # dest = valid ? cumsum - 1 : T, written as in-place arithmetic (cheaper than masked_fill).
    dest = valid.long().cumsum_(1).sub_(1 + slot)
    return dest.mul_(valid).add_(slot)


def _compact(x: torch.Tensor, dest: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Move valid tokens to the front of each row: [B, T] -> [B, width], width > T,
    zeros from column T on (column T first collects the masked tokens, then is cleared)."""
    batch, length = x.shape
    out = torch.zeros(batch, width, dtype=dtype, device=x.device)
    out.scatter_(1, dest, x.to(dtype))
    out[:, length] = 0
    return out


def _check_inputs(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, **scalars: float) -> None:
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must all be [batch, time]"
        )
    for name, value in scalars.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} must lie in [0, 1]")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    # Half-precision inputs are accumulated in float32.
    return torch.promote_types(x.dtype, torch.float32)


@torch.no_grad()
def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    block: int = DEFAULT_BLOCK,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns, matrix form (see module docstring).

    Args:
        rewards: [B, T] per-token rewards (e.g. from ``token_rewards``).
        values: [B, T] critic values V_t of the same tokens.
        mask: [B, T] 0/1 (bool, int or float), 1 = valid response token.
            Right padding; zeros inside a response are skipped (see module doc).
        gamma, lam: discount and GAE lambda in [0, 1].
        block: time block size K.
    Returns:
        (advantages, returns), each [B, T] in the promoted float dtype of
        ``rewards``; both are 0 at masked tokens. returns = advantages + values.
    """
    _check_inputs(rewards, values, mask, gamma=gamma, lam=lam)
    dtype = _work_dtype(rewards)
    width = _padded_width(rewards.shape[1], block)
    dest = _compaction_index(mask)
    # In-place ops below: fresh [B, T] buffers cost page faults on CPU.
    delta = _compact(rewards, dest, width, dtype)
    val = _compact(values, dest, width + 1, dtype)
    # Compacted rows are zero from each row's valid length on, so delta and the
    # advantage are 0 there, and masked tokens (dest = T) read back 0.
    delta.add_(val[:, 1:], alpha=gamma).sub_(val[:, :-1])
    adv = discounted_suffix_sum(delta, gamma * lam, block)
    del delta  # lowers the peak: it is not needed for the gathers
    advantages = adv.gather(1, dest)
    returns = adv.add_(val[:, :-1]).gather(1, dest)
    return advantages, returns


@torch.no_grad()
def discounted_returns(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float, block: int = DEFAULT_BLOCK
) -> torch.Tensor:
    """G_t = sum over later valid tokens j of gamma^(#valid steps t->j) * r_j.

    Args:
        rewards: [B, T]; mask: [B, T] 0/1, same convention as ``compute_gae``.
    Returns:
        [B, T] returns, 0 at masked tokens.
    """
    _check_inputs(rewards, rewards, mask, gamma=gamma)
    dest = _compaction_index(mask)
    rew = _compact(rewards, dest, _padded_width(rewards.shape[1], block), _work_dtype(rewards))
    return discounted_suffix_sum(rew, gamma, block).gather(1, dest)
