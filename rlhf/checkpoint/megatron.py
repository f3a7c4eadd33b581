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

    ours                                         Megatron-LM (megatron-core sharded_state_dict)
    embedding.word_embeddings.weight             embedding.word_embeddings.weight     [padded_vocab_size, h]
    decoder.layers.{i}.input_layernorm.weight    decoder.layers.self_attention.linear_qkv.layer_norm_weight
    decoder.layers.{i}.pre_mlp_layernorm.weight  decoder.layers.mlp.linear_fc1.layer_norm_weight
    decoder.layers.{i}.<rest>                    decoder.layers.<rest>                [num_layers, ...], row i
    decoder.final_layernorm.weight               decoder.final_layernorm.weight
    output_layer.weight                          output_layer.weight (the embedding when tied)

megatron-core writes TransformerEngine's fused layer-norm names for both
layer specs; the local spec's own names (``decoder.layers.input_layernorm.weight``)
load too, and so do per-layer keys (``decoder.layers.{i}.<rest>``, written for
non-homogeneous layers) beside the default stacked ones. A global tensor is
laid out as our unsharded model: fused QKV per query group, SwiGLU fc1 as
[gate; up]. A value model (ours-to-megatron of a critic or reward model) has
an ``output_layer.weight`` of one row.

Trust: ``common.pt`` and ``.metadata`` are pickles, which can run code when
loaded. ``common.pt`` is read with ``torch.load(weights_only=True)`` and an
allow-list (``argparse.Namespace`` and a few more, megatron-core's enums); ``.metadata``
(a plain pickle that ``weights_only`` cannot read) with an unpickler that
resolves only torch.distributed.checkpoint's metadata classes, ``torch.Size``
and dtypes. Anything else is refused before it is built. The tensor chunks
are read with ``torch.load(weights_only=True)``; TransformerEngine's pickled
``_extra_state`` entries are never read (docs/megatron_checkpoints.md).
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

from rlhf.checkpoint import storage
from rlhf.checkpoint.hf import export_hf, hf_sources
from rlhf.checkpoint.rlhf_state import TOKENIZER_DIR, read_full_state, save_model
from rlhf.data.tokenizer import copy_tokenizer_files
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
    ("num_experts", None, lambda v: not v, "mixture-of-experts (MoE) models are not supported, only dense ones"),
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
    ("qk_layernorm", False, lambda v: not v, "query/key layer norms are not supported"),
    ("multi_latent_attention", False, lambda v: not v, "multi-latent attention is not supported"),
    ("mtp_num_layers", None, lambda v: not v, "multi-token prediction layers are not supported"),
    ("hybrid_layer_pattern", None, lambda v: not v, "hybrid (Mamba) models are not supported"),
    ("heterogeneous_layers_config_path", None, lambda v: not v, "heterogeneous layers are not supported"),
    ("heterogeneous_layers_config_encoded_json", None, lambda v: not v, "heterogeneous layers are not supported"),
)
_REQUIRED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "padded_vocab_size")


def _arg(args: argparse.Namespace, name: str, default=None):
    """``args.name``, or ``default`` where the arg is absent or None (Megatron-LM's default then)."""
    value = getattr(args, name, None)
    return default if value is None else value


