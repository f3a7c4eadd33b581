"""4-rank scenario for ``rlhf.optim``: megatron DDP + optimizer + LR schedule against torch.

Each named layout (all on ranks 0-3) trains a model from the reference's
weights for STEPS AdamW steps, with clipping active (CLIP is below every
gradient norm) and a warm-up + cosine LR schedule; its DP replicas split each
step's micro-batches (MICROBATCHES[step]: the count varies, as token-balanced
mini-batches make it vary, which overlapped gradient reduction must survive). The
reference is the unsharded model in one process: ``torch.optim.AdamW`` (no weight decay on 1-D parameters),
``torch.nn.utils.clip_grad_norm_`` and :func:`lr_at` over all micro-batches.
"""

import math
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.models import ModelConfig
from rlhf.models.gpt import build_model, stage_forward
from rlhf.models.logprobs import vocab_parallel_log_probs
from rlhf.optim import ModelOptimizer, OptimizerConfig
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.parallel.reshard import gather_tp_full_weights, load_full_weights
from rlhf.pipeline.microbatch import pipeline_forward_backward

CFG = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_kv_heads=2, vocab_size=64, max_seq_len=16, qkv_bias=True)
MOE_CFG = replace(CFG, num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
SEEDS = {"lm": 21, "value": 22, "moe": 23}  # "moe": an MoE LM (MOE_CFG)
STEPS, MICROBATCHES, MB_SIZE, SEQ, CLIP = 4, (4, 2, 6, 4), 2, 8, 0.05
OPT = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_init=2e-4, lr_warmup_iters=1, lr_decay_iters=3,
                      lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
                      adam_eps=1e-8, clip_grad=CLIP)
DISTOPT = {"use_distributed_optimizer": True}
OVERLAP = {"overlap_grad_reduce": True}
LAYOUTS = {  # name: (task, strategy on ranks 0-3, model kind, OptimizerConfig options)
    "tp2_pp2": ("actor_train", {"tp": 2, "pp": 2}, "lm", {}),
    "pp2_dp2": ("critic_train", {"pp": 2, "dp": 2, "reverse_pp": True}, "value", {}),
    "pp2_dp2_distopt": ("actor_train", {"pp": 2, "dp": 2}, "lm", DISTOPT),
    "tp2_dp2_distopt": ("critic_train", {"tp": 2, "dp": 2}, "value", DISTOPT),
    "pp2_dp2_overlap": ("critic_train", {"pp": 2, "dp": 2, "reverse_pp": True}, "value", OVERLAP),
    "tp2_dp2_distopt_overlap": ("actor_train", {"tp": 2, "dp": 2}, "lm", {**DISTOPT, **OVERLAP}),
    "pp2_dp2_ep2": ("actor_train", {"pp": 2, "dp": 2, "ep": 2}, "moe", {}),  # dense and expert optimizers
}


def _model(kind: str, groups, seed: int):
    """A ``kind`` model ("moe": an LM of MOE_CFG) on ``groups``."""
    cfg, model_kind = (MOE_CFG, "lm") if kind == "moe" else (CFG, kind)
    return build_model(cfg, model_kind, groups.pg_collection, groups.stage, seed=seed)


def lr_at(n: int) -> float:
    """LR of the update after ``n`` earlier ones: linear warm-up, then cosine down to min_lr."""
    o = OPT
    if n <= o.lr_warmup_iters:
        return o.lr_warmup_init + (o.lr - o.lr_warmup_init) * n / o.lr_warmup_iters
    if n > o.lr_decay_iters:
        return o.min_lr
    x = (n - o.lr_warmup_iters) / (o.lr_decay_iters - o.lr_warmup_iters)
    return o.min_lr + (o.lr - o.min_lr) * (1 + math.cos(math.pi * x)) / 2


