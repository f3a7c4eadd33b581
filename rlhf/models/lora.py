"""LoRA adapters on megatron's tensor-parallel linear layers, with PEFT's semantics and names.

Each adapted layer gets a child module ``lora`` and a forward hook that adds
``scaling * B A dropout(x)`` to the layer's output; the base weight is frozen
and keeps its name, so resharding, checkpoints, HF conversion and the engine
see the base model unchanged, and the adapters as extra parameters
(``<layer>.lora.<projection>.A`` / ``.B``, global names as rlhf/models/naming.py).
One adapter per PEFT projection, so a PEFT checkpoint maps one to one:

    layer (megatron)                 kind     PEFT projections       A [r, in]        B [out, r]
    self_attention.linear_qkv        column   q_proj k_proj v_proj   replicated       split on out
    mlp.linear_fc1                   column   gate_proj up_proj      replicated       split on out
    self_attention.linear_proj       row      o_proj                 split on in      replicated
    mlp.linear_fc2                   row      down_proj              split on in      replicated

The split factor is sharded like the base weight along the layer's parallel
dimension (contiguous TP slices of the HF tensor, stride 1), the other factor
is whole on every TP rank (``tensor_model_parallel=False``: counted once in
the gradient norm). Where the partial products meet::

    column:  x (whole) -> h = A x [.., r] -> copy_to_tp (backward: all-reduce dL/dh) -> B_t h  (this rank's rows)
    row:     x_t (shard) -> A_t x_t -> reduce_from_tp (forward: all-reduce, as the base output) -> B h (whole)

so the row-parallel all-reduce carries r numbers per token, not the hidden
size, and every rank gets the complete gradient of its factors (the column
layer's input gradient from the adapter path is complete too; megatron
all-reduces only the base path's). Fused rows: linear_qkv's output is laid out
per KV group ``[q(g) k(g) v(g)]`` (rlhf/checkpoint/hf.py), a TP rank holding
whole groups, so the q, k and v deltas are interleaved per local group;
linear_fc1's is ``[gate_t; up_t]`` per TP rank. An untargeted projection adds
zeros. Sequence parallelism and TransformerEngine's fused-norm layers are
refused (the hook sees the layer's input before its norm there).

A is drawn as PEFT draws it (kaiming-uniform, a = sqrt(5), over the full
input), from a generator seeded by the model seed, the global layer and the
projection, so every TP rank draws the same full A and keeps its slice; B
starts at zero. Dropout masks come from megatron's tracked model-parallel RNG
(the same stream on the TP ranks of a stage, restored by activation recompute:
the recomputed forward draws the masks of the first); a frozen embedding's
output requires a gradient so that recomputed layers pass one to their adapters.
Dropout acts in training forwards only: inference passes run in eval mode
(rlhf.models.gpt.eval_mode).
"""

from __future__ import annotations

import contextlib
import math
import zlib

import torch
import torch.nn.functional as F

from rlhf.models.config import LoRAConfig, projection_shape
from rlhf.models.naming import global_name, named_global_parameters

