"""2-rank scenario for the HF interop tests: HF checkpoints loaded at TP2 and at PP2.

For every HF model the parent test saved, each layout loads it with
``load_hf_weights`` (a rank reads only its stage's tensors), runs a forward
pass and compares logits (or per-token values) with transformers' (computed
by the parent); then saves the sharded model with ``save_rlhf_state`` so the
parent can export it back to HF. Returns max abs errors and checkpoint roots.
"""

import os

import torch
import torch.distributed as dist

from rlhf.checkpoint.hf import load_hf_weights, read_hf_config
from rlhf.checkpoint.rlhf_state import ModelSlot, save_rlhf_state
from rlhf.models.gpt import build_model, stage_forward
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.pipeline.p2p import recv_forward, send_forward

PLAN = {"actor_train": {"ranks": "0-1", "tp": 2}, "critic_train": {"ranks": "0-1", "pp": 2}}
LAYOUTS = {"tp2": "actor_train", "pp2": "critic_train"}


def _forward(model, groups, ids, hidden_size):
    """Full logits / values on the last stage (gathered over TP), None elsewhere."""
    x = None
    if not groups.is_first_stage:
        x = recv_forward((ids.shape[1], ids.shape[0], hidden_size), torch.float32, "cpu", groups.peer(-1))
    out = stage_forward(model, ids, x)
    if not groups.is_last_stage:
        send_forward(out, groups.peer(+1))
        return None
    tp = groups.mesh.strategy.tp
    if out.dim() == 3 and tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=groups.tp)
        out = torch.cat(parts, dim=-1)
    return out


@torch.no_grad()
def _check(case: dict, groups, layout: str, ids, out_root: str, seed: int) -> dict:
    cfg = read_hf_config(case["dir"]).config
    model = build_model(cfg, case["role"], groups.pg_collection, groups.stage, seed=seed)
    head_before = model.output_layer.weight.clone() if groups.is_last_stage else None
    load_hf_weights(model, groups, case["dir"], case["role"])
    result = {}
    out = _forward(model, groups, ids, cfg.hidden_size)
    if out is not None and case.get("expected") is not None:
        result["err"] = (out - case["expected"]).abs().max().item()
    if out is not None and case.get("expected") is None:  # new value head: kept as initialised
        result["head_kept"] = bool(torch.equal(model.output_layer.weight, head_before))
    root = os.path.join(out_root, f"{case['name']}_{layout}")
    save_rlhf_state(root, 0, {"actor": ModelSlot(cfg, case["role"], model, groups)}, group=dist.group.WORLD)
    result["root"] = root
    return result


def run(cases: list, ids: torch.Tensor, out_root: str):
    groups = build_task_groups(Placement.from_plan(PLAN, dist.get_world_size()))
    results = {}
    for layout, task in LAYOUTS.items():
        for i, case in enumerate(cases):
            results[f"{case['name']}/{layout}"] = _check(case, groups[task], layout, ids, out_root, seed=11 + i)
    return results
