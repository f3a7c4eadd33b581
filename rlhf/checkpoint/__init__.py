"""Checkpoints: atomic, verified storage (``storage``); HF import/export lives beside it.

Only the storage API is re-exported here; see :mod:`rlhf.checkpoint.storage`.
"""
from .storage import (
    CheckpointError,
    LoadedCheckpoint,
    RngHook,
    accelerator_rng_hook,
    capture_rng_state,
    checkpoint_path,
    latest_iteration,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    resolve_checkpoint,
    restore_rng_state,
    save_checkpoint,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "RngHook",
    "accelerator_rng_hook",
    "capture_rng_state",
    "checkpoint_path",
    "latest_iteration",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "resolve_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "verify_checkpoint",
]
