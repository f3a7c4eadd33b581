"""The statistics of one iteration's samples that the trainer logs (docs/training.md, "Metrics").

Every rank holds the whole batch, so each computes the same numbers; counts come from rank 0 only
(``*_count`` keys are summed over the ranks that report them).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from rlhf.algorithms import kl_estimate, masked_mean, masked_var
from rlhf.batch import Batch
from rlhf.ppo.config import JobConfig
from rlhf.ppo.reward_fn import RewardFn, function_scores


def batch_metrics(batch: Batch, config: JobConfig, reward_fn: Optional[RewardFn]) -> dict:
    """Per-iteration statistics of the samples: rewards, lengths, truncation, advantages, returns, values,
    the samples dropped for non-finite scores, with recomputed log-probs how far the engine's are from the
    trainer's, and with both a reward model and ``reward_fn`` the function's mean as ``gold_reward_mean``."""
    lengths = batch.response_lengths.float()
    truncated = sum(reason == "length" for reason in batch.finish_reasons) / len(batch)
    out = {**reward_statistics(batch.scores, batch.sample_mask),
           "prompt_length_mean": batch.prompt_lengths.float().mean(), "response_length_mean": lengths.mean(),
           "response_length_min": lengths.min(), "response_length_max": lengths.max(),
           "truncated_fraction": float(truncated),
           **sample_statistics(batch), **episode_statistics(batch)}
    if config.ppo.recomputes_logprobs:
        out.update(rollout_mismatch(batch))
    if dist.get_rank() == 0:
        out.update(samples_count=float(len(batch)), tokens_count=lengths.sum())
    out["nonfinite_samples_dropped"] = 0.0 if batch.sample_mask is None else len(batch) - batch.sample_mask.sum()
    if reward_fn is not None and config.has_reward_model:
        gold = function_scores(reward_fn, batch, nonfinite_ok=config.reward.skip_nonfinite_samples)
        gold = reward_statistics(gold, batch.sample_mask)
        if gold:
            out["gold_reward_mean"] = gold["reward_mean"]
    return out


def reward_statistics(scores: torch.Tensor, sample_mask: Optional[torch.Tensor]) -> dict:
    """``reward_mean``, ``reward_std``, ``reward_min`` and ``reward_max`` of the samples trained on: with a
    ``sample_mask`` (``--skip-nonfinite-samples``) only of its kept samples' finite scores; none when none is left."""
    if sample_mask is not None:
        scores = scores[torch.isfinite(scores) & (sample_mask > 0)]  # a host sync on accelerators
        if not len(scores):
            return {}
    return {"reward_mean": scores.mean(), "reward_std": scores.std(correction=0), "reward_min": scores.min(),
            "reward_max": scores.max()}


def sample_statistics(batch: Batch) -> dict:
    """Means over the batch's response tokens: advantages (and their std), returns and, with a critic,
    values and the value function's explained variance 1 - Var(returns - values) / Var(returns)."""
    mask = batch.response_mask
    out = {"advantage_mean": masked_mean(batch.advantages, mask),
           "advantage_std": masked_var(batch.advantages, mask, unbiased=False).sqrt(),
           "return_mean": masked_mean(batch.returns, mask)}
    if batch.values is not None:
        unexplained = masked_var(batch.returns - batch.values, mask, unbiased=False)
        out.update(value_mean=masked_mean(batch.values, mask),
                   value_explained_variance=1 - unexplained / masked_var(batch.returns, mask, unbiased=False).clamp(
                       min=1e-8))
    return out


def episode_statistics(batch: Batch) -> dict:
    """A multi-turn run's (``batch.loss_mask`` set) statistics per episode: ``turns_mean`` (the model's turns:
    its runs of tokens between observations), ``multi_turn_fraction`` (episodes of two turns or more: a tool
    agent's tool-call rate) and ``observation_tokens_mean`` (the tokens that answered the model)."""
    if batch.loss_mask is None:
        return {}
    model = batch.response_mask
    turns = model[:, :1].sum(dim=1) + (model[:, 1:] * (1 - model[:, :-1])).sum(dim=1)
    inserted = batch.response_lengths.float().sum() - model.sum().cpu()
    return {"turns_mean": turns.mean(), "multi_turn_fraction": (turns >= 2).float().mean(),
            "observation_tokens_mean": inserted / len(batch)}


def rollout_mismatch(batch: Batch) -> dict:
    """How far the engine's rollout log-probs are from the trainer's recomputed ones on the response tokens:
    ``mismatch_kl``, the mean k3 estimate of KL(rollout || trainer) per token (NeMo-RL's gen_kl_error, 0
    when they agree), and ``mismatch_logprob_abs_max``, the largest |difference|."""
    mask = batch.response_mask
    diff = batch.old_logprobs - batch.rollout_logprobs
    return {"mismatch_kl": masked_mean(kl_estimate(batch.rollout_logprobs, batch.old_logprobs, "k3"), mask),
            "mismatch_logprob_abs_max": (diff.abs() * mask).max()}
