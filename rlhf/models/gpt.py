"""Build megatron-core GPTModel stages: LM (actor/reference) or value (critic/reward) kind.

A model is built from its shape, its kind, an explicit megatron
``ProcessGroupCollection`` and the facts of its pipeline stage; it knows
nothing of meshes or tasks (the parallel package makes the collection), so models
with different (dp, pp, tp) coexist in one set of processes. The layer spec is
rlhf.platform's choice: TransformerEngine's where a GPU computes and TE imports,
megatron's local one elsewhere (``transformer_impl`` overrides it).
"""

from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf import platform
from rlhf.models import moe, rope
from rlhf.models.attention import sdpa_core_attention
from rlhf.models.config import RECOMPUTE_GRANULARITIES, ModelConfig, padded_vocab_size
from rlhf.models.naming import named_global_parameters
from rlhf.models.packing import PackedLayout
from rlhf.models.sharding import ShardSpec, full_to_shard
from rlhf.models.vocab import VOCAB_PARAMETERS, mask_vocab_padding
from rlhf.tasks import KINDS


@dataclass(frozen=True)
class PipelineStage:
    """Stage ``index`` of a ``count``-stage pipeline (logical order: 0 embeds, count-1 has the head)."""

    index: int = 0
    count: int = 1

    def __post_init__(self):
        if not 0 <= self.index < self.count:
            raise ValueError(f"pipeline stage index {self.index} is outside 0..{self.count - 1}")

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


def recompute_fields(granularity: str | None, num_layers: int | None, stage_layers: int) -> dict:
    """TransformerConfig's recompute fields for Megatron-LM's ``--recompute-granularity`` and
    ``--recompute-num-layers`` on a pipeline stage of ``stage_layers`` layers.

    ``full``: method uniform, chunks of ``num_layers`` layers (default 1), each recomputed from its input;
    ``selective``: megatron's core-attention recompute (``num_layers`` must be None); None: no recompute.
    ValueError names the argument and what is valid.
    """
    if granularity is None:
        if num_layers is not None:
            raise ValueError(f"recompute_num_layers={num_layers} needs recompute_granularity 'full'")
        return {}
    if granularity not in RECOMPUTE_GRANULARITIES:
        raise ValueError(f"recompute_granularity={granularity!r} is not one of {RECOMPUTE_GRANULARITIES} (or None)")
    if granularity == "selective":
        if num_layers is not None:
            raise ValueError("recompute_num_layers applies to recompute_granularity 'full' only; selective "
                             "recomputes the core attention of every layer")
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    chunk = 1 if num_layers is None else num_layers
    if not (isinstance(chunk, int) and 1 <= chunk <= stage_layers and stage_layers % chunk == 0):
        raise ValueError(f"recompute_num_layers={num_layers} must divide the {stage_layers} layers of a pipeline "
                         f"stage (megatron's uniform method recomputes chunks of that many layers)")
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": chunk}


def moe_fields(cfg: ModelConfig, ep: int) -> dict:
    """TransformerConfig's MoE fields for ``cfg`` with its experts split over ``ep`` ranks ({} when dense).

    HF's norm_topk_prob is megatron's top-k before the softmax (the softmax over the chosen logits is the
    chosen probabilities renormalised); without it, the softmax over all experts comes first. The
    all-to-all dispatcher moves each token to its experts' ranks; no capacity limit, no jitter, and the
    router's probabilities in fp32 (docs/moe.md).
    """
    if not cfg.is_moe:
        return {}
    return dict(
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.expert_ffn_hidden_size,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or None,
        moe_router_pre_softmax=not cfg.moe_norm_topk_prob,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe_z_loss_coeff or None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_dtype="fp32",
        expert_model_parallel_size=ep,
    )


def transformer_config(cfg: ModelConfig, tp: int, pp: int, dtype: torch.dtype = torch.float32,
                       recompute_granularity: str | None = None, recompute_num_layers: int | None = None,
                       ep: int = 1):
    """megatron TransformerConfig for ``cfg`` sharded tp x pp (experts over ``ep``; no dropout, no fusions
    but RoPE's, which rlhf.models.rope provides where TransformerEngine does not: packed samples' positions
    found on the device), recomputing activations as :func:`recompute_fields` says."""
    from megatron.core.transformer import TransformerConfig

    rope.install()
    recompute = recompute_fields(recompute_granularity, recompute_num_layers, cfg.num_layers // pp)
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_kv_heads,
        kv_channels=cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.qkv_bias,
        qk_layernorm=cfg.qk_norm,
        init_method_std=cfg.init_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=True,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,
        **recompute,
        **moe_fields(cfg, ep),
    )


