"""Truncated importance sampling of the train-inference mismatch (TIS) against a plain loop."""
import math

import pytest
import torch

from rlhf.algorithms import policy_loss_per_token, truncated_is_weights

CAP = 2.0


def _inputs():
    gen = torch.Generator().manual_seed(11)
    rollout = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3
    old = rollout + torch.randn(3, 5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0]])
    return old, rollout, mask


def _loop(old, rollout, mask, level):
    """w = min(pi_old / pi_rollout, C) per token, or per sequence from the product of its token ratios."""
    weights = torch.zeros(old.shape, dtype=torch.float64)
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t]]
        product = math.prod(math.exp(old[i, t] - rollout[i, t]) for t in valid)
        for t in valid:
            ratio = math.exp(old[i, t] - rollout[i, t]) if level == "token" else product
            weights[i, t] = min(ratio, CAP)
    return weights


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_match_the_loop(level):
    old, rollout, mask = _inputs()
    weights, metrics = truncated_is_weights(old, rollout, mask, CAP, level)
    want = _loop(old, rollout, mask, level)
    torch.testing.assert_close(weights, want.float())
    torch.testing.assert_close(metrics["tis_weight_mean"], want[mask > 0].mean().float())
    assert 0 < metrics["tis_capped_fraction"] < 1  # some weights are capped, some are not


def test_weights_are_a_detached_multiplier_of_the_policy_loss():
    old, rollout, mask = _inputs()
    logprobs = old.clone().requires_grad_()
    weights, _ = truncated_is_weights(logprobs, rollout, mask, CAP)
    assert not weights.requires_grad
    advantages = torch.ones_like(old)
    losses, _ = policy_loss_per_token(logprobs, old, advantages, mask)
    (grad,) = torch.autograd.grad((losses * weights * mask).sum(), logprobs)
    # At ratio 1 the clipped loss's gradient is -A per token, scaled by the weight.
    torch.testing.assert_close(grad, -weights.double())


def test_extreme_mismatch_stays_finite_and_bad_arguments_are_named():
    old = torch.tensor([[100.0, -100.0]])
    weights, _ = truncated_is_weights(old, torch.zeros(1, 2), torch.ones(1, 2), CAP, "token")
    torch.testing.assert_close(weights, torch.tensor([[CAP, math.exp(-20.0)]]))  # log-ratio clamped to +-20
    with pytest.raises(ValueError, match="cap=0"):
        truncated_is_weights(old, old, torch.ones(1, 2), 0)
    with pytest.raises(ValueError, match="'seq'"):
        truncated_is_weights(old, old, torch.ones(1, 2), CAP, "seq")
