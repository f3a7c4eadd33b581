"""2-rank scenario for rlhf/models/attention.py: the local spec's SDPA core attention against megatron's own
unfused DotProductAttention, in whole models at TP1 (each rank alone) and TP2 (both), fp32 and bf16, with
grouped-query heads (4 heads, 2 KV groups).

Each model runs a padded micro-batch of samples of different lengths, and the same samples packed (one row,
per-sample causal attention); then its core attentions are turned back into megatron's class (SdpaAttention
adds no state to it) and the padded micro-batch runs again. Returned per (tp, dtype): the largest difference
of the logits at real tokens, SDPA padded and SDPA packed each against megatron padded, and in fp32 the
largest difference of every parameter's gradient of one weighted sum of those logits; and the would-be host
synchronisations (rlhf.testing.host_syncs) of one core attention's padded and packed forward and backward.
"""

import torch
import torch.distributed as dist

from rlhf.models import ModelConfig
from rlhf.models.gpt import build_model, stage_forward
from rlhf.models.packing import PackedLayout, unpacked
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.testing.host_syncs import HostSyncCounter

CFG = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                  vocab_size=96, max_seq_len=32)
LENGTHS = [12, 7, 9, 3]  # real tokens of each sample of the [4, 12] micro-batch; pads after them
PLAN = {"actor_train": {"ranks": [0, 1], "tp": 2}, "actor_gen": None, "critic_train": None, "ref_inf": None,
        "reward_inf": None, "critic_inf": None}


def _core_attentions(model):
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


def _run(model, tokens, packed=None):
    """Logits [b, T, V/tp] in the padded layout (zeros at a packed run's padding), and the gradients of one
    fixed weighted sum of them at the real tokens."""
    model.zero_grad(set_to_none=True)
    logits = unpacked(stage_forward(model, tokens, packed=packed), packed)
    real = (torch.arange(tokens.shape[1]).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)).unsqueeze(-1)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5)) * real
    (logits.float() * weights).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float() * real, grads


def _attention_syncs(attention, packed: PackedLayout) -> list:
    """The would-be host syncs of ``attention``'s padded [T, b, n, d] and packed [t, n, d] calls, backward too."""
    heads, groups = attention.num_attention_heads_per_partition, attention.num_query_groups_per_partition
    d, b, t = CFG.hidden_size // CFG.num_attention_heads, len(LENGTHS), max(LENGTHS)
    padded = [torch.randn(t, b, n, d, requires_grad=True) for n in (heads, groups, groups)]
    rows = [torch.randn(packed.total, n, d, requires_grad=True) for n in (heads, groups, groups)]
    with HostSyncCounter() as counter:
        attention(*padded, None).sum().backward()
        attention(*rows, None, packed_seq_params=packed.seq_params).sum().backward()
    return [f"{e.op} at {e.where}" for e in counter.events]


def _compare(g, dtype) -> dict:
    model = build_model(CFG, "lm", g.pg_collection, g.stage, seed=3, dtype=dtype)
    tokens = torch.randint(0, CFG.vocab_size, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(4))
    packed = PackedLayout(torch.tensor(LENGTHS), tokens.shape[1], tokens.device)
    padded, padded_grads = _run(model, tokens)
    packed_logits, packed_grads = _run(model, tokens, packed)
    classes = {type(a).__name__ for a in _core_attentions(model)}
    syncs = _attention_syncs(_core_attentions(model)[0], packed)
    for attention in _core_attentions(model):
        attention.__class__ = type(attention).__mro__[1]  # megatron's DotProductAttention
    reference, reference_grads = _run(model, tokens)

    def grad_diff(grads):
        return max((grads[n] - reference_grads[n]).abs().max().item() for n in reference_grads)

    return {"classes": sorted(classes), "syncs": syncs, "scale": reference.abs().max().item(),
            "padded": (padded - reference).abs().max().item(), "packed": (packed_logits - reference).abs().max().item(),
            "padded_grad": grad_diff(padded_grads), "packed_grad": grad_diff(packed_grads),
            "grad_scale": max(g.abs().max().item() for g in reference_grads.values())}


def run():
    groups = build_task_groups(Placement.from_plan(PLAN, dist.get_world_size()))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        out[f"tp1/{name}"] = _compare(local_groups(), dtype)
        out[f"tp2/{name}"] = _compare(groups["actor_train"], dtype)
    return out
