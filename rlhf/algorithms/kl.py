"""KL penalty (owns the per-token KL estimators, the KL coefficient controllers
and the per-token reward that GAE / REINFORCE++ consume).

Estimators of KL(pi || ref) from tokens sampled from pi, with
``log_ratio = logprobs - ref_logprobs`` (Schulman, "Approximating KL divergence"):

    k1 = log_ratio                          unbiased, can be negative
    k2 = 0.5 * log_ratio**2                 biased, low variance, >= 0
    k3 = exp(-log_ratio) - 1 + log_ratio    unbiased, low variance, >= 0

k3 is clamped as verl's "low_var_kl" (and OpenRLHF's k3): the log-ratio to
[-20, 20] before exp, the estimate to [-10, 10]. Values equal the unclamped
formula's wherever it is below 10; above, the token's estimate is 10 and its
gradient 0 (never inf or nan). k1 and k2 are not clamped (verl's are not).

The same estimate is the KL *loss term* of the actor (verl ``use_kl_loss``,
TRL ``beta``): call ``kl_estimate`` on the current log-probs (with grad); the
gradient then flows through ``logprobs`` only, as in the peers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Union

import torch

from rlhf.config import ConfigError

# verl's bounds (core_algos.kl_penalty_forward, "low_var_kl"); LOG_RATIO_BOUND also
# bounds the log-ratios of the policy loss and of TIS before exp.
LOG_RATIO_BOUND = 20.0
K3_MAX = 10.0


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    safe = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return (torch.expm1(-safe) + safe).clamp(-K3_MAX, K3_MAX)


KL_ESTIMATORS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda log_ratio: log_ratio,
    "k2": lambda log_ratio: 0.5 * log_ratio.square(),
    "k3": _k3,
}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate: the KL in the rewards (``token_rewards``)
    and, on current log-probs with grad, the per-token KL loss term.

    Args:
        logprobs, ref_logprobs: [B, T] log-probs of the sampled tokens under the
            policy and the reference model.
        estimator: "k1", "k2" or "k3" (module docstring).
    Returns:
        [B, T] float32 estimate (unmasked: aggregate it with the loss's mask and mode).
    """
    if estimator not in KL_ESTIMATORS:
        raise KeyError(f"unknown KL estimator {estimator!r}; known: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logprobs.float() - ref_logprobs.float())


@dataclass(frozen=True)
class KLConfig:
    """KL penalty settings.

    coef: initial (or fixed) coefficient beta >= 0.
    estimator: "k1" | "k2" | "k3".
    target: KL target per sequence for the adaptive controller; None = fixed coef.
    horizon: adaptive controller horizon in samples (Ziegler et al. 2019).
    """

    coef: float = 0.05
    estimator: str = "k1"
    target: Optional[float] = None
    horizon: int = 10000

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise ConfigError(f"KLConfig.coef={self.coef} must be >= 0; use 0 to disable the penalty", "coef")
        if self.estimator not in KL_ESTIMATORS:
            raise ConfigError(f"KLConfig.estimator={self.estimator!r} must be one of {sorted(KL_ESTIMATORS)}",
                              "estimator")
        if self.target is not None and self.target <= 0:
            raise ConfigError(f"KLConfig.target={self.target} must be > 0, or None for a fixed coefficient",
                              "target")
        if self.horizon <= 0:
            raise ConfigError(f"KLConfig.horizon={self.horizon} must be > 0 (samples)", "horizon")


class FixedKLController:
    """Constant coefficient. ``value`` is a 0-dim float tensor."""

    def __init__(self, coef: float):
        self.value = torch.tensor(float(coef))

    def update(self, current_kl: torch.Tensor, n_samples: int) -> None:
        """No-op (same signature as the adaptive controller)."""


class AdaptiveKLController:
    """Proportional controller to a KL target (Ziegler et al. 2019)::

        error = clip(kl / target - 1, -0.2, 0.2)
        beta *= 1 + error * n_samples / horizon

    Stays on tensors (no host sync); ``value`` is a 0-dim float tensor.
    """

    def __init__(self, coef: float, target: float, horizon: int):
        self.value = torch.tensor(float(coef))
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: torch.Tensor, n_samples: int) -> None:
        """current_kl: 0-dim mean per-sequence KL of the last batch; n_samples: its size."""
        error = (current_kl.detach().float() / self.target - 1.0).clamp(-0.2, 0.2)
        self.value = self.value * (1.0 + error * n_samples / self.horizon)


KLController = Union[FixedKLController, AdaptiveKLController]


def make_kl_controller(config: KLConfig) -> KLController:
    """Fixed controller when ``config.target`` is None, adaptive otherwise."""
    if config.target is None:
        return FixedKLController(config.coef)
    return AdaptiveKLController(config.coef, config.target, config.horizon)


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] 0/1 mask -> [B] int64 column of the last valid token (0 if none)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.zeros_like(positions)).amax(dim=1)


def scores_at_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence scores -> [B, T] float32: each score on its row's last valid
    token, 0 elsewhere (a row with no valid token gets none)."""
    valid = mask > 0
    placed = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    score = (scores.float() * valid.any(dim=1)).unsqueeze(1)
    return placed.scatter_(1, last_valid_index(mask).unsqueeze(1), score)


def token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: Union[float, torch.Tensor],
    estimator: str = "k1",
    placed: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token reward: -kl_coef * KL_t on every valid token, plus the sequence
    score on the last valid token, plus ``placed`` ([B, T] rewards already on
    their tokens: a multi-turn episode's per-turn rewards at each turn's end).

    Args:
        scores: [B] reward-model scores.
        logprobs, ref_logprobs: [B, T] sampled-token log-probs (policy, reference).
        mask: [B, T] 0/1 valid response tokens.
        kl_coef: float or 0-dim tensor (e.g. ``controller.value``).
        estimator: KL estimator name.
    Returns:
        (rewards [B, T] float32, kl [B, T] float32), both 0 at masked tokens.
        A row with no valid token gets no score.
    """
    kl = torch.where(mask > 0, kl_estimate(logprobs, ref_logprobs, estimator), torch.zeros((), device=mask.device))
    rewards = -kl_coef * kl + scores_at_last_token(scores, mask)
    return (rewards if placed is None else rewards + placed * (mask > 0)), kl