LAYERS = {
    "self_attention.linear_qkv": ("column", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("row", ("o_proj",)),
    "mlp.linear_fc1": ("column", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("row", ("down_proj",)),
}
"""megatron layer (attribute path in a transformer layer) -> (parallel kind, the PEFT projections it fuses)."""

ADAPTER_MARK = ".lora."
"""In a parameter's name: it belongs to an adapter (and is what LoRA trains)."""


SAVED_MODULES = {"lm_head": "output_layer.weight", "embed_tokens": "embedding.word_embeddings.weight",
                 "norm": "layernorm.weight"}
"""PEFT's ``modules_to_save`` name -> how our global parameter names it ends (PEFT matches the module name's
end: ``norm`` is every RMSNorm, input_layernorm, pre_mlp_layernorm and final_layernorm)."""


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` (any naming) is a LoRA factor."""
    return ADAPTER_MARK in name


def is_saved_module(name: str, modules_to_save: tuple) -> bool:
    """Whether global parameter ``name`` belongs to one of PEFT's ``modules_to_save`` (trained in full)."""
    return any(name.endswith(SAVED_MODULES[m]) if m == "norm" else name == SAVED_MODULES[m] for m in modules_to_save)


class LoRAFactors(torch.nn.Module):
    """One projection's factors as this TP rank holds them: ``A`` [r, in(/tp)], ``B`` [out(/tp), r]."""

    def __init__(self, full_a: torch.Tensor, out_features: int, split: str, tp: int, tp_rank: int):
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        rank, n_in = full_a.shape
        a = full_a.chunk(tp, dim=1)[tp_rank] if split == "A" else full_a
        rows = out_features // tp if split == "B" else out_features
        self.A = torch.nn.Parameter(a.clone().contiguous())
        self.B = torch.nn.Parameter(torch.zeros(rows, rank, dtype=full_a.dtype))
        set_tensor_model_parallel_attributes(self.A, split == "A" and tp > 1, 1, 1)
        set_tensor_model_parallel_attributes(self.B, split == "B" and tp > 1, 0, 1)


class LoRALayer(torch.nn.Module):
    """The adapters of one megatron linear layer (``kind`` "column" or "row") and how their outputs
    combine into the layer's (sharded) output: ``groups`` blocks, each ``rows[p]`` rows of projection p."""

    def __init__(self, kind: str, factors: dict, rows: dict, groups: int, config: LoRAConfig, tp_group):
        super().__init__()
        self.kind, self.rows, self.groups, self.tp_group = kind, rows, groups, tp_group
        self.scaling, self.dropout = config.scaling, config.dropout
        for name, f in factors.items():  # children named as PEFT's projections: <layer>.lora.q_proj.A
            self.add_module(name, f)
        self.projections = tuple(factors)
        self.enabled = True

    def factors(self) -> dict:
        """{projection: its LoRAFactors}."""
        return {name: self.get_submodule(name) for name in self.projections}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' term of the layer's output for input ``x`` [s, b, in(/tp)]: [s, b, out(/tp)]."""
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   reduce_from_tensor_model_parallel_region)

        parts = {}
        for name, f in self.factors().items():
            h = F.linear(self._dropout(x), f.A)
            if self.kind == "column":
                h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
            else:
                h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
            parts[name] = F.linear(h, f.B) * self.scaling
        return self._combine(parts, x.shape[:-1], x)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.dropout == 0:
            return x
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.dropout, training=True)

    def _combine(self, parts: dict, lead: torch.Size, like: torch.Tensor) -> torch.Tensor:
        """Interleave the projections' outputs [..., rows[p] x groups] per group into the layer's rows."""
        blocks = []
        for name, rows in self.rows.items():
            part = parts.get(name)
            if part is None:  # an untargeted projection of a fused layer
                part = like.new_zeros(*lead, rows * self.groups)
            blocks.append(part.reshape(*lead, self.groups, rows))
        return torch.cat(blocks, dim=-1).reshape(*lead, -1)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scaling * B A`` of every projection in the layer's weight layout: [out(/tp), in(/tp)]."""
        parts = {name: (f.B @ f.A).T * self.scaling for name, f in self.factors().items()}  # [in, out_p]
        some = next(iter(self.factors().values()))
        return self._combine(parts, torch.Size([some.A.shape[1]]), some.A).T


def _add_adapters(module, args, output):
    """Forward hook of an adapted layer: its (output, bias) with the adapters' term added."""
    if not module.lora.enabled:
        return output
    out, bias = output
    return out + module.lora(args[0]).to(out.dtype), bias


def _layer_plan(path: str, cfg, tp: int) -> tuple[dict, int]:
    """({projection: its rows per group on a TP rank}, groups per TP rank) of megatron layer ``path``."""
    if path == "self_attention.linear_qkv":
        groups = cfg.num_query_groups // tp
        q_rows = cfg.num_attention_heads // cfg.num_query_groups * cfg.kv_channels
        return {"q_proj": q_rows, "k_proj": cfg.kv_channels, "v_proj": cfg.kv_channels}, groups
    if path == "mlp.linear_fc1":
        return {"gate_proj": cfg.ffn_hidden_size // tp, "up_proj": cfg.ffn_hidden_size // tp}, 1
    return {LAYERS[path][1][0]: cfg.hidden_size}, 1


def initial_a(seed: int, layer: int, projection: str, rank: int, n_in: int) -> torch.Tensor:
    """PEFT's initial A [rank, n_in] (kaiming-uniform, a = sqrt(5)) drawn from (``seed``, global ``layer``,
    ``projection``) alone, so every rank that holds part of it draws the same."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"lora/{seed}/{layer}/{projection}".encode()))
    a = torch.empty(rank, n_in)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
    return a


def _check_layer(layer, path: str) -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    kind = LAYERS[path][0]
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    if type(layer) is not cls:
        raise NotImplementedError(f"LoRA adapts megatron's local {cls.__name__} layers; {path} is "
                                  f"{type(layer).__name__} (TransformerEngine spec?): build the model with "
                                  "transformer_impl='local'")
    if getattr(layer, "sequence_parallel", False):
        raise NotImplementedError(f"LoRA on {path} with sequence parallelism is not supported")


def apply_lora(model: torch.nn.Module, config: LoRAConfig, model_config, seed: int,
               trainable: tuple = ()) -> torch.nn.Module:
    """Add ``config``'s adapters to a pipeline stage built by rlhf.models.gpt.build_model and freeze
    everything else but ``config.modules_to_save`` and the parameters named in ``trainable`` (global names,
    e.g. a value head's ``output_layer.weight``). ``model_config``: its rlhf ModelConfig (shapes are checked
    against the rank).
    Returns ``model``, modified in place; ``model.lora_config`` records ``config``."""
    config.check_shape(model_config)
    tp_group = model.pg_collection.tp
    tp, tp_rank = tp_group.size(), tp_group.rank()
    dtype = next(model.parameters()).dtype
    for param_name, param in model.named_parameters():
        name = global_name(model, param_name)
        param.requires_grad_(name in trainable or is_saved_module(name, config.modules_to_save))
    for layer in model.decoder.layers:
        index = layer.layer_number - 1
        for path, (kind, projections) in LAYERS.items():
            targeted = [p for p in projections if p in config.target_modules]
            if not targeted:
                continue
            linear = layer.get_submodule(path)
            _check_layer(linear, path)
            factors = {}
            for name in targeted:
                n_in, n_out = projection_shape(model_config, name)
                full_a = initial_a(seed, index, name, config.rank, n_in).to(dtype)
                factors[name] = LoRAFactors(full_a, n_out, "B" if kind == "column" else "A", tp, tp_rank)
            rows, groups = _layer_plan(path, model.config, tp)
            linear.lora = LoRALayer(kind, factors, rows, groups, config, tp_group).to(linear.weight.device)
            linear.register_forward_hook(_add_adapters)
    embedding = getattr(model, "embedding", None)  # the first pipeline stage's
    if embedding is not None and not any(p.requires_grad for p in embedding.parameters()):
        embedding.register_forward_hook(_output_requires_grad)
    model.lora_config = config
    return model


def _output_requires_grad(module, args, output):
    """Forward hook of a frozen embedding: its output requires a gradient, as PEFT's
    ``enable_input_require_grads`` makes it. megatron's full activation recompute is a reentrant
    checkpoint, which passes gradients back only through inputs that require them: from a frozen
    embedding's output none would reach the recomputed layers' adapters."""
    return output.requires_grad_(True)


def adapted_layers(model: torch.nn.Module) -> dict:
    """{global name of an adapted layer's weight: that layer's LoRALayer} of this stage."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoRALayer):
            out[global_name(model, name[:-len("lora")] + "weight")] = module
    return out


def has_adapters(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` (a stage, or None) carries LoRA adapters."""
    return model is not None and getattr(model, "lora_config", None) is not None


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Run ``model`` as its base model inside the block (the adapters add nothing)."""
    layers = list(adapted_layers(model).values())
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.enabled = True


@torch.no_grad()
def merged_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This stage's base parameters by global name, each adapted weight replaced by a new tensor
    W + scaling B A (same shard, same TP attributes); the adapters left out. What another layout
    without adapters (the engine's actor_gen, an inference task) receives by resharding."""
    layers = adapted_layers(model)
    out = {}
    for name, param in named_global_parameters(model).items():
        if is_adapter(name):
            continue
        if name in layers:
            merged = param.detach() + layers[name].delta_weight().to(param.dtype)
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(param, attr):
                    setattr(merged, attr, getattr(param, attr))
            param = merged
        out[name] = param
    return out
