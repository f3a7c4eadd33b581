"""What ``pretrain_rlhf.py`` runs: the tokenizer, the prompts, the starting weights and the reward source,
then the Trainer (docs/training.md, "Models, tokenizer, prompts and rewards").

- tokenizer: ``--tokenizer`` (byte or an HF directory); by default the actor
  directory's with ``--prompt-data``, else the byte tokenizer. Its ids must
  fit the actor's vocabulary.
- prompts: ``--prompt-data`` through rlhf.data.PromptDataset, else the
  synthetic task's seeded prompts.
- starting weights: a model given as a directory is read by
  rlhf/checkpoint/sources.py, lazily: the Trainer asks for the tensors of the
  stage each rank holds, one model at a time. Other models start from seeded
  random weights; the reference as a copy of the actor's start; a reward model
  without weights is fitted at start-up to the synthetic task's gold rule (on
  rank 0, an unsharded model; its full weights are broadcast). With ``--load``
  none of this is read or fitted: the checkpoint holds every model.
- rewards: the reward model, ``--reward-fn`` or both (JobConfig.has_reward_model);
  the synthetic task's function defaults to its gold rule.

Every refusal is a ConfigError naming its field, raised alike on every rank.
"""

from __future__ import annotations

import functools
import importlib

import torch.distributed as dist

from rlhf.checkpoint.sources import ModelSourceError, open_source, read_weights
from rlhf.config import ConfigError, JobConfig
from rlhf.data import (PromptBatchIterator, PromptDataError, PromptDataset, Tokenizer, TokenizerError,
                       build_tokenizer)
from rlhf.data.synthetic import GOLD_TARGET_IDS, SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
from rlhf.models.gpt import build_model
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.parallel.reshard import gather_tp_full_weights
from rlhf.reward_fit import RewardFitConfig, fit_reward_model
from rlhf.trainer import MODEL_SEEDS, RewardFn, Trainer

SYNTHETIC_RULE = "rlhf.data.synthetic:gold_reward"


def build_trainer(config: JobConfig, placement) -> Trainer:
    """The Trainer of ``config`` (collective: every rank calls it)."""
    tokenizer = job_tokenizer(config)
    dataset = prompt_dataset(config, tokenizer)
    prompts = prompt_batches(config, dataset)
    reward_fn = job_reward_fn(config)
    weights = {}
    if config.checkpoint.load is None:  # a resumed run takes every model's weights from the checkpoint
        weights = {model: directory_weights(config, model) for model in config.models.weights}
        if config.has_reward_model and "reward" not in weights:
            weights["reward"] = fitted_reward_weights(config, dataset, tokenizer, placement)
    if dist.get_rank() == 0:
        print(describe_rewards(config), flush=True)
    return Trainer(config, placement, prompts, tokenizer, initial_weights=weights, reward_fn=reward_fn)


def job_tokenizer(config: JobConfig) -> Tokenizer:
    """``--tokenizer`` or its default, refused when its ids do not fit the actor's vocabulary."""
    name = config.data.tokenizer or default_tokenizer(config)
    try:
        tokenizer = build_tokenizer(name)
    except TokenizerError as exc:
        raise ConfigError(str(exc), "data.tokenizer") from None
    vocab = config.models.actor.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"tokenizer {name!r} has {tokenizer.vocab_size} ids, more than the actor's vocab_size="
                          f"{vocab} (--actor-model); give a tokenizer of the actor's vocabulary (--tokenizer) or an "
                          "actor whose vocabulary covers it (--actor-model)", "data.tokenizer")
    return tokenizer


def default_tokenizer(config: JobConfig) -> str:
    """The actor directory's tokenizer with prompt data, when it has one; else "byte"."""
    if config.data.prompt_data is None or "actor" not in config.models.weights:
        return "byte"
    return _source(config, "actor").tokenizer_dir() or "byte"


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


def reward_fn_spec(config: JobConfig) -> str | None:
    """``--reward-fn``; else the synthetic task's gold rule, or None with prompt data."""
    return config.reward.reward_fn or (SYNTHETIC_RULE if config.data.prompt_data is None else None)


def job_reward_fn(config: JobConfig) -> RewardFn | None:
    spec = reward_fn_spec(config)
    return load_reward_fn(spec) if spec else None


def load_reward_fn(spec: str) -> RewardFn:
    """The function ``module:function`` names (ConfigError naming ``reward.reward_fn`` if there is none)."""
    module_name, _, attribute = spec.partition(":")
    try:
        fn = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 -- importing user code can raise anything
        raise ConfigError(f"{spec}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); give "
                          "MODULE:FUNCTION of a module on the Python path", "reward.reward_fn") from None
    for part in attribute.split("."):
        if not hasattr(fn, part):
            raise ConfigError(f"{spec}: {fn.__name__!r} has no attribute {part!r}", "reward.reward_fn")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ConfigError(f"{spec} is a {type(fn).__name__}, not a function", "reward.reward_fn")
    return fn


def describe_rewards(config: JobConfig) -> str:
    """One line for the log: what the reward is and what is logged beside it."""
    spec = reward_fn_spec(config)
    if not config.has_reward_model:
        return f"reward: {spec} (no reward model: reward_inf does not run)"
    where = config.models.weights.get("reward", "fitted to the synthetic task's gold rule")
    return f"reward: the reward model's score ({where})" + (f"; gold_reward_mean: {spec}" if spec else "")


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


def fitted_reward_weights(config: JobConfig, dataset, tokenizer, placement) -> dict:
    """Full weights of a reward model fitted to the gold rule on rank 0, on every rank (collective)."""
    build_task_groups(placement)  # collective; makes the one-rank groups an unsharded model uses
    weights = [None]
    if dist.get_rank() == 0:
        local = local_groups()
        model = build_model(config.models["reward"], "value", local.pg_collection, local.stage,
                            seed=config.run.seed + MODEL_SEEDS["reward"])
        report = fit_reward_model(model, gold_reward, [p.token_ids for p in dataset],
                                  RewardFitConfig(seed=config.run.seed,
                                                  max_response_length=config.generation.max_response_len),
                                  target_ids=GOLD_TARGET_IDS, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
        print(report.summary(), flush=True)
        weights = [gather_tp_full_weights(model, local)]
    dist.broadcast_object_list(weights, src=0)
    return weights[0]
