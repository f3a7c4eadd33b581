"""4-rank scenario for reward-model training (see tests/test_reward_training.py).

1. Exactness: one optimizer step on TP2xPP2 and on PP2xDP2 (reversed), each also with activation
   recomputation (full on TP2xPP2, selective on PP2xDP2), and on TP2xPP2 in bf16, against single-process
   PyTorch written here from the loss definition: every pair's sequences scored alone (the value
   at their last token), mean over pairs of -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2,
   clip_grad_norm_ (low enough that it clips) and torch AdamW; the held-out metrics after the step.
2. Resume: 4 steps straight against 2, save, load into a fresh trainer, 2 more (PP2xDP2 reversed,
   the distributed optimizer, a warm-up + cosine LR schedule, held-out scoring every 2 steps).
3. The saved checkpoint as pretrain_rlhf.py's reward model: the PPO Trainer, given ``--reward-model
   <root>`` as rlhf/ppo/job.py reads it, scores the pairs on reward_inf TP2 as the trained model does.
4. The HF export of the checkpoint: written here, scored by transformers in the test process.
5. The tiny default's reward training cached (rlhf/ppo/job.py trained_reward_weights, 4 steps here): a miss
   trains and writes the entry, a second call loads it, an entry with a flipped byte is trained again, a
   truncated one is not read, another seed misses, ``RLHF_CACHE_DIR=off`` turns it off.
"""

import contextlib
import dataclasses
import io
import json
import os

import torch
import torch.distributed as dist

from rlhf.config import LoggingConfig, PlacementConfig, RunConfig
from rlhf.data import ByteTokenizer, PreferenceDataset
from rlhf.models import ModelConfig
from rlhf.models.gpt import stage_forward
from rlhf.models.precision import PrecisionConfig
from rlhf.parallel.groups import build_task_groups
from rlhf.ppo.layout import build_placement as build_ppo_placement
from rlhf.ppo.config import GenerationConfig, JobConfig, ModelsConfig, PPOConfig
from rlhf.ppo.job import directory_weights
from rlhf.ppo.trainer import Trainer
from rlhf.reward_model.config import TASK, RewardDataConfig, RewardJobConfig, RewardOptimizerConfig, RewardTrainingConfig
from rlhf.reward_model.job import build_placement, export_reward_model
from rlhf.reward_model.trainer import RewardTrainer, pair_batch
from rlhf.testing.models import full_weights, unsharded

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                    vocab_size=320, max_seq_len=64)  # holds the byte tokenizer's 259 ids
PAD = ByteTokenizer.PAD
LR, CLIP, CENTER = 5e-4, 0.05, 0.05
BETAS = (0.9, 0.95)  # rlhf.optim.OptimizerConfig's defaults
LAYOUTS = {"tp2pp2": {"ranks": "0-3", "tp": 2, "pp": 2},
           "pp2dp2": {"ranks": "0-3", "pp": 2, "dp": 2, "reverse_pp": True}}
RECORDS = [("QX ZT", "abc", "A1"), ("PROMPT", "x", "XYZ!"), ("K", "hello world", "HELLO"),
           ("LONG PROMPT HERE", "ok", "NO"), ("AB", "zz", "z"), ("Q", "mixed Case", "MIXED"),
           ("R S T", "lower", "UP"), ("W", "a", "bb")]
MARGINS = [0.0, 0.5, 1.0, 0.0, 0.25, 2.0, 0.0, 0.75]


FP32, BF16 = PrecisionConfig(), PrecisionConfig(bf16=True)
EXACT_RUNS = {"tp2pp2": ("tp2pp2", None, FP32), "pp2dp2": ("pp2dp2", None, FP32),
              "tp2pp2-full": ("tp2pp2", "full", FP32), "pp2dp2-selective": ("pp2dp2", "selective", FP32),
              "tp2pp2-bf16": ("tp2pp2", None, BF16)}
"""The one-step exactness runs: (layout, --recompute-granularity, precision)."""


def _config(layout: str, iterations: int = 1, eval_interval: int = 1, global_batch: int = 8,
            recompute: str | None = None, precision: PrecisionConfig = PrecisionConfig(),
            **optimizer) -> RewardJobConfig:
    return RewardJobConfig(
        placement=PlacementConfig(overrides={TASK: LAYOUTS[layout]}), model=MODEL,
        run=RunConfig(iterations=iterations, seed=3),
        training=RewardTrainingConfig(global_batch_size=global_batch, micro_batch_size=2, center_rewards_coef=CENTER,
                                      eval_interval=eval_interval, recompute_granularity=recompute),
        optimizer=RewardOptimizerConfig(lr=LR, clip_grad=CLIP, **optimizer),
        data=RewardDataConfig(margin_field="margin"),
        logging=LoggingConfig(progress=False), precision=precision)


