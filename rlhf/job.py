"""What ``pretrain_rlhf.py`` runs: the prompts, the tokenizer and the starting weights, then the Trainer.

The built-in tiny default needs no files: the synthetic task's prompts and
gold rule (rlhf/data/synthetic.py), the byte tokenizer, random actor and
critic weights, and a reward model fitted at start-up to the gold rule
(rlhf/reward_fit.py). The fit runs once, on rank 0, on an unsharded model;
its full weights are broadcast and loaded into reward_inf's layout.
"""

from __future__ import annotations

import torch.distributed as dist

from rlhf.config import JobConfig
from rlhf.data import ByteTokenizer, PromptBatchIterator
from rlhf.data.synthetic import GOLD_TARGET_IDS, SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
from rlhf.models.gpt import build_model
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.parallel.reshard import gather_tp_full_weights
from rlhf.reward_fit import RewardFitConfig, fit_reward_model
from rlhf.trainer import MODEL_SEEDS, Trainer


def build_trainer(config: JobConfig, placement) -> Trainer:
    """The Trainer of the built-in synthetic task (collective: every rank calls it)."""
    tokenizer = ByteTokenizer()
    dataset = SyntheticPromptDataset(SyntheticPromptConfig(
        seed=config.run.seed, max_length=config.generation.max_prompt_len))
    prompts = PromptBatchIterator(dataset, config.ppo.rollout_batch_size, seed=config.run.seed)
    reward = fitted_reward_weights(config, dataset, tokenizer, placement)
    return Trainer(config, placement, prompts, tokenizer, initial_weights={"reward": reward}, gold_fn=gold_reward)


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
