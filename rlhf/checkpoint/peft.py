"""PEFT LoRA adapters <-> ours: names, the adapter config, and PEFT's two files.

PEFT saves an adapter of an HF Llama as ``adapter_config.json`` and
``adapter_model.safetensors`` with, per layer ``i`` and projection ``p``
(rlhf.models.config.LORA_TARGET_MODULES)::

    base_model.model.model.layers.i.self_attn.p.lora_A.weight   [r, in]   (p: q, k, v, o_proj)
    base_model.model.model.layers.i.mlp.p.lora_B.weight         [out, r]  (p: gate, up, down_proj)

and ours holds the same full tensors as ``decoder.layers.i.<megatron layer>.lora.p.A`` / ``.B``
(rlhf/models/lora.py): no reordering, since each projection has its own adapter. PEFT's
``modules_to_save`` (LORA_MODULES_TO_SAVE) are saved under the HF name, ``base_model.model.lm_head.weight``
(our ``output_layer.weight``), ``base_model.model.model.norm.weight`` and so on, without the vocabulary's
padded rows.

A format module: it imports nothing of rlhf.checkpoint; exporting a checkpoint's adapters and importing
PEFT's onto an HF base are conversions (convert.py, above it).
"""

from __future__ import annotations

import json
import os
import re

import torch

from rlhf.models.config import LoRAConfig, ModelConfigError
from rlhf.models.lora import LAYERS, is_saved_module
from rlhf.models.vocab import drop_vocab_padding

HF_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
"""PEFT projection -> its parent module in an HF Llama layer."""
OUR_LAYERS = {proj: path for path, (_, projections) in LAYERS.items() for proj in projections}
"""PEFT projection -> the megatron layer holding its adapter."""
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"

_PEFT = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_OURS = re.compile(r"^decoder\.layers\.(\d+)\.([\w.]+)\.lora\.(\w+)\.([AB])$")
_SAVED = {"output_layer.weight": "lm_head.weight", "embedding.word_embeddings.weight": "model.embed_tokens.weight",
          "decoder.final_layernorm.weight": "model.norm.weight"}
_SAVED_IN_LAYER = {"input_layernorm.weight": "input_layernorm.weight",
                   "pre_mlp_layernorm.weight": "post_attention_layernorm.weight"}
PREFIX = "base_model.model."


def _saved_hf_name(name: str) -> str | None:
    """The HF name of our global parameter ``name`` of a module PEFT can save (None for any other)."""
    if name in _SAVED:
        return _SAVED[name]
    m = re.match(r"^decoder\.layers\.(\d+)\.(\w+\.weight)$", name)
    return f"model.layers.{m.group(1)}.{_SAVED_IN_LAYER[m.group(2)]}" if m and m.group(2) in _SAVED_IN_LAYER else None


def _saved_our_name(hf: str) -> str | None:
    """Our global name of HF parameter ``hf`` of a module PEFT can save (None for any other)."""
    whole = {v: k for k, v in _SAVED.items()}
    if hf in whole:
        return whole[hf]
    m = re.match(r"^model\.layers\.(\d+)\.(\w+\.weight)$", hf)
    in_layer = {v: k for k, v in _SAVED_IN_LAYER.items()}
    return f"decoder.layers.{m.group(1)}.{in_layer[m.group(2)]}" if m and m.group(2) in in_layer else None


class PeftConversionError(ValueError):
    """Adapter files or tensors that do not map; the message names what and why."""


