"""Model shapes the planner reasons about: presets, the weight tensors and parameter counts, FLOPs and bytes
per token.

Shapes are our :class:`rlhf.models.config.ModelConfig` (the job's own model
description). The presets are Llama-2 7B, 13B, 70B and CodeLlama 34B as
published on the model hub. Every count comes from one list of weight
tensors (:func:`model_weights`), the parameters of a megatron GPT model with
untied embeddings as our models keep them::

    per layer  = 2*h*h + 2*h*h_kv        q, o and k, v projections (h_kv = kv_heads * head_dim)
               + (h + 2*h_kv) if qkv_bias
               + 3*h*ffn                  SwiGLU gate, up, down
               + 2*h                      the two RMSNorms
    model      = vocab*h (embedding) + layers * per layer + h (final norm)
               + vocab*h (lm head) | h (value head, one output)

The same list tells resharding (rlhf.planner.reshard_bytes) how each tensor
is split over tensor-parallel ranks, so the bytes it moves and the
parameters counted here cannot drift apart.

Forward FLOPs per token are the schedule cost model's per-layer count
(rlhf.schedule.cost_model: matmuls plus attention over ``seq`` positions)
plus the head's 2*h*outputs. Weights and activations are bf16 (2 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from rlhf.models.config import ModelConfig
from rlhf.planner.errors import PlannerError
from rlhf.schedule.cost_model import ModelShape

BYTES = 2
"""Bytes per weight, activation and KV element (bf16)."""

LLAMA_SHAPES = {
    "llama-7b": ModelConfig(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                            num_kv_heads=32, vocab_size=32000, max_seq_len=4096, norm_eps=1e-5),
    "llama-13b": ModelConfig(num_layers=40, hidden_size=5120, ffn_hidden_size=13824, num_attention_heads=40,
                             num_kv_heads=40, vocab_size=32000, max_seq_len=4096, norm_eps=1e-5),
    "llama-34b": ModelConfig(num_layers=48, hidden_size=8192, ffn_hidden_size=22016, num_attention_heads=64,
                             num_kv_heads=8, vocab_size=32000, max_seq_len=16384, rope_theta=1e6, norm_eps=1e-5),
    "llama-70b": ModelConfig(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                             num_kv_heads=8, vocab_size=32000, max_seq_len=4096, norm_eps=1e-5),
}
"""The planner's model presets by name (a flag may name one instead of a file)."""


def llama_shape(name: str) -> ModelConfig:
    """A LLaMA preset by name; the error lists the presets."""
    try:
        return LLAMA_SHAPES[name]
    except KeyError:
        raise PlannerError(f"unknown model preset {name!r}; presets: {', '.join(LLAMA_SHAPES)}") from None


@dataclass(frozen=True)
class Weight:
    """One parameter tensor: ``place`` a layer index, ``"first"`` (the embedding) or ``"last"`` (final
    norm, head); ``numel`` its elements; ``rows`` its full size along the tensor-parallel split dimension,
    split in ``stride`` blocks (SwiGLU's [gate; up]); ``parallel`` False for a replicated one (norms, a
    value head)."""

    place: int | str
    numel: int
    rows: int
    stride: int = 1
    parallel: bool = True


def kv_width(cfg: ModelConfig) -> int:
    """h_kv: the width of the K (and of the V) projection."""
    return cfg.num_kv_heads * cfg.head_dim


def check_kind(kind: str) -> str:
    """``kind`` when it is a model kind (``lm`` or ``value``), else PlannerError."""
    if kind not in ("lm", "value"):
        raise PlannerError(f"model kind {kind!r} is not one of lm, value")
    return kind


def head_outputs(cfg: ModelConfig, kind: str) -> int:
    """Rows of the output layer: the vocabulary for an ``lm``, one for a ``value`` model."""
    return cfg.vocab_size if check_kind(kind) == "lm" else 1


def layer_weights(cfg: ModelConfig, layer: int) -> list[Weight]:
    """The tensors of decoder layer ``layer`` (see the module docstring)."""
    h, ffn, qkv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.hidden_size + 2 * kv_width(cfg)
    out = [Weight(layer, h, h, parallel=False),            # input_layernorm
           Weight(layer, qkv * h, qkv),                     # linear_qkv (per query group: stride 1)
           Weight(layer, h * h, h),                         # linear_proj (row-parallel, dim 1)
           Weight(layer, h, h, parallel=False),             # pre_mlp_layernorm
           Weight(layer, 2 * ffn * h, 2 * ffn, stride=2),   # linear_fc1 [gate; up]
           Weight(layer, h * ffn, ffn)]                     # linear_fc2 (row-parallel, dim 1)
    if cfg.qkv_bias:
        out.append(Weight(layer, qkv, qkv))
    return out


def model_weights(cfg: ModelConfig, kind: str, vocab_rows: int | None = None) -> list[Weight]:
    """The tensors of a megatron GPT model of ``kind`` (``lm`` or ``value``) whose embedding and LM head
    have ``vocab_rows`` rows (default the vocabulary, unpadded)."""
    h, rows = cfg.hidden_size, vocab_rows or cfg.vocab_size
    layers = [w for layer in range(cfg.num_layers) for w in layer_weights(cfg, layer)]
    head = Weight("last", rows * h, rows) if check_kind(kind) == "lm" else Weight("last", h, h, parallel=False)
    return [Weight("first", rows * h, rows)] + layers + [Weight("last", h, h, parallel=False),  # final_layernorm
                                                         head]                                 # output | value head


def weight_stage(place: int | str, num_layers: int, pp: int) -> int:
    """The pipeline stage of ``pp`` holding a weight at ``place`` (as rlhf.models.naming.owning_stage places
    a named parameter)."""
    if place == "first":
        return 0
    return pp - 1 if place == "last" else place // (num_layers // pp)


@lru_cache(maxsize=None)
def _stage_counts(cfg: ModelConfig, kind: str, pp: int) -> tuple[int, ...]:
    counts = [0] * pp
    for w in model_weights(cfg, kind):
        counts[weight_stage(w.place, cfg.num_layers, pp)] += w.numel
    return tuple(counts)


def stage_parameters(cfg: ModelConfig, kind: str, pp: int) -> list[int]:
    """Parameters of each of ``pp`` pipeline stages of a model of ``kind`` (``lm``: an output layer of
    [vocab, hidden]; ``value``: a value head of [1, hidden]): layers split evenly, the embedding on the
    first stage, the final norm and head on the last, the vocabulary unpadded. The project's one count."""
    return list(_stage_counts(cfg, kind, pp))


def parameter_count(cfg: ModelConfig, kind: str) -> int:
    """Parameters of a whole model of ``kind`` (``lm`` or ``value``)."""
    return sum(_stage_counts(cfg, kind, 1))


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
