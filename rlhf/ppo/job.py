"""What ``pretrain_rlhf.py`` runs: the tokenizer, the prompts, the starting weights and the reward source,
then the Trainer (docs/training.md, "Models, tokenizer, prompts and rewards").

- tokenizer: ``--tokenizer`` (byte or an HF directory); by default the actor
  directory's with ``--prompt-data``, else the byte tokenizer. Its ids must
  fit the actor's vocabulary (a preset's vocabulary is its ids).
- prompts: ``--prompt-data`` through rlhf.data.PromptDataset, else the
  synthetic task's seeded prompts.
- starting weights: a model given as a directory is read by
  rlhf/checkpoint/sources.py, lazily: the Trainer asks for the tensors of the
  stage each rank holds, one model at a time. Other models start from seeded
  random weights; the reference as a copy of the actor's start; a reward model
  without weights is trained at start-up on the synthetic task's preference
  pairs (rlhf/reward_model/trainer.py, the pairwise Bradley-Terry loss, on the
  reward_inf mesh; its full weights are then on every rank). With ``--load``
  none of this is read or trained: the checkpoint holds every model.
- rewards: the reward model, ``--reward-fn`` or both (JobConfig.has_reward_model;
  rlhf/ppo/reward_fn.py); the synthetic task's function defaults to its gold rule.

Every refusal is a ConfigError naming its field, raised alike on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.checkpoint.sources import ModelSourceError, open_source, read_weights
from rlhf.config import ConfigError, LoggingConfig, RunConfig
from rlhf.data import (PreferenceDataset, PreferenceDatasetConfig, PromptBatchIterator, PromptDataError,
                       PromptDataset, Tokenizer, checked_tokenizer)
from rlhf.data.synthetic import SyntheticPromptConfig, SyntheticPromptDataset, preference_pairs
from rlhf.ppo import reward_cache
from rlhf.ppo.arguments import tokenizer_name
from rlhf.ppo.config import JobConfig
from rlhf.ppo.reward_fn import describe_rewards, job_reward_fn
from rlhf.ppo.trainer import Trainer
from rlhf.reward_model.config import RewardJobConfig, RewardOptimizerConfig, RewardTrainingConfig
from rlhf.reward_model.trainer import RewardTrainer
from rlhf.tasks import MODEL_SEEDS


def build_trainer(config: JobConfig, placement) -> Trainer:
    """The Trainer of ``config`` (collective: every rank calls it)."""
    tokenizer = job_tokenizer(config)
    dataset = prompt_dataset(config, tokenizer)
    prompts = prompt_batches(config, dataset)
    reward_fn = job_reward_fn(config)
    # a resumed run takes every model's weights from the checkpoint, but a LoRA model's frozen base (its
    # checkpoint holds only what it trains, and refuses a base that differs from the one it was trained on)
    resumed = config.checkpoint.load is not None
    weights = {model: directory_weights(config, model) for model in config.models.weights
               if not resumed or config.lora.for_model(model) is not None}
    if not resumed:
        if config.has_reward_model and "reward" not in weights:
            weights["reward"] = trained_reward_weights(config, dataset, tokenizer, placement)
    if dist.get_rank() == 0:
        print(describe_rewards(config), flush=True)
        if platform.slow_half_precision(config.precision.dtype):
            print(f"warning: --{config.precision.name} on this CPU, which lacks {config.precision.name} matrix "
                  "instructions: its products run 5-170x slower than fp32's (docs/real_model.md); drop the flag "
                  "for CPU runs", flush=True)
    return Trainer(config, placement, prompts, tokenizer, initial_weights=weights, reward_fn=reward_fn)


def job_tokenizer(config: JobConfig) -> Tokenizer:
    """``--tokenizer`` or its default (rlhf.ppo.arguments.tokenizer_name, which also gave the preset models
    their vocabulary), refused when its ids do not fit the actor's vocabulary."""
    return checked_tokenizer(tokenizer_name(config.data, config.models.weights), config.models.actor.vocab_size,
                             "the actor", "--actor-model")


