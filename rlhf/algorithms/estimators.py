"""Advantage estimators, registered by name with one signature (owns the
registry and the GAE, GRPO, Dr. GRPO, RLOO, REINFORCE++ and REINFORCE++-baseline
estimators).

GAE and REINFORCE++ read the per-token rewards ``token_rewards``: the KL
penalty on every valid token plus the rewards at the tokens that earned them
(a single-turn sample's score at its last token; a multi-turn episode's
rewards at its turns' last tokens). The outcome estimators (grpo, dr-grpo,
rloo, reinforce++-baseline) build one advantage per sequence from its whole
score ``scores`` and broadcast it to every valid token, adding the reward-to-go
of the KL penalty alone (``kl_penalty``), as verl and OpenRLHF do; so a reward
earned at an intermediate turn counts once, in the score, for every token of
the episode (all zeros when the KL acts in the loss instead).

    @register_advantage_estimator("name")
    def fn(inputs: AdvantageInputs, config: AdvantageConfig) -> (advantages, returns)

Callers never branch on a name: ``compute_advantages(config.estimator, ...)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

import torch

from rlhf.algorithms.gae import compute_gae, discounted_returns
from rlhf.algorithms.losses import masked_whiten
from rlhf.config import ConfigError

if TYPE_CHECKING:
    from rlhf.batch import Batch


@dataclass(frozen=True)
class AdvantageConfig:
    """Estimator settings.

    estimator: registered name (``advantage_estimators()``).
    gamma, lam: discount and GAE lambda in [0, 1].
    whiten: whiten GAE advantages over the batch's valid tokens.
    norm_by_std: "grpo" divides by the group std (False = "dr-grpo").
    eps: added to the GRPO group std and inside the REINFORCE++(-baseline) whitening
        (GAE whitening keeps ``masked_whiten``'s own eps).
    """

    estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True
    norm_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"AdvantageConfig.{name}={value} must lie in [0, 1]", name)
        if self.eps <= 0:
            raise ConfigError(f"AdvantageConfig.eps={self.eps} must be > 0", "eps")


@dataclass(frozen=True)
class AdvantageInputs:
    """Per-batch inputs; an estimator uses the fields it needs.

    token_rewards: [B, T] per-token rewards (KL penalty + the rewards at the tokens that earned them; GAE
        and REINFORCE++).
    mask: [B, T] 0/1 valid response tokens.
    values: [B, T] critic values (GAE only).
    scores: [B] sequence scores: a multi-turn episode's is the sum of its rewards (the outcome estimators).
    kl_penalty: [B, T] the KL part of ``token_rewards`` alone (-kl_coef x KL per token; zeros when the KL is
        a loss term): the outcome estimators add its reward-to-go.
    group_index: [B] int64 prompt id of each sample (the outcome estimators: n samples per prompt).
    sample_mask: [B] 0/1, 0 for a sample out of training (its ``mask`` row is 0 too): the outcome
        estimators leave it out of its group's statistics; None: every sample counts.
    """

    token_rewards: torch.Tensor
    mask: torch.Tensor
    values: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    kl_penalty: Optional[torch.Tensor] = None
    group_index: Optional[torch.Tensor] = None
    sample_mask: Optional[torch.Tensor] = None

    @classmethod
    def from_batch(cls, batch: Batch, token_rewards: torch.Tensor, kl_penalty: torch.Tensor) -> AdvantageInputs:
        """Inputs of one ``rlhf.batch.Batch``: token_rewards and kl_penalty [N, R] (response-aligned like the
        batch), mask = ``batch.response_mask``, the batch's values, scores and sample_mask, group_index =
        ``batch.prompt_ids``."""
        mask = batch.response_mask
        for name, tensor in (("token_rewards", token_rewards), ("kl_penalty", kl_penalty)):
            if tensor.shape != mask.shape:
                raise ValueError(f"AdvantageInputs.from_batch: {name} shape {tuple(tensor.shape)}; "
                                 f"expected the batch's response shape {tuple(mask.shape)} [N, R]")
        # prompt_ids is host metadata; GRPO groups on the scores' device.
        group_index = batch.prompt_ids.to(mask.device, non_blocking=True)
        return cls(token_rewards, mask, values=batch.values, scores=batch.scores, kl_penalty=kl_penalty,
                   group_index=group_index, sample_mask=batch.sample_mask)

    def require(self, estimator: str, *names: str) -> None:
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(f"advantage estimator {estimator!r} needs AdvantageInputs fields {missing}")


Estimator = Callable[[AdvantageInputs, AdvantageConfig], Tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class RegisteredEstimator:
    """A registry entry: the function and whether it reads critic values (then the job places a critic)."""

    fn: Estimator
    needs_critic: bool


_ESTIMATORS: Dict[str, RegisteredEstimator] = {}


def register_advantage_estimator(name: str, *, needs_critic: bool = False) -> Callable[[Estimator], Estimator]:
    """Decorator registering ``fn(inputs, config) -> (advantages, returns)`` as ``name``; ``needs_critic``:
    it reads ``inputs.values``, so the job runs the critic's tasks."""

    def wrap(fn: Estimator) -> Estimator:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ESTIMATORS[name] = RegisteredEstimator(fn, needs_critic)
        return fn

    return wrap


def _entry(name: str) -> RegisteredEstimator:
    if name not in _ESTIMATORS:
        raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(_ESTIMATORS)}")
    return _ESTIMATORS[name]


def get_advantage_estimator(name: str) -> Estimator:
    """Registered estimator; KeyError lists the names that exist."""
    return _entry(name).fn


