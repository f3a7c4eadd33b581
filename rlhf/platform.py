"""Device and backend selection, and the CPU adaptation of megatron-core.

This is the only module that names CUDA. Everything else asks it for the
device (`device()`), the collective backend (`backend()`) and calls
`setup_megatron()` once per process before building models.

megatron-core assumes CUDA in a handful of places that our CPU runs reach:

* ``torch.cuda.current_device()`` as the ``device=`` of scratch tensors
  (global memory buffer, rotary embeddings, attention masks);
* ``torch.cuda.synchronize()`` around collectives;
* the default causal softmax mask, built with ``device="cuda"``;
* its RNG tracker, which saves and restores the CUDA generator with
  ``torch.cuda.get_rng_state`` / ``manual_seed`` and its own
  ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``;
* ``tensor.type()`` strings checked against ``torch.cuda.FloatTensor`` in its
  DDP / optimizer code, and scalars its optimizers allocate on ``device="cuda"``
  (those two run under :func:`megatron_scope`, a torch-function mode);
* the MoE all-to-all token dispatcher's side stream for its device-to-host
  copies of the token counts (``torch.cuda.Stream``, ``current_stream``,
  ``stream``): on the CPU there is one stream, the host's, and its events are
  complete when recorded.

When CUDA is unavailable, `setup_megatron()` points exactly these at their CPU
equivalents (the CPU generator plays the part of the device generator). When
CUDA is available it changes nothing.

``RLHF_DEVICE=cpu`` in the environment makes a GPU host behave as a CPU one
(gloo, CPU tensors): the test suite sets it so its multi-rank gloo runs work
on any host; ``auto`` (the default) uses the GPU when there is one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

# megatron-core warns at import that TE/apex are missing and it falls back to torch: expected on CPU,
# and once per module per process it is a dozen lines of noise in every entry point's output.
warnings.filterwarnings("ignore", category=UserWarning, module="megatron")

_MEGATRON_READY = False
DEVICE_ENV = "RLHF_DEVICE"
DEVICE_CHOICES = ("auto", "cpu")
TRANSFORMER_IMPL_ENV = "RLHF_TRANSFORMER_IMPL"
TRANSFORMER_IMPL_CHOICES = ("auto", "local", "transformer_engine")


def has_accelerator() -> bool:
    """True when a CUDA device can be used and ``RLHF_DEVICE`` does not force the CPU."""
    choice = os.environ.get(DEVICE_ENV, "auto")
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"{DEVICE_ENV}={choice!r} is not one of {DEVICE_CHOICES} "
                         "('cpu' forces gloo and CPU tensors, 'auto' uses a GPU when present)")
    return choice == "auto" and torch.cuda.is_available()


def device() -> torch.device:
    """The device this process computes on (its local GPU, or the CPU)."""
    if has_accelerator():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def device_name() -> str:
    """The compute device in words: the GPU's name (``NVIDIA H100 80GB HBM3``), else ``cpu``."""
    return torch.cuda.get_device_name(device()) if has_accelerator() else "cpu"


def slow_half_precision(dtype: torch.dtype) -> bool:
    """True where bf16 or fp16 products run far slower than fp32's: a CPU without the matrix instructions
    oneDNN uses for them (AVX-512 BF16/FP16, AMX). On an AVX2-only host bf16 matmuls ran at 0.3-10 GFLOP/s
    against fp32's 45-63 (docs/real_model.md)."""
    if has_accelerator() or dtype == torch.float32:
        return False
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16 else \
        torch.ops.mkldnn._is_mkldnn_fp16_supported
    return not supported()


def backend() -> str:
    """Collective backend: NCCL on GPUs, gloo on CPU."""
    return "nccl" if has_accelerator() else "gloo"


def init_distributed(timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed from the torchrun environment (idempotent).

    Selects the local GPU first when there is one. A missing torchrun
    environment is treated as a single-process world.
    """
    if dist.is_initialized():
        return
    if has_accelerator():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    timeout = timedelta(seconds=timeout_s)
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend(), timeout=timeout)
    else:
        dist.init_process_group(backend(), store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def _attempt_store(timeout: timedelta):
    """Under torchrun, the agent's store with keys of this attempt only (None elsewhere).

    torchrun keeps one store for all attempts of a job (``--max-restarts``), and
    torch 2.13 does not separate their keys: a restarted gloo group reads the
    addresses the killed attempt's ranks left there, and its connections are
    refused. Prefixing the keys with the attempt (``TORCHELASTIC_RESTART_COUNT``)
    gives each attempt its own rendezvous, as older torch releases did.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"rlhf/attempt_{attempt}", agent)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transformer_impl() -> str:
    """megatron's layer implementation for new models: "transformer_engine" where a GPU computes and
    TransformerEngine imports (fused kernels), else "local" (plain torch). ``RLHF_TRANSFORMER_IMPL``
    (auto, local, transformer_engine) overrides the choice."""
    choice = os.environ.get(TRANSFORMER_IMPL_ENV, "auto")
    if choice not in TRANSFORMER_IMPL_CHOICES:
        raise ValueError(f"{TRANSFORMER_IMPL_ENV}={choice!r} is not one of {TRANSFORMER_IMPL_CHOICES}")
    if choice != "auto":
        return choice
    return "transformer_engine" if has_accelerator() and importlib.util.find_spec("transformer_engine") else "local"


def peak_memory_bytes() -> int | None:
    """The most bytes this process's accelerator allocator has held (None on the CPU, which has no such counter)."""
    return torch.cuda.max_memory_allocated() if has_accelerator() else None


