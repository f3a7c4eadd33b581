"""2-rank scenario for the HF interop tests: HF checkpoints loaded at TP2 and at PP2 (mixtures of experts also
at EP2: each rank two of the four experts).

For every HF model the parent test saved, each layout loads it with
``load_hf_weights`` (a rank reads only its stage's tensors), runs a forward
pass and compares logits (or per-token values) with transformers' (computed
by the parent); then saves the sharded model with ``save_rlhf_state`` so the
parent can export it back to HF. Returns max abs errors and checkpoint roots.

A case with ``prompts`` has a vocabulary that tp=2 does not divide: both
layouts hold it padded (``padded``), and ``_padded_vocab`` also generates with
the engine at TP2, computes the training path's log-probs and entropy, and
reshards TP2 -> PP2 (see its docstring).
"""

import os

import torch
import torch.distributed as dist

from rlhf.checkpoint.hf import load_hf_weights, read_hf_config
from rlhf.checkpoint.rlhf_state import ModelSlot, load_rlhf_state, save_rlhf_state
from rlhf.engine import Engine, EngineConfig, Request, SamplingParams
from rlhf.models.gpt import build_model, stage_forward
from rlhf.models.logprobs import vocab_parallel_logprobs_entropy
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.parallel.reshard import reshard
from rlhf.testing.pipeline import stage_pass

PLAN = {"actor_train": {"ranks": "0-1", "tp": 2}, "critic_train": {"ranks": "0-1", "pp": 2},
        "ref_inf": {"ranks": "0-1", "dp": 2, "ep": 2}}
LAYOUTS = {"tp2": "actor_train", "pp2": "critic_train", "ep2": "ref_inf"}  # ep2: mixtures of experts only


def _forward(model, groups, ids, hidden_size):
    """Full logits / values on the last stage (gathered over TP), None elsewhere."""
    _, out = stage_pass(model, groups, ids, hidden_size)
    if not groups.is_last_stage:
        return None
    tp = groups.mesh.strategy.tp
    if out.dim() == 3 and tp > 1:
        parts = [torch.empty_like(out) for _ in range(tp)]
        dist.all_gather(parts, out.contiguous(), group=groups.tp)
        out = torch.cat(parts, dim=-1)
    return out


@torch.no_grad()
def _check(case: dict, groups, layout: str, out_root: str, seed: int) -> dict:
    cfg = read_hf_config(case["dir"]).config
    model = build_model(cfg, case["role"], groups.pg_collection, groups.stage, seed=seed,
                        padded_vocab=case.get("padded"))
    head_before = model.output_layer.weight.clone() if groups.is_last_stage else None
    load_hf_weights(model, groups, case["dir"], case["role"])
    model.eval()  # inference (megatron refuses an MoE layer training at tp > 1 without sequence parallelism)
    result = {}
    out = _forward(model, groups, case["ids"], cfg.hidden_size)
    if out is not None and case.get("expected") is not None:
        result["err"] = (out[..., :case["expected"].shape[-1]] - case["expected"]).abs().max().item()
        if case["role"] == "lm":
            result["padding_inf"] = bool((out[..., cfg.vocab_size:] == float("-inf")).all())
    if out is not None and case.get("expected") is None:  # new value head: kept as initialised
        result["head_kept"] = bool(torch.equal(model.output_layer.weight, head_before))
    root = os.path.join(out_root, f"{case['name']}_{layout}")
    save_rlhf_state(root, 0, {"actor": ModelSlot(cfg, case["role"], model, groups)}, group=dist.group.WORLD)
    result["root"] = root
    return result


def _generate_and_score(model, groups, cfg, prompts: list, new_tokens: int) -> dict:
    """The engine's greedy tokens and log-probs, and the training path's log-probs and entropy on them."""
    params = SamplingParams(max_new_tokens=new_tokens)
    results = Engine(model, groups, cfg, EngineConfig(num_blocks=64, block_size=8)).generate(
        [Request(f"p{i}", p, params) for i, p in enumerate(prompts)])
    out = {"tokens": [list(r.tokens) for r in results], "engine_lp": [list(r.logprobs) for r in results],
           "train_lp": [], "entropy": []}
    for r in results:
        ids = torch.tensor([list(r.prompt) + list(r.tokens)])
        logits = stage_forward(model, ids)[:, :-1]
        start = len(r.prompt) - 1
        logprobs, entropy = vocab_parallel_logprobs_entropy(logits, ids[:, 1:], groups.tp)
        out["train_lp"].append(logprobs[0, start:].tolist())
        out["entropy"].append(entropy[0, start:].tolist())
    return out


@torch.no_grad()
def _padded_vocab(case: dict, groups: dict, out_root: str) -> dict:
    """A vocabulary tp=2 does not divide, at TP2, padded two ways.

    ``case["padded"]`` rows, loaded from HF: engine generation and the training
    path's log-probs / entropy, then a reshard into the PP2 layout (same padded
    size) whose logits must still be transformers'. 256 rows (rank 1's whole
    slice is padding), loaded from our checkpoint that the 68-row TP2 model
    saved, with the padded output rows set to 10 so that only the -inf mask
    keeps them out: the same generation and log-prob checks.
    """
    tp2, pp2 = groups["actor_train"], groups["critic_train"]
    cfg = read_hf_config(case["dir"]).config
    out = {}
    model = build_model(cfg, "lm", tp2.pg_collection, tp2.stage, seed=3, padded_vocab=case["padded"])
    load_hf_weights(model, tp2, case["dir"])
    out["hf"] = _generate_and_score(model, tp2, cfg, case["prompts"], case["new_tokens"])
    target = build_model(cfg, "lm", pp2.pg_collection, pp2.stage, seed=4, padded_vocab=case["padded"])
    reshard(tp2.mesh, (tp2, model), pp2.mesh, (pp2, target), cfg.num_layers)
    logits = _forward(target, pp2, case["ids"], cfg.hidden_size)
    if logits is not None:
        out["reshard_err"] = (logits[..., :cfg.vocab_size] - case["expected"]).abs().max().item()

    wide = build_model(cfg, "lm", tp2.pg_collection, tp2.stage, seed=5, padded_vocab=256)
    load_rlhf_state(os.path.join(out_root, f"{case['name']}_tp2"),
                    {"actor": ModelSlot(cfg, "lm", wide, tp2)}, restore_rng=False)
    head = wide.output_layer.weight
    head[max(0, cfg.vocab_size - tp2.tp_rank * head.shape[0]):] = 10.0
    out["wide"] = _generate_and_score(wide, tp2, cfg, case["prompts"], case["new_tokens"])
    return out


def run(cases: list, out_root: str):
    groups = build_task_groups(Placement.from_plan(PLAN, dist.get_world_size()))
    results = {}
    for layout, task in LAYOUTS.items():
        for i, case in enumerate(cases):
            if layout == "ep2" and not read_hf_config(case["dir"]).config.is_moe:
                continue
            results[f"{case['name']}/{layout}"] = _check(case, groups[task], layout, out_root, seed=11 + i)
    for case in cases:
        if "prompts" in case:
            results[f"{case['name']}/padded"] = _padded_vocab(case, groups, out_root)
    return results
