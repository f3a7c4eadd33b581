"""PPO losses, KL penalty and masked statistics against hand-computed values."""
import math

import pytest
import torch

from rlhf.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    aggregate_loss,
    entropy_from_logits,
    kl_estimate,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    policy_loss,
    token_rewards,
    value_loss,
)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    log2 = math.log(2.0)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([[log2]]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([[0.5 * log2**2]]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([[0.5 - 1.0 + log2]]))
    with pytest.raises(KeyError, match="k1"):
        kl_estimate(logp, ref, "k4")


def test_token_rewards_add_score_at_last_valid_token():
    logp = torch.tensor([[0.0, -1.0, -2.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ref = torch.zeros(3, 4)
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0]])  # row 0 has a hole, row 2 is empty
    rewards, kl = token_rewards(torch.tensor([5.0, 7.0, 9.0]), logp, ref, mask, kl_coef=0.1, estimator="k1")
    want = torch.tensor([[0.0, 0.1, 0.0, 5.0], [0.1 + 7.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, want)
    torch.testing.assert_close(kl, torch.tensor([[0.0, -1.0, 0.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.0] * 4]))


def test_kl_controllers():
    assert isinstance(make_kl_controller(KLConfig(coef=0.1)), FixedKLController)
    ctl = make_kl_controller(KLConfig(coef=0.1, target=1.0, horizon=100))
    assert isinstance(ctl, AdaptiveKLController)
    ctl.update(torch.tensor(2.0), n_samples=10)  # error clipped to +0.2
    torch.testing.assert_close(ctl.value, torch.tensor(0.1 * (1 + 0.2 * 10 / 100)))
    ctl.update(torch.tensor(0.9), n_samples=10)  # error -0.1
    torch.testing.assert_close(ctl.value, torch.tensor(0.1 * 1.02 * (1 - 0.1 * 10 / 100)))
    with pytest.raises(ValueError, match="KLConfig.target"):
        KLConfig(target=0.0)


def test_policy_loss_by_hand():
    # Token 0: A=1, r=1.5 -> clipped at 1.2; token 1: A=-1, r=0.5 -> clipped at 0.8;
    # token 2 is masked and holds junk.
    advantages = torch.tensor([[1.0, -1.0, 1e6]])
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 9.0]])).requires_grad_()
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = policy_loss(logp, old, advantages, mask, clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 0.8) / 2))
    torch.testing.assert_close(metrics["clipfrac"], torch.tensor(1.0))
    # KL(old || new) from old samples, k3: r - 1 - log r with r = new / old.
    want_kl = ((1.5 - 1 - math.log(1.5)) + (0.5 - 1 - math.log(0.5))) / 2
    torch.testing.assert_close(metrics["approx_kl"], torch.tensor(want_kl))
    higher, _ = policy_loss(logp, old, advantages, mask, clip_eps=0.2, clip_eps_high=0.28)
    torch.testing.assert_close(higher, torch.tensor((-1.28 + 0.8) / 2))  # clip-higher: r capped at 1.28
    loss.backward()
    assert logp.grad[0, 2] == 0 and torch.isfinite(logp.grad).all()
    assert all(v.dim() == 0 for v in metrics.values())


def test_dual_clip_caps_negative_advantage_losses():
    advantages = torch.tensor([[-1.0, 1.0]])
    logp = torch.log(torch.tensor([[5.0, 5.0]]))
    mask = torch.ones(1, 2)
    plain, _ = policy_loss(logp, torch.zeros(1, 2), advantages, mask, clip_eps=0.2)
    dual, metrics = policy_loss(logp, torch.zeros(1, 2), advantages, mask, clip_eps=0.2, dual_clip=3.0)
    torch.testing.assert_close(plain, torch.tensor((5.0 - 1.2) / 2))  # A<0 unclipped: -A r = 5
    torch.testing.assert_close(dual, torch.tensor((3.0 - 1.2) / 2))  # capped at -c A = 3
    torch.testing.assert_close(metrics["dual_clipfrac"], torch.tensor(0.5))
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, logp, advantages, mask, dual_clip=1.0)


def test_aggregation_modes():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(aggregate_loss(loss, mask, "token-mean"), torch.tensor(10.0 / 4))
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean"), torch.tensor((2.0 + 4.0) / 2))
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum"), torch.tensor((6.0 + 4.0) / 2))
    global_count = torch.tensor(8.0)  # e.g. tokens of the whole DP mini-batch
    torch.testing.assert_close(aggregate_loss(loss, mask, "token-mean", denominator=global_count), torch.tensor(10.0 / 8))
    with pytest.raises(KeyError, match="token-mean"):
        aggregate_loss(loss, mask, "sum")


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.1]])
    old = torch.tensor([[0.0, 1.0]])
    returns = torch.tensor([[0.5, 0.0]])
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 2), clip_eps=0.2)
    # Token 0: unclipped 0.25 > clipped (0.2 - 0.5)^2; token 1: clipped (0.8 - 0)^2 = 0.64 wins.
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.25 + 0.64) / 2))
    torch.testing.assert_close(metrics["vf_clipfrac"], torch.tensor(0.5))
    unclipped, _ = value_loss(values, old, returns, torch.ones(1, 2), clip_eps=None)
    torch.testing.assert_close(unclipped, torch.tensor(0.5 * (0.25 + 0.01) / 2))


def test_entropy_from_logits():
    logits = torch.randn(2, 3, 11)
    want = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logits(logits), want)
    uniform = torch.zeros(1, 1, 4)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.tensor([[math.log(4)]]))
    banned = torch.tensor([[[0.0, 0.0, -math.inf]]])
    torch.testing.assert_close(entropy_from_logits(banned), torch.tensor([[math.log(2)]]))


def test_masked_whiten_matches_valid_entry_statistics():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 6.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    valid = torch.tensor([1.0, 2.0, 3.0, 6.0])
    want = (valid - valid.mean()) / valid.std()  # unbiased, as the library
    got = masked_whiten(x, mask, eps=0.0)
    torch.testing.assert_close(got[mask > 0], want)
    assert (got[mask == 0] == 0).all()
    torch.testing.assert_close(masked_mean(x, mask), valid.mean())
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False, eps=0.0)[mask > 0], want + valid.mean())