def megatron_model_config(args: argparse.Namespace, where: str) -> ModelConfig:
    """Our ModelConfig of Megatron-LM ``args`` (``where``: the file, for errors); refuses what our
    models cannot hold (MoE, learned positions, biases, ...) naming the arg."""
    for arg, default, supported, what in _UNSUPPORTED:
        value = _arg(args, arg, default)
        if not supported(value):
            raise MegatronCheckpointError(f"{where}: args.{arg}={value!r}: {what}")
    missing = [a for a in _REQUIRED if _arg(args, a) is None]
    context = _arg(args, "max_position_embeddings", _arg(args, "seq_length"))
    if context is None:
        missing.append("max_position_embeddings")
    if missing:
        raise MegatronCheckpointError(f"{where}: args lack {', '.join(missing)}; a Megatron-LM checkpoint "
                                      "records each (Megatron-LM sets them before its first save)")
    heads = args.num_attention_heads
    kv_channels = _arg(args, "kv_channels", args.hidden_size // heads)
    if kv_channels * heads != args.hidden_size:
        raise MegatronCheckpointError(f"{where}: args.kv_channels={kv_channels}: only kv_channels x "
                                      f"num_attention_heads == hidden_size ({args.hidden_size}) is supported")
    try:
        return ModelConfig(
            num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
            num_attention_heads=heads, vocab_size=args.padded_vocab_size, max_seq_len=context,
            num_kv_heads=_arg(args, "num_query_groups", heads) if _arg(args, "group_query_attention") else heads,
            rope_theta=float(_arg(args, "rotary_base", 10000)), norm_eps=_arg(args, "norm_epsilon", 1e-5),
            qkv_bias=bool(_arg(args, "add_qkv_bias", False)),
            tie_embeddings=not _arg(args, "untie_embeddings_and_output_weights", False),
            init_std=_arg(args, "init_method_std", 0.02))
    except (ModelConfigError, TypeError) as exc:
        raise MegatronCheckpointError(f"{where}: args describe no valid model: {exc}") from None


def megatron_args(cfg: ModelConfig, tied: bool, dtype: torch.dtype) -> argparse.Namespace:
    """The args Megatron-LM records for a model of ``cfg`` (those ``--use-checkpoint-args`` reads back)."""
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_kv_heads,
        group_query_attention=cfg.num_kv_heads != cfg.num_attention_heads, kv_channels=cfg.head_dim,
        padded_vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_seq_len, seq_length=cfg.max_seq_len, position_embedding_type="rope",
        use_rotary_position_embeddings=True, add_position_embedding=False, rotary_base=int(cfg.rope_theta),
        rotary_percent=1.0, rotary_interleaved=False, normalization="RMSNorm", norm_epsilon=cfg.norm_eps,
        apply_layernorm_1p=False, swiglu=True, squared_relu=False, add_bias_linear=False, add_qkv_bias=cfg.qkv_bias,
        untie_embeddings_and_output_weights=not tied, init_method_std=cfg.init_std, num_experts=None,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, ckpt_format="torch_dist",
        params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)


# --------------------------------------------------------------------------- keys
@dataclass(frozen=True)
class Location:
    """Where one of our tensors is stored: ``key``'s global tensor, row ``layer`` of its leading
    (stacked layers) axis, or all of it when ``layer`` is None."""

    key: str
    layer: int | None = None


def _layer_suffixes(suffix: str) -> list[str]:
    """The names a layer tensor may be saved under: the fused layer-norm name first, then our own."""
    return [_FUSED_NORMS[suffix], suffix] if suffix in _FUSED_NORMS else [suffix]


def _split_layer(name: str) -> tuple[str, str]:
    """(layer index, suffix) of global name ``decoder.layers.<index>.<suffix>``; ("", name) for others."""
    if not name.startswith(_LAYERS):
        return "", name
    index, _, suffix = name[len(_LAYERS):].partition(".")
    return index, suffix


def _saved_key(name: str) -> str:
    """The key megatron-core saves global name ``name`` under (layers stacked, fused norm names)."""
    index, suffix = _split_layer(name)
    return _LAYERS + _layer_suffixes(suffix)[0] if index else name


def _locate(name: str, saved, tied: bool) -> Location | None:
    """Where global name ``name`` is stored among ``saved`` keys (None: nowhere)."""
    if name == "output_layer.weight" and tied:
        name = "embedding.word_embeddings.weight"
    index, suffix = _split_layer(name)
    if not index:
        return Location(name) if name in saved else None
    for candidate in _layer_suffixes(suffix):
        if _LAYERS + candidate in saved:
            return Location(_LAYERS + candidate, int(index))
        if f"{_LAYERS}{index}.{candidate}" in saved:
            return Location(f"{_LAYERS}{index}.{candidate}")
    return None


