"""rlhf.platform: backend choice and the CPU adaptation of megatron-core.

The numerical check that the adaptation is right (TP2 / PP2 losses equal the
unsharded loss with the same weights) is in test_task_meshes.py.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

from rlhf import platform


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_cpu_backend_and_device():
    # the suite forces CPU mode (tests/conftest.py), on a CPU host and on a GPU host alike
    assert platform.backend() == "gloo"
    assert platform.device() == torch.device("cpu")
    assert not platform.has_accelerator()


def test_device_env_is_checked(monkeypatch):
    monkeypatch.setenv(platform.DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="RLHF_DEVICE='tpu' is not one of \\('auto', 'cpu'\\)"):
        platform.backend()


def test_transformer_impl_is_local_on_the_cpu_and_can_be_forced(monkeypatch):
    assert platform.transformer_impl() == "local"  # no accelerator in the suite's processes
    monkeypatch.setenv(platform.TRANSFORMER_IMPL_ENV, "transformer_engine")
    assert platform.transformer_impl() == "transformer_engine"
    monkeypatch.setenv(platform.TRANSFORMER_IMPL_ENV, "fast")
    with pytest.raises(ValueError, match="RLHF_TRANSFORMER_IMPL='fast' is not one of"):
        platform.transformer_impl()


@pytest.mark.gpu
def test_gpu_backend_and_device(monkeypatch):
    monkeypatch.setenv(platform.DEVICE_ENV, "auto")
    assert platform.has_accelerator()
    assert platform.backend() == "nccl"
    assert platform.device() == torch.device(torch.cuda.current_device())  # an int index names a GPU


def test_cpu_adaptation_makes_megatron_rng_tracker_use_cpu_generator():
    out = _run("""
        import torch
        from rlhf import platform
        platform.setup_megatron()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
        platform.seed_model_parallel_rng(5)
        before = torch.get_rng_state()
        with get_cuda_rng_tracker().fork():
            a = torch.rand(3)
        assert torch.equal(torch.get_rng_state(), before), "fork must restore the default generator"
        with get_cuda_rng_tracker().fork():
            b = torch.rand(3)
        assert not torch.equal(a, b), "the tracked generator must advance between forks"
        platform.seed_model_parallel_rng(5)
        with get_cuda_rng_tracker().fork():
            assert torch.equal(torch.rand(3), a), "reseeding must reproduce the tracked stream"
        print(torch.cuda.current_device())
    """)
    assert out == "cpu"


def test_no_adaptation_when_an_accelerator_is_present():
    out = _run("""
        import torch
        from rlhf import platform
        platform.has_accelerator = lambda: True
        original = torch.cuda.current_device
        platform.setup_megatron()
        print(torch.cuda.current_device is original)
    """)
    assert out == "True"
