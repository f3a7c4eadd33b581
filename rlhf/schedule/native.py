"""The schedule search's compiled inner loop (csrc/walker.c), built on first use and cached.

`compiled_walker()` returns the compiled ``Walker`` type, or None when it cannot be built here (no C compiler,
no Python headers), after one line on stderr saying why; the search then runs `simulate.Walker`, the Python
original, which computes the same end times to the bit (so a search gives the same schedule either way, only
slower: the walk is about 85% of an annealing proposal's time in Python). ``RLHF_SCHEDULE_PURE=1`` asks for
the Python one. The build takes about a second, once per machine, and is cached under
``$RLHF_KERNEL_CACHE`` (default ``~/.cache/rlhf/kernels``, shared with the engine's kernels) in a file named
after a hash of the source, the flags, the Python version and the platform; a build is written to a
temporary name and renamed, so ranks that start together never load half a file.

No torch here: the search runs without it.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "csrc" / "walker.c"
MODULE = "rlhf_schedule_walker"  # PyInit_<MODULE> in the source
CACHE_ENV, PURE_ENV = "RLHF_KERNEL_CACHE", "RLHF_SCHEDULE_PURE"
CFLAGS = ["-O2", "-shared", "-fPIC"]  # IEEE arithmetic: no fast-math, so the end times match Python's


@functools.lru_cache(maxsize=None)
def compiled_walker():
    """The compiled ``Walker`` type, or None (see the module doc)."""
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        return None
    compiler = sysconfig.get_config_var("CC") or "cc"
    include = sysconfig.get_paths()["include"]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(CFLAGS), compiler, sys.version,
                                    sysconfig.get_platform()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rlhf" / "kernels")
    path = root / f"{MODULE}_{key}{suffix}"
    try:
        if not path.exists():
            root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=suffix, dir=root)
            os.close(fd)
            try:
                subprocess.run([*compiler.split(), *CFLAGS, f"-I{include}", str(SOURCE), "-o", tmp],
                               check=True, capture_output=True, text=True)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        spec = importlib.util.spec_from_file_location(MODULE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, subprocess.CalledProcessError, ImportError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc) or type(exc).__name__
        print(f"rlhf.schedule: the compiled walker did not build in {root} ({detail.strip().splitlines()[-1]}); "
              "the search runs the Python one (same schedules, slower)", file=sys.stderr, flush=True)
        return None
    return module.Walker
