"""GRPO with the KL as a loss term, built from the library's pieces (the grpo / dr-grpo estimator, the
per-token clipped policy loss, the k3 KL term and the loss aggregation), equals TRL's GRPO objective
(trl/trainer/grpo_trainer.py ``_compute_loss``, written out below) on a fixed batch: loss and gradient."""
import pytest
import torch

from rlhf.algorithms import (
    AdvantageConfig,
    AdvantageInputs,
    compute_advantages,
    kl_estimate,
    loss_denominator,
    loss_numerator,
    policy_loss_per_token,
    token_rewards,
)

GROUP = 3  # completions per prompt, contiguous as TRL lays them out
BETA, EPSILON = 0.04, 0.2
MAX_COMPLETION_LENGTH = 6
LENGTHS = [4, 2, 3, 1, 4, 3]
SCORES = [1.0, 0.0, 0.5, 2.0, -1.0, 2.0]

# TRL loss_type -> (our estimator, our loss aggregation); "dapo" is "bnpo" with the token count of the
# whole accumulated batch, which one batch is here.
TRL_LOSS_TYPES = {"grpo": ("grpo", "seq-mean-token-mean"), "bnpo": ("grpo", "token-mean"),
                  "dapo": ("grpo", "token-mean"), "dr_grpo": ("dr-grpo", "seq-mean-token-sum-norm")}


def _batch():
    gen = torch.Generator().manual_seed(2)
    mask = (torch.arange(4)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    logp = (-torch.rand(6, 4, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(6, 4, generator=gen, dtype=torch.float64)  # some ratios clip
    ref = logp.detach() + 0.5 * torch.randn(6, 4, generator=gen, dtype=torch.float64)
    return logp, old, ref, mask


def _trl_loss(logp, old, ref, mask, loss_type):
    """TRL's GRPO loss (num_iterations > 1, so old log-probs are given; importance_sampling_level "token")."""
    rewards = torch.tensor(SCORES, dtype=torch.float64)
    mean_grouped = rewards.view(-1, GROUP).mean(dim=1).repeat_interleave(GROUP)
    advantages = rewards - mean_grouped
    if loss_type != "dr_grpo":  # scale_rewards="group"; Dr. GRPO recommends "none"
        advantages = advantages / (rewards.view(-1, GROUP).std(dim=1).repeat_interleave(GROUP) + 1e-4)
    advantages = advantages.unsqueeze(1)
    per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - EPSILON, 1 + EPSILON)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages) + BETA * per_token_kl
    if loss_type == "grpo":
        return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type in ("bnpo", "dapo"):
        return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * MAX_COMPLETION_LENGTH)


def _our_loss(logp, old, ref, mask, estimator, mode):
    scores = torch.tensor(SCORES)
    rewards, _ = token_rewards(scores, old, ref, mask, kl_coef=0.0)  # the KL is in the loss, not the rewards
    inputs = AdvantageInputs(rewards, mask, scores=scores, group_index=torch.arange(6) // GROUP,
                             kl_penalty=torch.zeros_like(rewards))
    advantages, _ = compute_advantages(inputs, AdvantageConfig(estimator=estimator, eps=1e-4))
    policy, _ = policy_loss_per_token(logp, old, advantages.double(), mask, clip_eps=EPSILON)
    per_token = policy + BETA * kl_estimate(logp, ref, "k3")
    denominator = loss_denominator(mask.sum(dim=1), mode, norm_length=MAX_COMPLETION_LENGTH)
    return loss_numerator(per_token, mask, mode) / denominator


@pytest.mark.parametrize("loss_type", TRL_LOSS_TYPES)
def test_grpo_with_kl_loss_equals_trl(loss_type):
    logp, old, ref, mask = _batch()
    want = _trl_loss(logp, old, ref, mask, loss_type)
    (want_grad,) = torch.autograd.grad(want, logp)
    got = _our_loss(logp, old, ref, mask, *TRL_LOSS_TYPES[loss_type])
    (got_grad,) = torch.autograd.grad(got, logp)
    # float32 inside the library (advantages, the KL estimate); float64 in TRL's formula here.
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    ratio = torch.exp(logp - old)[mask > 0]
    assert ((ratio < 1 - EPSILON) | (ratio > 1 + EPSILON)).any()  # the clip is exercised

