"""Hugging Face <-> ours: configs, tensor names and layouts of LLaMA / Qwen2 / Qwen3 / Qwen3-MoE checkpoints.

This module owns the mapping between an HF safetensors checkpoint (``LlamaForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` and their
``*ForSequenceClassification``) and our unsharded model in *global naming* (see
:mod:`rlhf.parallel.reshard`). Per layer ``i`` (``h = model.layers.i.``, ``o = decoder.layers.i.``)::

    h input_layernorm.weight           -> o input_layernorm.weight
    h self_attn.{q,k,v}_proj.{w,b}     -> o self_attention.linear_qkv.{weight,bias}  (fused, below; bias: Qwen2)
    h self_attn.{q,k}_norm.weight      -> o self_attention.{q,k}_layernorm.weight    (Qwen3, Qwen3-MoE)
    h self_attn.o_proj.weight          -> o self_attention.linear_proj.weight
    h post_attention_layernorm.weight  -> o pre_mlp_layernorm.weight
    h mlp.{gate,up}_proj.weight        -> o mlp.linear_fc1.weight                    ([gate; up])
    h mlp.down_proj.weight             -> o mlp.linear_fc2.weight
    h mlp.gate.weight                  -> o mlp.router.weight                        (Qwen3-MoE, below)
    h mlp.experts.E.{gate,up}_proj.weight -> o mlp.experts.local_experts.E.linear_fc1.weight  ([gate; up])
    h mlp.experts.E.down_proj.weight   -> o mlp.experts.local_experts.E.linear_fc2.weight
    model.embed_tokens.weight -> embedding.word_embeddings.weight
    model.norm.weight         -> decoder.final_layernorm.weight
    lm_head.weight (or the embedding when tied) / score.weight -> output_layer.weight

Fused QKV rows are grouped per KV head (G groups, q_per_group = heads / G)::

    [ q(g0 heads) k(g0) v(g0) | q(g1 heads) k(g1) v(g1) | ... ]

A Qwen3-MoE layer's MLP is ``num_experts`` experts (E is the global expert index)
and a router, every layer (``decoder_sparse_step`` 1, no ``mlp_only_layers``); HF's
``norm_topk_prob`` is our ``moe_norm_topk_prob``. Files hold one tensor per expert,
as ``save_pretrained`` writes and the published checkpoints have them; reading also
takes transformers' in-memory layout (``mlp.experts.gate_up_proj`` [E, 2f, h] of
[gate; up] rows, ``mlp.experts.down_proj`` [E, h, f]), slicing each expert out.

HF and megatron (``rotary_interleaved=False``) both apply RoPE with
``rotate_half`` on the projection rows as stored, so no row permutation is
needed (checked against transformers' logits in the tests).

Reading goes through ``safetensors.safe_open`` and fetches only the HF tensors
behind the requested global names, so a pipeline stage reads only its layers.

A format module: it imports nothing of rlhf.checkpoint; sources.py and the conversions to and from
other formats (convert.py) sit above it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Iterable

import torch

from rlhf.models.config import ModelConfig, ModelConfigError
from rlhf.models.vocab import drop_vocab_padding

logger = logging.getLogger(__name__)

FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}
FEATURES = {"llama": (), "qwen2": ("qkv_bias",), "qwen3": ("qk_norm",), "qwen3_moe": ("qk_norm", "moe")}
"""What each family's layers have beyond Llama's: Qwen2's QKV bias, Qwen3's QK-norm, Qwen3-MoE's experts."""
KINDS = {"causal_lm": "ForCausalLM", "sequence_classification": "ForSequenceClassification"}
ARCHITECTURES = {FAMILIES[f] + KINDS[k]: (f, k) for f in FAMILIES for k in KINDS}  # name -> (family, kind)
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class HFConversionError(ValueError):
    """An HF checkpoint cannot be converted; the message says what and how to fix it."""


@dataclass(frozen=True)
class HFModelInfo:
    """What an HF directory holds: our config, its model family and head kind."""

    config: ModelConfig
    family: str  # a key of FAMILIES
    kind: str  # "causal_lm" | "sequence_classification"

    @property
    def architecture(self) -> str:
        return FAMILIES[self.family] + KINDS[self.kind]


