"""Rotary position embedding for megatron's layers without a host synchronisation on packed samples.

megatron applies RoPE through ``rope_utils.apply_rotary_pos_emb``. Its unfused packed (THD) path splits the
row at ``cu_seqlens`` read on the host (``.tolist()``, ``.item()``) in every attention layer, so on a GPU each
layer of a packed micro-batch waits for the device. With ``apply_rope_fusion`` megatron calls
TransformerEngine's fused functions instead; where TE is absent :func:`install` puts this module's in their
place, which find each packed token's position on the device::

    cu_seqlens = [0, 5, 8]     token  0 1 2 3 4 5 6 7
                               sample 0 0 0 0 0 1 1 1   (searchsorted(cu_seqlens, token, right=True) - 1)
                               position 0 1 2 3 4 0 1 2  (token - cu_seqlens[sample])

and then rotate as the unfused padded path does (the same arithmetic: ``t cos + rotate_half(t) sin``,
cos and sin of the fp32 frequencies rounded to the input's dtype), so packed and padded runs stay equal.
"""

from __future__ import annotations

import functools

import torch


def rotate(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``t`` [s, b, heads, d] rotated by ``freqs`` [s, 1, 1, d_rot] (d_rot <= d; the rest passes through), as
    megatron's unfused ``_apply_rotary_pos_emb_bshd`` at mscale 1; the signature of TE's fused function."""
    if interleaved:
        raise ValueError("rlhf.models.rope: interleaved rotary embeddings are not supported (rotary_interleaved)")
    width = freqs.shape[-1]
    t, rest = t[..., :width], t[..., width:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    first, second = torch.chunk(t, 2, dim=-1)
    return torch.cat((t * cos + torch.cat((-second, first), dim=-1) * sin, rest), dim=-1)


@functools.lru_cache(maxsize=1)
def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[total] int64: each packed token's position in its own sample, computed on ``cu_seqlens``' device.

    Cached on the ``cu_seqlens`` object, which every layer of a micro-batch shares (its PackedLayout's), so
    the positions are found once per micro-batch and forward."""
    tokens = torch.arange(total, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    sample = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    return (tokens - cu_seqlens[sample]).long()


def rotate_packed(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
                  cp_rank: int = 0) -> torch.Tensor:
    """``t`` [total, heads, d], samples back to back at ``cu_seqlens``, each rotated from position 0 by
    ``freqs`` [longest, 1, 1, d_rot]; the signature of TE's fused THD function (no context parallelism)."""
    if cp_size != 1:
        raise ValueError(f"rlhf.models.rope: context parallelism is not supported (cp size {cp_size})")
    return rotate(t.unsqueeze(1), freqs[packed_positions(cu_seqlens, t.shape[0])]).squeeze(1)


def install() -> None:
    """Make megatron's fused-RoPE hooks this module's functions where TransformerEngine gave none (TE's, where
    it imports, take packed rows without a host read too), so that every config with ``apply_rope_fusion``
    has one."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None and rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd = rotate, rotate_packed
