"""Advantage-estimator registry and the estimators against plain loops (OpenRLHF's experience maker for the
outcome estimators: baseline on the scores, the KL penalty of the rewards summed from each token on), and
against verl's outcome estimators on multi-turn episodes, the numbers written out."""
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
    token_rewards,
)


def test_registry_lists_names_and_rejects_duplicates():
    assert {"gae", "grpo", "dr-grpo", "rloo", "reinforce++", "reinforce++-baseline"} <= set(advantage_estimators())
    with pytest.raises(KeyError, match=r"'gae', 'grpo', 'reinforce\+\+'"):
        get_advantage_estimator("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("gae")(lambda inputs, config: (None, None))


def test_grpo_group_normalisation_by_hand():
    scores = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0])
    groups = torch.tensor([7, 7, 3, 3, 9])  # last group has one sample
    mask = torch.tensor([[1, 1, 0]] * 5)
    rewards, _ = token_rewards(scores, torch.zeros(5, 3), torch.zeros(5, 3), mask, kl_coef=0.0)
    inputs = AdvantageInputs(rewards, mask=mask, scores=scores, group_index=groups, kl_penalty=torch.zeros(5, 3))
    adv, ret = compute_advantages(inputs, AdvantageConfig(estimator="grpo", eps=1e-6))
    per_sample = torch.tensor([-1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6), 0.0, 0.0, 5.0])
    torch.testing.assert_close(adv, per_sample[:, None] * mask)
    torch.testing.assert_close(ret, adv)
    unscaled, _ = compute_advantages(inputs, AdvantageConfig(estimator="grpo", norm_by_std=False))
    torch.testing.assert_close(unscaled[:, 0], torch.tensor([-1.0, 1.0, 0.0, 0.0, 5.0]))
    dr_grpo, _ = compute_advantages(inputs, AdvantageConfig(estimator="dr-grpo"))
    torch.testing.assert_close(dr_grpo, unscaled, rtol=0, atol=0)
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


SCORES = [1.0, 3.0, 2.0, 0.5, 4.0, 2.0, -1.0]
GROUPS = [7, 7, 7, 3, 3, 3, 9]  # the last group has one sample
BETA = 0.1


def _outcome_batch():
    """Scores, groups, a mask with holes and padding, and KL-penalised token rewards (k1, BETA)."""
    gen = torch.Generator().manual_seed(5)
    mask = (torch.rand(7, 6, generator=gen) > 0.25).long()
    mask[:, 0] = 1
    logp, ref = -torch.rand(7, 6, generator=gen), -torch.rand(7, 6, generator=gen)
    scores = torch.tensor(SCORES)
    rewards, kl = token_rewards(scores, logp, ref, mask, kl_coef=BETA, estimator="k1")
    return AdvantageInputs(rewards, mask, scores=scores, group_index=torch.tensor(GROUPS), kl_penalty=-BETA * kl), kl


def _loop_reference(kl, mask, per_sequence):
    """[B, T] per_sequence(i) - BETA * (sum of kl over valid tokens j >= t), on valid tokens."""
    out = torch.zeros(mask.shape)
    for i in range(mask.shape[0]):
        to_go = 0.0
        for t in reversed(range(mask.shape[1])):
            if mask[i, t]:
                to_go -= BETA * kl[i, t].item()
                out[i, t] = per_sequence(i) + to_go
    return out


def _group(i):
    """The scores of sample i's group, its own first."""
    return [SCORES[i]] + [SCORES[j] for j in range(len(SCORES)) if GROUPS[j] == GROUPS[i] and j != i]


def _minus_group_mean(i):
    group = _group(i)
    return SCORES[i] - sum(group) / len(group) if len(group) > 1 else SCORES[i]


def _minus_leave_one_out(i):
    others = _group(i)[1:]
    return SCORES[i] - sum(others) / len(others) if others else SCORES[i]


def _grpo(i, eps=AdvantageConfig().eps):
    group = torch.tensor(_group(i))
    return _minus_group_mean(i) / (group.std().item() + eps) if len(group) > 1 else SCORES[i]


def _whiten(x, mask, eps):
    valid = x[mask > 0]
    out = torch.zeros_like(x)
    out[mask > 0] = (valid - valid.mean()) / torch.sqrt(valid.var() + eps)
    return out


