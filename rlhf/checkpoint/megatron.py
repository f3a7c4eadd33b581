"""Megatron-LM checkpoints (``--ckpt-format torch_dist``) in and out, by our global parameter names.

What Megatron-LM's ``save_checkpoint`` writes, through megatron-core's ``dist_checkpointing``::

    <dir>/latest_checkpointed_iteration.txt   "1000" (or "release": then <dir>/release/)
    <dir>/iter_0001000/
        metadata.json       {"sharded_backend": "torch_dist", ...}
        common.pt           torch.save({"args": Namespace, "checkpoint_version": 3.0, "iteration": 1000, ...})
        .metadata           pickled torch.distributed.checkpoint Metadata: each tensor's global shape, chunks
        __<rank>_<i>.distcp the chunks, as the saving (tp, pp) held them
        tokenizer/          optional (--save-tokenizer-assets)

Every tensor is a *global* tensor cut into chunks, so the layout that saved it
does not matter: a region of a global tensor is read from whichever chunks
overlap it (torch.distributed.checkpoint's resharding, the storage layer of
``dist_checkpointing``), in this process alone, so a pipeline stage reads its
own layers and no process group is needed. Keys, against our global names::

    ours                                          Megatron-LM (megatron-core sharded_state_dict)
    embedding.word_embeddings.weight              embedding.word_embeddings.weight     [padded_vocab_size, h]
    decoder.layers.{i}.input_layernorm.weight     decoder.layers.self_attention.linear_qkv.layer_norm_weight
    decoder.layers.{i}.pre_mlp_layernorm.weight   decoder.layers.mlp.linear_fc1.layer_norm_weight
                                                  (MoE: also decoder.layers.pre_mlp_layernorm.weight)
    decoder.layers.{i}.mlp.experts.local_experts.{E}.<fc>
                                                  decoder.layers.mlp.experts.experts.<fc>
                                                  [num_layers, num_experts, ...], row (i, E)
    decoder.layers.{i}.<rest>                     decoder.layers.<rest>                [num_layers, ...], row i
    decoder.final_layernorm.weight                decoder.final_layernorm.weight
    output_layer.weight                           output_layer.weight (the embedding when tied)

``<rest>``: the attention's ``linear_qkv`` (and bias), ``linear_proj``, Qwen3's
``q_layernorm`` / ``k_layernorm`` [head_dim]; a dense MLP's ``linear_fc1`` /
``linear_fc2``; a MoE layer's ``mlp.router.weight`` [num_experts, h] and
``mlp.shared_experts.linear_fc1`` / ``linear_fc2``. megatron-core writes
TransformerEngine's fused layer-norm names for both layer specs, but a TE-spec
MoE layer keeps its pre-MLP norm as ``pre_mlp_layernorm.weight`` (the local
spec still saves the fused name): both are read, and both are written for MoE.
The local spec's own names (``decoder.layers.input_layernorm.weight``) load
too, and so do per-layer keys (``decoder.layers.{i}.<rest>``, experts
``decoder.layers.{i}.mlp.experts.experts.<w>`` [num_experts, ...], written for
non-homogeneous layers) beside the default stacked ones. Experts are indexed
globally whatever expert-parallel layout saved them (megatron-core's
SequentialMLP and grouped-GEMM experts save the same keys). A global tensor is
laid out as our unsharded model: fused QKV per query group, SwiGLU fc1 (an
expert's, the shared expert's) as [gate; up]. A value model (ours-to-megatron
of a critic or reward model) has an ``output_layer.weight`` of one row.

Trust: ``common.pt`` and ``.metadata`` are pickles, which can run code when
loaded. ``common.pt`` is read with ``torch.load(weights_only=True)`` and an
allow-list (``argparse.Namespace`` and a few more, megatron-core's enums); ``.metadata``
(a plain pickle that ``weights_only`` cannot read) with an unpickler that
resolves only torch.distributed.checkpoint's metadata classes, ``torch.Size``
and dtypes. Anything else is refused before it is built. The tensor chunks
are read with ``torch.load(weights_only=True)``; TransformerEngine's pickled
``_extra_state`` entries are never read (docs/megatron_checkpoints.md).

A format module: it imports nothing of rlhf.checkpoint; sources.py and the conversions to and from
HF and ours (convert.py) sit above it.
"""

from __future__ import annotations

import argparse
import enum
import functools
import importlib
import io
import json
import math
import os
import pickle
import re
import warnings
from dataclasses import dataclass

import torch

