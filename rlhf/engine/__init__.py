"""Generation engine: paged KV cache with prefix sharing, continuous batching,
sampling, a TP-sharded decoder on the actor's resharded weights, sample migration.

Layers (each only calls the one below): `Scheduler` -> `KVManager` ->
`BlockPool` -> `TPDecoder`; `Engine` ties them together. See docs/engine.md.
Above them, not imported here: `completions` (a prompts file in, completions
out, one model on one process: tools/generate.py's work).
"""

from rlhf.engine.block_pool import BlockPool
from rlhf.engine.engine import Engine, EngineStats
from rlhf.engine.kv_manager import KVManager
from rlhf.engine.migration import MigratedSequence
from rlhf.engine.sampler import mixed_seed
from rlhf.engine.scheduler import Scheduler, SchedulerOutput
from rlhf.engine.types import (LOGPROB_MODES, CapacityError, EngineConfig, EngineConfigError, NeverFitsError,
                               OutOfBlocksError, Request, SampleResult, SamplingParams)

__all__ = [
    "LOGPROB_MODES", "BlockPool", "CapacityError", "Engine", "EngineConfig", "EngineConfigError", "EngineStats",
    "KVManager", "MigratedSequence", "NeverFitsError", "OutOfBlocksError", "Request", "SampleResult", "SamplingParams",
    "Scheduler", "SchedulerOutput", "mixed_seed",
]