@pytest.mark.parametrize("estimator, per_sequence", [("rloo", _minus_leave_one_out), ("grpo", _grpo),
                                                     ("dr-grpo", _minus_group_mean)])
def test_outcome_estimators_match_the_loop(estimator, per_sequence):
    inputs, kl = _outcome_batch()
    adv, ret = compute_advantages(inputs, AdvantageConfig(estimator=estimator))
    torch.testing.assert_close(adv, _loop_reference(kl, inputs.mask, per_sequence))
    torch.testing.assert_close(ret, adv)
    # The KL in the rewards acts under every outcome estimator (GRPO used to ignore it).
    no_kl = AdvantageInputs(token_rewards(inputs.scores, kl, kl, inputs.mask, 0.0)[0], inputs.mask,
                            scores=inputs.scores, group_index=inputs.group_index, kl_penalty=torch.zeros_like(kl))
    assert not torch.allclose(compute_advantages(no_kl, AdvantageConfig(estimator=estimator))[0], adv)


def test_reinforce_pp_baseline_whitens_the_group_baseline_plus_the_kl_to_go():
    inputs, kl = _outcome_batch()
    config = AdvantageConfig(estimator="reinforce++-baseline")
    adv, ret = compute_advantages(inputs, config)
    want = _loop_reference(kl, inputs.mask, _minus_group_mean)
    torch.testing.assert_close(ret, want)
    torch.testing.assert_close(adv, _whiten(want, inputs.mask, config.eps), rtol=1e-5, atol=1e-5)


def test_grpo_leaves_dropped_samples_out_of_their_group_by_hand():
    """--skip-nonfinite-samples: sample 1 dropped leaves sample 0 alone in group 7 (its score passes through, as a
    group of one's does), group 3 keeps both, group 9's only sample is dropped: zeros, not NaN."""
    scores = torch.tensor([1.0, 0.0, 2.0, 4.0, 0.0])  # the dropped samples' scores are placeholders
    groups = torch.tensor([7, 7, 3, 3, 9])
    kept = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    mask = torch.tensor([[1, 1, 0]] * 5) * kept[:, None].long()
    rewards, _ = token_rewards(scores, torch.zeros(5, 3), torch.zeros(5, 3), mask, kl_coef=0.0)
    inputs = AdvantageInputs(rewards, mask=mask, scores=scores, group_index=groups, sample_mask=kept,
                             kl_penalty=torch.zeros(5, 3))
    adv, _ = compute_advantages(inputs, AdvantageConfig(estimator="grpo", eps=1e-6))
    per_sample = torch.tensor([1.0, 0.0, -1 / (math.sqrt(2) + 1e-6), 1 / (math.sqrt(2) + 1e-6), 0.0])
    torch.testing.assert_close(adv, per_sample[:, None] * mask)
    rloo, _ = compute_advantages(inputs, AdvantageConfig(estimator="rloo"))
    torch.testing.assert_close(rloo[:, 0], torch.tensor([1.0, 0.0, -2.0, 2.0, 0.0]))


KEPT = [1, 0, 1, 0, 0, 1, 0]
"""Which of SCORES' samples a run with --skip-nonfinite-samples keeps: group 7 two of three, group 3 one of three
(a group of one), group 9 none."""


def _inputs(scores, mask, logp, ref, values, groups, sample_mask=None):
    rewards, kl = token_rewards(scores, logp, ref, mask, kl_coef=BETA, estimator="k1")
    return AdvantageInputs(rewards, mask, values=values, scores=scores, group_index=groups, sample_mask=sample_mask,
                           kl_penalty=-BETA * kl)


