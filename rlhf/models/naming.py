"""Global parameter names: one name per parameter of the unsharded model, whatever the layout.

A pipeline stage numbers its layers from 0, so the same weight is
``decoder.layers.1.…`` on stage 1 of a pp=4, 8-layer model and
``decoder.layers.3.…`` unsharded. Its *global name* uses the global layer
(``layer.layer_number - 1``) and the local layer spec's norm names, so
resharding, checkpoints, HF conversion and the engine's decoder all agree on
one key per tensor. Which stage owns a name follows from the layer split.

A mixture of experts' routed expert is named by its global index
(``decoder.layers.L.mlp.experts.local_experts.E.…``, E in 0..num_experts-1):
an expert-parallel rank numbers its own experts from 0, and megatron's
``local_expert_indices`` say which they are. Which expert-parallel rank holds
expert E follows from the expert split (:func:`expert_owner`).
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")
_TE_FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
"""TransformerEngine-spec parameter names -> the local spec's names."""


def global_name(model: torch.nn.Module, name: str) -> str:
    """The unsharded local-spec name of parameter ``name`` of a pipeline stage."""
    m = _LAYER.match(name)
    if not m:
        return name
    layer = model.decoder.layers[int(m.group(1))]
    suffix = name[m.end():]
    expert = _EXPERT.match(suffix)
    if expert:
        index = layer.mlp.local_expert_indices[int(expert.group(1))]
        suffix = f"mlp.experts.local_experts.{index}." + suffix[expert.end():]
    return f"decoder.layers.{layer.layer_number - 1}." + _TE_FUSED_NORMS.get(suffix, suffix)


def named_global_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters keyed by global name."""
    return {global_name(model, n): p for n, p in model.named_parameters()}


def expert_index(name: str) -> int | None:
    """The global expert index of a routed expert's parameter (global name), None for any other."""
    m = _LAYER.match(name)
    expert = _EXPERT.match(name[m.end():]) if m else None
    return int(expert.group(1)) if expert else None


def expert_owner(name: str, num_experts: int, ep: int) -> int | None:
    """The expert-parallel rank holding parameter ``name`` when ``num_experts`` are split over ``ep`` ranks
    (megatron: rank r holds experts r * E / ep .. (r + 1) * E / ep - 1), None when every rank holds it."""
    index = expert_index(name)
    return None if index is None else index // (num_experts // ep)


def owning_stage(name: str, num_layers: int, pp: int) -> int:
    """Pipeline stage holding global parameter ``name`` when ``num_layers`` are split over ``pp``."""
    m = _LAYER.match(name)
    if m:
        return int(m.group(1)) // (num_layers // pp)
    return 0 if name.startswith("embedding.") else pp - 1