def _data(root: str) -> PreferenceDataset:
    """The 8 pairs (with margins), written to a JSONL file by rank 0 and read by every rank."""
    path = os.path.join(root, "pairs.jsonl")
    if dist.get_rank() == 0:
        with open(path, "w", encoding="utf-8") as f:
            for (prompt, chosen, rejected), margin in zip(RECORDS, MARGINS):
                f.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected, "margin": margin}) + "\n")
    dist.barrier()
    return PreferenceDataset(_config("tp2pp2").dataset_config(path), ByteTokenizer())


def _score(model, ids) -> torch.Tensor:
    """The value of an unsharded model at the last token of one unpadded sequence."""
    return stage_forward(model, torch.tensor([list(ids)]))[0, -1]


def _reference_loss(model, pairs) -> torch.Tensor:
    """Mean over pairs of -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2, each sequence scored alone."""
    losses = []
    for p in pairs:
        chosen, rejected = _score(model, p.prompt + p.chosen), _score(model, p.prompt + p.rejected)
        losses.append(-torch.log(torch.sigmoid(chosen - rejected - p.margin)) + CENTER * (chosen + rejected) ** 2)
    return torch.stack(losses).mean()


def _reference_step(full: dict, pairs) -> dict:
    """One step of single-process PyTorch from ``full``; the loss before it and held-out metrics after it."""
    model = unsharded("value", MODEL, full)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.0)
    loss = _reference_loss(model, pairs)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    optimizer.step()
    with torch.no_grad():
        margins = [_score(model, p.prompt + p.chosen) - _score(model, p.prompt + p.rejected) for p in pairs]
        eval_loss = _reference_loss(model, pairs)
    return {"params": dict(model.named_parameters()), "loss": loss.item(), "grad_norm": norm,
            "eval_loss": float(eval_loss), "eval_accuracy": sum(float(m > 0) for m in margins) / len(pairs)}


def _exactness(data, full: dict) -> dict:
    out = {}
    for name, (layout, recompute, precision) in EXACT_RUNS.items():
        config = _config(layout, recompute=recompute, precision=precision)
        trainer = RewardTrainer(config, build_placement(config, dist.get_world_size()), data, PAD, data, full)
        metrics = trainer.step()
        after = trainer.full_weights()
        if dist.get_rank() == 0:
            ref = _reference_step(full, list(data))
            out[name] = {"recompute": trainer.model.config.recompute_granularity,
                         "max_diff": max((after[k] - ref["params"][k]).abs().max().item() for k in after),
                         "moved": max((after[k] - full[k]).abs().max().item() for k in after),
                         "names": sorted(after) == sorted(ref["params"]), "metrics": metrics,
                         "reference": {k: v for k, v in ref.items() if k != "params"}}
    return out


RESUME_OPTIMIZER = dict(use_distributed_optimizer=True, lr_warmup_iters=1, lr_decay_style="cosine", lr_decay_iters=6)


def _resume(data, full: dict, root: str) -> tuple[dict, dict]:
    """4 steps straight vs 2, save, 2 more in a fresh trainer that loads; returns results and trained weights."""
    config = _config("pp2dp2", iterations=4, eval_interval=2, global_batch=4, **RESUME_OPTIMIZER)
    placement = build_placement(config, dist.get_world_size())
    fresh = lambda: RewardTrainer(config, placement, data, PAD, data, full)  # noqa: E731
    straight = fresh()
    metrics = [straight.step() for _ in range(4)]
    first = fresh()
    for _ in range(2):
        first.step()
    first.save(root)
    resumed = fresh()
    resumed.load(root)
    loaded_at = resumed.iteration
    metrics_resumed = [resumed.step() for _ in range(2)]
    resumed.save(root)
    a, b = straight.full_weights(), resumed.full_weights()
    return ({"loaded_at": loaded_at, "straight_metrics": metrics[2:], "resumed_metrics": metrics_resumed,
             "resume_param_diff": max((a[k] - b[k]).abs().max().item() for k in a),
             "resume_moved": max((a[k] - full[k]).abs().max().item() for k in a)}, b)


