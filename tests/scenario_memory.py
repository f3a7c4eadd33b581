"""4-rank scenario for activation recomputation and the measured memory per rank.

actor_train runs TP2xPP2 and critic_train PP2xDP2 reversed (the built-in 4-rank plan), each model 4
layers (2 per pipeline stage). One ``Trainer.learn`` (2 PPO epochs, so the second epoch's gradients
depend on the first update) runs on fixed samples without recomputation, with full recomputation in
chunks of 1 and of 2 layers, and with selective recomputation, from the same weights. Each rank returns
the trained weights' largest difference from the run without recomputation, the logged gradient norms,
its measured memory parts per stage and the same parts counted independently from the model shapes
(rlhf.planner.shapes' list of weight tensors), the placement and the engine's cache geometry.
"""

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.batch import Batch
from rlhf.config import RunConfig
from rlhf.engine.types import SampleResult
from rlhf.models import ModelConfig
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.parallel.reshard import gather_tp_full_weights
from rlhf.planner.shapes import model_weights, weight_stage
from rlhf.ppo.config import GenerationConfig, JobConfig, MemoryConfig, ModelsConfig, PPOConfig
from rlhf.ppo.layout import DEFAULT_PLANS
from rlhf.ppo.trainer import Trainer
from rlhf.tasks import MODEL_KIND, TASK_MODEL
from rlhf.testing.models import full_weights

MODEL = ModelConfig(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                    vocab_size=64, max_seq_len=32)
PLAN = DEFAULT_PLANS[4]  # actor_train TP2xPP2, critic_train PP2xDP2 reversed, every other kind of layout
PPO = PPOConfig(rollout_batch_size=4, n_samples_per_prompt=2, ppo_mini_batch_size=8, ppo_epochs=2,
                micro_batch_size=2, lr=5e-4, critic_lr=1e-3, clip_grad=0.05, kl_coef=0.1)
SETTINGS = {"none": MemoryConfig(), "full": MemoryConfig(recompute_granularity="full"),
            "full2": MemoryConfig(recompute_granularity="full", recompute_num_layers=2),
            "selective": MemoryConfig(recompute_granularity="selective")}
PROMPTS, RESPONSES = [3, 5, 2, 6], [4, 7, 1, 5, 6, 3, 7, 2]  # prompt lengths; response lengths (two per prompt)
ELEMENT = 4  # fp32


def _batch() -> Batch:
    """8 fixed samples; their old log-probs are made up (the update needs them only as numbers)."""
    g = torch.Generator().manual_seed(5)
    samples = []
    for s, r in enumerate(RESPONSES):
        prompt = torch.randint(0, MODEL.vocab_size, (PROMPTS[s // 2],), generator=g).tolist()
        response = torch.randint(0, MODEL.vocab_size, (r,), generator=g).tolist()
        logprobs = (-torch.rand(r, generator=g) * 3).tolist()
        samples.append(SampleResult(str(s // 2), s % 2, tuple(prompt), tuple(response), tuple(logprobs), "length", 0.0))
    return Batch.from_samples(samples, pad_id=0, prompt_ids={str(i): i for i in range(len(PROMPTS))})


def _trained(trainer) -> dict:
    """Full weights of actor_train and critic_train, merged from every rank (collective)."""
    out = {}
    for task in ("actor_train", "critic_train"):
        mine = gather_tp_full_weights(trainer.models[task], trainer.groups[task])
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
        out[task] = {k: v.cpu() for part in parts for k, v in part.items()}
    return out


def _shape_count(trainer, task: str) -> tuple[int, int]:
    """(elements, tensors) of ``task``'s parameters on this rank, from the shape's weight list: a TP-split
    tensor's 1/tp share, a replicated one (norms, a value head) whole, on the stage that holds it."""
    mesh, stage = trainer.placement[task], trainer.groups[task].stage.index
    cfg, kind = MODEL, MODEL_KIND[TASK_MODEL[task]]
    mine = [w for w in model_weights(cfg, kind) if weight_stage(w.place, cfg.num_layers, mesh.strategy.pp) == stage]
    return sum(w.numel // mesh.strategy.tp if w.parallel else w.numel for w in mine), len(mine)


def _expected_parts(trainer) -> dict:
    """This rank's parameters, gradients, optimizer state (after a step) and KV cache in bytes, counted from the
    shapes: 4 B per parameter, 4 B per trained one's gradient, AdamW's two 4 B moments per trained parameter and
    a 4 B step count per trained tensor; the cache holds K and V of every layer for this TP rank's KV heads."""
    counts = {t: _shape_count(trainer, t) for t in trainer.models}
    trained = [t for t in ("actor_train", "critic_train") if t in trainer.models]
    engine = trainer.engine.config
    gen_tp = trainer.placement["actor_gen"].strategy.tp
    kv = MODEL.num_layers * 2 * (MODEL.num_kv_heads // gen_tp) * engine.num_blocks * engine.block_size \
        * MODEL.head_dim * ELEMENT
    return {"parameters": ELEMENT * sum(n for n, _ in counts.values()),
            "gradients": ELEMENT * sum(counts[t][0] for t in trained),
            "optimizer": sum(2 * ELEMENT * counts[t][0] + ELEMENT * counts[t][1] for t in trained), "kv": kv}


def _learn(placement, full: dict, memory: MemoryConfig) -> dict:
    config = JobConfig(models=ModelsConfig(actor=MODEL, critic=MODEL), run=RunConfig(iterations=1, seed=3),
                       generation=GenerationConfig(max_prompt_len=8, max_response_len=8), ppo=PPO, memory=memory)
    trainer = Trainer(config, placement, prompts=None, tokenizer=None, initial_weights=full)
    metrics = trainer.learn(_batch().to(platform.device())).metrics
    recompute = {t: trainer.models[t].config.recompute_granularity for t in trainer.models}
    return {"weights": _trained(trainer), "metrics": metrics, "parts": trainer.memory.last_parts,
            "expected": _expected_parts(trainer), "recompute": recompute}


def run() -> dict:
    placement = Placement.from_plan(PLAN, dist.get_world_size())
    build_task_groups(placement)
    full = {"actor": full_weights("lm", MODEL, 101), "critic": full_weights("value", MODEL, 202),
            "reward": full_weights("value", MODEL, 303)}
    runs = {name: _learn(placement, full, memory) for name, memory in SETTINGS.items()}
    base = runs["none"]["weights"]
    out = {"rank": dist.get_rank()}
    for name, result in runs.items():
        after = result.pop("weights")
        result["max_diff"] = {t: max((after[t][k] - base[t][k]).abs().max().item() for k in base[t]) for t in base}
        result["moved"] = {t: max((after[t][k] - full[m][k]).abs().max().item() for k in base[t])
                           for t, m in (("actor_train", "actor"), ("critic_train", "critic"))}
        out[name] = result
    return out
