"""Model shapes: a LLaMA-style decoder described by one frozen dataclass."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Iterable


RECOMPUTE_GRANULARITIES = ("full", "selective")
"""Activation recomputation as Megatron-LM's --recompute-granularity: ``full`` recomputes whole transformer
layers in the backward (only each chunk's input is kept), ``selective`` only the core attention."""


class ModelConfigError(ValueError):
    """An invalid model configuration; the message names the field (``field``, when given, too)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelConfig:
    """LLaMA/Qwen2/Qwen3-style decoder: RMSNorm, RoPE, SwiGLU, GQA, untied embeddings, dense or MoE.

    ``qkv_bias`` is Qwen2's bias on the Q, K, V projections; ``qk_norm`` Qwen3's RMSNorm of each query and
    key head (one weight of ``head_dim`` per projection, before RoPE); ``kv_channels`` the head dimension
    where it is not hidden_size / num_attention_heads (None: it is). ``tie_embeddings`` is recorded for HF
    export; our models always keep a separate output layer (a tied checkpoint's embedding is copied into
    it on import).

    Mixture of experts (megatron-core's MoE layer, ``num_experts`` > 0; 0: every layer's MLP is dense):
    each token goes to ``moe_router_topk`` of ``num_experts`` SwiGLU experts of ``moe_ffn_hidden_size``
    (None: ``ffn_hidden_size``), weighted by the router's softmax probabilities of the chosen experts,
    renormalised to sum to 1 when ``moe_norm_topk_prob`` (HF's norm_topk_prob); a shared expert of
    ``moe_shared_expert_intermediate_size`` (0: none) sees every token. ``moe_aux_loss_coeff`` weights
    the load-balancing loss and ``moe_z_loss_coeff`` the router z-loss in training (docs/moe.md).
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
    qk_norm: bool = False
    kv_channels: int | None = None
    num_experts: int = 0
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int = 0
    moe_norm_topk_prob: bool = True
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_kv_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ModelConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads} "
                "(or give the head dimension as kv_channels)"
            )
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ModelConfigError(f"kv_channels must be >= 1 (or None: hidden_size / num_attention_heads), "
                                   f"got {self.kv_channels}", "kv_channels")
        self._check_moe()
        if self.num_attention_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )

    def _check_moe(self) -> None:
        if self.num_experts < 0 or self.num_experts == 1:
            raise ModelConfigError(f"num_experts must be 0 (dense) or >= 2, got {self.num_experts}", "num_experts")
        if not self.is_moe:
            return
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ModelConfigError(f"moe_router_topk={self.moe_router_topk} must be in 1..num_experts="
                                   f"{self.num_experts}", "moe_router_topk")
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
            raise ModelConfigError(f"moe_ffn_hidden_size must be >= 1 (or None: ffn_hidden_size), got "
                                   f"{self.moe_ffn_hidden_size}", "moe_ffn_hidden_size")
        if self.moe_shared_expert_intermediate_size < 0:
            raise ModelConfigError("moe_shared_expert_intermediate_size must be >= 0 (0: no shared expert), got "
                                   f"{self.moe_shared_expert_intermediate_size}", "moe_shared_expert_intermediate_size")
        for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ModelConfigError(f"{name} must be a finite number >= 0, got {getattr(self, name)}", name)

    @property
    def head_dim(self) -> int:
        """The dimension of one attention head (kv_channels, or hidden_size / num_attention_heads)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        """True when the MLPs are mixtures of experts."""
        return self.num_experts > 0

    @property
    def expert_ffn_hidden_size(self) -> int:
        """The intermediate size of one routed expert."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

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
    # name -> ModelConfig: the shapes a flag may name instead of a JSON file or a model directory. A job's
    # preset takes its vocabulary from the job's tokenizer (preset()); the vocab_size here is ModelConfig's
    # default, what the planner's tools assume for a preset.
    # The built-in tiny default: runs on two CPU cores in seconds.
    "tiny": ModelConfig(),
    "tiny-critic": ModelConfig(num_layers=2, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4,
                               num_kv_heads=2),
    # The tiny default's shapes as Qwen3-MoE-style mixtures of experts (QK-norm; 4 experts, each token to 2,
    # half the dense FFN each, so a token's active MLP is the dense one's size; docs/moe.md).
    "tiny-moe": ModelConfig(qk_norm=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                            moe_aux_loss_coeff=0.01),
    "tiny-moe-critic": ModelConfig(num_layers=2, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4,
                                   num_kv_heads=2, qk_norm=True, num_experts=4, moe_router_topk=2,
                                   moe_ffn_hidden_size=48, moe_aux_loss_coeff=0.01),
}


