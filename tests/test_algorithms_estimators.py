"""Advantage-estimator registry and the GAE / GRPO / REINFORCE++ estimators."""
import math

import pytest
import torch

from rlhf.algorithms import (
    AdvantageConfig,
    AdvantageInputs,
    advantage_estimators,
    compute_advantages,
    compute_gae,
    get_advantage_estimator,
    masked_whiten,
    register_advantage_estimator,
)


def test_registry_lists_names_and_rejects_duplicates():
    assert {"gae", "grpo", "reinforce++"} <= set(advantage_estimators())
    with pytest.raises(KeyError, match=r"'gae', 'grpo', 'reinforce\+\+'"):
        get_advantage_estimator("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("gae")(lambda inputs, config: (None, None))


def test_grpo_group_normalisation_by_hand():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([7, 7, 3, 3, 9])  # last group has one sample
    mask = torch.tensor([[1, 1, 0]] * 5)
    inputs = AdvantageInputs(token_rewards=torch.zeros(5, 3), mask=mask, scores=scores, group_index=groups)
    adv, ret = compute_advantages(inputs, AdvantageConfig(estimator="grpo", eps=1e-6))
    per_sample = torch.tensor([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6), 0.0, 0.0, 5.0])
    torch.testing.assert_close(adv, per_sample[:, None] * mask)
    torch.testing.assert_close(ret, adv)
    unscaled, _ = compute_advantages(inputs, AdvantageConfig(estimator="grpo", norm_by_std=False))
    torch.testing.assert_close(unscaled[:, 0], torch.tensor([-1.0, 1.0, 0.0, 0.0, 5.0]))
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages(AdvantageInputs(torch.zeros(5, 3), mask, scores=scores), AdvantageConfig(estimator="grpo"))


def test_reinforce_pp_whitens_discounted_returns():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 0, 0]])
    gamma = 0.5
    # Hand: row 0 valid tokens (1, 2, 0): returns 1 + 0.5*2 = 2, 2, 0; row 1: 1.5, 3.
    want_returns = torch.tensor([[2.0, 0.0, 2.0, 0.0], [1.5, 3.0, 0.0, 0.0]])
    adv, ret = compute_advantages(AdvantageInputs(rewards, mask), AdvantageConfig(estimator="reinforce++", gamma=gamma))
    torch.testing.assert_close(ret, want_returns)
    valid = torch.tensor([2.0, 2.0, 0.0, 1.5, 3.0])
    torch.testing.assert_close(adv[mask > 0], (valid - valid.mean()) / (valid.std() + 1e-6), rtol=1e-4, atol=1e-5)


def test_gae_estimator_is_whitened_compute_gae():
    rewards, values = torch.randn(3, 9), torch.randn(3, 9)
    mask = torch.ones(3, 9)
    config = AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8)
    adv, ret = compute_advantages(AdvantageInputs(rewards, mask, values=values), config)
    raw, want_ret = compute_gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, masked_whiten(raw, mask))
    torch.testing.assert_close(ret, want_ret)
    with pytest.raises(ValueError, match="values"):
        compute_advantages(AdvantageInputs(rewards, mask), config)


def test_config_validation():
    with pytest.raises(ValueError, match="AdvantageConfig.lam"):
        AdvantageConfig(lam=1.5)
