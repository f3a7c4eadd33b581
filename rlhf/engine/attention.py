"""Attention over the paged KV cache, behind one small interface.

The cache of one layer is ``k_cache, v_cache: [kv_heads, num_blocks,
block_size, head_dim]`` (head-major, so gathering a sequence's blocks yields
per-head contiguous keys ready for batched matmuls). The K/V of this step's
tokens are written into it *before* attention, so every query attends to
cache positions ``[0, its position]`` of its own sequence::

    block_tables[b] = [7, 2, 9]      block_size 4, ctx_lens[b] = 10
    positions 0..3 -> block 7, 4..7 -> block 2, 8..9 -> block 9 (slots 36, 37)

Interface: ``plan = attn.prepare(meta)`` once per step, then
``attn(q, k_cache, v_cache, plan, scale)`` per layer. Four implementations:

* `TorchPagedAttention`: pure torch, any device and dtype; gathers each
  sequence's blocks into a new tensor, then batched matmuls (the reference
  the others are tested against);
* `CpuPagedAttention`: decode rows by a C++ kernel that reads the blocks in
  place (rlhf/engine/native.py; CPU, float32), prefill chunks by the torch path;
* `FlashPagedAttention`: flash-attn's ``flash_attn_with_kvcache`` with block
  tables, given a strided ``[num_blocks, block_size, kv_heads, head_dim]`` view
  of the same cache; needs flash-attn, a half-precision model and
  ``block_size`` a multiple of 256; not exercised by the CPU tests;
* `TritonPagedAttention` (rlhf/engine/triton_attention.py): our own Triton kernel, decode rows and prefill
  chunks reading the blocks in place, online softmax in fp32; needs triton; tested on the CPU under Triton's
  interpreter.

rlhf/engine/attention_backend.py's `make_attention` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass
class AttentionMeta:
    """Where each sequence's queries and keys are, for one step.

    q_starts / q_lens / ctx_lens: python lists, one entry per sequence (query
    rows are contiguous in the flat token dimension). block_tables: [B,
    max_blocks] int32 (padded with 0). decode_rows: sequences with one query
    (batched together); prefill_rows: the others (one by one).
    """

    q_starts: list[int]
    q_lens: list[int]
    ctx_lens: list[int]
    block_tables: torch.Tensor
    decode_rows: list[int]
    prefill_rows: list[int]
    decode_ctx: torch.Tensor  # [len(decode_rows)] int32 context lengths
    decode_tokens: torch.Tensor  # [len(decode_rows)] flat query index

    def decode_tables(self) -> torch.Tensor:
        """The decode rows' block tables; the tensor itself when every row decodes (no index from a host
        list, which a CUDA graph could not record: rlhf/engine/static_decode.py)."""
        if len(self.decode_rows) == len(self.q_lens):
            return self.block_tables
        return self.block_tables[self.decode_rows]


@dataclass
class _Group:
    """Sequences attended in one batched matmul: their blocks, queries and additive mask."""

    idx: torch.Tensor  # [B * nblk] block ids to gather
    batch: int
    queries: int  # query tokens per sequence
    rows: torch.Tensor | slice  # their flat query indices
    mask: torch.Tensor  # additive, broadcastable to [kv_heads * B, queries * q_per_kv, nblk * block_size]


class TorchPagedAttention:
    """Gather blocks per KV head, then ``softmax(q k^T * scale + mask) v`` by PyTorch's
    ``scaled_dot_product_attention`` (GQA-aware).

    The training models' attention is the same fused call (rlhf/models/attention.py), which keeps the scores
    and the softmax in fp32 whatever the model's dtype, so a bf16 engine rounds where a bf16 trained model
    does and its log-probs are that model's.

    Queries of one KV head are stacked, so no K/V head is repeated::

        q [T, kv_heads * q_per_kv, D] -> [kv_heads * B, n * q_per_kv, D]
        k [kv_heads, B * nblk, bs, D] -> [kv_heads * B, nblk * bs, D]
    """

    name = "torch"

    def __init__(self, block_size: int, kv_heads: int, q_per_kv: int, dtype: torch.dtype = torch.float32):
        self.block_size, self.kv_heads, self.q_per_kv, self.dtype = block_size, kv_heads, q_per_kv, dtype

    def prepare(self, meta: AttentionMeta) -> list[_Group]:
        """Block indices and masks of this step, shared by all layers."""
        groups = []
        if meta.decode_rows:
            groups.append(self._group(meta.decode_tables(), meta.decode_tokens, 1,
                                      meta.decode_ctx[:, None, None], max(meta.ctx_lens[r] for r in meta.decode_rows)))
        for row in meta.prefill_rows:
            s, n, ctx = meta.q_starts[row], meta.q_lens[row], meta.ctx_lens[row]
            pos = torch.arange(ctx - n, ctx, device=meta.block_tables.device)
            limit = (pos + 1).repeat_interleave(self.q_per_kv)[None, :, None]  # causal: keys <= own position
            groups.append(self._group(meta.block_tables[row:row + 1], slice(s, s + n), n, limit, ctx))
        return groups

    def _group(self, tables, rows, queries: int, limit, max_ctx: int) -> _Group:
        """limit: [B, queries * q_per_kv or 1, 1] number of visible keys per query row (at most ``max_ctx``).

        ``max_ctx`` comes from the host-side ``ctx_lens``, so sizing the gather needs no device sync.
        """
        nblk = -(-max_ctx // self.block_size)
        keys = torch.arange(nblk * self.block_size, device=tables.device)
        mask = torch.zeros(limit.shape[:2] + keys.shape, device=tables.device, dtype=self.dtype)
        mask.masked_fill_(keys >= limit, float("-inf"))
        return _Group(tables[:, :nblk].reshape(-1).long(), tables.shape[0], queries, rows,
                      mask.repeat(self.kv_heads, 1, 1))

    def __call__(self, q, k_cache, v_cache, plan: list[_Group], scale: float) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim]."""
        out = torch.empty_like(q)
        kvh, qpg, d = self.kv_heads, self.q_per_kv, q.shape[-1]
        for g in plan:
            # [B, n, kvh, qpg, D] -> [kvh * B, n * qpg, D]
            qg = q[g.rows].view(g.batch, g.queries, kvh, qpg, d).permute(2, 0, 1, 3, 4).reshape(kvh * g.batch, -1, d)
            k = k_cache.index_select(1, g.idx).view(kvh * g.batch, -1, d)
            v = v_cache.index_select(1, g.idx).view(kvh * g.batch, -1, d)
            o = F.scaled_dot_product_attention(qg[:, None], k[:, None], v[:, None], attn_mask=g.mask[:, None],
                                               scale=scale)  # 4-D: the fused kernels' layout (3-D runs the math one)
            o = o.view(kvh, g.batch, g.queries, qpg, d).permute(1, 2, 0, 3, 4)
            out[g.rows] = o.reshape(g.batch * g.queries, kvh * qpg, d)
        return out


