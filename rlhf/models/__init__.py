"""LLaMA-style megatron-core models: LM (actor, reference) and value (critic, reward)."""

from rlhf.models.config import PRESETS, ModelConfig, ModelConfigError, preset

__all__ = ["PRESETS", "ModelConfig", "ModelConfigError", "preset"]