TRANSFORMER_IMPLS = ("local", "transformer_engine")


def _layer_spec(transformer_impl: str, cfg: ModelConfig):
    """megatron's local layer spec, or the TransformerEngine one (GPU, TE installed), with ``cfg``'s
    QK-norm and MoE MLP (megatron's SequentialMLP experts: one local MLP per expert).

    The local spec's core attention is PyTorch's fused scaled_dot_product_attention, which also takes
    packed samples (rlhf.models.attention), as TE's does. The TE spec
    fuses the pre-attention and pre-MLP norms into the following linear
    layers; `rlhf.models.naming.global_name` maps those parameter names back
    to the local spec's, so conversion and resharding see one naming.
    """
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = cfg.num_experts or None
    if transformer_impl == "local":
        spec = specs.get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = sdpa_core_attention()  # THD input too
        return spec
    if transformer_impl == "transformer_engine":
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, qk_layernorm=cfg.qk_norm)
    raise ValueError(f"unknown transformer_impl {transformer_impl!r}; valid: {TRANSFORMER_IMPLS}")


class ValueHead(torch.nn.Module):
    """hidden -> one scalar per token, replicated on every TP rank.

    Drop-in for GPTModel's output layer: same call signature and (out, bias)
    return. Each TP rank holds the full hidden state, so no collective is
    needed and gradients w.r.t. the hidden state are already complete.
    """

    def __init__(self, hidden_size: int, init_std: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size))
        torch.nn.init.normal_(self.weight, std=init_std)
        # Replicated across TP: counted once in grad norms, copied whole by resharding.
        self.weight.tensor_model_parallel = False
        self.sequence_parallel = False

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return F.linear(hidden, self.weight), None


def build_model(cfg: ModelConfig, kind: str, pg_collection, stage: PipelineStage = PipelineStage(),
                seed: int = 1234, dtype: torch.dtype = torch.float32,
                transformer_impl: str | None = None, padded_vocab: int | None = None,
                recompute_granularity: str | None = None, recompute_num_layers: int | None = None) -> torch.nn.Module:
    """This rank's ``stage`` of a model of ``kind`` (``lm`` or ``value``), sharded over ``pg_collection``.

    megatron takes the TP size from ``pg_collection.tp`` and the stage's layers
    from ``pg_collection.pp`` (its rank() and size()), so that group must
    report ``stage``. Ranks of one stage share the seed, so with CPU
    initialisation every TP rank draws the same full weights and keeps its slice.

    ``padded_vocab``: rows of the embedding and LM output layer (rlhf.models.vocab;
    default: ``cfg.vocab_size`` rounded up to a multiple of this tp). Every layout
    the weights are resharded between must use the same value. The padded rows
    start at zero; ``model.unpadded_vocab_size`` records ``cfg.vocab_size``.

    ``recompute_granularity``, ``recompute_num_layers``: activation recomputation in training forwards
    (:func:`recompute_fields`; megatron recomputes only in training mode and with gradients enabled).
    """
    from megatron.core.models.gpt import GPTModel

    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; valid: {KINDS}")
    pp = pg_collection.pp
    if (pp.rank(), pp.size()) != (stage.index, stage.count):
        raise ValueError(f"pg_collection.pp reports stage {pp.rank()} of {pp.size()} but the model is built as "
                         f"stage {stage.index} of {stage.count}; megatron assigns layers by that group, so "
                         "pass a pp group whose rank() is the logical stage")
    tp = pg_collection.tp.size()
    padded_vocab = padded_vocab or padded_vocab_size(cfg.vocab_size, 1, [tp])
    if padded_vocab < cfg.vocab_size or padded_vocab % tp:
        raise ValueError(f"padded_vocab={padded_vocab} must be a multiple of tp={tp} and at least "
                         f"vocab_size={cfg.vocab_size} (rlhf.models.config.padded_vocab_size gives one)")
    platform.setup_megatron()
    platform.seed_model_parallel_rng(seed + 1000 * stage.index)
    model = GPTModel(
        config=transformer_config(cfg, tp, stage.count, dtype, recompute_granularity, recompute_num_layers,
                                  ep=pg_collection.ep.size()),
        transformer_layer_spec=_layer_spec(transformer_impl or platform.transformer_impl(), cfg),
        vocab_size=padded_vocab,
        max_sequence_length=cfg.max_seq_len,
        pre_process=stage.is_first,
        post_process=stage.is_last,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=int(cfg.rope_theta),
        pg_collection=pg_collection,
    )
    if kind == "value" and stage.is_last:
        model.output_layer = ValueHead(cfg.hidden_size, cfg.init_std)
    for param in model.parameters():  # megatron's local norms are built fp32 whatever params_dtype says;
        param.data = param.data.to(dtype)  # Megatron-LM's Float16Module casts every parameter, so do we
    if cfg.is_moe:
        _mark_experts(model)
        _draw_by_name(model, cfg, seed, pg_collection.tp)
        moe.attach(model)
    _zero_vocab_padding(model, cfg.vocab_size, pg_collection.tp.rank())
    model.unpadded_vocab_size = cfg.vocab_size
    return model.to(platform.device())


