"""Which paged attention the engine runs (rlhf/engine/attention.py has the interface and the torch, C++ and
flash-attn implementations; rlhf/engine/triton_attention.py the Triton kernel): by the configured backend,
the model's dtype, the device and what imports here."""

from __future__ import annotations

import torch

from rlhf.engine.attention import CpuPagedAttention, FlashPagedAttention, TorchPagedAttention
from rlhf.engine.native import cpu_kernels


def flash_available() -> bool:
    """True when flash-attn imports (it needs a GPU build)."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def make_attention(backend: str, block_size: int, kv_heads: int, q_per_kv: int,
                   dtype: torch.dtype = torch.float32, device: torch.device = torch.device("cpu")):
    """``"torch"``, ``"cpu"``, ``"flash"`` or ``"triton"`` (an error if it cannot run here), or ``"auto"``:
    flash when usable, else the Triton kernel for a float16/bfloat16 model on a GPU when triton imports, else
    the C++ kernel for a float32 model on the CPU when it builds, else torch."""
    half = dtype in (torch.float16, torch.bfloat16)
    usable = half and block_size % 256 == 0 and flash_available()
    if backend == "flash" and not usable:
        raise RuntimeError("attention_backend='flash' needs flash-attn installed, a float16/bfloat16 model and "
                           f"block_size % 256 == 0 (got {dtype}, block_size={block_size}); use 'torch' or 'auto'")
    if backend == "flash" or (backend == "auto" and usable):
        return FlashPagedAttention()
    gpu = device.type != "cpu"
    if backend == "triton" or (backend == "auto" and half and gpu):
        from rlhf.engine.triton_attention import TritonPagedAttention, triton_available  # loads triton

        if gpu and triton_available():
            return TritonPagedAttention(block_size, kv_heads, q_per_kv)
        if backend == "triton":
            raise RuntimeError("attention_backend='triton' needs triton installed (pip install triton) and a GPU "
                               f"(got {device}, triton {'found' if triton_available() else 'missing'}); "
                               "use 'torch' or 'auto'")
    cpu_float = dtype == torch.float32 and device.type == "cpu"
    if backend == "cpu" and not cpu_float:
        raise RuntimeError(f"attention_backend='cpu' needs a float32 model on the CPU (got {dtype} on {device}); "
                           "use 'torch' or 'auto'")
    kernels = cpu_kernels() if backend == "cpu" or (backend == "auto" and cpu_float) else None
    if backend == "cpu" and kernels is None:
        raise RuntimeError("attention_backend='cpu': the C++ kernel did not build (the line above says why); "
                           "use 'torch' or 'auto'")
    if kernels is not None:
        return CpuPagedAttention(kernels.paged_decode, block_size, kv_heads, q_per_kv)
    return TorchPagedAttention(block_size, kv_heads, q_per_kv, dtype)
