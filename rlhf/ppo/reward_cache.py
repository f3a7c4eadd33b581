"""The tiny default's trained reward model, cached on disk (rlhf/ppo/job.py, trained_reward_weights).

Where: ``$RLHF_CACHE_DIR`` if set (``off`` turns the cache off), else ``$XDG_CACHE_HOME/rlhf``, else
``~/.cache/rlhf``. One entry per key: ``reward-<key>.safetensors`` (the full weights) and
``reward-<key>.json`` (the file's sha256 and the training's printed numbers), each written by rank 0 to a
temporary file in the same directory and renamed into place, the JSON last: a crash leaves no entry a later
run would load, and an entry whose file does not match its sha256 is a miss (trained again, rewritten).

The key is a sha256 of a canonical JSON of what determines the weights: the caller's fields (the training
configuration, the mesh, the data) plus this process's torch and megatron-core versions, its device, its
thread count, the source of the ``rlhf`` package (any edit retrains) and FORMAT.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.parallel.exchange import gather_to_all

ENV = "RLHF_CACHE_DIR"
FORMAT = 1
"""The entry layout's version (and a way to retire every entry at once)."""


def cache_dir() -> Path | None:
    """The cache directory (see the module docstring); None when ``RLHF_CACHE_DIR=off``."""
    value = os.environ.get(ENV)
    if value == "off":
        return None
    if value:
        return Path(value)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rlhf"


def cache_key(fields: dict) -> str:
    """sha256 (hex) of ``fields`` with this process's environment, as canonical JSON."""
    import megatron.core

    environment = {"format": FORMAT, "torch": torch.__version__, "megatron_core": megatron.core.__version__,
                   "device": platform.device_name(), "threads": torch.get_num_threads(), "source": _source_hash()}
    text = json.dumps(plain({"fields": fields, "environment": environment}), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def plain(value):
    """``value`` as JSON types: a dataclass as a dict of its fields, a mapping as a dict, a sequence as a
    list, other objects (a dtype) as their str."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _source_hash() -> str:
    """sha256 of every .py file of the rlhf package (relative path and bytes, in path order)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def entry_paths(key: str) -> tuple[Path, Path] | None:
    """(weights, info) paths of ``key``'s entry; None when the cache is off."""
    root = cache_dir()
    return None if root is None else (root / f"reward-{key}.safetensors", root / f"reward-{key}.json")


def load(fields_of) -> tuple[str | None, dict | None]:
    """(key, entry) on every rank (collective): rank 0 computes the key from ``fields_of()`` and looks it up;
    the entry, ``{"weights": ..., "info": ..., "path": ...}``, is None on a miss (absent, unreadable, or not
    matching its sha256) and the same on every rank; the key is rank 0's alone (None elsewhere)."""
    key = entry = None
    if dist.get_rank() == 0:
        key = cache_key(fields_of()) if cache_dir() is not None else None
        entry = read_entry(key) if key is not None else None
    found = gather_to_all([entry] if dist.get_rank() == 0 else [])[0]
    return key, found


def read_entry(key: str) -> dict | None:
    """``key``'s entry read from disk, or None (absent, unreadable, or not matching its sha256)."""
    from safetensors.torch import load as load_safetensors

    weights_path, info_path = entry_paths(key)
    try:
        info = json.loads(info_path.read_text())
        data = weights_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != info["sha256"]:
            return None
        return {"weights": load_safetensors(data), "info": info, "path": str(weights_path)}
    except Exception:  # absent, truncated, corrupt: train again
        return None


def store(key: str | None, weights: dict, info: dict) -> str | None:
    """Write ``key``'s entry (rank 0 with a key; a no-op elsewhere): the path written, or None. A failure to
    write (a read-only or full disk) is printed as a warning; the run goes on."""
    if key is None or dist.get_rank() != 0:
        return None
    from safetensors.torch import save

    weights_path, info_path = entry_paths(key)
    try:
        weights_path.parent.mkdir(parents=True, exist_ok=True)
        data = save({name: t.detach().cpu().contiguous().clone() for name, t in weights.items()})
        _write_atomically(weights_path, data)
        _write_atomically(info_path, json.dumps({**info, "sha256": hashlib.sha256(data).hexdigest()},
                                                sort_keys=True).encode())
    except OSError as exc:
        print(f"warning: could not cache the reward model in {weights_path.parent}: {exc}", flush=True)
        return None
    return str(weights_path)


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
