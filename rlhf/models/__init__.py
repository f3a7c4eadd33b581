"""LLaMA-style megatron-core models: LM (actor, reference) and value (critic, reward)."""

from rlhf.models.config import MODEL_PRESETS, ModelConfig, ModelConfigError, preset

__all__ = ["MODEL_PRESETS", "ModelConfig", "ModelConfigError", "preset"]
