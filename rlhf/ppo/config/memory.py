"""The memory section (``memory.*``): what is freed between stages, activation recomputation."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config import check_field_types, check_recompute, check_recompute_stage


@dataclass(frozen=True)
class MemoryConfig:
    """What is freed between the stages of an iteration (rlhf/memory.py; docs/training.md, "Memory
    between stages"), and what training keeps for its backward. ``offload_ref_reward``: the reference
    and reward weights stay in host memory except during their inference. ``release_generation_memory``:
    actor_gen's weights and the KV cache are freed after generation and allocated again at the next
    reshard. ``recompute_granularity`` (None, "full", "selective") and ``recompute_num_layers``:
    Megatron-LM's activation recomputation of the trained models (actor_train, critic_train): full
    recomputes chunks of ``recompute_num_layers`` layers (default 1; it must divide each training
    pipeline stage's layers, rlhf.ppo.layout checks), selective the core attention. None changes results."""

    offload_ref_reward: bool = False
    release_generation_memory: bool = False
    recompute_granularity: str | None = None
    recompute_num_layers: int | None = None

    def __post_init__(self):
        check_field_types("memory", self)
        check_recompute("memory", self.recompute_granularity, self.recompute_num_layers)

    @property
    def recompute(self) -> dict:
        """rlhf.models.gpt.build_model's recompute arguments for a trained model."""
        return {"recompute_granularity": self.recompute_granularity,
                "recompute_num_layers": self.recompute_num_layers}

    def check_stage_layers(self, task: str, stage_layers: int) -> None:
        """ConfigError unless a full recompute's chunk divides the ``stage_layers`` layers of a pipeline
        stage of ``task`` (megatron's uniform method recomputes whole chunks)."""
        check_recompute_stage("memory", task, self.recompute_granularity, self.recompute_num_layers, stage_layers)
