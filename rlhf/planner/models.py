"""Model shapes the planner reasons about: presets, parameter counts, FLOPs and bytes per token.

Shapes are our :class:`rlhf.models.config.ModelConfig` (the job's own model
description). The presets are the four LLaMA configurations of ReaL Table 1
(Llama-2 7B, 13B, 70B and CodeLlama 34B, as published on the model hub).
Parameters are counted from the shape, untied embeddings as our models keep
them::

    per layer  = 2*h*h + 2*h*h_kv        q, o and k, v projections (h_kv = kv_heads * head_dim)
               + (h + 2*h_kv) if qkv_bias
               + 3*h*ffn                  SwiGLU gate, up, down
               + 2*h                      the two RMSNorms
    model      = vocab*h (embedding) + layers * per layer + h (final norm)
               + vocab*h (lm head) | h (value head, one output)

Forward FLOPs per token are the schedule cost model's per-layer count
(rlhf.schedule.cost_model: matmuls plus attention over ``seq`` positions)
plus the head's 2*h*outputs. Weights and activations are bf16 (2 bytes).
"""

from __future__ import annotations

from rlhf.models.config import ModelConfig
from rlhf.planner.errors import PlannerError
from rlhf.schedule.cost_model import ModelShape

BYTES = 2
"""Bytes per weight, activation and KV element (bf16)."""

PRESETS = {
    "llama-7b": ModelConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                            num_kv_heads=32, vocab_size=32000, max_seq_len=4096, norm_eps=1e-5),
    "llama-13b": ModelConfig(num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                             num_kv_heads=40, vocab_size=32000, max_seq_len=4096, norm_eps=1e-5),
    "llama-34b": ModelConfig(num_layers=48, hidden_size=8192, ffn_hidden_size=22016, num_attention_heads=64,
                             num_kv_heads=8, vocab_size=32000, max_seq_len=16384, rope_theta=1e6, norm_eps=1e-5),
    "llama-70b": ModelConfig(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                             num_kv_heads=8, vocab_size=32000, max_seq_len=4096, norm_eps=1e-5),
}


def model_preset(name: str) -> ModelConfig:
    """A LLaMA preset by name; the error lists the presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise PlannerError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None


def kv_width(cfg: ModelConfig) -> int:
    """h_kv: the width of the K (and of the V) projection."""
    return cfg.num_kv_heads * cfg.head_dim


def layer_parameters(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer (see the module docstring)."""
    h, h_kv = cfg.hidden_size, kv_width(cfg)
    bias = h + 2 * h_kv if cfg.qkv_bias else 0
    return 2 * h * h + 2 * h * h_kv + bias + 3 * h * cfg.ffn_hidden_size + 2 * h


def head_outputs(cfg: ModelConfig, kind: str) -> int:
    """Rows of the output layer: the vocabulary for an ``lm``, one for a ``value`` model."""
    if kind not in ("lm", "value"):
        raise PlannerError(f"model kind {kind!r} is not one of lm, value")
    return cfg.vocab_size if kind == "lm" else 1


def stage_parameters(cfg: ModelConfig, kind: str, pp: int) -> list[int]:
    """Parameters of each of ``pp`` pipeline stages (layers split evenly, the embedding on the first
    stage, the final norm and head on the last), as rlhf.ppo.dry_run.stage_parameter_counts splits them."""
    h = cfg.hidden_size
    counts = [cfg.num_layers // pp * layer_parameters(cfg) for _ in range(pp)]
    counts[0] += cfg.vocab_size * h
    counts[-1] += h + head_outputs(cfg, kind) * h
    return counts


def parameter_count(cfg: ModelConfig, kind: str) -> int:
    """Parameters of a whole model of ``kind`` (``lm`` or ``value``)."""
    return sum(stage_parameters(cfg, kind, 1))


def schedule_shape(cfg: ModelConfig, name: str, tp: int, pp: int, microbatches: int,
                   direction: str = "down") -> ModelShape:
    """The schedule cost model's shape of ``cfg`` under (tp, pp, micro-batches)."""
    return ModelShape(name=name, layers=cfg.num_layers, hidden=cfg.hidden_size, ffn=cfg.ffn_hidden_size,
                      heads=cfg.num_attention_heads, kv_heads=cfg.num_kv_heads, tp=tp, pp=pp,
                      microbatches=microbatches, direction=direction)


def forward_flops_per_token(cfg: ModelConfig, kind: str, seq: int) -> float:
    """Forward FLOPs of one token attending to ``seq`` positions (all layers and the head)."""
    layer = schedule_shape(cfg, "m", 1, 1, 1).flops_per_token_layer(seq)
    return cfg.num_layers * layer + 2.0 * cfg.hidden_size * head_outputs(cfg, kind)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """KV-cache bytes one token occupies over all layers (K and V, bf16)."""
    return 2 * cfg.num_layers * kv_width(cfg) * BYTES