def make_data(seed: int) -> list:
    """STEPS lists of MICROBATCHES[step] (tokens [b, s], value targets [b, s])."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randint(0, CFG.vocab_size, (MB_SIZE, SEQ), generator=g), torch.randn(MB_SIZE, SEQ, generator=g))
             for _ in range(count)] for count in MICROBATCHES]


def sharded_loss(kind: str, out, tokens, target, tp_group):
    """Mean next-token NLL from vocab-parallel logits (lm, moe), or MSE of the values (value)."""
    if kind != "value":
        return -vocab_parallel_log_probs(out[:, :-1], tokens[:, 1:], tp_group).mean()
    return (out - target).square().mean()


def reference_loss(kind: str, out, tokens, target):
    if kind != "value":
        return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), tokens[:, 1:].reshape(-1))
    return (out - target).square().mean()


def torch_adamw(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    params = list(model.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1], "weight_decay": config.weight_decay},
                              {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}],
                             lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)


def reference_step(model, opt, kind: str, microbatches: list, n: int) -> float:
    """One unsharded step (update ``n``, 0-based) on all micro-batches; returns the gradient norm."""
    for tokens, target in microbatches:
        (reference_loss(kind, stage_forward(model, tokens), tokens, target) / len(microbatches)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    for group in opt.param_groups:
        group["lr"] = lr_at(n)
    opt.step()
    opt.zero_grad()
    return norm.item()  # a scalar for the report, once per step


def reference(kind: str, data: list) -> dict:
    """Unsharded training: full weights before and after, gradient norm per step."""
    local = local_groups()
    model = _model(kind, local, SEEDS[kind])
    before = gather_tp_full_weights(model, local)
    opt = torch_adamw(model, OPT)
    norms = [reference_step(model, opt, kind, mbs, n) for n, mbs in enumerate(data)]
    return {"before": before, "after": gather_tp_full_weights(model, local), "grad_norm": norms}


def sharded_step(module, groups, opt: ModelOptimizer, kind: str, microbatches: list, poison: bool = False) -> dict:
    """This DP replica's share of the micro-batches through the pipeline, then reduce and step; ``poison``: the
    loss is multiplied by NaN (every gradient NaN)."""
    scale = float("nan") if poison else 1.0
    strategy = groups.mesh.strategy
    share = len(microbatches) // strategy.dp
    mine = microbatches[groups.coord.dp * share:(groups.coord.dp + 1) * share]
    for i, (tokens, target) in enumerate(mine):
        with opt.backward_scope(last_microbatch=i == share - 1):
            pipeline_forward_backward(module, groups, tokens,
                                      lambda out: scale * sharded_loss(kind, out, tokens, target, groups.tp) / share)
    opt.reduce_grads()
    return opt.step()


def train(groups, kind: str, options: dict, data: list, ref: dict) -> dict:
    module = _model(kind, groups, SEEDS[kind] + 100)
    load_full_weights(module, groups, ref["before"])
    opt = ModelOptimizer(module, groups, replace(OPT, **options))
    stats, poisoned, in_a_row = [], [], []
    for n, mbs in enumerate(data):
        if n == 1:  # two steps of NaN gradients first: they must leave the weights, moments and schedule as they were
            for _ in range(2):
                poisoned.append(sharded_step(module, groups, opt, kind, mbs, poison=True))
                in_a_row.append(opt.skipped_in_a_row)
        stats.append(sharded_step(module, groups, opt, kind, mbs))
        in_a_row.append(opt.skipped_in_a_row)
    after = gather_tp_full_weights(module, groups)
    return {"err": max((after[k] - ref["after"][k]).abs().max().item() for k in after),
            "moved": max((after[k] - ref["before"][k]).abs().max().item() for k in after),
            "grad_norm": [s["grad_norm"] for s in stats], "lr": [s["lr"] for s in stats],
            "skipped": [s["skipped"] for s in stats], "poisoned": poisoned, "in_a_row": in_a_row,
            "ref_grad_norm": ref["grad_norm"]}


def run() -> dict:
    """{layout: {"err", "moved", "grad_norm", "lr", "ref_grad_norm"}} on this rank."""
    world = dist.get_world_size()
    groups = {name: build_task_groups(Placement.from_plan({task: {"ranks": "0-3", **plan}}, world))[task]
              for name, (task, plan, _, _) in LAYOUTS.items()}
    data = {kind: make_data(seed) for kind, seed in SEEDS.items()}
    refs = {kind: reference(kind, data[kind]) for kind in SEEDS}
    return {name: train(groups[name], kind, options, data[kind], refs[kind])
            for name, (_, _, kind, options) in LAYOUTS.items()}
