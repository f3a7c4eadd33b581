"""Global parameter names: one name per parameter of the unsharded model, whatever the layout.

A pipeline stage numbers its layers from 0, so the same weight is
``decoder.layers.1.…`` on stage 1 of a pp=4, 8-layer model and
``decoder.layers.3.…`` unsharded. Its *global name* uses the global layer
(``layer.layer_number - 1``) and the local layer spec's norm names, so
resharding, checkpoints, HF conversion and the engine's decoder all agree on
one key per tensor. Which stage owns a name follows from the layer split.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
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
    return f"decoder.layers.{layer.layer_number - 1}." + _TE_FUSED_NORMS.get(suffix, suffix)


def named_global_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters keyed by global name."""
    return {global_name(model, n): p for n, p in model.named_parameters()}


def owning_stage(name: str, num_layers: int, pp: int) -> int:
    """Pipeline stage holding global parameter ``name`` when ``num_layers`` are split over ``pp``."""
    m = _LAYER.match(name)
    if m:
        return int(m.group(1)) // (num_layers // pp)
    return 0 if name.startswith("embedding.") else pp - 1
