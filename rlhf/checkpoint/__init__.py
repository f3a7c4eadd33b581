"""Checkpoints: atomic, verified storage (``storage``) and RNG capture (``rng``); the RLHF state, model
sources and HF / GGUF / PEFT / Megatron-LM import and export live beside them.

Floors, each importing only from those below it: storage and rng; the format modules (``rlhf_state``,
``hf``, ``megatron``, ``peft``, ``gguf``: gguf takes hf's error class); ``sources``, which tells model
directories apart and opens them; ``convert`` (every cross-format conversion) and ``loading``.

Only the storage and RNG APIs are re-exported here, exactly the names in
:data:`rlhf.checkpoint.storage.__all__` and :data:`rlhf.checkpoint.rng.__all__` (listed once, there).
"""
from . import rng, storage
from .rng import *  # noqa: F401,F403 -- the names of rng.__all__
from .storage import *  # noqa: F401,F403 -- the names of storage.__all__

__all__ = [*storage.__all__, *rng.__all__]
