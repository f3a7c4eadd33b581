"""Model shapes: a LLaMA-style decoder described by one frozen dataclass."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Iterable


RECOMPUTE_GRANULARITIES = ("full", "selective")
"""Activation recomputation as Megatron-LM's --recompute-granularity: ``full`` recomputes whole transformer
layers in the backward (only each chunk's input is kept), ``selective`` only the core attention."""


class ModelConfigError(ValueError):
    """An invalid model configuration; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """LLaMA/Qwen2-style decoder: RMSNorm, RoPE, SwiGLU, GQA, untied embeddings.

    ``qkv_bias`` is Qwen2's bias on the Q, K, V projections. ``tie_embeddings``
    is recorded for HF export; our models always keep a separate output layer
    (a tied checkpoint's embedding is copied into it on import).
    """

    num_layers: int = 2
    hidden_size: int = 64
    ffn_hidden_size: int = 128
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 512
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_kv_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ModelConfigError(f"unknown model config field(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


MODEL_PRESETS = {
    # name -> ModelConfig: the shapes a flag may name instead of a JSON file or a model directory
    # The built-in tiny default: runs on two CPU cores in seconds.
    "tiny": ModelConfig(),
    "tiny-critic": ModelConfig(num_layers=2, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4,
                               num_kv_heads=2),
}


def preset(name: str) -> ModelConfig:
    """A named model shape; the error lists the presets that exist."""
    try:
        return MODEL_PRESETS[name]
    except KeyError:
        raise ModelConfigError(f"unknown model preset {name!r}; available: {', '.join(sorted(MODEL_PRESETS))}") from None


def padded_vocab_size(vocab_size: int, divisible_by: int, tps: Iterable[int]) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by`` x lcm(``tps``).

    The lcm of the tps of every layout a model's weights move between (the
    largest, for powers of two) keeps one padded size for all of them, so
    resharding maps rows one to one. ``divisible_by=1`` pads only what tp needs.
    """
    if divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by must be >= 1, got {divisible_by}")
    multiple = divisible_by * math.lcm(1, *tps)
    return -(-vocab_size // multiple) * multiple
