"""Scenarios for the RLHF-state checkpoints.

``run`` (4 ranks): the actor is saved from TP2xPP2 (``ModelOptimizer``,
megatron's AdamW) and the critic from a reversed PP2xDP2 layout with
megatron's distributed optimizer, each with AdamW moments, step and LR
schedule set to known values, plus data position and RNG. The actor loads
into TP1xDP2 with the distributed optimizer (ranks 0-1), the critic into TP1
with the plain one (rank 2). Reference full tensors are built on every rank
from fixed seeds, so the state checks are exact; the loaded models then take
one step, compared with unsharded ``torch.optim.AdamW`` started from the same
state (tests/scenario_optim.py).

``save_then_die`` (one plain process, no megatron): saves iteration 1, then
dies inside the commit of iteration 2, as a killed job would.
"""

import math
import os
import zlib
from dataclasses import replace

import torch
import torch.distributed as dist

from rlhf.checkpoint.rlhf_state import ModelSlot, load_rlhf_state, save_rlhf_state
from rlhf.models import ModelConfig
from rlhf.models.gpt import build_model
from rlhf.models.naming import named_global_parameters
from rlhf.models.sharding import ShardSpec, full_to_shard
from rlhf.optim import ModelOptimizer
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.parallel.reshard import gather_tp_full_weights
from scenario_optim import OPT, lr_at, make_data, reference_step, sharded_step, torch_adamw

CFG = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_kv_heads=2, vocab_size=256, max_seq_len=64, qkv_bias=True)
PLAN = {
    "actor_train": {"ranks": "0-3", "tp": 2, "pp": 2},
    "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True},
    "ref_inf": {"ranks": [0, 1]},
    "reward_inf": {"ranks": [2]},
}
STEP = 2  # updates taken before the save: the LR schedule is half-way down its cosine


def _moments(full: dict) -> dict:
    """Deterministic full AdamW moments per parameter name (same on every rank), scaled like the
    clipped gradients' so the next step's gradient still matters."""
    out = {}
    for name, t in full.items():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = {"exp_avg": 1e-4 * torch.randn(t.shape, generator=gen),
                     "exp_avg_sq": 1e-8 * (0.5 + torch.rand(t.shape, generator=gen))}
    return out


def _slot(role, groups, seed, distributed: bool, full=None, moments=None):
    """A model slot on ``groups`` with a ModelOptimizer; weights, moments and schedule set from the reference."""
    if groups is None:
        return ModelSlot(CFG, role)
    model = build_model(CFG, role, groups.pg_collection, groups.stage, seed=seed)
    opt = ModelOptimizer(model, groups, replace(OPT, use_distributed_optimizer=distributed))
    if full is not None:
        tp = groups.mesh.strategy.tp
        slices = opt.state_slices()
        for name, p in named_global_parameters(model).items():
            spec = ShardSpec.of(p, tp)
            p.data.copy_(full_to_shard(full[name], spec, groups.tp_rank))
            if p in slices:
                s = slices[p]
                s.owner.state[s.inner] = {"step": torch.tensor(float(STEP))} | {
                    k: full_to_shard(v, spec, groups.tp_rank).reshape(-1)[s.start:s.end].view_as(s.inner).clone()
                    for k, v in moments[name].items()}
        opt.scheduler.step(increment=STEP)
    return ModelSlot(CFG, role, model, groups, opt, opt.scheduler)


def _reference_next(role: str, full: dict, moments: dict, data: list) -> dict:
    """Unsharded torch AdamW from the saved state: the weights after one more step."""
    local = local_groups()
    model = build_model(CFG, role, local.pg_collection, local.stage, seed=1)
    opt = torch_adamw(model, OPT)
    for name, p in named_global_parameters(model).items():
        p.data.copy_(full[name])
        opt.state[p] = {"step": torch.tensor(float(STEP))} | {k: v.clone() for k, v in moments[name].items()}
    reference_step(model, opt, role, data, STEP)
    return gather_tp_full_weights(model, local)


