"""2-rank scenario for the Megatron-LM checkpoint tests: megatron-core writes and reads, we read.

Phase 1, megatron-core alone with its global parallel state on gloo, as Megatron-LM runs:

- each ours-to-megatron output the parent wrote loads with ``dist_checkpointing.load`` into a
  GPTModel built from the args in its ``common.pt`` (TP1, so every rank holds every dense weight; a
  MoE model at EP2, each rank its two experts, returned under their global indices);
- each case is saved the way Megatron-LM's ``save_checkpoint`` saves at its ``tp`` (default 2) and
  ``ep`` (default 1): random weights, ``{"args", "checkpoint_version": 3.0, "iteration", "model":
  sharded_state_dict}`` through ``dist_checkpointing.save`` into ``iter_NNNNNNN/``, then
  ``latest_checkpointed_iteration.txt``; the saving model's full logits are kept.

Phase 2 drops the global state and loads every case into our actor through the job's path
(rlhf.checkpoint.sources) at TP1 and at PP2 (a MoE case at EP2 too), returning the largest logit
difference.
"""

import argparse
import os
import re
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.checkpoint.sources import open_source, read_weights
from rlhf.models.gpt import build_model
from rlhf.models.naming import named_global_parameters
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.parallel.reshard import load_full_weights
from rlhf.pipeline.microbatch import pipeline_forward

PLAN = {"ref_inf": {"ranks": "0-1", "dp": 2}, "actor_train": {"ranks": "0-1", "pp": 2},
        "critic_train": {"ranks": "0-1", "dp": 2, "ep": 2}}
LAYOUTS = {"tp1": "ref_inf", "pp2": "actor_train", "ep2": "critic_train"}
"""Our layouts a case loads into (ep2: MoE cases only)."""
LOCAL_NORM_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def megatron_lm_args(**fields) -> argparse.Namespace:
    """Args as Megatron-LM records them for a RoPE / RMSNorm / SwiGLU model (a few unrelated ones too,
    an enum among them, as in a real ``common.pt``)."""
    from megatron.core.transformer.enums import AttnBackend

    args = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                add_qkv_bias=False, group_query_attention=True, untie_embeddings_and_output_weights=True,
                rotary_percent=1.0, init_method_std=0.02, lr=1e-5, micro_batch_size=1, seed=1234,
                params_dtype=torch.float32, attention_backend=AttnBackend.auto, tensor_model_parallel_size=2,
                pipeline_model_parallel_size=1, expert_model_parallel_size=1, ckpt_format="torch_dist",
                num_experts=None)
    args.update(fields)
    return argparse.Namespace(**args)


def megatron_gpt(args: argparse.Namespace, tp: int):
    """A GPTModel of ``args`` built by megatron-core alone (its global parallel state, which sets the expert
    parallelism), as Megatron-LM's model provider builds it with the local layer spec (its
    ``core_transformer_config_from_args`` copies the MoE args by name)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    experts = getattr(args, "num_experts", None)
    moe = {} if not experts else dict(
        num_moe_experts=experts, moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_router_topk=args.moe_router_topk,
        moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None),
        moe_router_pre_softmax=getattr(args, "moe_router_pre_softmax", False),
        moe_router_load_balancing_type=getattr(args, "moe_router_load_balancing_type", "aux_loss"),
        moe_aux_loss_coeff=getattr(args, "moe_aux_loss_coeff", 0.0), moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=args.expert_model_parallel_size)
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=getattr(args, "kv_channels", None), qk_layernorm=getattr(args, "qk_layernorm", False),
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, gated_linear_unit=args.swiglu,
        activation_func=F.silu, add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        init_method_std=args.init_method_std, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, tensor_model_parallel_size=tp, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, **moe)
    spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type="rope", rotary_base=args.rotary_base)


def _global_state(tp: int, ep: int = 1) -> None:
    """megatron's global parallel state at ``tp`` and ``ep`` (replacing any), as Megatron-LM initialises it."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    ps.destroy_model_parallel()
    ps.destroy_global_memory_buffer()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(123)


@torch.no_grad()
def _randomize(model, tp_rank: int) -> None:
    """Weights larger than megatron's init (so a misplaced row shows): replicated ones alike on every
    TP rank, TP shards drawn per rank, a routed expert by its global layer and index; norm weights around 1."""
    for name, p in _global_parameters(model).items():
        sharded = getattr(p, "tensor_model_parallel", False)
        seed = zlib.crc32(name.encode()) if ".experts." in name else sum(map(ord, name)) * 7
        gen = torch.Generator().manual_seed(seed + (tp_rank + 1) * sharded)
        p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if "norm" in name else 0.0))


