"""Model shapes the planner reasons about: presets, the weight tensors and parameter counts, FLOPs and bytes
per token.

Shapes are our :class:`rlhf.models.config.ModelConfig` (the job's own model
description). The presets are Llama-2 7B, 13B, 70B and CodeLlama 34B as
published on the model hub. Every count comes from one list of weight
tensors (:func:`model_weights`), the parameters of a megatron GPT model with
untied embeddings as our models keep them::

    per layer  = 2*h*q + 2*h*h_kv        q, o and k, v projections (q = heads * head_dim, h_kv = kv_heads *
                                          head_dim; q = h unless kv_channels sets head_dim apart)
               + (q + 2*h_kv) if qkv_bias
               + 2*head_dim if qk_norm    Qwen3's RMSNorm of each query and key head
               + 3*h*ffn                  SwiGLU gate, up, down (dense)
               | E*h + E*3*h*f_e          MoE: the router and E SwiGLU experts of f_e (expert_ffn_hidden_size)
                 + 3*h*f_s                 and the shared expert (f_s = moe_shared_expert_intermediate_size)
               + 2*h                      the two RMSNorms
    model      = vocab*h (embedding) + layers * per layer + h (final norm)
               + vocab*h (lm head) | h (value head, one output)

A token of a mixture of experts goes through k = moe_router_topk of the E
experts, so its *active* parameters (:func:`active_parameter_count`) are the
total less layers * (E - k) * 3*h*f_e. A routed expert's tensors carry their
expert index (``Weight.expert``) and are whole on every TP rank (megatron's
expert tensor parallelism is 1 here): expert parallelism holds each on one
in ep of the data-parallel replicas (:func:`rank_parameters`).

The same list tells resharding (rlhf.planner.reshard_bytes) how each tensor
is split over tensor-parallel ranks, so the bytes it moves and the
parameters counted here cannot drift apart.

Forward FLOPs per token (:func:`forward_flops_per_token`) are 2 x the matmul
parameters a token passes through per layer (:func:`layer_matmul_parameters`:
the projections, and the dense MLP or the router, k experts and the shared
expert; no norms, no biases) plus attention over ``seq`` positions (4*seq*q:
scores QK^T and AV), over all layers, plus the head's 2*h*outputs. For a
dense model with q = h that is the schedule cost model's per-layer count
(rlhf.schedule.cost_model). Weights and activations are bf16 (2 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from rlhf.models.config import ModelConfig
from rlhf.parallel.mesh import ParallelStrategy
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
    value head, a router); ``expert`` the global index of a routed expert whose tensor it is (None: every
    data-parallel replica holds it)."""

    place: int | str
    numel: int
    rows: int
    stride: int = 1
    parallel: bool = True
    expert: int | None = None


def kv_width(cfg: ModelConfig) -> int:
    """h_kv: the width of the K (and of the V) projection."""
    return cfg.num_kv_heads * cfg.head_dim


def q_width(cfg: ModelConfig) -> int:
    """q: the width of the Q projection (and the input of the output projection), heads * head_dim."""
    return cfg.num_attention_heads * cfg.head_dim


def expert_parameters(cfg: ModelConfig) -> int:
    """Parameters of one routed expert (SwiGLU of expert_ffn_hidden_size); 0 for a dense model."""
    return 3 * cfg.hidden_size * cfg.expert_ffn_hidden_size if cfg.is_moe else 0


def check_kind(kind: str) -> str:
    """``kind`` when it is a model kind (``lm`` or ``value``), else PlannerError."""
    if kind not in ("lm", "value"):
        raise PlannerError(f"model kind {kind!r} is not one of lm, value")
    return kind


def head_outputs(cfg: ModelConfig, kind: str) -> int:
    """Rows of the output layer: the vocabulary for an ``lm``, one for a ``value`` model."""
    return cfg.vocab_size if check_kind(kind) == "lm" else 1


def _mlp(layer: int, h: int, ffn: int, expert: int | None = None) -> list[Weight]:
    """A SwiGLU MLP's two tensors: linear_fc1 [gate; up] and linear_fc2 (row-parallel, dim 1); a routed
    ``expert``'s are whole on every TP rank (rlhf.models.sharding: expert tensor parallelism is 1)."""
    split = expert is None
    return [Weight(layer, 2 * ffn * h, 2 * ffn, stride=2, parallel=split, expert=expert),
            Weight(layer, h * ffn, ffn, parallel=split, expert=expert)]


def layer_weights(cfg: ModelConfig, layer: int) -> list[Weight]:
    """The tensors of decoder layer ``layer`` (see the module docstring)."""
    h, q = cfg.hidden_size, q_width(cfg)
    qkv = q + 2 * kv_width(cfg)
    out = [Weight(layer, h, h, parallel=False),            # input_layernorm
           Weight(layer, qkv * h, qkv),                     # linear_qkv (per query group: stride 1)
           Weight(layer, h * q, q),                         # linear_proj (row-parallel, dim 1)
           Weight(layer, h, h, parallel=False)]             # pre_mlp_layernorm
    if cfg.is_moe:
        out.append(Weight(layer, cfg.num_experts * h, cfg.num_experts, parallel=False))  # router (replicated)
        for e in range(cfg.num_experts):                                                 # experts.local_experts.e
            out += _mlp(layer, h, cfg.expert_ffn_hidden_size, expert=e)
        if cfg.moe_shared_expert_intermediate_size:                                      # shared_experts
            out += _mlp(layer, h, cfg.moe_shared_expert_intermediate_size)
    else:
        out += _mlp(layer, h, cfg.ffn_hidden_size)
    if cfg.qkv_bias:
        out.append(Weight(layer, qkv, qkv))
    if cfg.qk_norm:  # q_layernorm, k_layernorm: one head's width, replicated
        out += [Weight(layer, cfg.head_dim, cfg.head_dim, parallel=False)] * 2
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
def _stage_counts(cfg: ModelConfig, kind: str, pp: int, experts: bool = False) -> tuple[int, ...]:
    """Parameters per stage: all of them, or (``experts``) the routed experts' only."""
    counts = [0] * pp
    for w in model_weights(cfg, kind):
        if not experts or w.expert is not None:
            counts[weight_stage(w.place, cfg.num_layers, pp)] += w.numel
    return tuple(counts)


