"""Paged attention by a Triton kernel of our own: reads each sequence's K/V blocks in place through its block table.

One kernel serves decode rows and prefill chunks. A *work item* is ``(table row, first query token, n queries,
ctx_end)``: its queries sit at positions ``ctx_end - n .. ctx_end - 1`` and each sees the keys up to its own
position (keys of earlier chunks and prefix-shared blocks included, as the tables point at them). One program
takes one item and one KV head, with that head's ``q_per_kv`` query heads stacked as rows (GQA without
repeating K/V)::

    rows m = 0 .. BLOCK_M-1:  query qi = m // q_per_kv, head kv_head * q_per_kv + m % q_per_kv
    keys j = start .. start+BLOCK_N-1:  block tables[row, j // block_size], slot j % block_size

It walks the keys ``BLOCK_N`` at a time up to ``ctx_end`` (a bound it loads from the device) with an online
softmax in fp32 (scores and accumulator; the probabilities meet V in the input's dtype, as flash-attn's do).
fp32 inputs use ``input_precision="ieee"`` (Triton's fp32 default, TF32, rounds the inputs to 10 bits).

Decode rows form one launch whose grid and arguments depend only on tensor shapes and buffers (the items are
built on the device from ``decode_tokens`` / ``decode_ctx``), so rlhf/engine/static_decode.py records it in a
CUDA graph; prefill chunks, split into tiles of ``BLOCK_M // q_per_kv`` queries, form a second launch.

triton is imported guarded: without it this module still imports and `TritonPagedAttention` refuses to build.
On the CPU, ``TRITON_INTERPRET=1`` set before triton's import runs the kernel on CPU tensors (numpy; no bf16
arithmetic): tests/test_triton_attention.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.engine.attention import AttentionMeta

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install without triton: `triton_available()` says so
    triton = tl = None

LOG2E = 1.4426950408889634  # the kernel's softmax is in base 2: exp(x) = exp2(x * log2(e))


def triton_available() -> bool:
    """True when triton imports."""
    return triton is not None


def _paged_attention(q, out, k_cache, v_cache, tables, work, qk_scale,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_kb, stride_ks, stride_table,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, QPG: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """One program: work item ``program_id(0)`` for KV head ``program_id(1)`` (module docstring)."""
    item, kv_head = tl.program_id(0), tl.program_id(1).to(tl.int64)
    row = tl.load(work + item * 4).to(tl.int64)
    first = tl.load(work + item * 4 + 1)
    n = tl.load(work + item * 4 + 2)
    ctx_end = tl.load(work + item * 4 + 3)
    m = tl.arange(0, BLOCK_M)
    qi, head = m // QPG, kv_head * QPG + m % QPG
    # rows past the item's queries are padding (not stored); their pos >= ctx_end, so every row sees key 0
    # and no row's running max stays -inf (no NaN)
    pos = ctx_end - n + qi
    d = tl.arange(0, BLOCK_D)
    rows_mask = (qi < n)[:, None] & (d < HEAD_DIM)[None, :]
    token = (first + qi).to(tl.int64)
    qv = tl.load(q + (token * stride_qt + head * stride_qh)[:, None] + d[None, :], mask=rows_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = tables + row * stride_table
    k_head, v_head = k_cache + kv_head * stride_kh, v_cache + kv_head * stride_kh
    for start in range(0, ctx_end, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        inside = j < ctx_end
        block = tl.load(table + j // BLOCK_SIZE, mask=inside, other=0)
        kv = block * stride_kb + (j % BLOCK_SIZE) * stride_ks
        kv_mask = inside[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_head + kv[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(qv, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(j[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + kv[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    o = (acc / l_i[:, None]).to(out.dtype.element_ty)
    tl.store(out + (token * stride_ot + head * stride_oh)[:, None] + d[None, :], o, mask=rows_mask)


_kernel = triton.jit(_paged_attention) if triton is not None else None


@dataclass
class _TritonPlan:
    """A step's launches: decode items with their tables (None without decode rows), prefill tiles (items
    into ``meta.block_tables``; None without prefill rows)."""

    decode: torch.Tensor | None  # [rows, 4] int32
    decode_tables: torch.Tensor | None
    prefill: torch.Tensor | None  # [tiles, 4] int32
    tables: torch.Tensor


class TritonPagedAttention:
    """The Triton kernel above: decode rows in one launch, prefill tiles in another; fp16/bf16 (fp32 with
    IEEE products). q and each cache must be contiguous in their last dimension, K and V of equal strides
    (views of one cache tensor, as the decoder's are)."""

    name = "triton"
    PREFILL_ROWS = 64  # rows (queries x q_per_kv) of a prefill tile; a decode item has max(16, q_per_kv)
    TILE = 4096  # elements of a loop step's K (and V) tile: BLOCK_N keys x BLOCK_D (no register spills on sm_90)

    def __init__(self, block_size: int, kv_heads: int, q_per_kv: int):
        if triton is None:
            raise RuntimeError("TritonPagedAttention needs triton (pip install triton)")
        self.block_size, self.kv_heads, self.q_per_kv = block_size, kv_heads, q_per_kv
        pow2 = triton.next_power_of_2(q_per_kv)
        self.decode_rows, self.prefill_rows = max(16, pow2), max(self.PREFILL_ROWS, pow2)  # tl.dot: M >= 16

    def prepare(self, meta: AttentionMeta) -> _TritonPlan:
        """The step's work items. Decode items come from device tensors only (a CUDA graph can record this);
        prefill tiles from the host lists."""
        decode = tables = None
        if meta.decode_rows:
            tables = meta.decode_tables()
            rows = torch.arange(tables.shape[0], dtype=torch.int32, device=tables.device)
            decode = torch.stack((rows, meta.decode_tokens.to(torch.int32), torch.ones_like(rows),
                                  meta.decode_ctx.to(torch.int32)), 1)
        tiles = self._prefill_tiles(meta)
        prefill = (torch.tensor(tiles, dtype=torch.int32).to(meta.block_tables.device, non_blocking=True)
                   if tiles else None)  # non_blocking: no wait for the queued kernels
        return _TritonPlan(decode, tables, prefill, meta.block_tables)

    def _prefill_tiles(self, meta: AttentionMeta) -> list[tuple[int, int, int, int]]:
        """Each prefill chunk's queries in tiles of ``prefill_rows // q_per_kv``: (table row, first token, n,
        ctx_end); a chunk of ``q_len`` queries ends at position ``ctx_len - 1``, so its queries start at
        ``ctx_len - q_len``."""
        per_tile, tiles = self.prefill_rows // self.q_per_kv, []
        for row in meta.prefill_rows:
            first_pos, q_len = meta.ctx_lens[row] - meta.q_lens[row], meta.q_lens[row]
            for i in range(0, q_len, per_tile):
                n = min(per_tile, q_len - i)
                tiles.append((row, meta.q_starts[row] + i, n, first_pos + i + n))
        return tiles

    def __call__(self, q, k_cache, v_cache, plan: _TritonPlan, scale: float) -> torch.Tensor:
        """q: [T, heads, head_dim] -> [T, heads, head_dim]."""
        if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
            raise ValueError("TritonPagedAttention: q and the caches need unit stride in head_dim and K/V equal "
                             f"strides (got q {q.stride()}, k {k_cache.stride()}, v {v_cache.stride()})")
        if k_cache.shape[1] * k_cache.stride(1) >= 2 ** 31:  # the kernel's offsets within one KV head are int32
            raise ValueError(f"TritonPagedAttention: one KV head's cache {tuple(k_cache.shape[1:])} is too large")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.decode is not None:
            self._launch(q, out, k_cache, v_cache, plan.decode_tables, plan.decode, scale, self.decode_rows, 4)
        if plan.prefill is not None:
            self._launch(q, out, k_cache, v_cache, plan.tables, plan.prefill, scale, self.prefill_rows, 8)
        return out

    def _launch(self, q, out, k_cache, v_cache, tables, work, scale: float, block_m: int, warps: int) -> None:
        """One program per (work item, KV head); tl.dot needs every tile dimension >= 16."""
        head_dim = q.shape[-1]
        block_d = max(16, triton.next_power_of_2(head_dim))
        _kernel[(work.shape[0], self.kv_heads)](
            q, out, k_cache, v_cache, tables, work, scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
            BLOCK_SIZE=self.block_size, HEAD_DIM=head_dim, QPG=self.q_per_kv, BLOCK_M=block_m,
            BLOCK_N=min(64, max(16, self.TILE // block_d)), BLOCK_D=block_d,
            PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=warps)
