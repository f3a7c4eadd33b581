"""Attention over the paged KV cache, behind one small interface.

The cache of one layer is ``k_cache, v_cache: [num_blocks, block_size,
kv_heads, head_dim]`` (flash-attn's paged layout). The K/V of this step's
tokens are written into it *before* attention, so every query attends to
cache positions ``[0, its position]`` of its own sequence::

    block_tables[b] = [7, 2, 9]      block_size 4, ctx_lens[b] = 10
    positions 0..3 -> block 7, 4..7 -> block 2, 8..9 -> block 9 (slots 36, 37)

Two implementations: `TorchPagedAttention` (pure torch, any device, used on
CPU and in tests) and `FlashPagedAttention` (flash-attn's
``flash_attn_with_kvcache`` with block tables; needs flash-attn installed and
``block_size`` a multiple of 256). `make_attention` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMeta:
    """Where each sequence's queries and keys are, for one step.

    q_starts / q_lens / ctx_lens: python lists, one entry per sequence (query
    rows are contiguous in the flat token dimension). block_tables: [B,
    max_blocks] int32 (padded with 0). decode_rows: indices of sequences with
    one query (batched together); the rest are handled one by one.
    """

    q_starts: list[int]
    q_lens: list[int]
    ctx_lens: list[int]
    block_tables: torch.Tensor
    decode_rows: list[int]
    prefill_rows: list[int]
    decode_ctx: torch.Tensor  # [len(decode_rows)] int32 context lengths
    decode_tokens: torch.Tensor  # [len(decode_rows)] flat query index


class TorchPagedAttention:
    """Gather the blocks, mask by length and causality, call SDPA."""

    name = "torch"

    def __call__(self, q, k_cache, v_cache, meta: AttentionMeta, scale: float) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim]."""
        out = torch.empty_like(q)
        if meta.decode_rows:
            out[meta.decode_tokens] = self._decode(q[meta.decode_tokens], k_cache, v_cache, meta, scale)
        for row in meta.prefill_rows:
            s, n, ctx = meta.q_starts[row], meta.q_lens[row], meta.ctx_lens[row]
            k, v = _gather(k_cache, v_cache, meta.block_tables[row:row + 1], ctx)
            pos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= pos[:, None]  # [n, ctx]
            out[s:s + n] = _sdpa(q[s:s + n][None], k, v, mask[None, None], scale)[0]
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale):
        ctx = meta.decode_ctx
        max_ctx = max(meta.ctx_lens[r] for r in meta.decode_rows)
        k, v = _gather(k_cache, v_cache, meta.block_tables[meta.decode_rows], max_ctx)
        mask = torch.arange(max_ctx, device=q.device)[None, :] < ctx[:, None]  # [B, ctx]
        return _sdpa(q[:, None], k, v, mask[:, None, None, :], scale)[:, 0]


def _gather(k_cache, v_cache, tables, ctx):
    """[B, ctx, kv_heads, head_dim] keys and values of the sequences in ``tables``."""
    bs = k_cache.shape[1]
    nblk = -(-ctx // bs)
    idx = tables[:, :nblk].long()
    k = k_cache[idx].flatten(1, 2)[:, :ctx]
    v = v_cache[idx].flatten(1, 2)[:, :ctx]
    return k, v


def _sdpa(q, k, v, mask, scale):
    """q: [B, n, H, D], k/v: [B, ctx, Hkv, D], mask: bool broadcastable to [B, H, n, ctx]."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2)


class FlashPagedAttention:
    """flash-attn's paged kernel; decodes in one call, each prefill chunk in its own."""

    name = "flash"

    def __init__(self):
        from flash_attn import flash_attn_with_kvcache

        self._kernel = flash_attn_with_kvcache

    def __call__(self, q, k_cache, v_cache, meta: AttentionMeta, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        if meta.decode_rows:
            tables = meta.block_tables[meta.decode_rows]
            out[meta.decode_tokens] = self._kernel(
                q[meta.decode_tokens][:, None], k_cache, v_cache, cache_seqlens=meta.decode_ctx,
                block_table=tables, softmax_scale=scale, causal=True)[:, 0]
        for row in meta.prefill_rows:
            s, n = meta.q_starts[row], meta.q_lens[row]
            ctx = torch.tensor([meta.ctx_lens[row]], dtype=torch.int32, device=q.device)
            out[s:s + n] = self._kernel(q[s:s + n][None], k_cache, v_cache, cache_seqlens=ctx,
                                        block_table=meta.block_tables[row:row + 1], softmax_scale=scale,
                                        causal=True)[0]
        return out


def flash_available() -> bool:
    """True when flash-attn imports (it needs a GPU build)."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def make_attention(backend: str, block_size: int):
    """``"torch"``, ``"flash"`` (error if unavailable) or ``"auto"`` (flash when usable)."""
    usable = flash_available() and block_size % 256 == 0
    if backend == "flash" and not usable:
        raise RuntimeError("attention_backend='flash' needs flash-attn installed and block_size % 256 == 0; "
                           "use 'torch' or 'auto'")
    if backend == "flash" or (backend == "auto" and usable):
        return FlashPagedAttention()
    return TorchPagedAttention()