def _shape_args(name: str) -> str:
    """The args that set the shape of global tensor ``name``."""
    for part, args in (("embedding", "padded_vocab_size, hidden_size"), ("output_layer", "padded_vocab_size"),
                       ("linear_qkv.bias", "add_qkv_bias, num_attention_heads, num_query_groups"),
                       ("linear_qkv", "num_attention_heads, num_query_groups, hidden_size"),
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
    expected = _global_shapes(cfg, role)
    locations = {}
    for name, shape in expected.items():
        loc = _locate(name, saved, tied)
        if loc is None:
            raise MegatronCheckpointError(f"{where}: no tensor for {name} (as {_saved_key(name)}), which "
                                          f"the args in {args_file} imply ({_shape_args(name)}); the args and the "
                                          "shards disagree")
        want = (cfg.num_layers, *shape) if loc.layer is not None else shape
        if saved[loc.key] != want:
            raise MegatronCheckpointError(f"{where}: {loc.key} has shape {list(saved[loc.key])}, but the args in "
                                          f"{args_file} ({_shape_args(name)}) imply {list(want)}; the args and the "
                                          "shards disagree")
        locations[name] = loc
    unused = sorted(set(saved) - {loc.key for loc in locations.values()})
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise MegatronCheckpointError(f"{where}: holds {unused[0]}{more}, which the args in {args_file} do not "
                                      "describe (no biases but add_qkv_bias, an output layer only with "
                                      "untie_embeddings_and_output_weights); the args and the shards disagree")
    return role, locations


def _global_shapes(cfg: ModelConfig, role: str) -> dict[str, tuple[int, ...]]:
    """Global name -> full shape of every tensor of our model of ``cfg`` and ``role``."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    by_suffix = {"input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
                 "self_attention.linear_qkv.weight": (qkv, h), "self_attention.linear_qkv.bias": (qkv,),
                 "self_attention.linear_proj.weight": (h, cfg.num_attention_heads * cfg.head_dim),
                 "mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f),
                 "embedding.word_embeddings.weight": (cfg.vocab_size, h), "decoder.final_layernorm.weight": (h,),
                 "output_layer.weight": (1 if role == "value" else cfg.vocab_size, h)}
    return {name: by_suffix[_split_layer(name)[1]] for name in hf_sources(cfg, "lm_head")}


# --------------------------------------------------------------------------- reading tensors
def read_megatron_state(ckpt: MegatronCheckpoint, names=None) -> dict[str, torch.Tensor]:
    """Full tensors of ``names`` (global names; default: all), in the saved dtype, reading only the
    regions behind them: the layers a stage asks for, whatever (tp, pp) saved the chunks."""
    names = list(ckpt.locations) if names is None else list(names)
    unknown = sorted(set(names) - set(ckpt.locations))
    if unknown:
        raise MegatronCheckpointError(f"{ckpt.path}: no tensor for {unknown[:5]} in this model")
    by_key: dict[str, list[int | None]] = {}
    for name in names:
        loc = ckpt.locations[name]
        by_key.setdefault(loc.key, []).append(loc.layer)
    regions = {key: _region(ckpt.metadata.state_dict_metadata[key], layers) for key, layers in by_key.items()}
    _read_regions(ckpt, regions)
    out, used = {}, set()
    for name in names:
        loc = ckpt.locations[name]
        start, tensor = regions[loc.key]
        if loc.layer is not None:
            out[name] = tensor[loc.layer - start[0]].clone()
        else:  # a tied output layer shares the embedding's key: a tensor of its own
            out[name] = tensor.clone() if loc.key in used else tensor
            used.add(loc.key)
    return out


def _region(md, layers: list) -> tuple[tuple[int, ...], torch.Tensor]:
    """(offsets, empty target) of the part of a saved tensor ``md`` holding ``layers`` (all when None)."""
    size = tuple(md.size)
    if layers[0] is None:
        offsets = (0,) * len(size)
    else:
        lo, hi = min(layers), max(layers) + 1
        offsets, size = (lo,) + (0,) * (len(size) - 1), (hi - lo, *size[1:])
    return offsets, torch.empty(size, dtype=md.properties.dtype)


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
    _check_new(path)
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


def _check_new(path: str) -> None:
    if os.path.exists(path):
        raise MegatronCheckpointError(f"{path}: already exists; give another output directory or iteration")


_EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.core_attention",
                        "mlp.linear_fc1", "mlp.linear_fc2")
"""Layer modules whose ``_extra_state`` megatron-core's GPTModel asks for on load (the local spec's linear
layers keep None there, TransformerEngine's modules their FP8 state; core_attention is TE's alone)."""


def _megatron_state(cfg: ModelConfig, role: str, full: dict, tied: bool) -> dict:
    """Megatron-LM key -> global tensor (layers stacked along a leading axis, under the fused norm names),
    and every layer module's empty ``_extra_state`` as megatron-core writes it (``[None]``, pickled by the
    writer)."""
    names = [n for n in _global_shapes(cfg, role) if not (tied and n == "output_layer.weight")]
    missing = [n for n in names if n not in full]
    if missing:
        raise MegatronCheckpointError(f"the model to save lacks {missing[:5]}")
    out, layers = {}, {}
    for name in names:  # layer 0's tensors, then layer 1's, ...
        if name.startswith(_LAYERS):
            layers.setdefault(_saved_key(name), []).append(full[name])
        else:
            out[name] = full[name].contiguous()
    out.update({key: torch.stack(tensors) for key, tensors in layers.items()})
    for module in _EXTRA_STATE_MODULES:
        for i in range(cfg.num_layers):  # megatron-core's ShardedObject key: <key>/shard_<offset>_<shape>
            out[f"{_LAYERS}{module}._extra_state/shard_{i}_{cfg.num_layers}"] = [None]
    return out


# --------------------------------------------------------------------------- conversions
def megatron_to_hf(src: str, out: str, family: str | None = None) -> str:
    """Export Megatron-LM checkpoint directory ``src`` as an HF directory loadable by transformers (a value
    model as ``*ForSequenceClassification``), with its tokenizer files if it saved any; returns ``out``."""
    ckpt = open_megatron(src)
    kind = "sequence_classification" if ckpt.role == "value" else "causal_lm"
    export_hf(out, ckpt.config, read_megatron_state(ckpt), kind=kind, family=family)
    copy_tokenizer_files(ckpt.tokenizer_dir(), out)
    return out


def megatron_to_ours(src: str, out: str, model_name: str = "actor", iteration: int | None = None) -> str:
    """Import Megatron-LM checkpoint directory ``src`` as model ``model_name`` of a new checkpoint of ours
    (iteration: the Megatron-LM one unless given); returns its directory."""
    ckpt = open_megatron(src)
    iteration = ckpt.iteration if iteration is None else iteration
    _check_new(storage.checkpoint_path(out, iteration))
    path = save_model(out, iteration, model_name, ckpt.config, ckpt.role, read_megatron_state(ckpt),
                      {"converted_from": os.path.abspath(ckpt.path), "format": "megatron-lm torch_dist"})
    copy_tokenizer_files(ckpt.tokenizer_dir(), os.path.join(out, TOKENIZER_DIR))
    return path


def ours_to_megatron(root: str, out: str, model_name: str = "actor", iteration: int | None = None) -> str:
    """Export model ``model_name`` of our checkpoint root (``latest`` unless ``iteration``) as a Megatron-LM
    checkpoint directory ``out`` of the same iteration, with ``<root>/tokenizer``; returns its iteration
    directory."""
    it = storage.resolve_checkpoint(root, iteration)
    cfg, role, full = read_full_state(root, model_name, it)
    path = save_megatron(out, cfg, role, full, it)
    copy_tokenizer_files(os.path.join(root, TOKENIZER_DIR), os.path.join(path, "tokenizer"))
    return path