def prompt_dataset(config: JobConfig, tokenizer: Tokenizer):
    """The prompts of ``--prompt-data``, else the synthetic task's."""
    if config.data.prompt_data is None:
        return SyntheticPromptDataset(SyntheticPromptConfig(seed=config.run.seed,
                                                            max_length=config.generation.max_prompt_len))
    try:
        dataset = PromptDataset(config.prompt_dataset_config(), tokenizer)
    except PromptDataError as exc:
        raise ConfigError(str(exc), "data.prompt_data") from None
    if dist.get_rank() == 0:
        print(dataset.stats.summary(), flush=True)
    return dataset


def prompt_batches(config: JobConfig, dataset) -> PromptBatchIterator:
    """``rollout_batch_size`` prompts per iteration, reshuffled every epoch."""
    size = config.ppo.rollout_batch_size
    if size > len(dataset):
        raise ConfigError(f"rollout_batch_size {size} is more than the {len(dataset)} usable prompts of "
                          f"{config.data.prompt_data}; lower it or give more prompts", "ppo.rollout_batch_size")
    return PromptBatchIterator(dataset, size, seed=config.run.seed)


def directory_weights(config: JobConfig, model: str):
    """``names -> full tensors`` of ``model``'s starting weights, read from its directory when asked."""
    source = _source(config, model)
    if source.config != config.models[model]:
        raise ConfigError(f"{source.path} holds a model of shape {source.config}; the job's {model} has "
                          f"{config.models[model]}", f"models.{model}")
    return functools.partial(read_weights, source, head_seed=config.run.seed + MODEL_SEEDS[model])


def _source(config: JobConfig, model: str):
    try:
        return open_source(config.models.weights[model], model)
    except ModelSourceError as exc:
        raise ConfigError(str(exc), f"models.{model}") from None


SYNTHETIC_REWARD = RewardTrainingConfig(global_batch_size=64, center_rewards_coef=0.01)
"""The tiny default's reward training: 64 preference pairs per step, reward centering (it keeps the scores
of the untrained actor's samples near 0, where the critic starts; measured in docs/reward_model.md)."""
SYNTHETIC_REWARD_STEPS = 300
SYNTHETIC_REWARD_LR = 3e-3
SYNTHETIC_HELD_OUT = 512


def trained_reward_weights(config: JobConfig, dataset, tokenizer, placement) -> dict:
    """Full weights of a reward model trained on the synthetic task's preference pairs, on every rank
    (collective): rlhf/reward_model/trainer.py on the placement's reward_inf mesh, where PPO serves it; one
    micro-batch per DP replica and step, AdamW with a cosine decay to 0, the held-out pairs scored last.

    Cached (rlhf/ppo/reward_cache.py: ``$RLHF_CACHE_DIR``, else ``$XDG_CACHE_HOME/rlhf`` or
    ``~/.cache/rlhf``; ``RLHF_CACHE_DIR=off`` always trains): a run whose key (reward_cache_fields)
    matches an earlier one's loads its weights instead of training."""
    reward, steps = synthetic_reward_config(config, placement), SYNTHETIC_REWARD_STEPS
    key, entry = reward_cache.load(lambda: reward_cache_fields(config, dataset, tokenizer, placement))
    if entry is not None:
        if dist.get_rank() == 0:
            info = entry["info"]
            print(f"reward model: {steps} steps on {info['pairs']} synthetic preference pairs, cached "
                  f"({entry['path']}); held-out ({info['held_out']} pairs): accuracy {info['accuracy']:.3f}, "
                  f"loss {info['loss']:.3f}", flush=True)
        return entry["weights"]
    held_out, train = synthetic_preferences(config, dataset, tokenizer, steps * reward.training.global_batch_size)
    trainer = RewardTrainer(reward, placement, train, tokenizer.pad_id, held_out)
    start = time.perf_counter()
    for _ in range(steps):
        metrics = trainer.step()
    if dist.get_rank() == 0:
        print(f"reward model: {steps} steps on {len(train)} synthetic preference pairs in "
              f"{time.perf_counter() - start:.1f} s; held-out ({len(held_out)} pairs): accuracy "
              f"{metrics['eval_accuracy']:.3f}, loss {metrics['eval_loss']:.3f}", flush=True)
    weights = trainer.full_weights()
    reward_cache.store(key, weights, {"pairs": len(train), "held_out": len(held_out),
                                      "accuracy": metrics["eval_accuracy"], "loss": metrics["eval_loss"]})
    return weights