@dataclass
class _CpuPlan:
    """A step's decode rows for the kernel (their block tables, context lengths and flat query indices) and
    the torch path's plan of its prefill chunks."""

    tables: torch.Tensor
    ctx: torch.Tensor
    tokens: torch.Tensor
    prefill: list[_Group]


class CpuPagedAttention:
    """Decode rows by the C++ kernel of rlhf/engine/csrc/paged_attention.cpp, which reads each sequence's
    keys and values in its blocks (no gathered copy, no per-matrix overhead); prefill chunks, whose queries
    share their keys, by `TorchPagedAttention`'s batched matmuls. float32 on the CPU. The kernel's softmax
    is in float32, as the torch path's is."""

    name = "cpu"

    def __init__(self, kernel, block_size: int, kv_heads: int, q_per_kv: int):
        self.kernel = kernel
        self.prefill = TorchPagedAttention(block_size, kv_heads, q_per_kv, torch.float32)

    def prepare(self, meta: AttentionMeta) -> _CpuPlan:
        return _CpuPlan(meta.decode_tables().int(), meta.decode_ctx.int(), meta.decode_tokens,
                        self.prefill.prepare(replace(meta, decode_rows=[])))

    def __call__(self, q, k_cache, v_cache, plan: _CpuPlan, scale: float) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim]."""
        if not plan.prefill:  # every row decodes, in order: no gather of queries, no scatter of outputs
            return self.kernel(q, k_cache, v_cache, plan.tables, plan.ctx, scale)
        out = self.prefill(q, k_cache, v_cache, plan.prefill, scale)
        if len(plan.tokens):
            out[plan.tokens] = self.kernel(q[plan.tokens], k_cache, v_cache, plan.tables, plan.ctx, scale)
        return out


class FlashPagedAttention:
    """flash-attn's paged kernel; decodes in one call, each prefill chunk in its own."""

    name = "flash"

    def __init__(self):
        from flash_attn import flash_attn_with_kvcache

        self._kernel = flash_attn_with_kvcache

    def prepare(self, meta: AttentionMeta) -> AttentionMeta:
        return meta

    def __call__(self, q, k_cache, v_cache, meta: AttentionMeta, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        k_cache, v_cache = k_cache.permute(1, 2, 0, 3), v_cache.permute(1, 2, 0, 3)  # [blocks, bs, kvh, D] views
        if meta.decode_rows:
            tables = meta.decode_tables()
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
