"""Gloo scenario for the planner's reshard byte count: HybridFlow Table 2's transitions, measured.

Each transition reshards a training layout (p-t-d) into one generation
strategy twice with the real rlhf/parallel/reshard.py: with the generation
ranks in HybridFlow's order and in plain order. The six task slots of one
placement hold two transitions at once (their models are all built here as
LMs): actor_train -> actor_gen / ref_inf and critic_train -> critic_inf /
reward_inf. Each rank reports, per destination slot, the elements it
received, split into tensor-parallel and replicated weights, and whether the
copy's full weights equal the training model's.
"""

import torch
import torch.distributed as dist

from rlhf.models import ModelConfig
from rlhf.models.gpt import build_model
from rlhf.models.naming import named_global_parameters
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.parallel.reshard import gather_tp_full_weights, reshard

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                  vocab_size=256, max_seq_len=64)
SLOTS = (("actor_train", "actor_gen", "ref_inf"), ("critic_train", "critic_inf", "reward_inf"))
"""(training, generation in HybridFlow order, generation in plain order) task slots of each transition."""


def run(transitions: list) -> dict:
    """``transitions``: up to two dicts of ``train`` / ``gen`` plan entries (degrees), ``ranks`` (the
    training ranks, also the plain generation order) and ``hybridflow`` (the generation ranks)."""
    plan = {}
    for (train, hf, plain), t in zip(SLOTS, transitions):
        plan.update({train: {**t["train"], "ranks": t["ranks"]}, hf: {**t["gen"], "ranks": t["hybridflow"]},
                     plain: {**t["gen"], "ranks": t["ranks"]}})
    placement = Placement.from_plan({**{task: None for slots in SLOTS for task in slots}, **plan},
                                    dist.get_world_size())
    groups = build_task_groups(placement)
    out = {"rank": dist.get_rank()}
    for train, *targets in SLOTS[:len(transitions)]:
        src = groups[train]  # pp = 1: each training rank holds a whole TP shard of every weight
        if src is None:
            continue
        source = build_model(CFG, "lm", src.pg_collection, src.stage, seed=11)
        expected = gather_tp_full_weights(source, src)
        for task in targets:
            out[task] = _reshard_into(placement, groups, train, source, task, expected)
    return out


def _reshard_into(placement, groups, train, source, task, expected) -> dict:
    dst = groups[task]
    target = build_model(CFG, "lm", dst.pg_collection, dst.stage, seed=99)
    received = reshard(placement[train], (groups[train], source), placement[task], (dst, target), CFG.num_layers)
    params = named_global_parameters(target)
    size = next(iter(params.values())).element_size()
    split = {"parallel": 0, "replicated": 0}
    for name, nbytes in received.items():
        split["parallel" if getattr(params[name], "tensor_model_parallel", False) else "replicated"] += nbytes
    full = gather_tp_full_weights(target, dst)
    return {**{kind: n // size for kind, n in split.items()},
            "exact": all(torch.equal(full[k], expected[k]) for k in expected)}