def _global_parameters(model) -> dict:
    """megatron-core's parameters by name, a routed expert's under its global index."""
    out = {}
    for name, p in model.named_parameters():
        m = re.search(r"\.local_experts\.(\d+)\.", name)
        if m:
            layer = model.decoder.layers[int(name.split(".")[2])]
            name = name.replace(m.group(0), f".local_experts.{layer.mlp.local_expert_indices[int(m.group(1))]}.")
        out[name] = p
    return out


def _load_ours_to_megatron(path: str) -> dict:
    """``dist_checkpointing.load`` of our export into a megatron-core GPTModel (TP1; a MoE model at EP2): its
    full weights, a routed expert's by its global index (this rank's experts)."""
    from megatron.core import dist_checkpointing

    with torch.serialization.safe_globals([argparse.Namespace]):
        args = torch.load(os.path.join(path, "common.pt"), weights_only=True)["args"]
    ep = 2 if args.num_experts else 1
    _global_state(tp=1, ep=ep)
    model = megatron_gpt(argparse.Namespace(**{**vars(args), "expert_model_parallel_size": ep}), tp=1)
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)  # as Megatron-LM loads
    model.load_state_dict(loaded["model"], strict=True)
    return {name: p.detach().clone() for name, p in _global_parameters(model).items()}


def _megatron_lm_save(root: str, case: dict, ids: torch.Tensor) -> torch.Tensor:
    """Save ``case`` at its tp (default 2) and ep (default 1) as Megatron-LM does; the saving model's full
    logits [b, s, V]."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    tp, ep = case.get("tp", 2), case.get("ep", 1)
    _global_state(tp=tp, ep=ep)
    args = megatron_lm_args(**case["args"], tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    model = megatron_gpt(args, tp=tp).eval()
    _randomize(model, ps.get_tensor_model_parallel_rank())
    b, s = ids.shape
    logits = model(input_ids=ids, position_ids=torch.arange(s).expand(b, -1), attention_mask=None)
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
                "singleton_local_shards": False, "chained_optim_avoid_prefix": True, **case.get("metadata", {})}
    sharded = model.sharded_state_dict(metadata=metadata)
    if case.get("local_norm_names"):  # the names a local-spec model without megatron's TE key map saves
        for tensor in sharded.values():
            for fused, local in LOCAL_NORM_NAMES.items():
                if hasattr(tensor, "key") and tensor.key.endswith(fused):
                    tensor.key = tensor.key[:-len(fused)] + local
    iteration = case["iteration"]
    path = os.path.join(root, case["name"], f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": sharded,
             "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(state, path, content_metadata={k: v for k, v in metadata.items() if k != "dp_cp_group"})
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, case["name"], "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def _ours(path: str, groups, ids: torch.Tensor, expected: torch.Tensor) -> dict:
    """Load ``path`` into our actor on ``groups`` as the job does; the last stage's largest logit error and
    the largest logit (float32 rounding grows with it)."""
    source = open_source(path, "actor")
    model = build_model(source.config, "lm", groups.pg_collection, groups.stage, seed=99)
    load_full_weights(model, groups, read_weights(source, list(named_global_parameters(model)), head_seed=0))
    out = pipeline_forward(model.eval(), groups, ids)
    return {} if out is None else {"err": (out - expected).abs().max().item(), "scale": expected.abs().max().item()}


def run(root: str, cases: list, ours_to_megatron: dict, ids: torch.Tensor) -> dict:
    from megatron.core import parallel_state as ps

    from rlhf import platform

    platform.setup_megatron()
    results = {"ours_to_megatron": {name: _load_ours_to_megatron(path) for name, path in ours_to_megatron.items()},
               "expected": {}}
    for case in cases:
        results["expected"][case["name"]] = _megatron_lm_save(root, case, ids)
    ps.destroy_model_parallel()
    ps.destroy_global_memory_buffer()
    platform.setup_megatron()  # our models run without the global state, as setup_megatron leaves it
    groups = build_task_groups(Placement.from_plan(PLAN, dist.get_world_size()))
    for case in cases:
        for layout, task in LAYOUTS.items():
            if layout == "ep2" and not case["args"].get("num_experts"):
                continue
            path = os.path.join(root, case["name"])
            results[f"{case['name']}/{layout}"] = _ours(path, groups[task], ids, results["expected"][case["name"]])
    return results