from rlhf.models.config import ModelConfig, ModelConfigError

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
METADATA = ".metadata"
CONFIG = "metadata.json"
CHECKPOINT_VERSION = 3.0
"""The ``checkpoint_version`` Megatron-LM writes since its QKV layout settled (older ones reorder QKV)."""
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
           "common_backend_version": 1}
"""``metadata.json`` of a torch_dist checkpoint (megatron-core's ``CheckpointingConfig``)."""

_LAYERS = "decoder.layers."
_FUSED_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
"""Our (local-spec) layer-norm names -> the fused names megatron-core saves them under."""
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")
_SAVED_EXPERTS = "mlp.experts.experts."
"""A routed expert's layer suffix (ours, E global) and the one megatron-core saves all experts under."""
_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")
_DOCS = "docs/megatron_checkpoints.md"


class MegatronCheckpointError(ValueError):
    """A Megatron-LM checkpoint cannot be read or written; the message names the file or arg and what is valid."""


# --------------------------------------------------------------------------- pickles, allow-listed
_COMMON_CLASSES = ("argparse.Namespace", "types.SimpleNamespace", "pathlib.PosixPath")
_ENUM_MODULES = ("megatron.core.enums", "megatron.core.transformer.enums", "megatron.core.rerun_state_machine")
"""Besides ``_COMMON_CLASSES``, the Enum classes of these modules may be in ``common.pt`` (Megatron-LM's
args hold e.g. ``attention_backend``, its rerun state machine its modes). megatron-core allows the same
kinds process-wide when imported (``megatron.core.safe_globals``)."""


def _common_global(name: str):
    """The object of an allowed global of ``common.pt`` (``module.qualname``), else None."""
    module, _, attr = name.rpartition(".")
    if name in _COMMON_CLASSES or module in _ENUM_MODULES:
        obj = getattr(importlib.import_module(module), attr, None)
        if name in _COMMON_CLASSES or (isinstance(obj, type) and issubclass(obj, enum.Enum)):
            return obj
    return None


def _refused(path: str, names) -> MegatronCheckpointError:
    return MegatronCheckpointError(
        f"{path}: refused to unpickle {', '.join(names)}: not on the allow-list of what a Megatron-LM checkpoint "
        f"holds, and loading it could run code; if you trust this file, re-save it without that object "
        f"(trust model: {_DOCS})")


