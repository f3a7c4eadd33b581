"""PPO losses, KL penalty and masked statistics against hand-computed values and the peers' formulas."""
import math

import pytest
import torch

from rlhf.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    aggregate_loss,
    kl_estimate,
    loss_denominator,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    policy_loss,
    token_rewards,
    value_loss,
    value_loss_per_token,
)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    log2 = math.log(2.0)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([[log2]]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([[0.5 * log2**2]]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([[0.5 - 1.0 + log2]]))
    with pytest.raises(KeyError, match="k1"):
        kl_estimate(logp, ref, "k4")


def _verl_low_var_kl(logprob, ref_logprob):
    """verl core_algos.kl_penalty_forward(..., "low_var_kl"), written out."""
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def _openrlhf_k3(log_probs, log_probs_base):
    """OpenRLHF models/utils.compute_approx_kl(..., "k3"), written out."""
    log_ratio = log_probs - log_probs_base
    return ((-log_ratio).exp() - 1 + log_ratio).clamp(min=-10, max=10)


def test_k3_is_clamped_as_verl_and_openrlhf():
    log_ratio = torch.tensor([-200.0, -89.0, -30.0, -20.5, -3.0, -0.1, 0.0, 0.2, 5.0, 11.5, 25.0, 200.0],
                             dtype=torch.float64)
    ref = torch.linspace(-3.0, -0.5, log_ratio.numel(), dtype=torch.float64)
    logp = (ref + log_ratio).requires_grad_()
    ours = kl_estimate(logp.double(), ref, "k3")
    torch.testing.assert_close(ours, _verl_low_var_kl(logp, ref).float())
    finite = log_ratio > -80  # OpenRLHF's k3 overflows exp() below that; its value is then the clamp, 10
    torch.testing.assert_close(ours[finite], _openrlhf_k3(logp, ref)[finite].float())
    assert ours.max() == 10.0 and ours.min() == 0.0
    # The KL loss term's gradient (verl use_kl_loss with "low_var_kl"): d k3 / d logp = 1 - exp(ref - logp)
    # where k3 < 10, and 0 where it is clamped; never inf or nan.
    (grad,) = torch.autograd.grad(ours.sum(), logp)
    (want,) = torch.autograd.grad(_verl_low_var_kl(logp, ref).sum(), logp)
    torch.testing.assert_close(grad, want)
    inside = _verl_low_var_kl(logp, ref).detach() < 10
    torch.testing.assert_close(grad[inside], 1 - torch.exp(-log_ratio[inside]))
    assert (grad[~inside] == 0).all()


def test_kl_loss_term_gradients_of_k1_and_k2():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    (k1,) = torch.autograd.grad(kl_estimate(logp, ref, "k1").sum(), logp)
    (k2,) = torch.autograd.grad(kl_estimate(logp, ref, "k2").sum(), logp)
    torch.testing.assert_close(k1, torch.ones(1, 3))
    torch.testing.assert_close(k2, logp.detach() - ref)


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
    torch.testing.assert_close(metrics["ratio_mean"], torch.tensor(1.0))
    torch.testing.assert_close(metrics["ratio_max"], torch.tensor(1.5))  # not the masked 9.0
    loss.backward()
    assert logp.grad[0, 2] == 0 and torch.isfinite(logp.grad).all()
    assert all(v.dim() == 0 for v in metrics.values())


def test_policy_loss_clamps_the_log_ratio():
    # One token with log-ratio 95 and a negative advantage: exp(95) overflows float32, so an
    # unclamped loss is inf; clamped as verl to 20 before exp, the loss is exp(20) * |A| and the
    # gradient is 0 there (the other token still trains).
    logp = torch.tensor([[95.0, 0.1]], requires_grad=True)
    advantages = torch.tensor([[-1.0, 1.0]])
    loss, metrics = policy_loss(logp, torch.zeros(1, 2), advantages, torch.ones(1, 2))
    want = (math.exp(20.0) - math.exp(0.1)) / 2  # token 1: ratio exp(0.1) < 1.2, so -A r
    torch.testing.assert_close(loss, torch.tensor(want))
    torch.testing.assert_close(metrics["ratio_max"], torch.tensor(math.exp(20.0)))
    assert torch.isfinite(metrics["approx_kl"])
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -math.exp(0.1) / 2]]))


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
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the empty row counts in no denominator
    torch.testing.assert_close(aggregate_loss(loss, mask, "token-mean"), torch.tensor(10.0 / 4))
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean"), torch.tensor((2.0 + 4.0) / 2))
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum"), torch.tensor((6.0 + 4.0) / 2))
    # Dr. GRPO: token sums over a constant (sequences x the mask's width, verl's default).
    torch.testing.assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum-norm"), torch.tensor(10.0 / (2 * 3)))
    global_count = torch.tensor(8.0)  # e.g. tokens of the whole DP mini-batch
    torch.testing.assert_close(aggregate_loss(loss, mask, "token-mean", denominator=global_count), torch.tensor(10.0 / 8))
    with pytest.raises(KeyError, match="token-mean"):
        aggregate_loss(loss, mask, "sum")
    with pytest.raises(ValueError, match="norm_length >= 1"):
        loss_denominator(torch.tensor([3, 1]), "seq-mean-token-sum-norm")


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.1]])
    old = torch.tensor([[0.0, 1.0]])
    returns = torch.tensor([[0.5, 0.0]])
    loss, metrics = value_loss(values, old, returns, torch.ones(1, 2), clip_eps=0.2)
    # Token 0: unclipped 0.25 > clipped (0.2 - 0.5)^2; token 1: clipped (0.8 - 0)^2 = 0.64 wins.
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.25 + 0.64) / 2))
    torch.testing.assert_close(metrics["vf_clipfrac"], torch.tensor(0.5))
    per_token, _ = value_loss_per_token(values, old, returns, torch.ones(1, 2), clip_eps=0.2)
    torch.testing.assert_close(per_token, torch.tensor([[0.5 * 0.25, 0.5 * 0.64]]))
    unclipped, _ = value_loss(values, old, returns, torch.ones(1, 2), clip_eps=None)
    torch.testing.assert_close(unclipped, torch.tensor(0.5 * (0.25 + 0.01) / 2))


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
