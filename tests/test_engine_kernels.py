"""The engine's C++ RMSNorm (rlhf/engine/native.py) against torch's and float64 arithmetic; the decoder's choice."""

import pytest
import torch
import torch.nn.functional as F

from rlhf.engine.decoder import rms_norm_for
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


def test_rms_norm_refuses_other_dtypes_and_shapes():
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels().rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5)
    with pytest.raises(RuntimeError, match=r"x \[rows, hidden\]"):
        cpu_kernels().rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5)


def test_the_decoder_takes_the_kernel_only_for_float32_on_the_cpu():
    assert rms_norm_for(torch.float32, torch.device("cpu")) is cpu_kernels().rms_norm
    x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, dtype=torch.bfloat16)
    half = rms_norm_for(torch.bfloat16, torch.device("cpu"))
    assert torch.equal(half(x, w, 1e-5), F.rms_norm(x, (16,), w, 1e-5))