# --------------------------------------------------------------------------- configs
def _parse_architecture(raw: dict, path: str) -> tuple[str, str]:
    archs = raw.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise HFConversionError(f"{path}: unsupported architectures {archs}; supported: "
                                f"{', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[archs[0]]


def _rope_theta(raw: dict, path: str) -> float:
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise HFConversionError(f"{path}: rope_type {rope_type!r} is not supported (only 'default' RoPE)")
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise HFConversionError(f"{path}: rope_theta={theta} must be a whole number (megatron's rotary_base)")
    return theta


def _check_unsupported(raw: dict, family: str, kind: str, path: str) -> None:
    if raw.get("hidden_act", "silu") != "silu":
        raise HFConversionError(f"{path}: hidden_act={raw['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
    if raw.get("mlp_bias"):
        raise HFConversionError(f"{path}: mlp_bias=true is not supported")
    if family != "qwen2" and raw.get("attention_bias"):
        raise HFConversionError(f"{path}: {FAMILIES[family]} attention_bias=true (bias on o_proj too) is not supported")
    if raw.get("use_sliding_window"):
        raise HFConversionError(f"{path}: use_sliding_window=true is not supported")
    windowed = sorted({t for t in raw.get("layer_types") or () if t != "full_attention"})
    if windowed:
        raise HFConversionError(f"{path}: layer_types {windowed} are not supported (only 'full_attention')")
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    if family == "qwen2" and head_dim * heads != raw["hidden_size"]:
        raise HFConversionError(f"{path}: head_dim={head_dim} x heads={heads} != hidden_size={raw['hidden_size']} "
                                "(Qwen2 has no separate head dimension)")
    labels = raw.get("num_labels") or len(raw.get("id2label") or {0: 0})
    if kind == "sequence_classification" and labels != 1:
        raise HFConversionError(f"{path}: a value head needs num_labels=1, got {labels}")
    if family == "qwen3_moe":
        if raw.get("decoder_sparse_step", 1) != 1:
            raise HFConversionError(f"{path}: decoder_sparse_step={raw['decoder_sparse_step']} is not supported "
                                    "(every layer must be MoE: 1)")
        if raw.get("mlp_only_layers"):
            raise HFConversionError(f"{path}: mlp_only_layers={raw['mlp_only_layers']} is not supported "
                                    "(every layer must be MoE: [])")
        if _num_experts(raw) < 2:
            raise HFConversionError(f"{path}: num_experts={_num_experts(raw)}; a Qwen3-MoE needs at least 2")


def _num_experts(raw: dict) -> int:
    """Qwen3-MoE's expert count: ``num_experts`` as published, ``num_local_experts`` as transformers 5 saves it."""
    return raw.get("num_experts") or raw.get("num_local_experts") or 0


def _moe_fields(raw: dict, family: str) -> dict:
    """Our MoE fields from a Qwen3-MoE config.json (transformers' defaults where a field is absent)."""
    if family != "qwen3_moe":
        return {}
    return {"num_experts": _num_experts(raw), "moe_router_topk": raw["num_experts_per_tok"],
            "moe_ffn_hidden_size": raw["moe_intermediate_size"],
            "moe_norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "moe_aux_loss_coeff": float(raw.get("router_aux_loss_coef", 0.001))}


_REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_REQUIRED_MOE = ("num_experts_per_tok", "moe_intermediate_size")


def is_hf_dir(path: str) -> bool:
    """True for a Hugging Face model directory (it has a config.json)."""
    return os.path.isfile(os.path.join(path, "config.json"))


def read_hf_config(hf_dir: str) -> HFModelInfo:
    """Parse ``<hf_dir>/config.json`` into our :class:`ModelConfig` (raises on anything unsupported)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise HFConversionError(f"{hf_dir}: no config.json; expected a Hugging Face model directory")
    raw = _read_json(path, "a Hugging Face config.json")
    if not isinstance(raw, dict):
        raise HFConversionError(f"{path}: expected a JSON object of model settings, got {type(raw).__name__}")
    family, kind = _parse_architecture(raw, path)
    required = _REQUIRED + (_REQUIRED_MOE if family == "qwen3_moe" else ())
    missing = [k for k in required if k not in raw]
    if family == "qwen3_moe" and "num_experts" not in raw and "num_local_experts" not in raw:
        missing.append("num_experts")
    if missing:
        raise HFConversionError(f"{path}: missing field(s) {missing}")
    _check_unsupported(raw, family, kind, path)
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    try:
        cfg = ModelConfig(
            num_layers=raw["num_hidden_layers"],
            hidden_size=raw["hidden_size"],
            ffn_hidden_size=raw["intermediate_size"],
            num_attention_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            vocab_size=raw["vocab_size"],
            max_seq_len=raw.get("max_position_embeddings", 2048),
            rope_theta=_rope_theta(raw, path),
            norm_eps=raw.get("rms_norm_eps", 1e-6),
            qkv_bias="qkv_bias" in FEATURES[family],
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            init_std=raw.get("initializer_range", 0.02),
            qk_norm="qk_norm" in FEATURES[family],
            kv_channels=head_dim if head_dim * heads != raw["hidden_size"] else None,
            **_moe_fields(raw, family),
        )
    except ModelConfigError as exc:
        raise HFConversionError(f"{path}: {exc}") from None
    return HFModelInfo(cfg, family, kind)


def default_family(cfg: ModelConfig) -> str:
    """The HF family a model exports as: qwen3_moe with experts, qwen3 with QK-norm, qwen2 with QKV bias, else
    llama."""
    return ("qwen3_moe" if cfg.is_moe else "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama")


_FEATURE_NAMES = {"qkv_bias": "QKV bias", "qk_norm": "QK-norm", "moe": "experts"}


def _check_family(cfg: ModelConfig, family: str) -> None:
    """HFConversionError unless ``family``'s layers are exactly ``cfg``'s (one line naming the difference)."""
    have = {"qkv_bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm, "moe": cfg.is_moe}
    for feature, present in have.items():
        if present != (feature in FEATURES[family]):
            fits = default_family(cfg)
            hint = (f"export it as family {fits!r}" if all(have[f] == (f in FEATURES[fits]) for f in have)
                    else "no supported HF family has " + " and ".join(_FEATURE_NAMES[f] for f in have if have[f]))
            raise HFConversionError(f"family {family!r} {'has no' if present else 'has'} "
                                    f"{_FEATURE_NAMES[feature]} but this model {'has' if present else 'has no'} "
                                    f"{_FEATURE_NAMES[feature]}; {hint}")
    if family == "qwen2" and cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise HFConversionError(f"Qwen2 has no separate head dimension: kv_channels={cfg.kv_channels} x "
                                f"heads={cfg.num_attention_heads} != hidden_size={cfg.hidden_size}")
    if cfg.is_moe and cfg.moe_shared_expert_intermediate_size:
        raise HFConversionError(f"Qwen3-MoE has no shared expert: moe_shared_expert_intermediate_size="
                                f"{cfg.moe_shared_expert_intermediate_size} cannot be exported")


def hf_config_dict(cfg: ModelConfig, kind: str = "causal_lm", family: str | None = None,
                   dtype: torch.dtype = torch.float32) -> dict:
    """config.json content for ``cfg``; family defaults to :func:`default_family`."""
    family = family or default_family(cfg)
    if family not in FAMILIES or kind not in KINDS:
        raise HFConversionError(f"family={family!r} / kind={kind!r}; valid: {sorted(FAMILIES)} / {sorted(KINDS)}")
    _check_family(cfg, family)
    out = {
        "architectures": [FAMILIES[family] + KINDS[kind]], "model_type": family,
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "mlp_bias": False, "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if family != "llama":
        out["use_sliding_window"] = False
    if family != "qwen2":
        out["attention_bias"] = False
    if family == "qwen3_moe":
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
                   moe_intermediate_size=cfg.expert_ffn_hidden_size, norm_topk_prob=cfg.moe_norm_topk_prob,
                   router_aux_loss_coef=cfg.moe_aux_loss_coeff, decoder_sparse_step=1, mlp_only_layers=[])
    if kind == "sequence_classification":
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return out


# --------------------------------------------------------------------------- names and layouts
def _layer_sources(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    h, o = f"model.layers.{i}.", f"decoder.layers.{i}."
    attn = h + "self_attn."
    out = {
        o + "input_layernorm.weight": [h + "input_layernorm.weight"],
        o + "self_attention.linear_qkv.weight": [attn + f"{x}_proj.weight" for x in "qkv"],
        o + "self_attention.linear_proj.weight": [attn + "o_proj.weight"],
        o + "pre_mlp_layernorm.weight": [h + "post_attention_layernorm.weight"],
    }
    if cfg.qkv_bias:
        out[o + "self_attention.linear_qkv.bias"] = [attn + f"{x}_proj.bias" for x in "qkv"]
    if cfg.qk_norm:
        out.update({o + f"self_attention.{x}_layernorm.weight": [attn + f"{x}_norm.weight"] for x in "qk"})
    if not cfg.is_moe:
        out[o + "mlp.linear_fc1.weight"] = [h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"]
        out[o + "mlp.linear_fc2.weight"] = [h + "mlp.down_proj.weight"]
        return out
    out[o + "mlp.router.weight"] = [h + "mlp.gate.weight"]
    for e in range(cfg.num_experts):
        ours, theirs = f"{o}mlp.experts.local_experts.{e}.", f"{h}mlp.experts.{e}."
        out[ours + "linear_fc1.weight"] = [theirs + "gate_proj.weight", theirs + "up_proj.weight"]
        out[ours + "linear_fc2.weight"] = [theirs + "down_proj.weight"]
    return out


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape every HF tensor of a model with this config must have (by HF name; the fused expert
    tensors of transformers' in-memory Qwen3-MoE layout too)."""
    h, f, v, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_kv_heads * hd
    n, ef = cfg.num_experts, cfg.expert_ffn_hidden_size
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h),
           "score.weight": (1, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f),
                    p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                    p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        if cfg.is_moe:
            out.update({p + "mlp.gate.weight": (n, h), p + "mlp.experts.gate_up_proj": (n, 2 * ef, h),
                        p + "mlp.experts.down_proj": (n, h, ef)})
            for e in range(n):
                out.update({p + f"mlp.experts.{e}.gate_proj.weight": (ef, h),
                            p + f"mlp.experts.{e}.up_proj.weight": (ef, h),
                            p + f"mlp.experts.{e}.down_proj.weight": (h, ef)})
    return out


def hf_sources(cfg: ModelConfig, head: str | None) -> dict[str, list[str]]:
    """Global name -> the HF tensor names it is built from.

    ``head``: "lm_head", "tied" (output layer = embedding), "score" (value head
    of a sequence classifier) or None (no output layer: a new value head).
    """
    out = {"embedding.word_embeddings.weight": ["model.embed_tokens.weight"]}
    for i in range(cfg.num_layers):
        out.update(_layer_sources(cfg, i))
    out["decoder.final_layernorm.weight"] = ["model.norm.weight"]
    heads = {"lm_head": "lm_head.weight", "tied": "model.embed_tokens.weight", "score": "score.weight"}
    if head is not None:
        out["output_layer.weight"] = [heads[head]]
    return out


def _qkv_groups(cfg: ModelConfig) -> tuple[int, int]:
    return cfg.num_kv_heads, cfg.num_attention_heads // cfg.num_kv_heads * cfg.head_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q/k/v ([rows, ...] weights or biases) -> megatron's per-group fused QKV."""
    groups, q_rows = _qkv_groups(cfg)
    rest = q.shape[1:]
    parts = (q.reshape(groups, q_rows, *rest), k.reshape(groups, cfg.head_dim, *rest),
             v.reshape(groups, cfg.head_dim, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    groups, q_rows = _qkv_groups(cfg)
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, q_rows + 2 * cfg.head_dim, *rest).split(
        [q_rows, cfg.head_dim, cfg.head_dim], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def _combine(name: str, parts: list[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    if ".linear_qkv." in name:
        return fuse_qkv(*parts, cfg)
    return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


def _split(name: str, full: torch.Tensor, cfg: ModelConfig) -> list[torch.Tensor]:
    if ".linear_qkv." in name:
        return list(split_qkv(full, cfg))
    if name.endswith("linear_fc1.weight"):  # [gate; up] of the MLP or an expert
        return [t.contiguous() for t in full.chunk(2, dim=0)]
    return [full]


# --------------------------------------------------------------------------- reading
def _read_json(path: str, what: str):
    """The parsed JSON of ``path``; HFConversionError naming it if it is unreadable or truncated."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise HFConversionError(f"{path}: cannot read {what} ({exc}); the file is truncated or not JSON") from None


@contextlib.contextmanager
def _safetensors(path: str):
    """``safe_open`` of ``path``; HFConversionError naming it for a truncated or foreign file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except SafetensorError as exc:
        raise HFConversionError(f"{path}: cannot read safetensors ({exc}); the file is truncated or not "
                                "a safetensors file") from None


def _weight_files(hf_dir: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path (single file or sharded index)."""
    single, index = os.path.join(hf_dir, WEIGHTS_FILE), os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = _read_json(index, "a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFConversionError(f"{index}: no 'weight_map' object of tensor name -> file")
        return {k: os.path.join(hf_dir, v) for k, v in weight_map.items()}
    if os.path.isfile(single):
        with _safetensors(single) as f:
            return {k: single for k in f.keys()}
    raise HFConversionError(f"{hf_dir}: no {WEIGHTS_FILE} or {INDEX_FILE} (only safetensors checkpoints "
                            f"are supported; re-save with save_pretrained(safe_serialization=True))")


def head_source(info: HFModelInfo, role: str) -> str | None:
    """Which HF tensor initialises our output layer for ``role`` ("lm" or "value")."""
    if role == "lm":
        if info.kind != "causal_lm":
            raise HFConversionError(f"an LM needs a *ForCausalLM checkpoint, got {info.architecture}")
        return "tied" if info.config.tie_embeddings else "lm_head"
    if role == "value":
        return "score" if info.kind == "sequence_classification" else None
    raise HFConversionError(f"unknown role {role!r}; valid: 'lm', 'value'")


_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")


def _fused_expert(name: str, cfg: ModelConfig) -> tuple[str, int, slice] | None:
    """Where per-expert HF tensor ``name`` lies in transformers' in-memory layout: (fused tensor, expert,
    rows); None for a name that is not an expert's."""
    m = _EXPERT.fullmatch(name)
    if m is None:
        return None
    prefix, expert, proj = m.groups()
    f = cfg.expert_ffn_hidden_size
    rows = {"gate": slice(0, f), "up": slice(f, 2 * f), "down": slice(None)}[proj]
    return prefix + ("down_proj" if proj == "down" else "gate_up_proj"), int(expert), rows


def read_hf_state(hf_dir: str, info: HFModelInfo, role: str = "lm",
                  names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Full tensors by global name, reading only the HF tensors behind ``names`` (default: all).

    With role "value" and a causal-LM checkpoint there is no ``output_layer.weight``
    (the value head is new); requesting it is skipped. Qwen3-MoE experts are read
    per expert, or sliced out of fused ``experts.gate_up_proj`` / ``down_proj``.
    """
    cfg = info.config
    sources = hf_sources(cfg, head_source(info, role))
    wanted = list(sources) if names is None else [n for n in names if n in sources]
    files = _weight_files(hf_dir)
    needed = {s for n in wanted for s in sources[n]}
    fused = {s: _fused_expert(s, cfg) for s in needed - set(files)}
    fused = {s: where for s, where in fused.items() if where is not None and where[0] in files}
    missing = sorted(needed - set(files) - set(fused))
    if missing:
        raise HFConversionError(f"{hf_dir}: missing tensor(s) {missing[:5]} for {info.architecture}")
    stored = (needed - set(fused)) | {where[0] for where in fused.values()}
    loaded: dict[str, torch.Tensor] = {}
    shapes = hf_shapes(cfg)
    for path in sorted({files[s] for s in stored}):
        with _safetensors(path) as f:
            for s in sorted(n for n in stored if files[n] == path):
                shape = tuple(f.get_slice(s).get_shape())
                if shape != shapes[s]:
                    raise HFConversionError(f"{path}: tensor {s} has shape {list(shape)} but config.json "
                                            f"implies {list(shapes[s])}; the weights and the config disagree")
            for s in sorted(n for n in needed if files.get(n) == path):
                loaded[s] = f.get_tensor(s)
            for s, (name, expert, rows) in sorted(fused.items()):
                if files[name] == path:
                    loaded[s] = f.get_slice(name)[expert][rows].contiguous()
    return {n: _combine(n, [loaded[s] for s in sources[n]], cfg) for n in wanted}


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, groups, hf_dir: str, role: str = "lm") -> HFModelInfo:
    """Fill this rank's stage (any tp/pp) from an HF directory, reading only its own tensors.

    A value model built from a causal LM keeps its freshly initialised head. A
    model built with a padded vocabulary (rlhf.models.vocab) gets zero rows there.
    """
    from rlhf.models.naming import named_global_parameters
    from rlhf.parallel.reshard import load_full_weights

    info = read_hf_config(hf_dir)
    params = named_global_parameters(model)
    full = read_hf_state(hf_dir, info, role, params)
    unmapped = sorted(set(params) - set(full))
    if head_source(info, role) is None and "output_layer.weight" in unmapped:
        unmapped.remove("output_layer.weight")  # the new value head: not TP-sharded, keep as is
        full["output_layer.weight"] = params["output_layer.weight"].data
    if unmapped:
        raise HFConversionError(f"no HF tensor maps to parameter(s) {unmapped[:5]} of this model "
                                f"(only megatron's local layer spec is supported)")
    load_full_weights(model, groups, full)
    return info


# --------------------------------------------------------------------------- writing
def to_hf_state(full: dict[str, torch.Tensor], cfg: ModelConfig, kind: str = "causal_lm") -> dict[str, torch.Tensor]:
    """Our full state dict (global names) -> HF tensors (tied output layer omitted; padded vocabulary
    rows dropped, so the shapes are ``cfg``'s)."""
    head = "score" if kind == "sequence_classification" else ("tied" if cfg.tie_embeddings else "lm_head")
    out = {}
    for name, srcs in hf_sources(cfg, head).items():
        if name not in full:
            raise HFConversionError(f"our state dict lacks {name!r}")
        if name == "output_layer.weight" and head == "tied":
            continue
        out.update(zip(srcs, _split(name, drop_vocab_padding(name, full[name], cfg.vocab_size), cfg)))
    return {k: v.contiguous() for k, v in out.items()}


def export_hf(out_dir: str, cfg: ModelConfig, full: dict[str, torch.Tensor], kind: str = "causal_lm",
              family: str | None = None, dtype: torch.dtype | None = None, deltas: dict | None = None) -> str:
    """Write ``config.json`` + ``model.safetensors`` loadable by transformers; returns ``out_dir``.

    ``dtype``: the weights' dtype in the files (None: as ``full`` holds them; a bf16 run's checkpoint holds
    the fp32 main weights of its trained models).

    ``full``: our full state dict (global names, e.g. from ``sources.read_full_state`` or
    ``gather_tp_full_weights`` at pp=1). A tied config whose output layer no
    longer equals the embedding is written untied, so no trained weight is lost.
    """
    from safetensors.torch import save_file

    tied = cfg.tie_embeddings and kind == "causal_lm"
    if tied and not torch.equal(full["output_layer.weight"], full["embedding.word_embeddings.weight"]):
        logger.warning("output layer differs from the embedding (trained untied): exporting "
                       "tie_word_embeddings=false with an lm_head")
        cfg = dataclasses.replace(cfg, tie_embeddings=False)
    hf_config_dict(cfg, kind, family)  # refuses a family that cannot hold this model before anything is written
    tensors = to_hf_state(full, cfg, kind)
    for name, delta in (deltas or {}).items():
        tensors[name] = tensors[name] + delta.to(tensors[name].dtype)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    dtype = next(iter(tensors.values())).dtype
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config_dict(cfg, kind, family, dtype), f, indent=2, sort_keys=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    return out_dir