def _as_ppo_reward_model(data, trained: dict, root: str) -> dict:
    """A PPO Trainer whose reward model is ``--reward-model root`` scores the pairs on reward_inf TP2."""
    config = JobConfig(models=ModelsConfig(actor=MODEL, critic=MODEL, reward=MODEL, weights={"reward": root}),
                       generation=GenerationConfig(max_prompt_len=16, max_response_len=16),
                       ppo=PPOConfig(rollout_batch_size=4, n_samples_per_prompt=2, ppo_mini_batch_size=8,
                                     micro_batch_size=2, advantage_estimator="grpo"),
                       placement=PlacementConfig(overrides={"reward_inf": {"ranks": "0-3", "tp": 2},
                                                            "critic_inf": None, "critic_train": None}))
    placement = build_ppo_placement(config, dist.get_world_size())
    trainer = Trainer(config, placement, prompts=None, tokenizer=ByteTokenizer(),
                      initial_weights={"reward": directory_weights(config, "reward")})
    batch = pair_batch(list(data), 0, PAD)  # as PPO samples: the engine's log-probs fix the response width
    batch = batch.with_fields(old_logprobs=torch.zeros(len(batch), int(batch.response_lengths.max())))
    scores = trainer.infer(batch).scores
    out = {}
    if dist.get_rank() == 0:
        model = unsharded("value", MODEL, trained)
        with torch.no_grad():
            ours = torch.stack([_score(model, p.prompt + a) for p in data for a in (p.chosen, p.rejected)])
        out = {"ppo_score_diff": (scores - ours).abs().max().item(), "scores": ours.tolist(),
               "rows": [list(p.prompt + a) for p in data for a in (p.chosen, p.rejected)]}
    return out


def _cached_reward_training(root: str) -> dict:
    """Part 5: each call's start-up line and whether its weights equal the first (fresh) training's bitwise."""
    from rlhf.data.synthetic import SyntheticPromptConfig, SyntheticPromptDataset
    from rlhf.ppo import job, reward_cache

    saved = job.SYNTHETIC_REWARD_STEPS, job.SYNTHETIC_HELD_OUT, os.environ.get(reward_cache.ENV)
    os.environ[reward_cache.ENV] = os.path.join(root, "cache")
    job.SYNTHETIC_REWARD_STEPS, job.SYNTHETIC_HELD_OUT = 4, 64
    config = JobConfig(models=ModelsConfig(actor=MODEL, critic=MODEL, reward=MODEL),
                       generation=GenerationConfig(max_prompt_len=16, max_response_len=16),
                       placement=PlacementConfig(overrides={"reward_inf": {"ranks": "0-3", "tp": 2}}))
    placement = build_ppo_placement(config, dist.get_world_size())
    dataset, tokenizer = SyntheticPromptDataset(SyntheticPromptConfig(max_length=16)), ByteTokenizer()
    out = {"lines": [], "equal": []}

    def call():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            weights = job.trained_reward_weights(config, dataset, tokenizer, placement)
        out["lines"].append(buf.getvalue().strip())
        return weights

    def entry_of(cfg):
        return reward_cache.load(lambda: job.reward_cache_fields(cfg, dataset, tokenizer, placement))[1]

    try:
        fresh = call()  # a miss: trained, written
        out["equal"].append(_bitwise_equal(call(), fresh))  # a hit
        if dist.get_rank() == 0:
            out["entries"] = sorted(os.listdir(os.environ[reward_cache.ENV]))
            key = reward_cache.cache_key(job.reward_cache_fields(config, dataset, tokenizer, placement))
            weights_path = reward_cache.entry_paths(key)[0]
            data = bytearray(weights_path.read_bytes())
            data[-1] ^= 1  # a flipped bit of the last tensor: safetensors alone would load it
            weights_path.write_bytes(bytes(data))
        out["equal"].append(_bitwise_equal(call(), fresh))  # trained again, rewritten
        out["equal"].append(_bitwise_equal(call(), fresh))  # a hit again
        if dist.get_rank() == 0:
            weights_path.write_bytes(weights_path.read_bytes()[:1000])
            out["truncated_read"] = reward_cache.read_entry(key)
        other = dataclasses.replace(config, run=dataclasses.replace(config.run, seed=config.run.seed + 1))
        out["other_seed"] = entry_of(other)
        os.environ[reward_cache.ENV] = "off"
        out["off"] = reward_cache.load(lambda: job.reward_cache_fields(config, dataset, tokenizer, placement))
    finally:
        job.SYNTHETIC_REWARD_STEPS, job.SYNTHETIC_HELD_OUT, directory = saved
        os.environ.pop(reward_cache.ENV)
        if directory is not None:
            os.environ[reward_cache.ENV] = directory
    return out


def _bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


def run(root: str) -> dict:
    build_task_groups(build_placement(_config("tp2pp2"), dist.get_world_size()))  # the one-rank groups of testing.models
    data = _data(root)
    out = {"exactness": _exactness(data, full_weights("value", MODEL, 101))}
    resume, trained = _resume(data, full_weights("value", MODEL, 202), os.path.join(root, "ckpt"))
    out.update(resume)
    out.update(_as_ppo_reward_model(data, trained, os.path.join(root, "ckpt")))
    out["hf"] = export_reward_model(os.path.join(root, "ckpt"), ByteTokenizer())
    out["cache"] = _cached_reward_training(root)
    return out
