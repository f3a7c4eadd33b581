"""Core attention of megatron's local layer spec through PyTorch's ``scaled_dot_product_attention``.

megatron's local ``DotProductAttention`` is unfused: it materialises the [b, heads, s, s] scores, masks,
softmaxes and multiplies in separate kernels, so on a GPU without TransformerEngine it is memory-bound
and slow. :func:`sdpa_core_attention` keeps its construction (heads per TP rank, the softmax scale, the
dropout) and computes the same causal attention with one call of
``torch.nn.functional.scaled_dot_product_attention``: PyTorch picks its FlashAttention or
memory-efficient kernel on a GPU and its CPU kernels here. Two layouts come in:

    padded   query [s, b, heads, d], key and value [s, b, groups, d]   causal; grouped-query heads by
                                                                        ``enable_gqa`` (no copies)
    packed   query [t, heads, d], key and value [t, groups, d] (THD)    causal within each sample of
                                                                        ``cu_seqlens_q`` (block-diagonal
                                                                        mask, built on the device: no
                                                                        host sync, no loop over samples)

Padded samples sit left-aligned, so a causal mask is all they need: no real token attends to a pad.
The result equals megatron's unfused attention to rounding (tests/test_attention.py: fp32 within 1e-5;
bf16 within the documented tolerance, as the fused kernels accumulate in fp32 where megatron rounds the
scores to bf16 first). TransformerEngine's attention stays the choice where TE imports (rlhf.platform).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=1)
def packed_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[t, t] bool, True where packed token i may attend to token j: the same sample and j <= i.
    ``cu_seqlens`` [n + 1]: where each sample starts (and the end); computed where it lives. Every layer of a
    micro-batch passes the same ``cu_seqlens`` tensor (a tensor hashes by identity), so the mask is built
    once per micro-batch, not once per layer."""
    position = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    sample = torch.searchsorted(cu_seqlens[1:], position, right=True)
    same = sample.unsqueeze(1) == sample.unsqueeze(0)
    return same & (position.unsqueeze(1) >= position.unsqueeze(0))


@functools.cache
def sdpa_core_attention() -> type:
    """The local spec's core attention class (module docstring). (Made on first use, as megatron is
    imported only once rlhf.platform has set it up.)"""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if attention_mask is not None or attention_bias is not None:
                raise ValueError("SdpaAttention computes causal attention only; it takes no attention_mask or "
                                 "attention_bias (our models pass none)")
            dropout = self.attention_dropout.p if self.training else 0.0
            if packed_seq_params is None:  # [s, b, n, d] -> [b, n, s, d]
                q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                     scale=self.softmax_scale, enable_gqa=True)
                return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed input must be in the THD layout; got {packed_seq_params.qkv_format!r}")
            per_group = query.shape[1] // key.shape[1]  # a masked call: the kernels that take a mask want
            key, value = (x.repeat_interleave(per_group, dim=1) for x in (key, value))  # every head's K/V
            q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, n, t, d]
            mask = packed_causal_mask(packed_seq_params.cu_seqlens_q, query.shape[0])
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 scale=self.softmax_scale)
            return out[0].transpose(0, 1).reshape(query.shape[0], -1)

    return SdpaAttention
