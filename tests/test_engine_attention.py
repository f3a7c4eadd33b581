"""Paged attention (pure torch) vs dense causal attention on contiguous K/V (no model)."""

import pytest
import torch

from rlhf.engine.attention import AttentionMeta, TorchPagedAttention, make_attention

BS, KVH, QPG, D = 4, 2, 3, 8


def dense(q, k, v, first_pos, scale):
    """q: [n, H, D] at positions first_pos.., k/v: [ctx, KVH, D]; causal, GQA by repeating K/V."""
    k, v = k.repeat_interleave(QPG, dim=1), v.repeat_interleave(QPG, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale
    pos = torch.arange(first_pos, first_pos + q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


def test_paged_attention_matches_dense_for_decodes_and_a_prefill_chunk():
    torch.manual_seed(0)
    ctx_lens, q_lens = [10, 5, 13], [1, 3, 1]  # sequence 1 is a prefill chunk (positions 2..4)
    tables = [[5, 0, 9], [3, 7], [8, 1, 6, 2]]  # scattered block ids
    k_cache, v_cache = torch.randn(2, KVH, 10, BS, D).unbind(0)
    q = torch.randn(sum(q_lens), KVH * QPG, D)
    width = max(map(len, tables))
    decode = [0, 2]
    starts = [0, 1, 4]
    meta = AttentionMeta(starts, q_lens, ctx_lens, torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                         decode_rows=decode, prefill_rows=[1], decode_ctx=torch.tensor([10, 13]),
                         decode_tokens=torch.tensor([0, 4]))
    attn = TorchPagedAttention(BS, KVH, QPG)
    out = attn(q, k_cache, v_cache, attn.prepare(meta), scale=D ** -0.5)
    for s, n, ctx, table in zip(starts, q_lens, ctx_lens, tables):
        k = k_cache[:, table].flatten(1, 2)[:, :ctx].transpose(0, 1)  # [ctx, KVH, D]
        v = v_cache[:, table].flatten(1, 2)[:, :ctx].transpose(0, 1)
        ref = dense(q[s:s + n], k, v, ctx - n, D ** -0.5)
        assert torch.allclose(out[s:s + n], ref, atol=1e-6)


def test_auto_backend_falls_back_to_torch_and_flash_refuses_clearly():
    assert make_attention("auto", 16, KVH, QPG).name == "torch"
    with pytest.raises(RuntimeError, match="block_size % 256"):
        make_attention("flash", 16, KVH, QPG)
