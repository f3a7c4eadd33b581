"""Atomic, verified checkpoint storage (layout-agnostic); the ground floor of rlhf.checkpoint (it imports none
of it).

This module owns how a checkpoint lands on disk and how it is found and
checked again; *what* goes into it (which parameters, sharded how) belongs to
the callers. On disk::

    <root>/
      latest                      "42\\n", replaced atomically after each save
      iter_0000042/
        model_actor_rank0.safetensors   tensors, one file per shard name
        model_actor_rank1.safetensors
        rng_rank1.json                  per-rank JSON files (optional)
        state.json                      non-tensor state from group rank 0
        manifest.json                   written LAST: every file's bytes + sha256
      .tmp_iter_0000043_k2j4x/    a save in progress (or a crashed one)

Save protocol (every member of ``group`` calls :func:`save_checkpoint`)::

    rank 0: mkdtemp .tmp_iter_<it>_<rand>  --broadcast path-->  all ranks
    all:    write own shards / json files (fsync), hash them; a floating
            tensor holding NaN or infinity fails the rank's part instead
    all:    all_gather (entries | error)          <- the barrier
    rank 0: state.json, manifest.json, fsync, rename tmp -> iter_<it>,
            latest (tmp file + os.replace), retention
    rank 0: --broadcast ok | error-->  all ranks return or raise

A crash at any point before the rename leaves only a ``.tmp_*`` directory,
which loaders never look at; ``latest`` changes only after the rename. A
directory without a manifest, or with a file whose size or sha256 differs from
the manifest, is refused with :class:`CheckpointError` naming it.

No pickle anywhere: tensors are safetensors, everything else is JSON. Without
a ``group`` the calling process alone writes or reads; nothing falls back to a
global process group. RNG state to store with a checkpoint: :mod:`rlhf.checkpoint.rng`.

Fault-injection seams: a save looks up :func:`write_safetensors` (every
rank's tensor files), :func:`commit_checkpoint` (rank 0's commit) and
:func:`write_latest` (the ``latest`` record) on this module when it calls
them, so a test replaces one of them to fail or die at that step.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "checkpoint_path",
    "latest_iteration",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "resolve_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.json"
LATEST = "latest"
TENSOR_EXT = ".safetensors"
JSON_EXT = ".json"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_RESERVED = ("state", "manifest")
_HASH_CHUNK = 1 << 22

PathLike = Union[str, os.PathLike]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found or trusted; the message names the directory."""


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` returns.

    ``tensors``: shard name -> {tensor name -> CPU tensor}; ``json``: JSON file
    name -> value; ``state``: the ``state`` passed to :func:`save_checkpoint`.
    """

    iteration: int
    path: str
    state: dict
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    json: dict[str, Any] = field(default_factory=dict)
    manifest: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- paths
def checkpoint_path(root: PathLike, iteration: int) -> str:
    """``<root>/iter_<iteration:07d>``."""
    return os.path.join(os.fspath(root), f"iter_{_check_iteration(iteration):07d}")


def _check_iteration(iteration: Any) -> int:
    if isinstance(iteration, bool) or not isinstance(iteration, (int, np.integer)) or iteration < 0:
        raise CheckpointError(f"iteration={iteration!r}: must be an int >= 0")
    return int(iteration)


def list_checkpoints(root: PathLike) -> list[int]:
    """Iterations that have an ``iter_*`` directory under ``root`` (complete or not), ascending."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    its = []
    for name in os.listdir(root):
        m = _ITER_RE.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            its.append(int(m.group(1)))
    return sorted(its)


def latest_iteration(root: PathLike) -> Optional[int]:
    """The iteration named by ``<root>/latest``, or ``None`` if there is no such file.

    A ``latest`` file that does not hold an iteration number raises
    :class:`CheckpointError`.
    """
    path = os.path.join(os.fspath(root), LATEST)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}")
    return int(text)


def holds_no_checkpoint(root: PathLike) -> bool:
    """Whether ``root`` (possibly missing) has neither an ``iter_*`` directory nor a ``latest`` file: nothing a
    run saved there yet (a save killed before its commit leaves only a ``.tmp_iter_*``, which does not count)."""
    return not list_checkpoints(root) and not os.path.exists(os.path.join(os.fspath(root), LATEST))


# --------------------------------------------------------------------------- distributed
def _rank_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _broadcast(obj: Any, group) -> Any:
    """Group rank 0's ``obj`` on every member (identity without a group)."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _all_gather(obj: Any, group) -> list:
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# --------------------------------------------------------------------------- file helpers
def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256_file(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _write_bytes_exclusive(path: str, data: bytes) -> None:
    with open(path, "xb") as f:  # "x": two writers of one name fail instead of clobbering
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_safetensors(path: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write one tensor file of a save, claiming its name first and fsyncing it (a fault-injection seam)."""
    from safetensors.torch import save_file

    open(path, "xb").close()  # claim the name (see _write_bytes_exclusive)
    save_file(dict(tensors), path, metadata={"format": "pt"})
    _fsync_file(path)


def _json_bytes(obj: Any, what: str) -> bytes:
    try:
        return json.dumps(obj, sort_keys=True, indent=1).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{what} is not JSON-serialisable ({e}); store tensors as "
                              f"shards and other values as str/int/float/list/dict") from None


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in _RESERVED:
        raise CheckpointError(f"{what} name {name!r}: use letters, digits, '_', '-', '.' "
                              f"(not starting with '.'), not one of {_RESERVED}")
    return name


def _prepare_tensors(shard: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, Mapping):
        raise CheckpointError(f"shard {shard!r} must map tensor names to tensors, "
                              f"got {type(tensors).__name__}")
    out = {}
    for key, t in tensors.items():
        if not isinstance(key, str) or not isinstance(t, torch.Tensor):
            raise CheckpointError(f"shard {shard!r}: entry {key!r} must be str -> torch.Tensor, "
                                  f"got {type(key).__name__} -> {type(t).__name__}")
        _check_finite(shard, key, t)
        out[key] = t.detach().cpu().contiguous()
    return out


def _check_finite(shard: str, key: str, t: torch.Tensor) -> None:
    """Refuse a floating tensor holding NaN or infinity (one ``isfinite().all()`` where it lives): a checkpoint is
    never written from non-finite weights or optimizer state, which no resumed run could recover from."""
    if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()):
        bad = int((~torch.isfinite(t.detach())).sum())
        raise CheckpointError(f"shard {shard!r}: tensor {key!r} holds {bad} NaN or infinite value(s) of {t.numel()}; "
                              "a checkpoint is never written from non-finite values")


# --------------------------------------------------------------------------- save
def _rank_files(tmp: str, rank: int, shards, json_files) -> list[dict]:
    """Write this rank's files into the temp dir; return their manifest entries."""
    entries = []
    for name, tensors in (shards or {}).items():
        _check_name(name, "shard")
        fname = name + TENSOR_EXT
        try:
            write_safetensors(os.path.join(tmp, fname), _prepare_tensors(name, tensors))
        except FileExistsError:
            raise CheckpointError(f"file {fname} written by two ranks; shard names must be "
                                  f"unique across ranks (e.g. add _rank{rank})") from None
        entries.append({"name": fname, "kind": "tensors", "rank": rank})
    for name, value in (json_files or {}).items():
        _check_name(name, "json file")
        fname = name + JSON_EXT
        try:
            _write_bytes_exclusive(os.path.join(tmp, fname), _json_bytes(value, f"json file {name!r}"))
        except FileExistsError:
            raise CheckpointError(f"file {fname} written by two ranks; json file names must be "
                                  f"unique across ranks") from None
        entries.append({"name": fname, "kind": "json", "rank": rank})
    for e in entries:
        e["bytes"], e["sha256"] = _sha256_file(os.path.join(tmp, e["name"]))
    return entries


def _begin_save(root: str, iteration: int, overwrite: bool, clean_stale: bool) -> str:
    """Rank 0: make ``<root>/.tmp_iter_<it>_<rand>``; refuse to clobber unless asked."""
    os.makedirs(root, exist_ok=True)
    if clean_stale:
        for name in os.listdir(root):
            if name.startswith(".tmp_"):
                stale = os.path.join(root, name)
                logger.warning("removing stale partial checkpoint %s", stale)
                if os.path.isdir(stale):
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    os.remove(stale)
    final = checkpoint_path(root, iteration)
    if os.path.exists(final) and not overwrite:
        raise CheckpointError(f"{final} already exists; pass overwrite=True to replace it")
    _check_free_space(root)
    return tempfile.mkdtemp(prefix=f".tmp_iter_{iteration:07d}_", dir=root)


def _check_free_space(root: str) -> None:
    """Refuse to start a save the disk cannot hold, judging by the size of the newest checkpoint (before
    a byte is written, so the previous checkpoints and ``latest`` stay as they are)."""
    its = list_checkpoints(root)
    if not its:
        return
    try:
        need = sum(e["bytes"] for e in _read_manifest(checkpoint_path(root, its[-1]))["files"])
    except CheckpointError:  # a broken newest checkpoint says nothing of the size; the save finds out
        return
    free = shutil.disk_usage(root).free
    if free < need:
        raise CheckpointError(f"{free / 2 ** 30:.2f} GiB free, but the last checkpoint took {need / 2 ** 30:.2f} "
                              "GiB; free some space (--keep-last N deletes older checkpoints)")


def commit_checkpoint(root: str, iteration: int, tmp: str, entries: list[dict], state: Mapping,
                      world: int, keep_last: Optional[int]) -> str:
    """Rank 0: state.json, manifest LAST, rename into place, then ``latest``, retention (a fault-injection
    seam)."""
    state_entry = {"name": STATE, "kind": "state", "rank": 0}
    _write_bytes_exclusive(os.path.join(tmp, STATE), _json_bytes(dict(state), "state"))
    state_entry["bytes"], state_entry["sha256"] = _sha256_file(os.path.join(tmp, STATE))
    manifest = {"format_version": FORMAT_VERSION, "iteration": iteration, "world_size": world,
                "created_unix": time.time(),
                "files": sorted(entries + [state_entry], key=lambda e: e["name"])}
    _write_bytes_exclusive(os.path.join(tmp, MANIFEST), _json_bytes(manifest, "manifest"))
    _fsync_dir(tmp)
    final = checkpoint_path(root, iteration)
    old = None
    if os.path.exists(final):  # overwrite=True was checked in _begin_save
        old = tempfile.mkdtemp(prefix=f".tmp_delete_iter_{iteration:07d}_", dir=root)
        os.rename(final, os.path.join(old, "old"))
    os.rename(tmp, final)
    _fsync_dir(root)
    write_latest(root, iteration)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    if keep_last is not None:
        try:
            prune_checkpoints(root, keep_last)
        except OSError as e:  # the new checkpoint is committed; retention can catch up next time
            logger.warning("retention keep_last=%d in %s failed: %s", keep_last, root, e)
    return final


def write_latest(root: str, iteration: int) -> None:
    """Point ``<root>/latest`` at ``iteration`` atomically (temp file + rename; a fault-injection seam)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp_latest_", dir=root)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)


def save_checkpoint(
    root: PathLike,
    iteration: int,
    *,
    shards: Optional[Mapping[str, Mapping[str, torch.Tensor]]] = None,
    state: Optional[Mapping[str, Any]] = None,
    json_files: Optional[Mapping[str, Any]] = None,
    group: Optional["dist.ProcessGroup"] = None,
    keep_last: Optional[int] = None,
    overwrite: bool = False,
    clean_stale: bool = True,
) -> str:
    """Write ``<root>/iter_<iteration:07d>`` atomically and point ``latest`` at it.

    Collective over ``group`` (every member calls it; ``None`` = this process
    alone). Each rank passes its own ``shards`` (shard name -> {tensor name ->
    tensor}, written as ``<shard>.safetensors``; names must be unique across
    ranks, e.g. ``model_actor_rank3``) and optional ``json_files`` (name ->
    JSON value, e.g. per-rank RNG state). ``state`` (JSON: scalars, data
    position, ...) is taken from group rank 0 only; ``"iteration"`` is added.
    ``keep_last=N`` deletes all but the N newest checkpoints after the save.
    ``clean_stale`` removes ``.tmp_*`` leftovers of crashed saves first (one
    training job per root). Returns the final directory; raises
    :class:`CheckpointError` on every rank if any rank failed (a write, or a
    floating tensor holding NaN or infinity), leaving the previous checkpoints
    and ``latest`` untouched.
    """
    root = os.fspath(root)
    iteration = _check_iteration(iteration)
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r}: must be an int >= 1 or None (keep all)")
    rank, world = _rank_size(group)

    prepared = None
    if rank == 0:
        try:
            prepared = ("ok", _begin_save(root, iteration, overwrite, clean_stale))
        except (OSError, CheckpointError) as e:
            prepared = ("error", f"{root}: cannot start checkpoint {iteration}: {e}")
    status, tmp = _broadcast(prepared, group)
    if status != "ok":
        raise CheckpointError(tmp)

    try:
        mine = ("ok", _rank_files(tmp, rank, shards, json_files))
    except Exception as e:  # noqa: BLE001 -- every failure must reach the gather below
        mine = ("error", f"rank {rank}: {type(e).__name__}: {e}")
    gathered = _all_gather(mine, group)
    errors = [msg for status, msg in gathered if status != "ok"]

    result = None
    if rank == 0:
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
            result = ("error", f"checkpoint {iteration} in {root} not written: " + "; ".join(errors))
        else:
            try:
                entries = [e for _, part in gathered for e in part]
                st = dict(state or {})
                st["iteration"] = iteration
                result = ("ok", commit_checkpoint(root, iteration, tmp, entries, st, world, keep_last))
            except Exception as e:  # noqa: BLE001 -- reported to every rank
                renamed = not os.path.exists(tmp)  # failed after the rename into place
                shutil.rmtree(tmp, ignore_errors=True)
                what = (f"{checkpoint_path(root, iteration)} was written but '{LATEST}' was not "
                        f"updated" if renamed else f"checkpoint {iteration} in {root} not committed")
                result = ("error", f"{what}: {type(e).__name__}: {e}")
    status, value = _broadcast(result, group)
    if status != "ok":
        raise CheckpointError(value)
    logger.info("saved checkpoint %s", value)
    return value


# --------------------------------------------------------------------------- verify / load
def _read_manifest(path: str) -> dict:
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path}: incomplete: directory missing")
    if not os.path.isfile(mpath):
        raise CheckpointError(f"checkpoint {path}: incomplete: manifest missing")
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
        files = manifest["files"]
        version = manifest["format_version"]
        if not all(isinstance(e, dict) and {"name", "bytes", "sha256", "kind"} <= set(e)
                   for e in files):
            raise ValueError("file entries lack name/bytes/sha256/kind")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: corrupt: manifest unreadable ({e})") from None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format_version {version} is not supported "
                              f"(this code reads {FORMAT_VERSION})")
    return manifest


def _verify_entry(path: str, entry: Mapping) -> None:
    fpath = os.path.join(path, entry["name"])
    if not os.path.isfile(fpath):
        raise CheckpointError(f"checkpoint {path}: incomplete: file {entry['name']} missing")
    size = os.path.getsize(fpath)
    if size != entry["bytes"]:
        raise CheckpointError(f"checkpoint {path}: corrupt: file {entry['name']} is {size} bytes, "
                              f"manifest says {entry['bytes']}")
    _, digest = _sha256_file(fpath)
    if digest != entry["sha256"]:
        raise CheckpointError(f"checkpoint {path}: corrupt: file {entry['name']} sha256 mismatch "
                              f"(manifest {entry['sha256'][:12]}..., file {digest[:12]}...)")


def verify_checkpoint(path: PathLike, names: Optional[Sequence[str]] = None) -> dict:
    """Check a checkpoint directory; return its manifest.

    Verifies the manifest and the size + sha256 of every listed file (or of
    the file names in ``names`` only). Raises :class:`CheckpointError`:
    ``"checkpoint <dir>: incomplete: manifest missing"``,
    ``"checkpoint <dir>: corrupt: file X sha256 mismatch (...)"``, ...
    """
    path = os.fspath(path)
    manifest = _read_manifest(path)
    by_name = {e["name"]: e for e in manifest["files"]}
    for name in (by_name if names is None else names):
        if name not in by_name:
            raise CheckpointError(f"checkpoint {path}: no file {name} in the manifest "
                                  f"(files: {', '.join(sorted(by_name))})")
        _verify_entry(path, by_name[name])
    return manifest


def _candidates(root: str, iteration: Optional[int], fallback: bool) -> list[int]:
    if iteration is not None:
        return [_check_iteration(iteration)]
    dirs = list_checkpoints(root)
    try:
        first = latest_iteration(root)
    except CheckpointError as e:
        if not fallback:
            raise
        logger.warning("%s; falling back to the newest complete checkpoint", e)
        first = None
    if first is None:
        if not dirs:
            raise CheckpointError(f"no checkpoint in {root} (no '{LATEST}' file, no iter_* directory)")
        first = dirs[-1]
    rest = [it for it in reversed(dirs) if it != first] if fallback else []
    return [first] + rest


def resolve_checkpoint(root: PathLike, iteration: Optional[int] = None, *, fallback: bool = False,
                       group: Optional["dist.ProcessGroup"] = None) -> int:
    """The iteration to load, fully verified (every file of the manifest).

    ``iteration=None`` means the one ``latest`` names (or the newest
    ``iter_*`` directory when there is no ``latest`` file). If it fails
    verification: ``fallback=False`` raises :class:`CheckpointError` naming
    the directory and the problem; ``fallback=True`` logs that and tries the
    other directories newest first, raising only if none is complete. With a
    ``group``, group rank 0 does the checking and broadcasts the answer.
    """
    root = os.fspath(root)
    rank, _ = _rank_size(group)
    answer = None
    if rank == 0:
        try:
            answer = ("ok", _resolve_local(root, iteration, fallback))
        except CheckpointError as e:
            answer = ("error", str(e))
    status, value = _broadcast(answer, group)
    if status != "ok":
        raise CheckpointError(value)
    return value


def _resolve_local(root: str, iteration: Optional[int], fallback: bool) -> int:
    problems = []
    for it in _candidates(root, iteration, fallback):
        try:
            verify_checkpoint(checkpoint_path(root, it))
            if problems:
                logger.warning("using checkpoint %s instead", checkpoint_path(root, it))
            return it
        except CheckpointError as e:
            if not fallback:
                raise
            logger.warning("skipping %s", e)
            problems.append(str(e))
    raise CheckpointError(f"no complete checkpoint in {root}: " + "; ".join(problems))


def load_checkpoint(
    root: PathLike,
    iteration: Optional[int] = None,
    *,
    shards: Optional[Sequence[str]] = None,
    json_files: Optional[Sequence[str]] = None,
    fallback: bool = False,
    group: Optional["dist.ProcessGroup"] = None,
) -> LoadedCheckpoint:
    """Find (see :func:`resolve_checkpoint`), verify and read a checkpoint.

    ``shards`` / ``json_files``: the names this rank needs (default: all in
    the manifest); each file read is checked against the manifest's size and
    sha256 first. Tensors come back on CPU. Collective over ``group``.
    """
    root = os.fspath(root)
    rank, _ = _rank_size(group)
    it = resolve_checkpoint(root, iteration, fallback=fallback, group=group)
    path = checkpoint_path(root, it)
    manifest = _read_manifest(path)
    kinds = {e["name"]: e["kind"] for e in manifest["files"]}
    if shards is None:
        shards = [n[: -len(TENSOR_EXT)] for n, k in kinds.items() if k == "tensors"]
    if json_files is None:
        json_files = [n[: -len(JSON_EXT)] for n, k in kinds.items() if k == "json"]
    names = [STATE] + [s + TENSOR_EXT for s in shards] + [j + JSON_EXT for j in json_files]
    if rank != 0:  # rank 0 verified every file in resolve_checkpoint
        verify_checkpoint(path, names)
    else:
        verify_checkpoint(path, [n for n in names if n not in kinds])  # only reports unknown names
    out = LoadedCheckpoint(iteration=it, path=path, state=_load_json(path, STATE), manifest=manifest)
    for s in shards:
        out.tensors[s] = _load_tensors(path, s + TENSOR_EXT)
    for j in json_files:
        out.json[j] = _load_json(path, j + JSON_EXT)
    return out


def _load_json(path: str, name: str) -> Any:
    try:
        with open(os.path.join(path, name), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: corrupt: {name} unreadable ({e})") from None


def _load_tensors(path: str, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(os.path.join(path, name), device="cpu")
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
        raise CheckpointError(f"checkpoint {path}: corrupt: {name} unreadable ({e})") from None


# --------------------------------------------------------------------------- retention
def prune_checkpoints(root: PathLike, keep_last: int) -> list[int]:
    """Delete all but the ``keep_last`` newest ``iter_*`` directories; return deleted iterations.

    The checkpoint ``latest`` names is never deleted. Each directory is first
    renamed to ``.tmp_delete_*`` (atomic), so a crash mid-delete never leaves
    a half-deleted ``iter_*`` behind.
    """
    if not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(f"keep_last={keep_last!r}: must be an int >= 1")
    root = os.fspath(root)
    try:
        protected = latest_iteration(root)
    except CheckpointError:
        protected = None
    its = list_checkpoints(root)
    doomed = [it for it in its[: max(0, len(its) - keep_last)] if it != protected]
    for it in doomed:
        trash = tempfile.mkdtemp(prefix=f".tmp_delete_iter_{it:07d}_", dir=root)
        os.rename(checkpoint_path(root, it), os.path.join(trash, "old"))
        shutil.rmtree(trash, ignore_errors=True)
    if doomed:
        logger.info("retention keep_last=%d removed iterations %s", keep_last, doomed)
    return doomed