def estimator_needs_critic(name: str) -> bool:
    """Whether estimator ``name`` reads critic values; KeyError lists the names that exist."""
    return _entry(name).needs_critic


def advantage_estimators() -> Tuple[str, ...]:
    """Names of the registered estimators, sorted."""
    return tuple(sorted(_ESTIMATORS))


def compute_advantages(inputs: AdvantageInputs, config: AdvantageConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """Run ``config.estimator``: ([B, T] advantages, [B, T] returns), 0 at masked tokens."""
    return get_advantage_estimator(config.estimator)(inputs, config)


@register_advantage_estimator("gae", needs_critic=True)
def gae_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """GAE (matrix form) on the critic's values; returns are the critic targets."""
    inputs.require("gae", "values")
    advantages, returns = compute_gae(inputs.token_rewards, inputs.values, inputs.mask, config.gamma, config.lam)
    if config.whiten:
        advantages = masked_whiten(advantages, inputs.mask)
    return advantages, returns


def group_statistics(scores: torch.Tensor, group_index: torch.Tensor,
                     sample_mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, unbiased std and size of its group's scores ([B] each), over the samples
    ``sample_mask`` keeps (default: all; a dropped sample's own score is ignored, so it may be anything finite).

    Groups of one kept sample get mean 0 and std 1 (their score passes through), as do groups of none."""
    # unique() sizes its output from the data (a host sync on accelerators): once per batch.
    groups, inverse = torch.unique(group_index, return_inverse=True)

    def group_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(groups.shape[0], dtype=x.dtype, device=x.device).index_add_(0, inverse, x)[inverse]

    kept = torch.ones_like(scores) if sample_mask is None else sample_mask.to(scores.dtype)
    count = group_sum(kept)
    mean = group_sum(kept * scores) / count.clamp(min=1)
    std = (group_sum(kept * (scores - mean).square()) / (count - 1).clamp(min=1)).sqrt()
    single = count <= 1
    return torch.where(single, torch.zeros_like(mean), mean), torch.where(single, torch.ones_like(std), std), count


def kl_reward_to_go(inputs: AdvantageInputs) -> torch.Tensor:
    """[B, T] sum of ``kl_penalty`` from each valid token to the end (undiscounted; 0 when the KL is not in
    the rewards). Outcome estimators add it to their per-sequence advantage, as OpenRLHF does; no reward a
    turn earned is in it (that is in the score)."""
    return discounted_returns(inputs.kl_penalty.float(), inputs.mask, 1.0)


def outcome_advantages(inputs: AdvantageInputs, per_sequence: torch.Tensor) -> torch.Tensor:
    """[B] per-sequence advantage -> [B, T]: on every valid token, plus the KL
    reward-to-go; 0 at masked tokens."""
    advantages = per_sequence.unsqueeze(1) + kl_reward_to_go(inputs)
    return torch.where(inputs.mask > 0, advantages, torch.zeros((), device=advantages.device))


def group_normalised(inputs: AdvantageInputs, estimator: str, norm_by_std: bool, eps: float) -> torch.Tensor:
    """GRPO's [B, T] advantages: score - group mean, divided by (group std + eps) when ``norm_by_std``."""
    inputs.require(estimator, "scores", "group_index", "kl_penalty")
    scores = inputs.scores.float()
    mean, std, _ = group_statistics(scores, inputs.group_index, inputs.sample_mask)
    normalised = (scores - mean) / (std + eps) if norm_by_std else scores - mean
    return outcome_advantages(inputs, normalised)


@register_advantage_estimator("grpo")
def grpo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (score - group mean) / (group std + eps) on every valid token of the
    sample (+ the KL reward-to-go); no critic. Returns equal the advantages."""
    advantages = group_normalised(inputs, "grpo", config.norm_by_std, config.eps)
    return advantages, advantages


@register_advantage_estimator("dr-grpo")
def dr_grpo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al. 2025): score - group mean, no std division (+ the KL
    reward-to-go); pair it with the "seq-mean-token-sum-norm" loss aggregation."""
    advantages = group_normalised(inputs, "dr-grpo", False, config.eps)
    return advantages, advantages


@register_advantage_estimator("rloo")
def rloo_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): score - mean of the *other* samples of its
    group (+ the KL reward-to-go); a group of one keeps its score. No critic."""
    inputs.require("rloo", "scores", "group_index", "kl_penalty")
    scores = inputs.scores.float()
    mean, _, count = group_statistics(scores, inputs.group_index, inputs.sample_mask)
    others = torch.where(count > 1, (count * mean - scores) / (count - 1).clamp(min=1), torch.zeros_like(scores))
    advantages = outcome_advantages(inputs, scores - others)
    return advantages, advantages


@register_advantage_estimator("reinforce++-baseline")
def reinforce_pp_baseline_estimator(inputs: AdvantageInputs,
                                    config: AdvantageConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu et al. 2025): score - group mean (+ the KL
    reward-to-go), whitened over all valid tokens of the batch. Returns are the
    values before whitening."""
    returns = group_normalised(inputs, "reinforce++-baseline", False, config.eps)
    return masked_whiten(returns, inputs.mask, eps=config.eps), returns


@register_advantage_estimator("reinforce++")
def reinforce_pp_estimator(inputs: AdvantageInputs, config: AdvantageConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns of the per-token rewards (KL penalty
    included), whitened over all valid tokens of the batch; no critic."""
    returns = discounted_returns(inputs.token_rewards, inputs.mask, config.gamma)
    return masked_whiten(returns, inputs.mask, eps=config.eps), returns
