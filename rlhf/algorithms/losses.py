"""PPO losses and their metrics (owns masked statistics, advantage whitening,
loss aggregation and its DP-exact numerator / denominator, the clipped policy
and value losses, truncated importance sampling of the rollout policy), and
the reward model's pairwise preference loss. The entropy bonus is
vocabulary-parallel: rlhf.models.logprobs.vocab_parallel_logprobs_entropy.

All inputs are [B, T] per-token tensors with a 0/1 ``mask`` of valid response
tokens; every metric is returned as a 0-dim tensor (no host sync here).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from rlhf.algorithms.kl import LOG_RATIO_BOUND, kl_estimate

Metrics = Dict[str, torch.Tensor]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Sum of ``x`` over valid entries (masked entries may hold inf/nan)."""
    kept = torch.where(mask > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``x`` over valid entries; 0 where there are none."""
    count = (mask > 0).sum() if dim is None else (mask > 0).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all valid entries (0-dim)."""
    count = (mask > 0).sum()
    centered = x - masked_mean(x, mask)
    total = masked_sum(centered.square(), mask)
    return total / (count - 1 if unbiased else count).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over valid entries; 0 at masked entries.

    Args:
        x: [B, T]; mask: [B, T] 0/1.
        shift_mean: False keeps the mean (only rescales), as some PPO variants do.
    Returns:
        [B, T] whitened tensor.
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask > 0, whitened, torch.zeros((), dtype=whitened.dtype, device=x.device))


# Per mode: the numerator (additive over sequences, so a micro-batch's adds up to
# the mini-batch's) and what the denominator counts in the mini-batch's
# per-sequence valid-token counts ``lengths``.
_NUMERATORS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token-mean": masked_sum,
    "seq-mean-token-mean": lambda loss, mask: masked_mean(loss, mask, dim=1).sum(),
    "seq-mean-token-sum": masked_sum,
    "seq-mean-token-sum-norm": masked_sum,
}
_COUNTS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "token-mean": lambda lengths: lengths.sum(),
    "seq-mean-token-mean": lambda lengths: (lengths > 0).sum(),
    "seq-mean-token-sum": lambda lengths: (lengths > 0).sum(),
    "seq-mean-token-sum-norm": lambda lengths: (lengths > 0).sum(),
}
LOSS_AGGREGATIONS = tuple(_NUMERATORS)


def _check_mode(mode: str) -> None:
    if mode not in _NUMERATORS:
        raise KeyError(f"unknown loss aggregation {mode!r}; known: {list(LOSS_AGGREGATIONS)}")


