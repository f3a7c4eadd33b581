"""The engine's C++ CPU kernels (csrc/), compiled on first use and cached: paged decode attention, and the
decoder's elementwise steps (RMSNorm, SwiGLU's product, RoPE with the K/V cache write).

`cpu_kernels()` returns the compiled module, or None when it cannot be built here (no C++ compiler, no ninja),
after one line on stderr saying why; the engine then runs the pure torch paths, which compute the same
functions. The build takes about 40 s once per machine and is cached under ``$RLHF_KERNEL_CACHE`` (default
``~/.cache/rlhf/kernels``) in a directory named after a hash of the sources, the compiler flags, torch's
version and this CPU's instruction set (the code is compiled for the CPU it runs on, so a home directory
shared by different machines keeps one build per kind of CPU). Ranks that start together wait for one build
(torch's file lock).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("paged_attention.cpp", "rms_norm.cpp", "silu_and_mul.cpp", "rope_and_cache.cpp", "bindings.cpp")
HEADERS = ("vec8.h",)  # shared by the sources: part of the build's key
CACHE_ENV = "RLHF_KERNEL_CACHE"
# IEEE arithmetic (no fast-math: the kernels vectorise their sums themselves, and exp8's range reduction
# depends on its order of operations)
CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _cpu_signature() -> str:
    """The CPU's instruction-set flags (Linux), or the machine name elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine()


def _ninja_on_path() -> None:
    """torch builds with the ``ninja`` it finds on PATH; the pip package's lies in the venv's bin directory,
    which is not on PATH when the venv's python is run without activating it."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.lru_cache(maxsize=None)
def cpu_kernels():
    """The compiled module: ``paged_decode(q, k_cache, v_cache, tables, ctx, scale)`` and the functions of
    `rlhf.engine.decoder.TorchOps` (``rms_norm``, ``silu_and_mul``, ``rope_and_cache``); or None (see the
    module doc)."""
    from torch.utils.cpp_extension import load

    texts = [(CSRC / f).read_text() for f in SOURCES + HEADERS]
    key = hashlib.sha256("\n".join(texts + [" ".join(CFLAGS), torch.__version__, _cpu_signature()]).encode())
    name = f"rlhf_cpu_kernels_{key.hexdigest()[:16]}"
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlhf" / "kernels")
    build = root / name
    _ninja_on_path()
    try:
        build.mkdir(parents=True, exist_ok=True)
        module = load(name=name, sources=[str(CSRC / f) for f in SOURCES], extra_cflags=CFLAGS,
                      extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as exc:  # a missing compiler or ninja: the torch paths compute the same functions
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        print(f"rlhf.engine: the C++ CPU kernels did not build in {build} ({reason}); "
              "decoding uses the torch paths", file=sys.stderr, flush=True)
        return None
    return module

