"""The engine's C++ RMSNorm and SwiGLU product (rlhf/engine/native.py) against torch's and float64 arithmetic;
the decoder's choice of them."""

import pytest
import torch
import torch.nn.functional as F

from rlhf.engine.decoder import elementwise_ops_for
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
    assert torch.allclose(ours, F.rms_norm(x, (hidden,), w, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, f", [(1, 8), (3, 13), (128, 1536)])
def test_silu_and_mul_matches_torch_and_float64(rows, f):
    """Widths with and without a scalar tail; gates from -120 to 120, so that e^-gate overflows to inf and
    underflows to 0 (silu -> -0 and -> gate)."""
    torch.manual_seed(f)
    gate_up = torch.randn(rows, 2 * f) * 8
    gate_up[0, :f] = torch.linspace(-120, 120, f)
    ours = cpu_kernels().silu_and_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    assert torch.allclose(ours.double(), exact, rtol=1e-6, atol=1e-30)
    assert torch.allclose(ours, F.silu(gate_up[:, :f]) * gate_up[:, f:], rtol=4e-6, atol=1e-30)  # torch: 2.6e-6


def test_kernels_refuse_other_dtypes_and_shapes():
    kernels = cpu_kernels()
    with pytest.raises(RuntimeError, match="float32"):
        kernels.rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match=r"x \[rows, hidden\]"):
        kernels.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.silu_and_mul(torch.ones(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"gate_up \[rows, 2 \* F\]"):
        kernels.silu_and_mul(torch.ones(2, 7))


def test_the_decoder_takes_the_kernels_only_for_float32_on_the_cpu():
    kernels = cpu_kernels()
    assert elementwise_ops_for(torch.float32, torch.device("cpu")) == (kernels.rms_norm, kernels.silu_and_mul)
    norm, silu_and_mul = elementwise_ops_for(torch.bfloat16, torch.device("cpu"))
    x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    assert torch.equal(norm(x, w, 1e-5), F.rms_norm(x, (16,), w, 1e-5))
    assert torch.equal(silu_and_mul(x), F.silu(x[:, :8]) * x[:, 8:])