def stage_parameters(cfg: ModelConfig, kind: str, pp: int) -> list[int]:
    """Parameters of each of ``pp`` pipeline stages of a model of ``kind`` (``lm``: an output layer of
    [vocab, hidden]; ``value``: a value head of [1, hidden]): layers split evenly, the embedding on the
    first stage, the final norm and head on the last, the vocabulary unpadded. The project's one count."""
    return list(_stage_counts(cfg, kind, pp))


def stage_expert_parameters(cfg: ModelConfig, kind: str, pp: int) -> list[int]:
    """The routed experts' share of :func:`stage_parameters` (all zero for a dense model)."""
    return list(_stage_counts(cfg, kind, pp, True))


def parameter_count(cfg: ModelConfig, kind: str) -> int:
    """Parameters of a whole model of ``kind`` (``lm`` or ``value``): every expert of a mixture of experts."""
    return sum(_stage_counts(cfg, kind, 1))


def active_parameter_count(cfg: ModelConfig, kind: str) -> int:
    """Parameters one token passes through: :func:`parameter_count` less the layers' E - k experts it is not
    routed to (a dense model's are all of them)."""
    idle = cfg.num_experts - cfg.moe_router_topk if cfg.is_moe else 0
    return parameter_count(cfg, kind) - cfg.num_layers * idle * expert_parameters(cfg)


def rank_parameters(cfg: ModelConfig, kind: str, strategy: ParallelStrategy) -> float:
    """Parameters one rank of ``strategy`` holds: its largest pipeline stage's parameters but the routed
    experts / tp (as for a dense model: max(stage_parameters) / tp), and the stage's routed experts / ep
    (each of ep replicas holds num_experts / ep whole experts, whole on every TP rank)."""
    return max(_rank_split(cfg, kind, strategy))


def _rank_split(cfg: ModelConfig, kind: str, s: ParallelStrategy) -> list[float]:
    if not cfg.is_moe:
        return [total / s.tp for total in _stage_counts(cfg, kind, s.pp)]
    return [(total - experts) / s.tp + experts / s.ep
            for total, experts in zip(_stage_counts(cfg, kind, s.pp), _stage_counts(cfg, kind, s.pp, True))]


def rank_expert_parameters(cfg: ModelConfig, kind: str, strategy: ParallelStrategy) -> float:
    """The routed experts' share of :func:`rank_parameters` (on the same, largest, stage)."""
    split = _rank_split(cfg, kind, strategy)
    return _stage_counts(cfg, kind, strategy.pp, True)[split.index(max(split))] / strategy.ep


def active_ffn(cfg: ModelConfig) -> int:
    """The MLP width one token passes through: ffn_hidden_size, or k x expert_ffn_hidden_size + the shared
    expert's for a mixture of experts."""
    if not cfg.is_moe:
        return cfg.ffn_hidden_size
    return cfg.moe_router_topk * cfg.expert_ffn_hidden_size + cfg.moe_shared_expert_intermediate_size


def layer_matmul_parameters(cfg: ModelConfig) -> int:
    """Matmul parameters one token passes through in one layer: Q, K, V and output projections, then the
    dense MLP or the router, its k experts and the shared expert."""
    h, q = cfg.hidden_size, q_width(cfg)
    attention = h * (q + 2 * kv_width(cfg)) + q * h
    router = cfg.num_experts * h if cfg.is_moe else 0
    return attention + router + 3 * h * active_ffn(cfg)


def schedule_shape(cfg: ModelConfig, name: str, tp: int, pp: int, microbatches: int,
                   direction: str = "down") -> ModelShape:
    """The schedule cost model's shape of ``cfg`` under (tp, pp, micro-batches); a mixture of experts as the
    dense model of its active MLP width (:func:`active_ffn`)."""
    return ModelShape(name=name, layers=cfg.num_layers, hidden=cfg.hidden_size, ffn=active_ffn(cfg),
                      heads=cfg.num_attention_heads, kv_heads=cfg.num_kv_heads, tp=tp, pp=pp,
                      microbatches=microbatches, direction=direction)


def forward_flops_per_token(cfg: ModelConfig, kind: str, seq: int) -> float:
    """Forward FLOPs of one token attending to ``seq`` positions (all layers and the head): 2 x the active
    matmul parameters and 4 x seq x q per layer, 2 x h x outputs for the head (the module docstring)."""
    layer = 2.0 * layer_matmul_parameters(cfg) + 4.0 * seq * q_width(cfg)
    return cfg.num_layers * layer + 2.0 * cfg.hidden_size * head_outputs(cfg, kind)


def kv_bytes_per_token(cfg: ModelConfig) -> int:
    """KV-cache bytes one token occupies over all layers (K and V, bf16)."""
    return 2 * cfg.num_layers * kv_width(cfg) * BYTES