def preset(name: str, vocab_size: int) -> ModelConfig:
    """The named model shape with ``vocab_size`` ids: a job gives a preset its tokenizer's number of ids, so
    that every id the model can sample has a token. The error lists the presets that exist."""
    try:
        return replace(MODEL_PRESETS[name], vocab_size=vocab_size)
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


LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections LoRA can adapt, as PEFT names them on an HF Llama (rlhf/models/lora.py maps them onto
megatron's fused linear_qkv and linear_fc1 and its linear_proj and linear_fc2)."""
LORA_MODULES_TO_SAVE = ("lm_head", "embed_tokens", "norm")
"""PEFT's ``modules_to_save`` names LoRA can train in full beside the adapters: the output layer, the input
embedding, and (PEFT matches a name as a suffix of the module's) every RMSNorm."""


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters of one model, as PEFT's ``LoraConfig``: ``rank`` r (0: no adapters), ``alpha`` (the
    adapter's output is scaled by alpha / r, PEFT's default, not rsLoRA; None: alpha = r, scale 1),
    ``dropout`` on the adapter's input in training, the ``target_modules`` adapted (PEFT's names), and the
    ``modules_to_save`` trained in full beside them (PEFT's names, LORA_MODULES_TO_SAVE)."""

    rank: int = 0
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: tuple = LORA_TARGET_MODULES
    modules_to_save: tuple = ()

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ModelConfigError(f"rank must be an integer >= 0 (0: no adapters), got {self.rank!r}", "rank")
        if self.alpha is not None and not (isinstance(self.alpha, (int, float)) and 0 < self.alpha < math.inf):
            raise ModelConfigError(f"alpha must be a finite number > 0 (or None: the rank), got {self.alpha!r}",
                                   "alpha")
        if not (isinstance(self.dropout, (int, float)) and 0 <= self.dropout < 1):
            raise ModelConfigError(f"dropout must be in [0, 1), got {self.dropout!r}", "dropout")
        if not isinstance(self.target_modules, tuple) or not self.target_modules:
            raise ModelConfigError(f"target_modules must name at least one of {', '.join(LORA_TARGET_MODULES)}, "
                                   f"got {self.target_modules!r}", "target_modules")
        unknown = [m for m in self.target_modules if m not in LORA_TARGET_MODULES]
        if unknown:
            raise ModelConfigError(f"target module {unknown[0]!r} does not exist; the projections are "
                                   f"{', '.join(LORA_TARGET_MODULES)}", "target_modules")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ModelConfigError(f"target_modules {self.target_modules!r} names a projection twice",
                                   "target_modules")
        saved = self.modules_to_save
        if (not isinstance(saved, tuple) or len(set(saved)) != len(saved)
                or any(m not in LORA_MODULES_TO_SAVE for m in saved)):
            raise ModelConfigError(f"modules_to_save {saved!r}: name each of {', '.join(LORA_MODULES_TO_SAVE)} "
                                   "at most once", "modules_to_save")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        """What the adapter's output B A x is multiplied by: alpha / r."""
        return (self.rank if self.alpha is None else self.alpha) / self.rank

    def check_shape(self, model: ModelConfig) -> None:
        """ModelConfigError when the rank exceeds the smaller dimension of a targeted projection of ``model``."""
        for name in self.target_modules:
            n_in, n_out = projection_shape(model, name)
            if self.rank > min(n_in, n_out):
                small = min(n_in, n_out)
                raise ModelConfigError(f"rank {self.rank} is larger than {name}'s smaller dimension {small} "
                                       f"([{n_out}, {n_in}]); give a rank <= {small}", "rank")


def projection_shape(model: ModelConfig, name: str) -> tuple[int, int]:
    """(input, output) features of the PEFT projection ``name`` of ``model`` (unsharded)."""
    h, ffn = model.hidden_size, model.ffn_hidden_size
    q, kv = model.num_attention_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, ffn), "up_proj": (h, ffn), "down_proj": (ffn, h)}[name]