@pytest.mark.parametrize("estimator", ["gae", "grpo", "dr-grpo", "rloo", "reinforce++", "reinforce++-baseline"])
def test_dropped_samples_train_as_if_absent(estimator):
    """Samples of sample_mask 0 (a placeholder score, their mask rows 0): the others' advantages and returns are
    those of the batch without them (whitening and group statistics alike), theirs are 0, and nothing is NaN."""
    gen = torch.Generator().manual_seed(6)
    mask = (torch.rand(7, 6, generator=gen) > 0.25).long()
    mask[:, 0] = 1
    logp, ref, values = -torch.rand(7, 6, generator=gen), -torch.rand(7, 6, generator=gen), torch.randn(7, 6)
    kept, rows = torch.tensor(KEPT, dtype=torch.float32), torch.tensor([i for i, k in enumerate(KEPT) if k])
    scores, groups = torch.tensor(SCORES), torch.tensor(GROUPS)
    config = AdvantageConfig(estimator=estimator)
    adv, ret = compute_advantages(_inputs(torch.where(kept > 0, scores, -7.0), mask * kept[:, None].long(), logp, ref,
                                          values, groups, kept), config)
    want_adv, want_ret = compute_advantages(_inputs(scores[rows], mask[rows], logp[rows], ref[rows], values[rows],
                                                    groups[rows]), config)
    torch.testing.assert_close(adv[rows], want_adv)
    torch.testing.assert_close(ret[rows], want_ret)
    assert not adv[kept == 0].any() and not ret[kept == 0].any() and adv.isfinite().all() and ret.isfinite().all()
    # the dropped samples would have moved the others: the check can tell
    assert not torch.allclose(compute_advantages(_inputs(scores, mask, logp, ref, values, groups), config)[0][rows],
                              want_adv)


EPS = AdvantageConfig().eps
A_MASK = [1, 1, 0, 0, 1, 1]  # A: a 2-token turn rewarded 1.0, a 2-token observation, a 2-token turn rewarded 0
B_MASK = [1, 1, 1, 1, 0, 0]  # B: one 4-token turn scored 0 (padded to A's width)
VERL = {  # verl's advantage on each model token of A and B (two samples of one prompt, scores 1 and 0)
    # grpo: (score - mean) / (std + eps), std unbiased: |1 - 0.5| / (sqrt(0.5) + eps)
    "grpo": (0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS)),
    "dr-grpo": (0.5, -0.5),  # score - mean
    "rloo": (1.0, -1.0),  # score - the mean of the other samples
    # score - mean on the 8 model tokens (four 0.5, four -0.5), whitened: x / sqrt(var + eps), var = 8 x 0.25 / 7
    "reinforce++-baseline": (0.5 / math.sqrt(2 / 7 + EPS), -0.5 / math.sqrt(2 / 7 + EPS)),
}


def _review_example(a_rewards: tuple) -> AdvantageInputs:
    """The review's two episodes as the trainer builds them (KL in the loss: no penalty in the rewards): A's turn
    rewards ``a_rewards`` at its turns' last tokens (columns 1 and 5), B's 0 at its turn's (column 3); each
    episode's score the sum of its rewards."""
    mask = torch.tensor([A_MASK, B_MASK])
    placed = torch.zeros(2, 6)
    placed[0, 1], placed[0, 5] = a_rewards
    rewards, kl = token_rewards(torch.zeros(2), torch.zeros(2, 6), torch.zeros(2, 6), mask, kl_coef=0.0,
                                placed=placed)
    return AdvantageInputs(rewards, mask, scores=torch.tensor([sum(a_rewards), 0.0]), group_index=torch.tensor([0, 0]),
                           kl_penalty=-0.0 * kl)


@pytest.mark.parametrize("estimator", sorted(VERL))
def test_multi_turn_rewards_count_once_on_every_model_token_as_verl(estimator):
    """A reward earned at turn 1 is in the episode's score, and the score's normalised advantage sits on every
    model token of the episode (turn 2's too), 0 at the observation; as verl's outcome estimators give."""
    inputs = _review_example((1.0, 0.0))
    adv, _ = compute_advantages(inputs, AdvantageConfig(estimator=estimator))
    a, b = VERL[estimator]
    want = torch.tensor([[a * m for m in A_MASK], [b * m for m in B_MASK]])
    torch.testing.assert_close(adv, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "dr-grpo", "rloo"])
def test_episodes_scoring_alike_get_no_advantage(estimator):
    """Both episodes score 1.0 (A earns it after turn 1 and 0 at the end): every advantage is 0."""
    inputs = _review_example((1.0, 0.0))
    inputs = AdvantageInputs(inputs.token_rewards, inputs.mask, scores=torch.tensor([1.0, 1.0]),
                             group_index=inputs.group_index, kl_penalty=inputs.kl_penalty)
    adv, _ = compute_advantages(inputs, AdvantageConfig(estimator=estimator))
    assert torch.equal(adv, torch.zeros(2, 6)), adv
