"""Attention over the paged KV cache, behind one small interface.

The cache of one layer is ``k_cache, v_cache: [num_blocks, block_size,
kv_heads, head_dim]`` (flash-attn's paged layout). The K/V of this step's
tokens are written into it *before* attention, so every query attends to
cache positions ``[0, its position]`` of its own sequence::

    block_tables[b] = [7, 2, 9]      block_size 4, ctx_lens[b] = 10
    positions 0..3 -> block 7, 4..7 -> block 2, 8..9 -> block 9 (slots 36, 37)

Interface: ``plan = attn.prepare(meta, block_size)`` once per step, then
``attn(q, k_cache, v_cache, plan, scale)`` per layer. Two implementations:
`TorchPagedAttention` (pure torch, any device, used on
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


@dataclass
class _Gather:
    """Precomputed per step: which cache blocks to read for a group of sequences, and its mask."""

    idx: torch.Tensor  # [B * nblk] block ids
    batch: int
    ctx: int  # keys read per sequence (padded to the longest in the group)
    mask: torch.Tensor  # bool, broadcastable to [B, heads, queries, ctx]


class TorchPagedAttention:
    """Gather the blocks, mask by length and causality, call SDPA.

    `prepare` builds the block indices and masks once per step; the call per
    layer then only gathers and attends.
    """

    name = "torch"

    def prepare(self, meta: AttentionMeta, block_size: int):
        dev = meta.block_tables.device
        decode = None
        if meta.decode_rows:
            ctx = max(meta.ctx_lens[r] for r in meta.decode_rows)
            mask = torch.arange(ctx, device=dev)[None, :] < meta.decode_ctx[:, None]  # [B, ctx]
            decode = _plan(meta.block_tables[meta.decode_rows], ctx, block_size, mask[:, None, None, :])
        prefill = []
        for row in meta.prefill_rows:
            n, ctx = meta.q_lens[row], meta.ctx_lens[row]
            pos = torch.arange(ctx - n, ctx, device=dev)
            mask = torch.arange(ctx, device=dev)[None, :] <= pos[:, None]  # [n, ctx] causal
            prefill.append((meta.q_starts[row], n, _plan(meta.block_tables[row:row + 1], ctx, block_size,
                                                         mask[None, None])))
        return meta, decode, prefill

    def __call__(self, q, k_cache, v_cache, plan, scale: float) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim]."""
        meta, decode, prefill = plan
        out = torch.empty_like(q)
        if decode is not None:
            k, v = _gather(k_cache, v_cache, decode)
            out[meta.decode_tokens] = _sdpa(q[meta.decode_tokens][:, None], k, v, decode.mask, scale)[:, 0]
        for s, n, g in prefill:
            k, v = _gather(k_cache, v_cache, g)
            out[s:s + n] = _sdpa(q[s:s + n][None], k, v, g.mask, scale)[0]
        return out


def _plan(tables: torch.Tensor, ctx: int, block_size: int, mask: torch.Tensor) -> _Gather:
    nblk = -(-ctx // block_size)
    return _Gather(tables[:, :nblk].reshape(-1).long(), tables.shape[0], ctx, mask)


def _gather(k_cache, v_cache, g: _Gather):
    """[B, ctx, kv_heads, head_dim] keys and values of the planned sequences."""
    # index_select copies whole contiguous blocks (much faster on CPU than advanced indexing)
    shape = (g.batch, -1) + k_cache.shape[2:]
    k = k_cache.index_select(0, g.idx).view(shape)[:, :g.ctx]
    v = v_cache.index_select(0, g.idx).view(shape)[:, :g.ctx]
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

    def prepare(self, meta: AttentionMeta, block_size: int) -> AttentionMeta:
        return meta

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
