"""Checkpoints: atomic, verified storage (``storage``); HF import/export lives beside it.

Only the storage API is re-exported here, exactly the names in
:data:`rlhf.checkpoint.storage.__all__` (listed once, there).
"""
from . import storage
from .storage import *  # noqa: F401,F403 -- the names of storage.__all__

__all__ = list(storage.__all__)