def device_memory_bytes() -> int | None:
    """The accelerator's memory in bytes (None on the CPU, whose memory is not what limits a micro-batch)."""
    return torch.cuda.get_device_properties(device()).total_memory if has_accelerator() else None


def reset_peak_memory() -> None:
    """Start :func:`peak_memory_bytes` again from what is allocated now (no-op on CPU)."""
    if has_accelerator():
        torch.cuda.reset_peak_memory_stats()


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor in page-locked memory where an accelerator exists (its copies to the device can then
    run asynchronously), else the tensor itself."""
    return tensor.pin_memory() if has_accelerator() else tensor


def synchronize() -> None:
    """Wait for queued device work (no-op on CPU)."""
    if has_accelerator():
        torch.cuda.synchronize()


@contextlib.contextmanager
def syncs_raise():
    """Inside, a device operation that makes the host wait for the device raises
    (``torch.cuda.set_sync_debug_mode("error")``): how a GPU test proves a loop free of host stalls; nothing
    on the CPU, where rlhf.testing.host_syncs counts them instead."""
    if not has_accelerator():
        yield
        return
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def capture_graph(fn):
    """``fn`` (no arguments, returning tensors) recorded once as a CUDA graph, returned as a function that
    replays it and returns the same output tensors, overwritten; on the CPU ``fn`` itself.

    ``fn`` must read only tensors that stay where they are (it is replayed on whatever they then hold) and
    must not synchronise with the host. It runs twice on a side stream first, so that lazy set-up (library
    handles, communicators, allocations) happens outside the graph.
    """
    if not has_accelerator():
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    return replay


def flush_denormals() -> None:
    """Treat CPU floats below 2**-126 (denormals) as zero, in this thread and in every thread it starts later.

    x86 CPUs take a slow microcode path for each denormal operand. An LLM's forward makes many: attention
    probabilities of far-away keys and silu of very negative gates (measured on SmolLM2-135M decoding: the
    attention's probs @ V took 5.8 ms per layer with them, 1.0 ms without; the step 1.24 s against 0.91 s).
    A GPU's fast paths flush them too. The setting lives in each thread's float control register and a new
    thread copies its parent's, so call this before torch's first parallel CPU op: threads of its pool
    that exist already keep theirs. No effect on accelerator kernels.
    """
    torch.set_flush_denormal(True)


def setup_megatron() -> None:
    """Process-wide megatron-core setup; adapts it to CPU when needed.

    megatron's global parallel state is deliberately left uninitialised: every
    model receives an explicit process-group collection. Only the global memory
    buffer (a scratch allocator) is created here, again if it was destroyed (a
    test that ran Megatron-LM's own global-state code and tore it down calls
    this to return to our state).
    """
    global _MEGATRON_READY
    if not _MEGATRON_READY and not has_accelerator():
        _adapt_megatron_to_cpu()
    if not _MEGATRON_READY:
        _define_missing_te_gemm()
    _MEGATRON_READY = True
    from megatron.core import parallel_state

    if parallel_state.get_global_memory_buffer.__globals__["_GLOBAL_MEMORY_BUFFER"] is None:
        parallel_state._set_global_memory_buffer()


def seed_model_parallel_rng(seed: int) -> None:
    """Seed the default and megatron's tracked generators identically on all ranks.

    Models are built with ``use_cpu_initialization``: every TP rank draws the
    full weight and keeps its slice, so all ranks building a model must share
    the seed (tp_rank=0 for the tracker too).
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, tp_rank=0, ep_rank=0, etp_rank=0, force_reset_rng=True
    )


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's MoE router asks ``te_general_gemm is not None`` but binds the name only when
    TransformerEngine imports (a NameError on any device without TE): bind it to None there, so the router's
    torch matmul runs."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _adapt_megatron_to_cpu() -> None:
    """Point megatron's CUDA-only calls at CPU equivalents (CUDA absent only)."""
    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # A new mask per call, as megatron's CUDA version makes one: a cache shared across micro-batches would
    # make the activation bytes measured (rlhf.memory.SavedActivations) depend on what ran before.
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    # The MoE all-to-all dispatcher copies token counts to the host on a side stream: the host's own here.
    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def to_host(tensor, as_numpy=False, record_stream=False):
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    host = _HostStream()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = host
    torch.cuda.current_stream = lambda *args, **kwargs: host
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    # megatron's DDP/optimizer compare tensor.type() with these names.
    torch.cuda.FloatTensor = torch.FloatTensor
    torch.cuda.HalfTensor = torch.HalfTensor
    torch.cuda.BFloat16Tensor = torch.BFloat16Tensor


class _HostStream:
    """The one stream of CPU work, as megatron's MoE dispatcher uses a CUDA side stream: work on it is done
    when issued, so waiting and events are no-ops."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self):
        return self

    def synchronize(self) -> None:
        pass


class _CpuMegatron(TorchFunctionMode):
    """Runs megatron's optimizer code on CPU tensors (no accelerator).

    megatron allocates scalars with ``device='cuda'`` and accepts only tensors
    whose ``type()`` is ``torch.cuda.*Tensor`` in its optimizers and clipping.
    Inside this mode a factory call's non-CPU ``device=`` becomes the CPU and
    ``tensor.type()`` reports the CUDA name.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and not isinstance(device, int) and torch.device(device).type != "cpu":
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def megatron_scope():
    """Where megatron's optimizer code runs: as is with an accelerator, else under :class:`_CpuMegatron`."""
    return contextlib.nullcontext() if has_accelerator() else _CpuMegatron()
