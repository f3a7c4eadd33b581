"""The engine's C++ CPU kernels for the decoder's elementwise steps (rlhf/engine/native.py) against the torch
ones (`TorchOps`) and float64 arithmetic, and the decoder's choice between them."""

import pytest
import torch

from rlhf.engine.decoder import TorchOps, decoder_ops
from rlhf.engine.native import cpu_kernels


@pytest.mark.parametrize("rows, hidden", [(1, 8), (3, 13), (128, 576), (130, 64)])
def test_rms_norm_matches_torch_and_float64(rows, hidden):
    """Hidden sizes with and without a scalar tail after the 8-float vectors, row counts split over threads
    (64 rows a task) or not, a non-contiguous input; large and tiny rows alike."""
    torch.manual_seed(rows)
    x = torch.randn(hidden, rows).t() * torch.logspace(-3, 3, rows)[:, None]  # a transposed view
    w = torch.randn(hidden)
    ours = cpu_kernels().rms_norm(x, w, 1e-5)
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double())
    assert torch.allclose(ours.double(), exact, rtol=1e-6, atol=1e-6)
    assert torch.allclose(ours, TorchOps.rms_norm(x, w, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, f", [(1, 8), (3, 13), (128, 1536)])
def test_silu_and_mul_matches_torch_and_float64(rows, f):
    """Widths with and without a scalar tail; gates from -120 to 120, so that e^-gate overflows to inf and
    underflows to 0 (silu -> -0 and -> gate)."""
    torch.manual_seed(f)
    gate_up = torch.randn(rows, 2 * f) * 8
    gate_up[0, :f] = torch.linspace(-120, 120, f)
    ours = cpu_kernels().silu_and_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert torch.allclose(ours.double(), gate * torch.sigmoid(gate) * up, rtol=1e-6, atol=1e-30)
    assert torch.allclose(ours, TorchOps.silu_and_mul(gate_up), rtol=4e-6, atol=1e-30)  # torch's: 2.6e-6


@pytest.mark.parametrize("q_per_kv, head_dim", [(1, 8), (3, 64), (4, 6)])
def test_rope_and_cache_matches_torch(q_per_kv, head_dim):
    """Rotated queries, and keys and values written at scattered slots, equal the torch path's; no other slot
    of the cache changes."""
    torch.manual_seed(head_dim)
    kv_heads, tokens, slots_total = 2, 5, 40
    qkv = torch.randn(tokens, kv_heads * (q_per_kv + 2) * head_dim)
    angles = torch.rand(tokens, head_dim // 2) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    slots = torch.tensor([7, 0, 39, 12, 13])
    caches = [torch.randn(kv_heads, slots_total, head_dim) for _ in range(2)]
    ours_k, ours_v, ref_k, ref_v = (c.clone() for c in caches + caches)
    q = cpu_kernels().rope_and_cache(qkv, cos, sin, ours_k, ours_v, slots, q_per_kv)
    ref_q = TorchOps.rope_and_cache(qkv, cos, sin, ref_k, ref_v, slots, q_per_kv)
    assert q.shape == ref_q.shape == (tokens, kv_heads * q_per_kv, head_dim)
    assert torch.allclose(q, ref_q, atol=1e-6) and torch.allclose(ours_k, ref_k, atol=1e-6)
    assert torch.equal(ours_v, ref_v)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(ours_k[:, untouched], caches[0][:, untouched])
    assert not torch.allclose(ours_k[:, slots], caches[0][:, slots])


def test_kernels_refuse_other_dtypes_shapes_and_slots():
    kernels = cpu_kernels()
    with pytest.raises(RuntimeError, match="float32"):
        kernels.rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match=r"x \[rows, hidden\]"):
        kernels.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.silu_and_mul(torch.ones(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"gate_up \[rows, 2 \* F\]"):
        kernels.silu_and_mul(torch.ones(2, 7))
    cache = torch.zeros(1, 4, 8)
    with pytest.raises(RuntimeError, match="slot 4 outside the cache"):
        kernels.rope_and_cache(torch.ones(1, 24), torch.ones(1, 8), torch.ones(1, 8), cache, cache.clone(),
                               torch.tensor([4]), 1)
    with pytest.raises(RuntimeError, match=r"qkv \[T, kv_heads \* \(q_per_kv \+ 2\) \* head_dim\]"):
        kernels.rope_and_cache(torch.ones(1, 16), torch.ones(1, 8), torch.ones(1, 8), cache, cache.clone(),
                               torch.tensor([0]), 1)


def test_the_decoder_takes_the_kernels_only_for_float32_on_the_cpu():
    assert decoder_ops(torch.float32, torch.device("cpu")) is cpu_kernels()
    assert decoder_ops(torch.bfloat16, torch.device("cpu")) is TorchOps
