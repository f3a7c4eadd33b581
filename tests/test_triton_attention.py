"""The engine's Triton paged-attention kernel (rlhf/engine/triton_attention.py) against the torch kernel.

On the CPU the kernel runs under Triton's interpreter, which ``TRITON_INTERPRET=1`` turns on only if set
before triton is imported: every case runs in one subprocess (`interpreter_diffs`), in float32 and float16
(the interpreter has no bf16 arithmetic). On a GPU (``gpu``) the compiled kernel runs the same cases in
bfloat16, and once recorded in a CUDA graph. Each output is compared with `TorchPagedAttention` in the same
dtype and with float64 attention on the same (rounded) inputs.
"""

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from rlhf import platform
from rlhf.engine.attention import AttentionMeta, TorchPagedAttention
from rlhf.engine.attention_backend import make_attention
from test_engine_attention import step_meta

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
BS, KVH, QPG = 4, 2, 2  # GQA: 4 query heads over 2 KV heads
# max |triton - torch| over the outputs (which reach 3.3); half precisions: two steps of the dtype at |o| < 4.
# Measured under the interpreter: float32 1.8e-6, float16 1.95e-3 (one step at o = 2.5); against float64,
# float32 1.8e-6 (torch's 1.6e-6), float16 9.6e-4 (torch's 1.1e-3). bf16 is not measured on the CPU: the torch
# kernel's own bf16 error on these cases is 7.7e-3 there.
TOL = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3.2e-2}


def on(meta: AttentionMeta, device) -> AttentionMeta:
    """``meta`` with its tensors on ``device``, tables and context lengths int32 (as the engine builds them)."""
    return replace(meta, block_tables=meta.block_tables.to(device, torch.int32),
                   decode_ctx=meta.decode_ctx.to(device, torch.int32), decode_tokens=meta.decode_tokens.to(device))


def steps(device) -> dict[str, AttentionMeta]:
    """Two steps over one cache of 60 blocks (block ids scattered):

    * ``mixed``: decodes at context 8 (exactly two blocks) and 3 (less than one); a chunk of 6 queries at
      positions 17..22 (a chunk after an earlier one); a whole 5-token prompt; and two sequences sharing their
      first 17 blocks: a decode at context 70 and a chunk of 40 queries at positions 35..74 (two key tiles of
      the kernel's loop, two query tiles of its prefill launch);
    * ``decode``: every row decodes (the launch a CUDA graph records), tables padded with block 0 to width 20.
    """
    order = torch.randperm(60, generator=torch.Generator().manual_seed(0)).tolist()
    shared = order[:17]
    tables = [order[20:22], order[22:23], order[23:29], order[29:31], shared + order[40:41], shared + order[41:43]]
    mixed = step_meta([1, 1, 6, 5, 1, 40], [8, 3, 23, 5, 70, 75], tables)
    decode = step_meta([1] * 4, [8, 3, 70, 75], [tables[0], tables[1], tables[4], tables[5] + [0]])
    return {"mixed": on(mixed, device), "decode": on(decode, device)}


def diffs(dtype: torch.dtype, device, head_dim: int) -> dict[str, list[float]]:
    """Per step: max |triton - torch| (both in ``dtype``), |triton - float64| and |torch - float64|."""
    from rlhf.engine.triton_attention import TritonPagedAttention

    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(KVH, 60, BS, head_dim, generator=gen) * 2  # scores of a few units: peaked softmaxes
    v_cache = torch.randn(KVH, 60, BS, head_dim, generator=gen)
    triton_attn, scale = TritonPagedAttention(BS, KVH, QPG), head_dim ** -0.5
    out = {}
    for name, meta in steps(device).items():
        q = torch.randn(sum(meta.q_lens), KVH * QPG, head_dim, generator=gen) * 2
        q, k, v = (t.to(device, dtype) for t in (q, k_cache, v_cache))
        ours = triton_attn(q, k, v, triton_attn.prepare(meta), scale).double()
        torch_attn, exact = TorchPagedAttention(BS, KVH, QPG, dtype), TorchPagedAttention(BS, KVH, QPG, torch.float64)
        theirs = torch_attn(q, k, v, torch_attn.prepare(meta), scale).double()
        ref = exact(q.double(), k.double(), v.double(), exact.prepare(meta), scale)
        out[name] = [(ours - theirs).abs().max().item(), (ours - ref).abs().max().item(),
                     (theirs - ref).abs().max().item()]
    return out


