"""4-rank scenario of tests/test_task_meshes.py: six task meshes, sharded models, resharding.

Every check compares a sharded computation against an unsharded model with
the same weights, built on each rank from one seed. Returns max abs errors.
A mixture of experts (MOE_CFG) is built on MOE_PLAN's layouts from one seed:
the same weights everywhere, the unsharded logits, the unsharded gradient at
EP2 x DP4, and a reshard from EP2 x DP4 to TP2 x EP2.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.models import ModelConfig
from rlhf.models.gpt import build_model, stage_forward
from rlhf.models.logprobs import vocab_parallel_log_probs
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.parallel.reshard import gather_tp_full_weights, load_full_weights, reshard
from rlhf.pipeline.microbatch import pipeline_forward_backward

CFG = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_kv_heads=2, vocab_size=256, max_seq_len=64, qkv_bias=True)
MOE_CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                      vocab_size=256, max_seq_len=64, qk_norm=True, kv_channels=24, num_experts=4,
                      moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48)
MOE_PLAN = {  # tasks as names of layouts (the models are all MOE_CFG LMs)
    "actor_train": {"ranks": "0-3", "dp": 4, "ep": 2},
    "ref_inf": {"ranks": "0-3", "tp": 2, "dp": 2, "ep": 2},
    "critic_train": {"ranks": "0-3", "pp": 2, "dp": 2},
    "reward_inf": {"ranks": "0-3", "tp": 2, "pp": 2},
}
PLAN = {
    "actor_train": {"ranks": "0-3", "tp": 2, "pp": 2},
    "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True},
    "actor_gen": {"ranks": "0-3", "tp": 2, "dp": 2},
    "reward_inf": {"ranks": [0, 1]},
    "ref_inf": {"ranks": [2, 3]},
}


def _lm_loss(logits_or_lp, ids, tp_group=None):
    if tp_group is None:  # reference: plain log-softmax over the full vocabulary
        lp = torch.log_softmax(logits_or_lp[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    else:
        lp = vocab_parallel_log_probs(logits_or_lp[:, :-1], ids[:, 1:], tp_group)
    return -lp.mean()


def _max_err(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _gather_logits(logits, groups):
    parts = [torch.empty_like(logits) for _ in range(groups.mesh.strategy.tp)]
    dist.all_gather(parts, logits.contiguous(), group=groups.tp)
    return torch.cat(parts, dim=-1)


def run():
    rank = dist.get_rank()
    placement = Placement.from_plan(PLAN, dist.get_world_size())
    placement.validate_models({"actor": CFG, "critic": CFG, "reward": CFG, "reference": CFG})
    groups = build_task_groups(placement)
    local = local_groups()
    torch.manual_seed(0)
    ids = torch.randint(0, CFG.vocab_size, (4, 16))
    targets = torch.randn(4, 16)
    results = {}

    ref_lm = build_model(CFG, "lm", local.pg_collection, local.stage, seed=7)
    full_lm = gather_tp_full_weights(ref_lm, local)
    ref_loss = _lm_loss(stage_forward(ref_lm, ids), ids)
    ref_loss.backward()
    ref_lm_grads = gather_tp_full_weights(ref_lm, local, grads=True)
    ref_val = build_model(CFG, "value", local.pg_collection, local.stage, seed=8)
    full_val = gather_tp_full_weights(ref_val, local)

    # actor_train TP2 x PP2: pipeline forward/backward, loss and gradients.
    g = groups["actor_train"]
    actor = build_model(CFG, "lm", g.pg_collection, g.stage, seed=99)
    load_full_weights(actor, g, full_lm)
    loss = pipeline_forward_backward(actor, g, ids, lambda logits: _lm_loss(logits, ids, g.tp))
    if loss is not None:
        results["actor_train_loss"] = abs(loss.item() - ref_loss.item())
    grads = gather_tp_full_weights(actor, g, grads=True)
    results["actor_train_grad"] = _max_err(grads, ref_lm_grads)

    # critic_train PP2 x DP2, reversed: each replica trains on its half, grads averaged over DP.
    g = groups["critic_train"]
    critic = build_model(CFG, "value", g.pg_collection, g.stage, seed=98)
    load_full_weights(critic, g, full_val)
    half = slice(2 * g.coord.dp, 2 * g.coord.dp + 2)
    loss = pipeline_forward_backward(critic, g, ids[half], lambda v: F.mse_loss(v, targets[half]))
    for p in critic.parameters():
        dist.all_reduce(p.grad, group=g.dp)
        p.grad /= g.mesh.strategy.dp
    ref_val.zero_grad()
    ref_half_loss = F.mse_loss(stage_forward(ref_val, ids[half]), targets[half])
    F.mse_loss(stage_forward(ref_val, ids), targets).backward()
    if loss is not None:
        results["critic_train_loss"] = abs(loss.item() - ref_half_loss.item())
    results["critic_train_grad"] = _max_err(gather_tp_full_weights(critic, g, grads=True),
                                            gather_tp_full_weights(ref_val, local, grads=True))
    results["critic_first_stage_ranks"] = g.mesh.pp_ranks(0, 0)

    # reward_inf TP1 on ranks {0, 1}: values and loss of an unsharded copy.
    g = groups["reward_inf"]
    if g is not None:
        reward = build_model(CFG, "value", g.pg_collection, g.stage, seed=97)
        load_full_weights(reward, g, full_val)
        values = stage_forward(reward, ids)
        F.mse_loss(values, targets).backward()
        with torch.no_grad():
            results["reward_inf_values"] = (values - stage_forward(ref_val, ids)).abs().max().item()

    # actor_gen TP2 x DP2, resharded from actor_train (TP2 x PP2); ref_inf TP1 on {2, 3}.
    for task in ("actor_gen", "ref_inf"):
        g = groups[task]
        target = build_model(CFG, "lm", g.pg_collection, g.stage, seed=55) if g is not None else None
        reshard(placement["actor_train"], (groups["actor_train"], actor), placement[task], (g, target),
                CFG.num_layers)
        if g is not None:
            part = slice(2 * g.coord.dp, 2 * g.coord.dp + 2)
            logits = _gather_logits(stage_forward(target, ids[part]), g)
            with torch.no_grad():
                ref_logits = stage_forward(ref_lm, ids[part])
            results[f"{task}_logits"] = (logits - ref_logits).abs().max().item()
            loss = _lm_loss(stage_forward(target, ids[part]), ids[part], g.tp)
            loss.backward()
            results[f"{task}_loss"] = abs(loss.item() - _lm_loss(ref_logits, ids[part]).item())
    results.update(_moe_layouts(ids))
    results["rank"] = rank
    return results


def _moe_layouts(ids) -> dict:
    """MOE_CFG on every MOE_PLAN layout: {layout: (weights err, logits err)} against an unsharded build from
    the same seed, the EP2 x DP4 gradient error (one sequence per replica; experts' gradients reduced over the
    replicas holding them, the rest over DP) and the weights error after resharding EP2 -> TP2 x EP2."""
    from rlhf.models.gpt import eval_mode
    from rlhf.testing.models import full_weights, unsharded
    from rlhf.testing.pipeline import stage_pass

    placement = Placement.from_plan(MOE_PLAN, dist.get_world_size())
    groups = build_task_groups(placement)
    full = full_weights("lm", MOE_CFG, 5)
    ref = unsharded("lm", MOE_CFG, full)
    with torch.no_grad():
        expected = stage_forward(ref, ids)
    sum(_lm_loss(stage_forward(ref, ids[q:q + 1]), ids[q:q + 1]) for q in range(4)).div(4).backward()
    ref_grads = gather_tp_full_weights(ref, local_groups(), grads=True)
    out, models = {}, {}
    for task in MOE_PLAN:
        g = groups[task]
        models[task] = model = build_model(MOE_CFG, "lm", g.pg_collection, g.stage, seed=5)
        weights_err = _max_err(gather_tp_full_weights(model, g), full)
        with eval_mode(model), torch.no_grad():
            _, logits = stage_pass(model, g, ids, MOE_CFG.hidden_size)
        logits_err = (_gather_logits(logits, g) - expected).abs().max().item() if g.is_last_stage else None
        out[f"moe_{task}"] = (weights_err, logits_err)
    g, model = groups["actor_train"], models["actor_train"]
    mine = ids[g.coord.dp:g.coord.dp + 1]
    _lm_loss(stage_forward(model, mine), mine).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=g.pg_collection.expt_dp if p.is_expert else g.dp)
        p.grad /= g.mesh.strategy.dp
    out["moe_ep2_grad"] = _max_err(gather_tp_full_weights(model, g, grads=True), ref_grads)
    g = groups["ref_inf"]
    target = build_model(MOE_CFG, "lm", g.pg_collection, g.stage, seed=6)
    reshard(placement["actor_train"], (groups["actor_train"], model), placement["ref_inf"], (g, target),
            MOE_CFG.num_layers, num_experts=MOE_CFG.num_experts)
    out["moe_reshard"] = _max_err(gather_tp_full_weights(target, g), full)
    return out
