"""Paged attention (pure torch, and the C++ decode kernel) vs dense causal attention on contiguous K/V (no model)."""

import pytest
import torch

from rlhf.engine.attention import AttentionMeta, CpuPagedAttention, TorchPagedAttention
from rlhf.engine.attention_backend import make_attention

BS, KVH, QPG, D = 4, 2, 3, 8


def dense(q, k, v, first_pos, scale):
    """q: [n, H, D] at positions first_pos.., k/v: [ctx, KVH, D]; causal, GQA by repeating K/V."""
    k, v = k.repeat_interleave(QPG, dim=1), v.repeat_interleave(QPG, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale
    pos = torch.arange(first_pos, first_pos + q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


def step_meta(q_lens, ctx_lens, tables) -> AttentionMeta:
    """A step's AttentionMeta: rows with one query decode, the others are prefill chunks."""
    width = max(map(len, tables))
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    return AttentionMeta(starts, q_lens, ctx_lens, torch.tensor([t + [0] * (width - len(t)) for t in tables]),
                         decode_rows=decode, prefill_rows=[i for i, n in enumerate(q_lens) if n > 1],
                         decode_ctx=torch.tensor([ctx_lens[i] for i in decode]),
                         decode_tokens=torch.tensor([starts[i] for i in decode]))


def check_against_dense(attn, k_cache, v_cache, q, meta, atol, reference=torch.float32):
    """Every sequence's rows of ``attn``'s output equal dense causal attention on its gathered K/V, computed
    in ``reference`` precision."""
    out = attn(q, k_cache, v_cache, attn.prepare(meta), scale=q.shape[-1] ** -0.5).to(reference)
    q, k_cache, v_cache = q.to(reference), k_cache.to(reference), v_cache.to(reference)
    for s, n, ctx, table in zip(meta.q_starts, meta.q_lens, meta.ctx_lens, meta.block_tables):  # padded: cut at ctx
        k = k_cache[:, table].flatten(1, 2)[:, :ctx].transpose(0, 1)  # [ctx, KVH, D]
        v = v_cache[:, table].flatten(1, 2)[:, :ctx].transpose(0, 1)
        ref = dense(q[s:s + n], k, v, ctx - n, q.shape[-1] ** -0.5)
        assert torch.allclose(out[s:s + n], ref, atol=atol), (ctx, (out[s:s + n] - ref).abs().max())


def test_paged_attention_matches_dense_for_decodes_and_a_prefill_chunk():
    torch.manual_seed(0)
    ctx_lens, q_lens = [10, 5, 13], [1, 3, 1]  # sequence 1 is a prefill chunk (positions 2..4)
    tables = [[5, 0, 9], [3, 7], [8, 1, 6, 2]]  # scattered block ids
    k_cache, v_cache = torch.randn(2, KVH, 10, BS, D).unbind(0)
    q = torch.randn(sum(q_lens), KVH * QPG, D)
    check_against_dense(TorchPagedAttention(BS, KVH, QPG), k_cache, v_cache, q, step_meta(q_lens, ctx_lens, tables),
                        atol=1e-6)


def test_cpu_kernel_matches_dense_and_the_torch_path():
    """The C++ decode kernel on scattered, shared and partly filled blocks (context 1 to 70, block tables of
    different widths), with prefill chunks in the same step, against dense attention and the torch path."""
    torch.manual_seed(1)
    attn = make_attention("cpu", BS, KVH, QPG)
    assert isinstance(attn, CpuPagedAttention)
    k_cache, v_cache = (torch.randn(2, KVH, 40, BS, D) * 3).unbind(0)  # scores large enough to be peaked
    order = torch.randperm(40).tolist()
    ctx_lens = [1, 4, 5, 17, 70, 33, 9, 64]
    q_lens = [1, 1, 1, 4, 1, 1, 9, 1]
    tables = [order[:-(-c // BS)] if i % 2 else order[-(-(-c // BS)):] for i, c in enumerate(ctx_lens)]
    q = torch.randn(sum(q_lens), KVH * QPG, D) * 3
    meta = step_meta(q_lens, ctx_lens, tables)
    check_against_dense(attn, k_cache, v_cache, q, meta, atol=2e-6)
    torch_path = TorchPagedAttention(BS, KVH, QPG)
    ours = attn(q, k_cache, v_cache, attn.prepare(meta), 0.125)
    assert torch.allclose(ours, torch_path(q, k_cache, v_cache, torch_path.prepare(meta), 0.125), atol=2e-6)
    decodes = step_meta([1] * len(ctx_lens), ctx_lens, tables)  # a step of decodes only: the kernel alone
    check_against_dense(attn, k_cache, v_cache, q[:len(ctx_lens)], decodes, atol=2e-6)



@pytest.mark.parametrize("head_dim", [4, 12, 64, 80])
def test_cpu_kernel_vector_paths_match_dense(head_dim):
    """The kernel's vector loops at head dims that take each path (4: no 8-float vector; 12: a vector and a
    scalar tail; 64: eight vectors held in registers; 80: eight, then two), on contexts that take the
    four-keys-at-a-time loop, its one-key tail and the exponential's padded tail, with scores spread wide
    enough that some weights underflow to exactly 0 (the reference in float64: float32 scores of a few hundred
    carry errors of about 1e-5 in any implementation)."""
    torch.manual_seed(head_dim)
    attn = make_attention("cpu", BS, KVH, QPG)
    k_cache, v_cache = torch.randn(2, KVH, 60, BS, head_dim).unbind(0)
    ctx_lens = [1, 3, 8, 13, 41, 96, 200]
    tables = [torch.randperm(60)[:-(-c // BS)].tolist() for c in ctx_lens]
    q = torch.randn(len(ctx_lens), KVH * QPG, head_dim) * 40
    scores = torch.einsum("nd,cd->nc", q[:, 0], k_cache[0, tables[-1]].flatten(0, 1)) * head_dim ** -0.5
    assert (scores.max(-1).values - scores.min(-1).values)[-1] > 100  # e^-100 underflows float32
    check_against_dense(attn, k_cache, v_cache, q, step_meta([1] * len(ctx_lens), ctx_lens, tables), atol=5e-5,
                        reference=torch.float64)

def test_backend_choice_and_clear_refusals():
    """auto: the C++ kernel for float32 on the CPU, torch for half precision (no flash-attn here)."""
    assert make_attention("auto", 16, KVH, QPG).name == "cpu"
    assert make_attention("auto", 16, KVH, QPG, torch.bfloat16).name == "torch"
    assert make_attention("torch", 16, KVH, QPG).name == "torch"
    with pytest.raises(RuntimeError, match="block_size % 256"):
        make_attention("flash", 16, KVH, QPG)
    with pytest.raises(RuntimeError, match="attention_backend='cpu' needs a float32 model on the CPU"):
        make_attention("cpu", 16, KVH, QPG, torch.bfloat16)