def read_common(path: str) -> dict:
    """``common.pt`` through ``torch.load(weights_only=True)``, allowing ``_COMMON_CLASSES`` and
    megatron-core's enums besides torch's own (MegatronCheckpointError naming any other global)."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 -- a truncated or foreign file fails in many ways
        raise MegatronCheckpointError(f"{path}: cannot read ({type(exc).__name__}: {exc}); expected the "
                                      "torch.save'd common state of a torch_dist checkpoint") from None
    allowed = {name: _common_global(name) for name in unsafe}
    refused = sorted(name for name, obj in allowed.items() if obj is None)
    if refused:
        raise _refused(path, refused)
    try:
        with torch.serialization.safe_globals(list(allowed.values())):
            common = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # a global the static scan could not see
        found = re.search(r"GLOBAL (\S+)", str(exc))
        raise _refused(path, [found.group(1) if found else str(exc).splitlines()[0][:200]]) from None
    if not isinstance(common, dict) or not isinstance(common.get("args"), argparse.Namespace):
        raise MegatronCheckpointError(f"{path}: holds no 'args' (an argparse.Namespace); it is not the common "
                                      "state of a Megatron-LM checkpoint")
    return common


@functools.lru_cache(maxsize=1)
def _metadata_globals() -> frozenset[tuple[str, str]]:
    """(module, name) of every global a torch.distributed.checkpoint Metadata pickle may name."""
    dcp = "torch.distributed.checkpoint."
    names = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
             ("pathlib", "PosixPath"), (dcp + "filesystem", "_StorageInfo")}
    names |= {(dcp + "metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")}
    names |= {(dcp + "planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}
    names |= {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
    return frozenset(names)


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals of a torch.distributed.checkpoint Metadata (find_class is the one door
    through which a pickle reaches code: REDUCE, NEWOBJ, INST and BUILD all act on what it returns)."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path, self.allowed = path, _metadata_globals()

    def find_class(self, module, name):
        if (module, name) not in self.allowed:
            raise _refused(self.path, [f"{module}.{name}"])
        return super().find_class(module, name)

    def persistent_load(self, pid):
        raise _refused(self.path, [f"persistent id {str(pid)[:40]!r}"])


def read_metadata(path: str):
    """The torch.distributed.checkpoint Metadata of ``path`` (a ``.metadata`` file), unpickled with
    the allow-list of :class:`_MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read()), path).load()
    except MegatronCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 -- a truncated pickle fails in many ways
        raise MegatronCheckpointError(f"{path}: cannot read ({type(exc).__name__}: {exc}); the file is "
                                      "truncated or not torch_dist metadata") from None
    if not isinstance(metadata, Metadata):
        raise MegatronCheckpointError(f"{path}: holds a {type(metadata).__name__}, not checkpoint Metadata")
    return metadata


# --------------------------------------------------------------------------- args -> our model config
_UNSUPPORTED = (  # (arg, Megatron-LM's default, is the value supported?, what we support)
    ("position_embedding_type", "learned_absolute", lambda v: v == "rope",
     "only RoPE ('rope') is supported, not learned absolute positions"),
    ("normalization", "LayerNorm", lambda v: v == "RMSNorm", "only 'RMSNorm' is supported"),
    ("swiglu", False, lambda v: v is True, "only SwiGLU MLPs (swiglu=True) are supported"),
    ("add_bias_linear", True, lambda v: not v, "linear-layer biases are not supported (add_qkv_bias is)"),
    ("squared_relu", False, lambda v: not v, "only SwiGLU MLPs are supported"),
    ("rotary_percent", 1.0, lambda v: v == 1.0, "only full RoPE (rotary_percent=1.0) is supported"),
    ("rotary_interleaved", False, lambda v: not v, "only non-interleaved RoPE is supported"),
    ("use_rope_scaling", False, lambda v: not v, "RoPE scaling is not supported"),
    ("apply_layernorm_1p", False, lambda v: not v, "layer norms with 1+weight are not supported"),
    ("qk_l2_norm", False, lambda v: not v, "L2 query/key norms are not supported (qk_layernorm is)"),
    ("multi_latent_attention", False, lambda v: not v, "multi-latent attention is not supported"),
    ("mtp_num_layers", None, lambda v: not v, "multi-token prediction layers are not supported"),
    ("hybrid_layer_pattern", None, lambda v: not v, "hybrid (Mamba) models are not supported"),
    ("heterogeneous_layers_config_path", None, lambda v: not v, "heterogeneous layers are not supported"),
    ("heterogeneous_layers_config_encoded_json", None, lambda v: not v, "heterogeneous layers are not supported"),
)
_UNSUPPORTED_MOE = (  # checked when num_experts is set; list-valued args of one element count as that element
    ("moe_layer_freq", 1, lambda v: v == 1 or (isinstance(v, list) and set(v) == {1}),
     "only MoE layers throughout (moe_layer_freq=1) are supported, not dense layers between them"),
    ("moe_router_score_function", "softmax", lambda v: v == "softmax",
     "only softmax router scores are supported, not sigmoid"),
    ("moe_router_num_groups", None, lambda v: not v, "group-limited routing is not supported"),
    ("moe_router_group_topk", None, lambda v: not v, "group-limited routing is not supported"),
    ("moe_router_topk_limited_devices", None, lambda v: not v, "device-limited routing is not supported"),
    ("moe_router_enable_expert_bias", False, lambda v: not v,
     "a router expert bias (aux-loss-free load balancing) is not supported"),
    ("moe_router_topk_scaling_factor", 1.0, lambda v: v == 1.0, "scaled routing weights are not supported"),
    ("moe_router_load_balancing_type", "aux_loss", lambda v: v in ("aux_loss", "none"),
     "only 'aux_loss' (or 'none') load balancing is supported"),
    ("moe_aux_loss_coeff", 0.0, lambda v: isinstance(v, (int, float)), "only one aux-loss coefficient is supported"),
    ("moe_shared_expert_gate", False, lambda v: not v, "a gated shared expert is not supported"),
    ("moe_apply_probs_on_input", False, lambda v: not v,
     "routing weights applied to the experts' input are not supported"),
    ("moe_latent_size", None, lambda v: not v, "MoE latent projections are not supported"),
)
_REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size")


def _arg(args: argparse.Namespace, name: str, default=None):
    """``args.name``, or ``default`` where the arg is absent or None (Megatron-LM's default then)."""
    value = getattr(args, name, None)
    return default if value is None else value


def _one(value):
    """A list of one element as that element (Megatron-LM's nargs='+' MoE args), anything else as is."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


def _check_supported(args: argparse.Namespace, where: str, table) -> None:
    for arg, default, supported, what in table:
        value = _one(_arg(args, arg, default))
        if not supported(value):
            raise MegatronCheckpointError(f"{where}: args.{arg}={value!r}: {what}")


def megatron_model_config(args: argparse.Namespace, where: str) -> ModelConfig:
    """Our ModelConfig of Megatron-LM ``args`` (``where``: the file, for errors); refuses what our
    models cannot hold (learned positions, biases, sigmoid routing, ...) naming the arg."""
    _check_supported(args, where, _UNSUPPORTED)
    if _arg(args, "num_experts"):
        _check_supported(args, where, _UNSUPPORTED_MOE)
    missing = [a for a in _REQUIRED if _arg(args, a) is None]
    context = _arg(args, "max_position_embeddings", _arg(args, "seq_length"))
    if context is None:
        missing.append("max_position_embeddings")
    if missing:
        raise MegatronCheckpointError(f"{where}: args lack {', '.join(missing)}; a Megatron-LM checkpoint "
                                      "records each (Megatron-LM sets them before its first save)")
    heads = args.num_attention_heads
    kv_channels = _arg(args, "kv_channels")
    try:
        return ModelConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
            num_attention_heads=heads, vocab_size=args.padded_vocab_size, max_seq_len=context,
            num_kv_heads=_arg(args, "num_query_groups", heads) if _arg(args, "group_query_attention") else heads,
            rope_theta=float(_arg(args, "rotary_base", 10000)), norm_eps=_arg(args, "norm_epsilon", 1e-5),
            qkv_bias=bool(_arg(args, "add_qkv_bias", False)),
            tie_embeddings=not _arg(args, "untie_embeddings_and_output_weights", False),
            init_std=_arg(args, "init_method_std", 0.02), qk_norm=bool(_arg(args, "qk_layernorm", False)),
            kv_channels=None if kv_channels is None or kv_channels * heads == args.hidden_size else kv_channels,
            **_moe_config(args))
    except (ModelConfigError, TypeError) as exc:
        raise MegatronCheckpointError(f"{where}: args describe no valid model: {exc}") from None


def _moe_config(args: argparse.Namespace) -> dict:
    """Our MoE fields of Megatron-LM ``args`` ({} for a dense model); moe_router_pre_softmax off is
    HF's norm_topk_prob (rlhf.models.gpt.moe_fields), load balancing 'none' an aux-loss coefficient of 0."""
    experts = _arg(args, "num_experts")
    if not experts:
        return {}
    ffn = _arg(args, "moe_ffn_hidden_size")
    balancing = _one(_arg(args, "moe_router_load_balancing_type", "aux_loss"))
    return dict(num_experts=experts, moe_router_topk=_arg(args, "moe_router_topk", 2),
                moe_ffn_hidden_size=None if ffn == args.ffn_hidden_size else ffn,
                moe_shared_expert_intermediate_size=_arg(args, "moe_shared_expert_intermediate_size", 0),
                moe_norm_topk_prob=not _arg(args, "moe_router_pre_softmax", False),
                moe_aux_loss_coeff=0.0 if balancing == "none" else float(_one(_arg(args, "moe_aux_loss_coeff", 0.0))),
                moe_z_loss_coeff=float(_arg(args, "moe_z_loss_coeff", 0.0)))


def megatron_args(cfg: ModelConfig, tied: bool, dtype: torch.dtype) -> argparse.Namespace:
    """The args Megatron-LM records for a model of ``cfg`` (those ``--use-checkpoint-args`` reads back;
    the MoE ones as rlhf.models.gpt.moe_fields sets megatron's TransformerConfig)."""
    moe = {} if not cfg.is_moe else dict(
        moe_router_topk=cfg.moe_router_topk, moe_ffn_hidden_size=cfg.expert_ffn_hidden_size,
        moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size or None,
        moe_router_pre_softmax=not cfg.moe_norm_topk_prob, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, moe_z_loss_coeff=cfg.moe_z_loss_coeff or None,
        moe_layer_freq=1, moe_router_score_function="softmax", moe_router_topk_scaling_factor=None,
        moe_router_enable_expert_bias=False, moe_shared_expert_gate=False, moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False)
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_kv_heads,
        group_query_attention=cfg.num_kv_heads != cfg.num_attention_heads, kv_channels=cfg.head_dim,
        qk_layernorm=cfg.qk_norm, padded_vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_seq_len, seq_length=cfg.max_seq_len, position_embedding_type="rope",
        use_rotary_position_embeddings=True, add_position_embedding=False, rotary_base=int(cfg.rope_theta),
        rotary_percent=1.0, rotary_interleaved=False, normalization="RMSNorm", norm_epsilon=cfg.norm_eps,
        apply_layernorm_1p=False, swiglu=True, squared_relu=False, add_bias_linear=False, add_qkv_bias=cfg.qkv_bias,
        untie_embeddings_and_output_weights=not tied, init_method_std=cfg.init_std, num_experts=cfg.num_experts or None,
        **moe, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
        expert_tensor_parallel_size=1, ckpt_format="torch_dist", params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16)


# --------------------------------------------------------------------------- keys
@dataclass(frozen=True)
class Location:
    """Where one of our tensors is stored: element ``index`` of the leading axes of ``key``'s global tensor
    (stacked layers, then experts; of sizes ``lead``), or all of it when ``index`` is ()."""

    key: str
    index: tuple = ()
    lead: tuple = ()


def _split_layer(name: str) -> tuple[str, str]:
    """(layer index, suffix) of global name ``decoder.layers.<index>.<suffix>``; ("", name) for others."""
    if not name.startswith(_LAYERS):
        return "", name
    index, _, suffix = name[len(_LAYERS):].partition(".")
    return index, suffix


def _layer_keys(suffix: str, cfg: ModelConfig) -> tuple[list[str], tuple, tuple]:
    """(the suffixes a layer tensor may be saved under, the one written first; its expert index and the
    expert count as leading axes after the layer's, () for a tensor that is no routed expert's)."""
    expert = _EXPERT.match(suffix)
    if expert:
        return [_SAVED_EXPERTS + suffix[expert.end():]], (int(expert.group(1)),), (cfg.num_experts,)
    if suffix in _FUSED_NORMS:
        return [_FUSED_NORMS[suffix], suffix], (), ()
    return [suffix], (), ()


def _written(name: str, cfg: ModelConfig) -> list[Location]:
    """Where megatron-core saves global name ``name`` (layers stacked, fused norm names); a MoE layer's
    pre-MLP norm under the TE spec's own name too."""
    index, suffix = _split_layer(name)
    if not index:
        return [Location(name)]
    keys, experts, sizes = _layer_keys(suffix, cfg)
    keys = keys if cfg.is_moe and suffix == "pre_mlp_layernorm.weight" else keys[:1]
    return [Location(_LAYERS + key, (int(index), *experts), (cfg.num_layers, *sizes)) for key in keys]


def _locate(name: str, saved, tied: bool, cfg: ModelConfig) -> Location | None:
    """Where global name ``name`` is stored among ``saved`` keys (None: nowhere)."""
    if name == "output_layer.weight" and tied:
        name = "embedding.word_embeddings.weight"
    index, suffix = _split_layer(name)
    if not index:
        return Location(name) if name in saved else None
    keys, experts, sizes = _layer_keys(suffix, cfg)
    for key in keys:
        if _LAYERS + key in saved:
            return Location(_LAYERS + key, (int(index), *experts), (cfg.num_layers, *sizes))
        if f"{_LAYERS}{index}.{key}" in saved:
            return Location(f"{_LAYERS}{index}.{key}", experts, sizes)
    return None


def _aliases(name: str, cfg: ModelConfig) -> set[str]:
    """Every key layer tensor ``name`` may be saved under (a norm under both of its names: one is read);
    none for other tensors."""
    index, suffix = _split_layer(name)
    keys = _layer_keys(suffix, cfg)[0] if index else []
    return {_LAYERS + key for key in keys} | {f"{_LAYERS}{index}.{key}" for key in keys}


def _shape_args(name: str) -> str:
    """The args that set the shape of global tensor ``name``."""
    for part, args in (("embedding", "padded_vocab_size, hidden_size"), ("output_layer", "padded_vocab_size"),
                       ("linear_qkv.bias", "add_qkv_bias, num_attention_heads, num_query_groups, kv_channels"),
                       ("linear_qkv", "num_attention_heads, num_query_groups, kv_channels, hidden_size"),
                       ("linear_proj", "num_attention_heads, kv_channels, hidden_size"),
                       ("q_layernorm", "qk_layernorm, kv_channels"), ("k_layernorm", "qk_layernorm, kv_channels"),
                       ("router", "num_experts, hidden_size"),
                       ("shared_experts", "moe_shared_expert_intermediate_size, hidden_size"),
                       ("experts", "num_experts, moe_ffn_hidden_size, hidden_size"),
                       ("linear_fc", "ffn_hidden_size, hidden_size")):
        if part in name:
            return args
    return "hidden_size"


# --------------------------------------------------------------------------- a checkpoint, opened
@dataclass(frozen=True)
class MegatronCheckpoint:
    """One iteration of a Megatron-LM checkpoint directory, checked against its args.

    ``role``: "lm", or "value" for an output layer of one row; ``locations``:
    every global name of the model -> where it is stored; ``metadata``: the
    torch.distributed.checkpoint Metadata (global shapes and chunks).
    """

    root: str
    path: str
    iteration: int
    config: ModelConfig
    role: str
    locations: dict
    metadata: object

    def tokenizer_dir(self) -> str:
        """Where Megatron-LM's ``--save-tokenizer-assets`` puts the tokenizer files."""
        return os.path.join(self.path, "tokenizer")


def is_megatron_dir(path: str) -> bool:
    """A directory Megatron-LM saved into: its tracker file, or an iteration directory with ``common.pt``."""
    if os.path.isfile(os.path.join(path, TRACKER)):
        return True
    return os.path.isdir(path) and any(
        (n.startswith("iter_") or n == "release") and os.path.isfile(os.path.join(path, n, COMMON))
        for n in os.listdir(path))


def _iteration_dir(root: str) -> tuple[int, str]:
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise MegatronCheckpointError(f"{tracker}: no such file; give the directory Megatron-LM saved into "
                                      f"(its --save), which holds {TRACKER} and iter_NNNNNNN/")
    with open(tracker, encoding="utf-8") as f:
        text = f.read().strip()
    if text == "release":
        iteration, path = 0, os.path.join(root, "release")
    elif text.isdigit():
        iteration, path = int(text), os.path.join(root, f"iter_{int(text):07d}")
    else:
        raise MegatronCheckpointError(f"{tracker}: holds {text[:40]!r}; expected an iteration number or 'release'")
    if not os.path.isdir(path):
        raise MegatronCheckpointError(f"{tracker}: names iteration {text}, but {path} does not exist")
    return iteration, path


def _check_backend(path: str) -> None:
    config = os.path.join(path, CONFIG)
    if not os.path.isfile(config):
        legacy = any(n.startswith("mp_rank_") for n in os.listdir(path))
        hint = ("a legacy 'torch' checkpoint (mp_rank_*/): convert it with Megatron-LM's --ckpt-convert-format "
                "torch_dist" if legacy else "not a torch_dist checkpoint")
        raise MegatronCheckpointError(f"{config}: no such file; {path} is {hint}")
    try:
        with open(config, encoding="utf-8") as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as exc:
        raise MegatronCheckpointError(f"{config}: cannot read ({exc}); expected megatron-core's JSON "
                                      "checkpoint config") from None
    if backend != "torch_dist":
        raise MegatronCheckpointError(f"{config}: sharded_backend {backend!r}; only 'torch_dist' is supported")


def open_megatron(root: str) -> MegatronCheckpoint:
    """The latest iteration of Megatron-LM checkpoint directory ``root``: its args as our ModelConfig,
    checked against the shapes of its tensors (reads metadata only; MegatronCheckpointError naming the
    file or arg for anything we cannot load)."""
    iteration, path = _iteration_dir(root)
    _check_backend(path)
    common_path = os.path.join(path, COMMON)
    if not os.path.isfile(common_path):
        raise MegatronCheckpointError(f"{common_path}: no such file; a torch_dist checkpoint keeps its args there")
    common = read_common(common_path)
    version = common.get("checkpoint_version")
    if version != CHECKPOINT_VERSION:
        raise MegatronCheckpointError(f"{common_path}: checkpoint_version={version!r}; only {CHECKPOINT_VERSION} "
                                      "(Megatron-LM's torch_dist checkpoints) is known")
    config = megatron_model_config(common["args"], common_path)
    metadata = read_metadata(os.path.join(path, METADATA))
    role, locations = _check_tensors(config, metadata, os.path.join(path, METADATA), common_path)
    return MegatronCheckpoint(root, path, iteration, config, role, locations, metadata)


def _check_tensors(cfg: ModelConfig, metadata, where: str, args_file: str) -> tuple[str, dict]:
    """(role, locations) of the model ``cfg`` describes, every tensor's saved shape checked against the
    args (MegatronCheckpointError naming the key, the shapes and the args when they disagree)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {k: tuple(md.size) for k, md in metadata.state_dict_metadata.items()
             if isinstance(md, TensorStorageMetadata) and k.startswith(_MODEL_PREFIXES)}
    role = "value" if saved.get("output_layer.weight") == (1, cfg.hidden_size) else "lm"
    tied = cfg.tie_embeddings and role == "lm"
    locations, used = {}, set()
    for name, shape in model_shapes(cfg, role).items():
        loc = _locate(name, saved, tied, cfg)
        if loc is None:
            raise MegatronCheckpointError(f"{where}: no tensor for {name} (as {_written(name, cfg)[0].key}), "
                                          f"which the args in {args_file} imply ({_shape_args(name)}); the args "
                                          "and the shards disagree")
        want = (*loc.lead, *shape)
        if saved[loc.key] != want:
            raise MegatronCheckpointError(f"{where}: {loc.key} has shape {list(saved[loc.key])}, but the args in "
                                          f"{args_file} ({_shape_args(name)}) imply {list(want)}; the args and the "
                                          "shards disagree")
        locations[name] = loc
        used |= _aliases(name, cfg)
    unused = sorted(set(saved) - used - {loc.key for loc in locations.values()})
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise MegatronCheckpointError(f"{where}: holds {unused[0]}{more}, which the args in {args_file} do not "
                                      "describe (no biases but add_qkv_bias, QK norms only with qk_layernorm, "
                                      "experts only with num_experts, a shared expert only with "
                                      "moe_shared_expert_intermediate_size, an output layer only with "
                                      "untie_embeddings_and_output_weights); the args and the shards disagree")
    return role, locations


def model_shapes(cfg: ModelConfig, role: str) -> dict[str, tuple[int, ...]]:
    """Global name -> full shape of every tensor of our model of ``cfg`` and ``role`` (the output layer of a
    value model one row), layer by layer."""
    h, f, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_kv_heads * hd
    layer = {"input_layernorm.weight": (h,), "self_attention.linear_qkv.weight": (q + 2 * kv, h)}
    if cfg.qkv_bias:
        layer["self_attention.linear_qkv.bias"] = (q + 2 * kv,)
    if cfg.qk_norm:
        layer.update({"self_attention.q_layernorm.weight": (hd,), "self_attention.k_layernorm.weight": (hd,)})
    layer.update({"self_attention.linear_proj.weight": (h, q), "pre_mlp_layernorm.weight": (h,)})
    if not cfg.is_moe:
        layer.update({"mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f)})
    else:
        ef, sf = cfg.expert_ffn_hidden_size, cfg.moe_shared_expert_intermediate_size
        layer["mlp.router.weight"] = (cfg.num_experts, h)
        for e in range(cfg.num_experts):
            layer.update({f"mlp.experts.local_experts.{e}.linear_fc1.weight": (2 * ef, h),
                          f"mlp.experts.local_experts.{e}.linear_fc2.weight": (h, ef)})
        if sf:
            layer.update({"mlp.shared_experts.linear_fc1.weight": (2 * sf, h),
                          "mlp.shared_experts.linear_fc2.weight": (h, sf)})
    out = {"embedding.word_embeddings.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        out.update({f"{_LAYERS}{i}.{suffix}": shape for suffix, shape in layer.items()})
    out["decoder.final_layernorm.weight"] = (h,)
    out["output_layer.weight"] = (1 if role == "value" else cfg.vocab_size, h)
    return out


# --------------------------------------------------------------------------- reading tensors
def read_megatron_state(ckpt: MegatronCheckpoint, names=None) -> dict[str, torch.Tensor]:
    """Full tensors of ``names`` (global names; default: all), in the saved dtype, reading only the
    regions behind them: the layers a stage asks for (the experts an expert-parallel rank asks for),
    whatever layout saved the chunks."""
    names = list(ckpt.locations) if names is None else list(names)
    unknown = sorted(set(names) - set(ckpt.locations))
    if unknown:
        raise MegatronCheckpointError(f"{ckpt.path}: no tensor for {unknown[:5]} in this model")
    by_key: dict[str, list[tuple]] = {}
    for name in names:
        loc = ckpt.locations[name]
        by_key.setdefault(loc.key, []).append(loc.index)
    regions = {key: _region(ckpt.metadata.state_dict_metadata[key], indices) for key, indices in by_key.items()}
    _read_regions(ckpt, regions)
    out, used = {}, set()
    for name in names:
        loc = ckpt.locations[name]
        start, tensor = regions[loc.key]
        if loc.index:
            out[name] = tensor[tuple(i - s for i, s in zip(loc.index, start))].clone()
        else:  # a tied output layer shares the embedding's key: a tensor of its own
            out[name] = tensor.clone() if loc.key in used else tensor
            used.add(loc.key)
    return out


def _region(md, indices: list[tuple]) -> tuple[tuple[int, ...], torch.Tensor]:
    """(offsets, empty target) of the box of a saved tensor ``md`` that holds the elements ``indices`` of its
    leading axes (all of it for ())."""
    size, lead = tuple(md.size), len(indices[0])
    lo = [min(index[axis] for index in indices) for axis in range(lead)]
    hi = [max(index[axis] for index in indices) + 1 for axis in range(lead)]
    offsets = (*lo, *(0,) * (len(size) - lead))
    return offsets, torch.empty((*(b - a for a, b in zip(lo, hi)), *size[lead:]), dtype=md.properties.dtype)


def _read_regions(ckpt: MegatronCheckpoint, regions: dict) -> None:
    """Fill each ``key -> (offsets, target)`` from the chunks that overlap it (no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # the metadata read through the allow-list
            return ckpt.metadata

    class RegionPlanner(dcp.DefaultLoadPlanner):
        def create_local_plan(self):
            items = []
            for key, (offsets, target) in regions.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=target.shape)
                reads = create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
                if sum(math.prod(r.lengths) for r in reads) != target.numel():
                    raise MegatronCheckpointError(f"{ckpt.path}: the saved chunks of {key} do not cover it; "
                                                  "the checkpoint is incomplete")
                items += reads
            return dcp.LoadPlan(items)

        def lookup_tensor(self, index):
            return regions[index.fqn][1]

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({key: target for key, (_, target) in regions.items()}, storage_reader=Reader(ckpt.path),
                 planner=RegionPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)


# --------------------------------------------------------------------------- writing
def save_megatron(out: str, cfg: ModelConfig, role: str, full: dict[str, torch.Tensor], iteration: int = 0) -> str:
    """Write ``full`` (our global names) as a Megatron-LM torch_dist checkpoint ``<out>/iter_<N>`` that
    megatron-core's ``dist_checkpointing.load`` reads into a GPTModel at any (tp, pp); the tracker file is
    written last. Returns the iteration directory."""
    import torch.distributed.checkpoint as dcp

    path = os.path.join(out, f"iter_{iteration:07d}")
    check_new_path(path)
    tied = (cfg.tie_embeddings and role == "lm"
            and torch.equal(full["output_layer.weight"], full["embedding.word_embeddings.weight"]))
    tensors = _megatron_state(cfg, role, full, tied)
    dtype = full["embedding.word_embeddings.weight"].dtype
    os.makedirs(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path), no_dist=True,
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    torch.save({"args": megatron_args(cfg, tied, dtype), "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": iteration}, os.path.join(path, COMMON))
    with open(os.path.join(path, CONFIG), "w", encoding="utf-8") as f:
        json.dump(BACKEND, f)
    with open(os.path.join(out, TRACKER), "w", encoding="utf-8") as f:
        f.write(str(iteration))
    return path


def check_new_path(path: str) -> None:
    """MegatronCheckpointError if ``path`` (a checkpoint's iteration directory about to be written) exists."""
    if os.path.exists(path):
        raise MegatronCheckpointError(f"{path}: already exists; give another output directory or iteration")


_EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.core_attention")
_EXTRA_STATE_MLP = ("linear_fc1", "linear_fc2")
"""Layer modules whose ``_extra_state`` megatron-core's GPTModel asks for on load (the local spec's linear
layers keep None there, TransformerEngine's modules their FP8 state; core_attention is TE's alone): these,
and the MLP's (a MoE layer's: every expert's, the shared expert's) linear layers."""


def _megatron_state(cfg: ModelConfig, role: str, full: dict, tied: bool) -> dict:
    """Megatron-LM key -> global tensor (layers, then experts, stacked along leading axes, under the fused
    norm names), and every layer module's empty ``_extra_state`` as megatron-core writes it (``[None]``,
    pickled by the writer)."""
    names = [n for n in model_shapes(cfg, role) if not (tied and n == "output_layer.weight")]
    missing = [n for n in names if n not in full]
    if missing:
        raise MegatronCheckpointError(f"the model to save lacks {missing[:5]}")
    out = {}
    for name in names:
        for loc in _written(name, cfg):
            if not loc.index:
                out[loc.key] = full[name].contiguous()
                continue
            if loc.key not in out:
                out[loc.key] = torch.empty((*loc.lead, *full[name].shape), dtype=full[name].dtype)
            out[loc.key][loc.index] = full[name]
    layers, experts = cfg.num_layers, cfg.num_experts
    modules = list(_EXTRA_STATE_MODULES)
    if not cfg.is_moe:
        modules += [f"mlp.{fc}" for fc in _EXTRA_STATE_MLP]
    elif cfg.moe_shared_expert_intermediate_size:
        modules += [f"mlp.shared_experts.{fc}" for fc in _EXTRA_STATE_MLP]
    for module in modules:
        for i in range(layers):  # megatron-core's ShardedObject key: <key>/shard_<offsets>_<shape>
            out[f"{_LAYERS}{module}._extra_state/shard_{i}_{layers}"] = [None]
    for fc in _EXTRA_STATE_MLP if cfg.is_moe else ():
        for i in range(layers):
            for e in range(experts):
                out[f"{_LAYERS}{_SAVED_EXPERTS}{fc}._extra_state/shard_{i}.{e}_{layers}.{experts}"] = [None]
    return out