def interpreter_diffs() -> None:
    """Print `diffs` of float32 and float16 on the CPU as JSON (run with ``TRITON_INTERPRET=1``)."""
    print(json.dumps({str(d).removeprefix("torch."): diffs(d, "cpu", 12) for d in (torch.float32, torch.float16)}))


@pytest.fixture(scope="module")
def interpreted():
    if importlib.util.find_spec("triton") is None:
        pytest.fail("triton is not installed: pip install triton (it is in the test extra; its CPU interpreter "
                    "runs these tests)")
    proc = subprocess.run([sys.executable, "-c", "import test_triton_attention as t; t.interpreter_diffs()"],
                          cwd=TESTS_DIR, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("step", ["mixed", "decode"])
def test_interpreted_kernel_matches_the_torch_kernel(interpreted, dtype, step):
    """Decodes, chunked prefill, shared prefix blocks and GQA, under the interpreter: the kernel equals the torch
    kernel within ``TOL`` and is no further from float64 attention than the torch kernel's rounding allows."""
    to_torch, to_exact, torch_to_exact = interpreted[dtype][step]
    assert to_torch <= TOL[dtype], (dtype, step, to_torch)
    assert to_exact <= 2 * torch_to_exact + TOL[dtype] / 10, (dtype, step, to_exact, torch_to_exact)


def test_backend_choice():
    """``"triton"`` (and ``"auto"`` for half precision) on a non-CPU device (``meta`` stands in for a GPU);
    never on the CPU; a clear refusal without triton or a GPU."""
    from rlhf.engine import triton_attention

    gpu = torch.device("meta")
    assert make_attention("triton", 16, KVH, QPG, torch.float32, gpu).name == "triton"
    assert make_attention("auto", 16, KVH, QPG, torch.bfloat16, gpu).name == "triton"
    assert make_attention("auto", 16, KVH, QPG, torch.float32, gpu).name == "torch"
    assert make_attention("auto", 16, KVH, QPG, torch.float16).name == "torch"  # the CPU
    with pytest.raises(RuntimeError, match=r"needs triton installed \(pip install triton\) and a GPU \(got cpu"):
        make_attention("triton", 16, KVH, QPG, torch.float16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_attention, "triton", None)
        with pytest.raises(RuntimeError, match="got meta, triton missing"):
            make_attention("triton", 16, KVH, QPG, torch.float16, gpu)
        assert make_attention("auto", 16, KVH, QPG, torch.bfloat16, gpu).name == "torch"
        with pytest.raises(RuntimeError, match="needs triton"):
            triton_attention.TritonPagedAttention(16, KVH, QPG)


@pytest.mark.gpu
def test_compiled_kernel_matches_the_torch_kernel_on_a_gpu_in_bf16(monkeypatch):
    """bf16 on the GPU (head_dim 64), eager and replayed from a CUDA graph after its buffers change; auto picks
    triton for a bf16 model there (block_size 16: flash-attn's kernel needs 256)."""
    monkeypatch.setenv(platform.DEVICE_ENV, "auto")
    device = platform.device()
    assert make_attention("auto", 16, KVH, QPG, torch.bfloat16, device).name == "triton"
    for step, (to_torch, to_exact, torch_to_exact) in diffs(torch.bfloat16, device, 64).items():
        assert to_torch <= TOL["bfloat16"] and to_exact <= 2 * torch_to_exact + 2e-3, (step, to_torch, to_exact)

    from rlhf.engine.triton_attention import TritonPagedAttention

    attn, meta = TritonPagedAttention(BS, KVH, QPG), steps(device)["decode"]
    k, v = torch.randn(2, KVH, 60, BS, 64, device=device, dtype=torch.bfloat16).unbind(0)
    q = torch.randn(4, KVH * QPG, 64, device=device, dtype=torch.bfloat16)
    replay = platform.capture_graph(lambda: attn(q, k, v, attn.prepare(meta), 0.125))
    meta.decode_ctx.copy_(torch.tensor([5, 12, 33, 80], dtype=torch.int32))  # new contexts and tables, same buffers
    meta.block_tables.copy_(meta.block_tables.flip(0))
    q.normal_()
    ref = TorchPagedAttention(BS, KVH, QPG, torch.bfloat16)
    meta_now = replace(meta, ctx_lens=[5, 12, 33, 80])  # the torch kernel sizes its gather from the host list
    expected = ref(q, k, v, ref.prepare(meta_now), 0.125)
    assert (replay().float() - expected.float()).abs().max().item() <= TOL["bfloat16"]