def _compare(slot, full, moments, data, ref_next) -> dict:
    """Exactness of a loaded TP1 slot against the reference full tensors, then one step against torch."""
    params = named_global_parameters(slot.model)
    slices = slot.optimizer.state_slices()
    states = {p: s.owner.state[s.inner] for p, s in slices.items()}
    ok_w = all(torch.equal(p.data, full[n]) for n, p in params.items())
    ok_m = all(torch.equal(states[p][k].reshape(-1), moments[n][k].reshape(-1)[slices[p].start:slices[p].end])
               for n, p in params.items() if p in slices for k in moments[n])
    ok_step = all(float(st["step"]) == STEP for st in states.values())
    lrs = [g["lr"] for g in slot.optimizer.param_groups]
    ok_sched = slot.scheduler.num_steps == STEP and all(math.isclose(lr, lr_at(STEP), rel_tol=1e-12) for lr in lrs)
    ranges = {n: (slices[p].start, slices[p].end) for n, p in params.items() if p in slices}
    sharded_step(slot.model, slot.groups, slot.optimizer, slot.role, data)  # the loaded state drives a real step
    after = gather_tp_full_weights(slot.model, slot.groups)
    return {"weights": ok_w, "moments": ok_m, "step": ok_step, "scheduler": ok_sched,
            "names": len(params) == len(full), "ranges": ranges, "numel": {n: t.numel() for n, t in full.items()},
            "next_step_err": max((after[n] - ref_next[n]).abs().max().item() for n in after),
            "next_step_moved": max((after[n] - full[n]).abs().max().item() for n in after)}


def run(root: str):
    rank = dist.get_rank()
    groups = build_task_groups(Placement.from_plan(PLAN, dist.get_world_size()))
    local = local_groups()
    full = {"actor": gather_tp_full_weights(build_model(CFG, "lm", local.pg_collection, local.stage, seed=7), local),
            "critic": gather_tp_full_weights(build_model(CFG, "value", local.pg_collection, local.stage, seed=8), local)}
    moments = {k: _moments(v) for k, v in full.items()}

    saved = {"actor": _slot("lm", groups["actor_train"], 99, False, full["actor"], moments["actor"]),
             "critic": _slot("value", groups["critic_train"], 98, True, full["critic"], moments["critic"])}
    torch.manual_seed(1000 + rank)
    save_rlhf_state(root, 5, saved, data_position={"epoch": 1, "index": 17}, group=dist.group.WORLD)
    after_save = torch.rand(4)

    torch.manual_seed(0)
    loaded = {"actor": _slot("lm", groups["ref_inf"], 55, True), "critic": _slot("value", groups["reward_inf"], 56, False)}
    state = load_rlhf_state(root, loaded, group=dist.group.WORLD)
    result = {"iteration": state.iteration, "data_position": state.data_position,
              "rng": bool(torch.equal(torch.rand(4), after_save)), "files": sorted(os.listdir(state.path))}
    data = make_data(seed=3)[0]
    for name, slot in loaded.items():
        if slot.model is not None:
            ref_next = _reference_next(slot.role, full[name], moments[name], data)
            result[name] = _compare(slot, full[name], moments[name], data, ref_next)
    return result


# --------------------------------------------------------------------------- crash scenario
class TinyLM(torch.nn.Module):
    """Two parameters named like ours (embedding, output layer): enough for the state format."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.output_layer = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


def tiny_slot(seed: int) -> ModelSlot:
    cfg = ModelConfig(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                      num_kv_heads=1, vocab_size=16)
    torch.manual_seed(seed)
    model = TinyLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.output_layer.weight.sum().backward()
    model.embedding.word_embeddings.weight.sum().backward()
    opt.step()
    return ModelSlot(cfg, "lm", model, None, opt)


def save_then_die(root: str) -> None:
    """Save iteration 1, then get killed after writing iteration 2's files, before its commit."""
    from rlhf.checkpoint import storage

    save_rlhf_state(root, 1, {"actor": tiny_slot(1)}, data_position={"index": 1})
    storage.commit_checkpoint = lambda *args, **kwargs: os._exit(9)
    save_rlhf_state(root, 2, {"actor": tiny_slot(2)}, data_position={"index": 2})
