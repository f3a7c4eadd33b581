"""Scenarios for the RLHF-state checkpoint tests.

``run`` (4 ranks): the actor is saved from TP2xPP2 and the critic from a
reversed PP2xDP2 layout, with AdamW moments, LR schedulers, data position and
RNG; both load into TP1 layouts on other rank sets. Reference full tensors are
built on every rank from fixed seeds, so each check is exact.

``save_then_die`` (one plain process, no megatron): saves iteration 1, then
dies inside the commit of iteration 2, as a killed job would.
"""

import os
import zlib

import torch
import torch.distributed as dist

from rlhf.checkpoint.rlhf_state import ModelSlot, load_rlhf_state, save_rlhf_state
from rlhf.models import ModelConfig
from rlhf.models.gpt import build_model
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.models.naming import named_global_parameters
from rlhf.parallel.reshard import ShardSpec, full_to_shard, gather_tp_full_weights

CFG = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_kv_heads=2, vocab_size=256, max_seq_len=64, qkv_bias=True)
PLAN = {
    "actor_train": {"ranks": "0-3", "tp": 2, "pp": 2},
    "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True},
    "ref_inf": {"ranks": [0, 1]},
    "reward_inf": {"ranks": [2]},
}
STEP = 3.0


def _moments(full: dict) -> dict:
    """Deterministic full AdamW moments per parameter name (same on every rank)."""
    out = {}
    for name, t in full.items():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        out[name] = {"exp_avg": torch.randn(t.shape, generator=gen), "exp_avg_sq": torch.rand(t.shape, generator=gen)}
    return out


def _slot(role, groups, seed, full=None, moments=None):
    """A model slot on ``groups`` with AdamW + LambdaLR; filled from ``full``/``moments`` when given."""
    if groups is None:
        return ModelSlot(CFG, role)
    model = build_model(CFG, role, groups.pg_collection, groups.stage, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    if full is not None:
        tp = groups.mesh.strategy.tp
        for name, p in named_global_parameters(model).items():
            spec = ShardSpec.of(p, tp)
            p.data.copy_(full_to_shard(full[name], spec, groups.tp_rank))
            opt.state[p] = {"step": torch.tensor(STEP)}
            opt.state[p].update({k: full_to_shard(v, spec, groups.tp_rank) for k, v in moments[name].items()})
        for _ in range(int(STEP)):
            sched.step()
    return ModelSlot(CFG, role, model, groups, opt, sched)


def _compare(slot, full, moments) -> dict:
    """Exactness of a loaded TP1 slot against the reference full tensors."""
    params = named_global_parameters(slot.model)
    state = slot.optimizer.state
    ok_w = all(torch.equal(p.data, full[n]) for n, p in params.items())
    ok_m = all(torch.equal(state[p][k], moments[n][k]) for n, p in params.items() for k in moments[n])
    ok_step = all(float(state[p]["step"]) == STEP for p in params.values())
    sched = slot.scheduler
    ok_sched = sched.last_epoch == STEP and slot.optimizer.param_groups[0]["lr"] == 1e-3 / (STEP + 1)
    for p in params.values():  # the loaded state must drive a real step
        p.grad = torch.zeros_like(p)
    slot.optimizer.step()
    return {"weights": ok_w, "moments": ok_m, "step": ok_step, "scheduler": ok_sched,
            "names": len(params) == len(full)}


def run(root: str):
    rank = dist.get_rank()
    groups = build_task_groups(Placement.from_plan(PLAN, dist.get_world_size()))
    local = local_groups()
    full = {"actor": gather_tp_full_weights(build_model(CFG, "lm", local.pg_collection, local.stage, seed=7), local),
            "critic": gather_tp_full_weights(build_model(CFG, "value", local.pg_collection, local.stage, seed=8), local)}
    moments = {k: _moments(v) for k, v in full.items()}

    saved = {"actor": _slot("lm", groups["actor_train"], 99, full["actor"], moments["actor"]),
             "critic": _slot("value", groups["critic_train"], 98, full["critic"], moments["critic"])}
    torch.manual_seed(1000 + rank)
    save_rlhf_state(root, 5, saved, data_position={"epoch": 1, "index": 17}, group=dist.group.WORLD)
    after_save = torch.rand(4)

    torch.manual_seed(0)
    loaded = {"actor": _slot("lm", groups["ref_inf"], 55), "critic": _slot("value", groups["reward_inf"], 56)}
    state = load_rlhf_state(root, loaded, group=dist.group.WORLD)
    result = {"iteration": state.iteration, "data_position": state.data_position,
              "rng": bool(torch.equal(torch.rand(4), after_save)), "files": sorted(os.listdir(state.path))}
    for name, slot in loaded.items():
        if slot.model is not None:
            result[name] = _compare(slot, full[name], moments[name])
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
    storage._commit = lambda *args, **kwargs: os._exit(9)
    save_rlhf_state(root, 2, {"actor": tiny_slot(2)}, data_position={"index": 2})