def synthetic_reward_config(config: JobConfig, placement) -> RewardJobConfig:
    """The reward training of trained_reward_weights."""
    dp, steps = placement["reward_inf"].strategy.dp, SYNTHETIC_REWARD_STEPS
    micro = -(-SYNTHETIC_REWARD.global_batch_size // dp)  # about 64 pairs a step whatever the dp
    return RewardJobConfig(
        model=config.models["reward"], run=RunConfig(iterations=steps, seed=config.run.seed + MODEL_SEEDS["reward"]),
        training=dataclasses.replace(SYNTHETIC_REWARD, global_batch_size=micro * dp, micro_batch_size=micro,
                                     eval_interval=steps),
        optimizer=RewardOptimizerConfig(lr=SYNTHETIC_REWARD_LR, lr_decay_style="cosine", lr_decay_iters=steps),
        logging=LoggingConfig(progress=False))


def reward_cache_fields(config: JobConfig, dataset, tokenizer, placement) -> dict:
    """What determines trained_reward_weights' result, for its cache key: the reward training's whole
    configuration (model, seed, batch sizes, optimizer, precision), the reward_inf mesh and world size, and
    the preference pairs' sources (the job's seed, the prompts' ids, the generation lengths, the tokenizer's
    special ids, the SYNTHETIC_* constants)."""
    mesh, reward = placement["reward_inf"], synthetic_reward_config(config, placement)
    prompts = hashlib.sha256(json.dumps([list(p.token_ids) for p in dataset]).encode()).hexdigest()
    return {"reward": reward, "model": reward.model.to_dict(),
            "reward_inf": {"ranks": mesh.ranks, "strategy": mesh.strategy, "reverse_pp": mesh.reverse_pp},
            "world_size": dist.get_world_size(), "seed": config.run.seed, "prompts": prompts,
            "max_prompt_len": config.generation.max_prompt_len, "max_response_len": config.generation.max_response_len,
            "tokenizer": {"class": type(tokenizer).__name__, "eos": tokenizer.eos_id, "bos": tokenizer.bos_id,
                          "pad": tokenizer.pad_id},
            "constants": {"training": SYNTHETIC_REWARD, "steps": SYNTHETIC_REWARD_STEPS,
                          "lr": SYNTHETIC_REWARD_LR, "held_out": SYNTHETIC_HELD_OUT}}


def synthetic_preferences(config: JobConfig, dataset, tokenizer, n: int) -> tuple:
    """(held-out, training) preference pairs of the synthetic task: the seed's first SYNTHETIC_HELD_OUT
    draws, then ``n`` more (rlhf.data.synthetic.preference_pairs over the reward model's whole vocabulary:
    for the tiny default's preset, the tokenizer's ids; responses as long as the actor's, a quarter ending
    with EOS)."""
    gen = torch.Generator().manual_seed(config.run.seed)
    prompts = [p.token_ids for p in dataset]
    model = config.models["reward"]
    out = []
    for name, count in (("synthetic-held-out", SYNTHETIC_HELD_OUT), ("synthetic-preferences", n)):
        pairs = preference_pairs(prompts, count, range(model.vocab_size), config.generation.max_response_len, gen,
                                 tokenizer.eos_id, eos_probability=0.25)
        out.append(PreferenceDataset.from_token_ids(pairs, PreferenceDatasetConfig(name, model.max_seq_len),
                                                    tokenizer.bos_id))
    return tuple(out)
