"""Rule rewards: ``--reward-fn MODULE:FUNCTION`` loaded, checked, scored on rank 0 and shared, described.

A reward function is ``fn(prompts, responses) -> scores``: token-id lists in,
one finite number per sample out (a response may end with the EOS id), the
signature of rlhf.data.synthetic.gold_reward. Without a reward model its
score is the reward; with one it is logged beside the model's score as
``gold_reward_mean`` (``JobConfig.has_reward_model``). The synthetic task's
function defaults to its gold rule. Rank 0 calls the function once per
batch and broadcasts the scores, or why they are unusable, so a function
that raises, or is not deterministic, cannot split the ranks: every
refusal is a ConfigError naming ``reward.reward_fn`` on every rank.

A score that is NaN or infinite, from the function or the reward model,
stops the run, unless ``--skip-nonfinite-samples``
(``reward.skip_nonfinite_samples``): then its sample is dropped from
training (``drop_nonfinite_samples``) and counted.
"""

from __future__ import annotations

import math
import numbers
import traceback
from typing import Callable

import torch
import torch.distributed as dist

from rlhf.batch import Batch
from rlhf.config import ConfigError, import_named
from rlhf.parallel.exchange import first_rank
from rlhf.ppo.config import JobConfig

RewardFn = Callable[[list, list], list]
"""``fn(prompts, responses) -> scores``: token-id lists in, one float per sample out."""

SYNTHETIC_RULE = "rlhf.data.synthetic:gold_reward"
"""The synthetic task's reward function (its gold rule)."""


def reward_fn_spec(config: JobConfig) -> str | None:
    """``--reward-fn``; else the synthetic task's gold rule, or None with prompt data or an environment or
    agent (whose rewards are the reward)."""
    synthetic = config.data.prompt_data is None and config.generation.multi_turn is None
    return config.reward.reward_fn or (SYNTHETIC_RULE if synthetic else None)


def job_reward_fn(config: JobConfig) -> RewardFn | None:
    """The job's reward function (``reward_fn_spec``), loaded; None when it has none."""
    spec = reward_fn_spec(config)
    return load_reward_fn(spec) if spec else None


def load_reward_fn(spec: str) -> RewardFn:
    """The function ``module:function`` names (ConfigError naming ``reward.reward_fn`` if there is none)."""
    fn = import_named(spec, "reward.reward_fn", "MODULE:FUNCTION")
    if not callable(fn):
        raise ConfigError(f"{spec} is a {type(fn).__name__}, not a function", "reward.reward_fn")
    return fn


def describe_rewards(config: JobConfig) -> str:
    """One line for the log: what the reward is and what is logged beside it."""
    spec = reward_fn_spec(config)
    if config.generation.environment is not None:
        return f"reward: the environment's rewards ({config.generation.environment}), summed over each episode"
    if config.generation.agent is not None:
        return f"reward: what the agent ({config.generation.agent}) returns for each episode"
    if not config.has_reward_model:
        return f"reward: {spec} (no reward model: reward_inf does not run)"
    where = config.models.weights.get("reward", "trained on the synthetic task's preference pairs")
    return f"reward: the reward model's score ({where})" + (f"; gold_reward_mean: {spec}" if spec else "")


def checked_scores(fn: RewardFn, prompts: list, responses: list, nonfinite_ok: bool = False) -> list[float]:
    """``fn(prompts, responses)`` as one float per sample; a ConfigError (``reward.reward_fn``) says what
    went wrong when it raises or returns anything else (a list, tuple or array of finite numbers; NaN and
    infinity pass with ``nonfinite_ok``, for ``--skip-nonfinite-samples`` to drop)."""
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
    try:
        scores = fn(prompts, responses)
    except Exception as exc:  # noqa: BLE001 -- whatever user code raises is reported against its flag
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise ConfigError(f"{name} raised {type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})",
                          "reward.reward_fn") from None
    scores = scores.tolist() if hasattr(scores, "tolist") else scores  # a numpy array or torch tensor
    if not isinstance(scores, (list, tuple)) or len(scores) != len(prompts):
        got = f"{len(scores)} score(s)" if isinstance(scores, (list, tuple)) else f"a {type(scores).__name__}"
        raise ConfigError(f"{name} returned {got} for {len(prompts)} samples; it must return a list of one "
                          "number per sample", "reward.reward_fn")
    for i, score in enumerate(scores):
        number = isinstance(score, numbers.Real) and not isinstance(score, bool)
        if not number or not (nonfinite_ok or math.isfinite(score)):
            raise ConfigError(f"{name} returned {score!r} for sample {i}; every score must be a "
                              f"{'' if nonfinite_ok else 'finite '}number", "reward.reward_fn")
    return [float(score) for score in scores]


def function_scores(fn: RewardFn, batch: Batch, group=None, nonfinite_ok: bool = False) -> torch.Tensor:
    """[N] float32 scores of ``fn`` on the batch (``checked_scores``), the same on every rank of ``group``
    (default: all; collective: its first rank calls it and broadcasts the scores or the ConfigError's
    message, which every rank then raises)."""
    box, first = [None], first_rank(group)
    if dist.get_rank() == first:
        try:
            box = [checked_scores(fn, *prompts_and_responses(batch), nonfinite_ok)]
        except ConfigError as exc:
            box = [str(exc)]
    dist.broadcast_object_list(box, src=first, group=group)
    if isinstance(box[0], str):
        raise ConfigError(box[0], "reward.reward_fn")
    return torch.tensor(box[0], dtype=torch.float32, device=batch.tokens.device)


def check_model_scores(batch: Batch) -> None:
    """Stop the run when the reward model scored a sample NaN or infinite (every rank holds the same scores,
    so every rank raises the same line): one line naming the model and the first such samples."""
    bad = (~torch.isfinite(batch.scores)).nonzero().flatten().tolist()
    if bad:
        where = ", ".join(f"{i} (prompt {batch.prompt_ids[i]}, sample {batch.sample_indices[i]}): "
                          f"{batch.scores[i].item()}" for i in bad[:5])
        raise RuntimeError(f"the reward model scored {len(bad)} of {len(batch)} samples non-finite, e.g. sample "
                           f"{where}; its weights or inputs hold NaN or infinity (--reward-model)")


def drop_nonfinite_samples(batch: Batch) -> Batch:
    """``--skip-nonfinite-samples``: the batch with ``sample_mask`` 0 (and score 0, a finite placeholder) for each
    sample whose score is NaN or infinite, 1 for the others; the batch keeps its shape, so it still divides over
    the data-parallel replicas, while the dropped samples train nothing (rlhf.batch.Batch.sample_mask)."""
    kept = torch.isfinite(batch.scores)
    mask = kept.float() if batch.sample_mask is None else batch.sample_mask * kept
    return batch.with_fields(scores=torch.where(kept, batch.scores, torch.zeros_like(batch.scores)), sample_mask=mask)


def prompts_and_responses(batch: Batch) -> tuple[list, list]:
    """The batch's prompts and responses as token-id lists (what a reward function reads)."""
    rows = batch.tokens.tolist()
    p, r = batch.prompt_lengths.tolist(), batch.response_lengths.tolist()
    return [row[:a] for row, a in zip(rows, p)], [row[a:a + b] for row, a, b in zip(rows, p, r)]