def ours_to_peft(state: dict[str, torch.Tensor], modules_to_save: tuple = (),
                 vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Our full adapter tensors and those of ``modules_to_save`` (global names; other names are ignored) under
    PEFT's saved names; ``vocab_size``: the model's, whose padded rows are dropped."""
    out = {}
    for name, tensor in state.items():
        m = _OURS.match(name)
        if m:
            layer, _, proj, factor = m.groups()
            out[f"{PREFIX}model.layers.{layer}.{HF_MODULES[proj]}.{proj}.lora_{factor}.weight"] = tensor
        elif is_saved_module(name, modules_to_save) and _saved_hf_name(name):
            out[PREFIX + _saved_hf_name(name)] = tensor if vocab_size is None else drop_vocab_padding(
                name, tensor, vocab_size)
    return out


def peft_to_ours(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's saved adapter tensors under our global names (PeftConversionError for any other tensor)."""
    out = {}
    for name, tensor in state.items():
        key = name.replace(".default.", ".").replace(".modules_to_save.", ".")  # a live PeftModel's names
        saved = _saved_our_name(key[len(PREFIX):]) if key.startswith(PREFIX) else None
        if saved is not None:
            out[saved] = tensor
            continue
        m = _PEFT.match(key)
        if not m or m.group(3) not in OUR_LAYERS:
            raise PeftConversionError(f"{name}: not a LoRA factor of a Llama projection "
                                      f"({', '.join(OUR_LAYERS)}); modules_to_save and other adapters are "
                                      "not supported")
        layer, _, proj, factor = m.groups()
        out[f"decoder.layers.{layer}.{OUR_LAYERS[proj]}.lora.{proj}.{factor}"] = tensor
    return out


def adapter_config(config: LoRAConfig, base_model: str | None = None) -> dict:
    """PEFT's adapter_config.json fields for ``config`` (plain LoRA, not rsLoRA, no bias)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": config.rank,
            "lora_alpha": config.rank if config.alpha is None else config.alpha,
            "lora_dropout": config.dropout, "target_modules": sorted(config.target_modules),
            "bias": "none", "use_rslora": False, "fan_in_fan_out": False, "init_lora_weights": True,
            "modules_to_save": list(config.modules_to_save) or None, "base_model_name_or_path": base_model,
            "inference_mode": True}


def save_peft(out: str, state: dict[str, torch.Tensor], config: LoRAConfig, base_model: str | None = None,
              vocab_size: int | None = None) -> str:
    """Write our full adapter tensors (and ``config.modules_to_save``'s) in ``state`` as PEFT's two files in
    directory ``out``; returns ``out``."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    peft = ours_to_peft(state, config.modules_to_save, vocab_size)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in peft.items()}
    if not tensors:
        raise PeftConversionError("no adapter tensors to export: the model has no LoRA adapters")
    save_file(tensors, os.path.join(out, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out, CONFIG_FILE), "w") as f:
        json.dump(adapter_config(config, base_model), f, indent=2)
    return out


def load_peft(path: str) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """(the LoRAConfig, our full adapter tensors) of PEFT's files in directory ``path``."""
    from safetensors.torch import load_file

    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            raw = json.load(f)
        state = load_file(os.path.join(path, WEIGHTS_FILE))
    except (OSError, ValueError) as exc:
        raise PeftConversionError(f"{path}: cannot read PEFT adapter files ({exc})") from None
    if raw.get("peft_type") != "LORA" or raw.get("use_rslora") or raw.get("use_dora"):
        raise PeftConversionError(f"{path}: only plain LoRA adapters are supported (peft_type LORA, no rsLoRA, "
                                  "no DoRA)")
    targets = raw.get("target_modules")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    try:
        config = LoRAConfig(rank=raw["r"], alpha=float(raw["lora_alpha"]), dropout=float(raw.get("lora_dropout", 0.0)),
                            target_modules=tuple(t for t in OUR_LAYERS if t in targets) or tuple(targets),
                            modules_to_save=tuple(raw.get("modules_to_save") or ()))
    except (KeyError, ModelConfigError) as exc:
        raise PeftConversionError(f"{path}/{CONFIG_FILE}: {exc}") from None
    unknown = sorted(set(targets) - set(config.target_modules))
    if unknown:
        raise PeftConversionError(f"{path}/{CONFIG_FILE}: target module(s) {unknown} are not Llama projections "
                                  f"({', '.join(OUR_LAYERS)})")
    return config, peft_to_ours(state)


def merged_deltas(state: dict[str, torch.Tensor], config: LoRAConfig) -> dict[str, torch.Tensor]:
    """{HF weight name: (alpha / r) B A} of the adapters in our full ``state`` (what merging adds)."""
    peft = ours_to_peft(state)
    out = {}
    for name, a in peft.items():
        if name.endswith(".lora_A.weight"):
            b = peft[name.replace(".lora_A.", ".lora_B.")]
            weight = name[len(PREFIX):-len(".lora_A.weight")] + ".weight"
            out[weight] = (b.double() @ a.double() * config.scaling).float()
    return out


def check_adapters(state: dict[str, torch.Tensor], config: LoRAConfig, model, what: str) -> None:
    """PeftConversionError (one line, naming ``what``) unless ``state`` holds exactly ``config``'s adapters
    for ModelConfig ``model``, each of its shape."""
    from rlhf.models.config import projection_shape

    try:
        config.check_shape(model)
    except ModelConfigError as exc:
        raise PeftConversionError(f"{what}: {exc}") from None
    expected = {}
    for layer in range(model.num_layers):
        for proj in config.target_modules:
            n_in, n_out = projection_shape(model, proj)
            stem = f"decoder.layers.{layer}.{OUR_LAYERS[proj]}.lora.{proj}."
            expected.update({stem + "A": (config.rank, n_in), stem + "B": (n_out, config.rank)})
    lora = {k: tuple(v.shape) for k, v in state.items() if _OURS.match(k)}
    for name in sorted(set(expected) | set(lora)):
        if expected.get(name) != lora.get(name):
            raise PeftConversionError(f"{what}: adapter {name} is {lora.get(name, 'missing')}, the model (rank "
                                      f"{config.rank}, targets {','.join(config.target_modules)}, "
                                      f"{model.num_layers} layers) needs {expected.get(name, 'none')}")

