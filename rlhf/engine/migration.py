"""Sample migration: an unfinished sequence as plain data.

`Engine.export_sequence` produces a `MigratedSequence` (tokens, log-probs so
far, sampling params and, optionally, this TP rank's K/V of the computed
positions, with their routing when the engine records it);
`Engine.import_sequence` continues it in another engine. Without K/V the
importer re-prefills the tokens (which records their routing again); with K/V
it continues decoding at once (same TP degree and model needed on both sides:
each TP rank sends its own KV shard to the same TP rank on the other side).
Moving it between ranks is inter-stage fusion's job (`rlhf.fusion.transport`);
the engine knows nothing of it. No sampling state travels: a sample's draws
depend only on its seed, ``mixed_seed(params.seed, sample_index)``, and the
tokens it has generated (`rlhf.engine.sampler.uniforms`), so a migrated sample
draws what it would have drawn unmoved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlhf.engine.types import SamplingParams


@dataclass
class MigratedSequence:
    """Everything needed to continue one sample elsewhere.

    kv: [layers, 2, num_computed, local kv heads, head_dim] or None.
    routing: the experts of those positions, [num_computed, layers, k] (int16), when the exporting engine
    records routing (`EngineConfig.record_routing`) and K/V are sent; else None (ignored without K/V).
    """

    request_id: str
    sample_index: int
    prompt_len: int
    tokens: list[int]
    logprobs: list[float]
    params: SamplingParams
    num_computed: int
    kv: torch.Tensor | None = None
    policy_versions: list[int] = field(default_factory=list)
    routing: torch.Tensor | None = None