def _mark_experts(model: torch.nn.Module) -> None:
    """Set ``is_expert`` on the routed experts' parameters: whole tensors on every TP rank
    (rlhf.models.sharding), split between expert-parallel ranks by expert (rlhf.models.naming)."""
    for name, param in model.named_parameters():
        param.is_expert = ".mlp.experts." in name


@torch.no_grad()
def _draw_by_name(model: torch.nn.Module, cfg: ModelConfig, seed: int, tp_group) -> None:
    """Redraw a mixture of experts' weights as a function of (``seed``, global name) alone, with megatron's
    initialisation (normal(0, init_std); the residual-branch outputs ``linear_proj`` and ``linear_fc2`` with
    init_std / sqrt(2 num_layers); norms 1, biases 0), each rank keeping its TP shard. megatron draws weights
    in construction order from one generator, and an expert-parallel rank constructs only its own experts,
    so without this every ep would build another model from the same seed."""
    residual_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for name, param in named_global_parameters(model).items():
        spec = ShardSpec.of(param, tp_group.size())
        shape = list(param.shape)
        shape[spec.dim] = spec.full_size(param)
        if name.endswith("layernorm.weight") or name.endswith(".bias"):
            full = torch.full(shape, 1.0 if name.endswith("weight") else 0.0)
        else:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            std = residual_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else cfg.init_std
            full = torch.randn(shape, generator=generator) * std
        param.copy_(full_to_shard(full, spec, tp_group.rank()))


@torch.no_grad()
def _zero_vocab_padding(model: torch.nn.Module, vocab_size: int, tp_rank: int) -> None:
    """Zero this TP rank's rows of ids >= ``vocab_size`` (drawn at random with the rest)."""
    for name, param in model.named_parameters():
        if name in VOCAB_PARAMETERS and getattr(param, "tensor_model_parallel", False):
            rows = param.shape[0]
            param[max(0, vocab_size - tp_rank * rows):].zero_()


def stage_forward(model: torch.nn.Module, input_ids: torch.Tensor, input_tensor: torch.Tensor | None = None,
                  packed: PackedLayout | None = None, padding_mask: torch.Tensor | None = None):
    """Run one pipeline stage.

    input_ids: [b, s] token ids (every stage needs them for the shape; only the
    first stage embeds them). input_tensor: [s, b, h] hidden states from the
    previous stage (None on the first stage). Returns [s, b, h] hidden states,
    or on the last stage [b, s, V/tp] logits (LM, in the model's dtype; V the padded
    vocabulary, padded ids -inf: rlhf.models.vocab) / [b, s] float32 values (value
    model; a bf16 or fp16 head's output cast up, as the log-probs are computed in fp32).
    ``packed``: the layout of input_ids' samples, which then run as one packed row of
    t tokens (rlhf/models/packing.py): hidden states [t, 1, h], the output [1, t, ...].
    ``padding_mask`` [b, s] bool, True at padding (padded input): a MoE model leaves those tokens out of its
    load-balancing statistics and z-loss.
    """
    model.set_input_tensor(input_tensor)
    if packed is None:
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, -1)
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None, padding_mask=padding_mask)
    else:
        out = model(input_ids=packed.pack(input_ids), position_ids=packed.positions, attention_mask=None,
                    packed_seq_params=packed.seq_params)
    if not model.post_process:
        return out
    if isinstance(model.output_layer, ValueHead):
        return out.squeeze(-1).float()
    return mask_vocab_padding(out, model.unpadded_vocab_size, model.pg_collection.tp.rank() * out.shape[-1])


@contextmanager
def eval_mode(model: torch.nn.Module):
    """``model`` in eval mode for an inference pass, every module's train/eval flag restored after: dropout
    (LoRA's ``--lora-dropout``, any module's) is off where log-probs, values or scores are inferred and on
    in the training forwards of the same model (verl's ``compute_log_prob`` switches to eval alike)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training