def loss_numerator(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """The part of an aggregated loss one micro-batch contributes (0-dim, with grad).

    Sum over valid tokens, except "seq-mean-token-mean": sum over sequences of
    each sequence's token mean (an empty sequence adds 0). Summed over all
    micro-batches and DP ranks it is the whole mini-batch's numerator.

    Args:
        loss: [B, T] per-token loss (masked entries may hold inf/nan); mask: [B, T] 0/1.
    """
    _check_mode(mode)
    return _NUMERATORS[mode](loss, mask)


def loss_denominator(lengths: torch.Tensor, mode: str = "token-mean",
                     norm_length: Optional[int] = None) -> torch.Tensor:
    """The global denominator of a mini-batch (0-dim float, >= 1).

    "token-mean": valid tokens; "seq-mean-token-mean" / "seq-mean-token-sum":
    sequences with at least one valid token (verl); "seq-mean-token-sum-norm"
    (Dr. GRPO): those sequences x the constant ``norm_length`` (e.g. the
    maximum response length).

    Args:
        lengths: [N] valid-token counts of every sequence of the mini-batch, over
            all DP ranks (``mask.sum(1)`` of the whole mini-batch).
        norm_length: required by "seq-mean-token-sum-norm", ignored otherwise.
    """
    _check_mode(mode)
    count = _COUNTS[mode](torch.as_tensor(lengths)).float().clamp(min=1)
    if mode != "seq-mean-token-sum-norm":
        return count
    if norm_length is None or norm_length < 1:
        raise ValueError(f"loss aggregation {mode!r} needs norm_length >= 1 (a constant such as the maximum "
                         f"response length); got {norm_length}")
    return count * norm_length


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
                   denominator: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar: ``loss_numerator`` / ``loss_denominator``.

    Modes: "token-mean" (sum over valid tokens / token count), "seq-mean-token-mean"
    (mean over sequences of each sequence's token mean), "seq-mean-token-sum"
    (mean over sequences of each sequence's token sum), "seq-mean-token-sum-norm"
    (token sum / (sequences x T), T = the mask's width, as verl's default).
    ``denominator`` replaces the local one, e.g. with the global count of a
    data-parallel mini-batch (``loss_denominator``).
    """
    if denominator is None:
        denominator = loss_denominator((mask > 0).sum(dim=1), mode, norm_length=mask.shape[1])
    return loss_numerator(loss, mask, mode) / denominator


def policy_loss_per_token(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    dual_clip: Optional[float] = None,
) -> Tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate per token, optionally dual-clipped (Ye et al. 2020).

    loss_t = max(-A r, -A clip(r, 1 - eps, 1 + eps_high)), r = exp(clamp(logp - old_logp, -20, 20))
    (verl's and OpenRLHF's clamp: one token with a huge log-ratio gives a finite
    loss and zero gradient); with dual_clip = c > 1, tokens with A < 0 are
    further capped at -c A.

    Args:
        logprobs: [B, T] current policy log-probs (with grad).
        old_logprobs: [B, T] log-probs at sampling time.
        advantages: [B, T].
        mask: [B, T] 0/1 valid tokens (for the metrics).
        clip_eps, clip_eps_high: lower / upper clip range (high defaults to low).
        dual_clip: constant c > 1, or None.
    Returns:
        (losses [B, T], unmasked; metrics: clipfrac, dual_clipfrac, approx_kl,
        ratio_mean, ratio_max over valid tokens).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (or None to disable)")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + eps_high)
    losses = torch.maximum(unclipped, clipped)
    dual_clipped = torch.zeros_like(losses, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (losses > cap)
        losses = torch.where(advantages < 0, torch.minimum(losses, cap), losses)
    valid_ratio = torch.where(mask > 0, ratio, torch.zeros((), dtype=ratio.dtype, device=ratio.device))
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).float(), mask).detach(),
        "dual_clipfrac": masked_mean(dual_clipped.float(), mask).detach(),
        # KL(old || new) with the k3 estimator on tokens sampled from the old policy.
        "approx_kl": masked_mean(kl_estimate(old_logprobs, logprobs, "k3"), mask).detach(),
        "ratio_mean": masked_mean(ratio, mask).detach(),
        "ratio_max": valid_ratio.amax().detach(),
    }
    return losses, metrics


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                agg: str = "token-mean", **clip) -> Tuple[torch.Tensor, Metrics]:
    """``policy_loss_per_token(..., **clip)`` (``clip_eps``, ``clip_eps_high``, ``dual_clip``) reduced by
    ``aggregate_loss(..., agg)`` on this batch alone: (loss 0-dim, metrics)."""
    losses, metrics = policy_loss_per_token(logprobs, old_logprobs, advantages, mask, **clip)
    return aggregate_loss(losses, mask, agg), metrics


def truncated_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, cap: float,
    level: str = "token",
) -> Tuple[torch.Tensor, Metrics]:
    """Truncated importance sampling of the train-inference mismatch (TIS; verl's
    ``rollout_is`` / ``rollout_is_threshold``, formerly ``tis_imp_ratio_cap``).

    "token": w_t = min(exp(old_t - rollout_t), cap); "sequence": every token of a
    sequence gets w = min(exp(sum over its valid tokens of (old - rollout)), cap),
    the product of its token ratios, capped. Log-ratios are clamped to [-20, 20]
    before exp (verl). Multiply the per-token policy loss by ``w`` before aggregating.

    Args:
        old_logprobs: [B, T] the trainer's log-probs of the sampled tokens (before the update).
        rollout_logprobs: [B, T] the generation engine's log-probs of the same tokens.
        mask: [B, T] 0/1 valid tokens; cap: C > 0; level: "token" | "sequence".
    Returns:
        (weights [B, T], detached, 0 at masked tokens; metrics: tis_weight_mean,
        tis_capped_fraction, both over valid tokens).
    """
    if cap <= 0:
        raise ValueError(f"TIS cap={cap} must be > 0")
    if level not in ("token", "sequence"):
        raise ValueError(f"TIS level={level!r} must be 'token' or 'sequence'")
    log_ratio = (old_logprobs.float() - rollout_logprobs.float()).detach()
    if level == "sequence":
        log_ratio = masked_sum(log_ratio, mask, dim=1).unsqueeze(1).expand_as(log_ratio)
    raw = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    weights = torch.where(mask > 0, raw.clamp(max=cap), torch.zeros((), device=raw.device))
    return weights, {"tis_weight_mean": masked_mean(weights, mask),
                     "tis_capped_fraction": masked_mean((raw > cap).float(), mask)}


def value_loss_per_token(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: Optional[float] = 0.2,
) -> Tuple[torch.Tensor, Metrics]:
    """Clipped value loss per token, 0.5 * max((V - R)^2, (V_clip - R)^2), with
    V_clip = V_old + clip(V - V_old, -eps, eps); ``clip_eps=None`` disables clipping.

    Args:
        values: [B, T] current critic values (with grad); old_values: [B, T] at
            sampling time; returns: [B, T] targets; mask: [B, T] 0/1.
    Returns:
        (losses [B, T], unmasked; metrics: vf_clipfrac, value_mean over valid tokens).
    """
    unclipped = (values - returns).square()
    if clip_eps is None:
        losses, clipfrac = unclipped, torch.zeros((), device=values.device)
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped = (clipped_values - returns).square()
        losses = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean((clipped > unclipped).float(), mask).detach()
    return 0.5 * losses, {"vf_clipfrac": clipfrac, "value_mean": masked_mean(values, mask).detach()}


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: Optional[float] = 0.2,
    agg: str = "token-mean",
) -> Tuple[torch.Tensor, Metrics]:
    """``value_loss_per_token`` reduced by ``aggregate_loss(..., agg)`` on this batch alone:
    (loss 0-dim, metrics)."""
    losses, metrics = value_loss_per_token(values, old_values, returns, mask, clip_eps)
    return aggregate_loss(losses, mask, agg), metrics


def preference_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | float = 0.0,
                    center_coef: float = 0.0) -> torch.Tensor:
    """Pairwise Bradley-Terry loss of a reward model, per pair.

    loss_i = -log sigmoid(r_c - r_r - m) + center_coef * (r_c + r_r)^2: the
    negative log-likelihood that the chosen answer wins by at least the margin
    m (Llama 2's margin), plus reward centering (Eisenstein et al. 2023), which
    pulls the scores' mean towards 0 without changing their order.

    Args:
        chosen, rejected: [P] scores of each pair's answers (with grad).
        margin: [P] or a float; center_coef: >= 0 (0: off).
    Returns:
        [P] losses (mean them over the pairs for a batch loss).
    """
    loss = -F.logsigmoid(chosen - rejected - margin)
    return loss + center_coef * (chosen + rejected).square() if center_coef else loss
