"""rlhf/ppo/update.py's losses without processes, and the loss options' refusals (rlhf/ppo/config/ppo.py).

What the trainer trains on: the actor's loss mask drops samples cut at the length budget with
``mask_truncated``; each aggregation's mini-batch denominator counts that mask over the whole
mini-batch; statistics are token-weighted means, maxima for ``*_max``; the logged loss of a step is the
mini-batch's aggregated loss under every aggregation, however it is split. DAPO's overlong penalty
against its formula. A combination of loss options that cannot act is refused, naming the flag. A model's
skipped steps in a row stop the run at --max-skipped-steps.
"""

import pytest
import torch

from rlhf.algorithms.losses import LOSS_AGGREGATIONS, value_loss_per_token
from rlhf.algorithms.shaping import overlong_penalty
from rlhf.batch import Batch
from rlhf.config import ConfigError
from rlhf.ppo.config import GenerationConfig, JobConfig, PPOConfig
from rlhf.ppo.update import ActorLoss, CriticLoss, combine_records, stop_after_skipped_steps

PAD = 0


def _batch(lengths: list, reasons: tuple) -> Batch:
    n, width = len(lengths), max(lengths) + 2
    ones = torch.ones(n, dtype=torch.int64)
    return Batch(tokens=torch.ones(n, width, dtype=torch.int64), pad_id=PAD, prompt_lengths=ones,
                 response_lengths=torch.tensor(lengths), prompt_ids=torch.arange(n), sample_indices=0 * ones,
                 finish_reasons=reasons)


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_the_actor_trains_on_truncated_samples_unless_masked(mask_truncated):
    batch = _batch([3, 1, 2], ("length", "stop", "length"))
    ppo = PPOConfig(mask_truncated=mask_truncated)
    actor, critic = ActorLoss(ppo, 16, 1.0, 0.0), CriticLoss(ppo, 16)
    expected = [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    if mask_truncated:
        expected = [[0, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert actor.mask(batch).tolist() == expected
    assert critic.mask(batch).tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]  # the critic learns every value


@pytest.mark.parametrize("mode,expected", [("token-mean", 6.0), ("seq-mean-token-mean", 3.0),
                                           ("seq-mean-token-sum", 3.0), ("seq-mean-token-sum-norm", 48.0)])
def test_the_denominator_counts_the_whole_minibatch(mode, expected):
    batch = _batch([3, 1, 2], ("stop", "stop", "length"))
    assert ActorLoss(PPOConfig(loss_agg=mode), 16, 1.0, 0.0).denominator(batch) == expected


def _written_out(per_token: torch.Tensor, mask: torch.Tensor, mode: str, max_response_len: int) -> float:
    """A [N, R] loss over a whole mini-batch as its aggregation's name says, one sequence at a time."""
    rows = [per_token[i][mask[i] > 0] for i in range(len(mask))]
    if mode == "token-mean":
        return float(torch.cat(rows).sum() / sum(len(r) for r in rows))
    sums = {"seq-mean-token-mean": [r.mean() for r in rows], "seq-mean-token-sum": [r.sum() for r in rows],
            "seq-mean-token-sum-norm": [r.sum() / max_response_len for r in rows]}[mode]
    return float(sum(sums) / len(rows))


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_the_logged_loss_is_the_minibatch_loss_however_it_is_split(mode):
    """Two DP shares of unequal tokens (samples {0, 3} and {1, 2, 4}), each in micro-batches of one or two
    samples: the shares the critic's loss records add up to the mini-batch's value loss as its aggregation
    defines it (seq-mean-token-sum-norm over --max-response-len 16, not the longest response), and what it
    backpropagates, after the executor's average over micro-batches x replicas, is that loss too."""
    lengths = [3, 1, 2, 5, 4]
    g = torch.Generator().manual_seed(2)
    batch = _batch(lengths, ("stop",) * 5)
    width = batch.response_width
    batch = batch.with_fields(values=torch.randn(5, width, generator=g), returns=torch.randn(5, width, generator=g))
    outputs = torch.randn(5, batch.tokens.shape[1], generator=g)  # the critic's value at every position
    loss = CriticLoss(PPOConfig(loss_agg=mode), 16)
    denominator = loss.denominator(batch)
    shares, backpropagated = ([0, 3], [1, 2, 4]), 0.0
    for share in shares:
        micro = [[i] for i in share[:-2]] + [share[-2:]] if len(share) > 2 else [[i] for i in share]
        averaged = len(micro) * len(shares)
        for members in micro:
            backpropagated += float(loss(outputs[members], batch.select(members), None, None, denominator, averaged)) / averaged
    mask = batch.response_mask
    per_token, _ = value_loss_per_token(batch.response_from_positions(outputs), batch.values, batch.returns, mask,
                                        clip_eps=PPOConfig().value_clip)
    want = _written_out(per_token, mask, mode, 16)
    assert float(loss.terms["value_loss"]) == pytest.approx(want, rel=1e-6)
    assert backpropagated == pytest.approx(want, rel=1e-6)


def test_statistics_are_token_weighted_and_maxima_stay_maxima():
    recorded = [(torch.tensor(3.0), {"a": torch.tensor(1.0), "ratio_max": torch.tensor(1.5)}),
                (torch.tensor(1.0), {"a": torch.tensor(5.0), "ratio_max": torch.tensor(1.2)})]
    combined = combine_records(recorded)
    assert combined["a"].item() == pytest.approx(2.0) and combined["ratio_max"].item() == pytest.approx(1.5)


def test_overlong_penalty_is_dapos_formula():
    lengths = torch.tensor([0, 12, 13, 14, 16])  # budget 16, buffer 4: from 12 tokens on the penalty grows to coef
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == pytest.approx([0, 0, -0.125, -0.25, -0.5])
    with pytest.raises(ValueError, match="buffer 17"):
        overlong_penalty(lengths, 16, 17, 1.0)


@pytest.mark.parametrize("fields,flag_field,message", [
    (dict(kl_target=1.0, kl_coef=0.0), "ppo.kl_target", "from kl_coef 0 it never moves"),
    (dict(tis_cap=2.0), "ppo.tis_cap", "needs|only --recompute-logprobs"),
    (dict(critic_warmup=2, advantage_estimator="grpo"), "ppo.critic_warmup", "has no critic"),
    (dict(kl_in="gradient"), "ppo.kl_in", "not one of auto, reward, loss"),
    (dict(loss_agg="mean"), "ppo.loss_agg", "not one of token-mean"),
    (dict(overlong_penalty="4"), "ppo.overlong_penalty", "LEN,COEF"),
    (dict(clip_eps=0.2, clip_eps_high=0.1), "ppo.clip_eps_high", "in \\[clip_eps, 10\\]"),
])
def test_options_that_cannot_act_are_refused(fields, flag_field, message):
    with pytest.raises(ConfigError, match=message) as exc:
        PPOConfig(**fields)
    assert exc.value.field_name == flag_field


def test_the_overlong_buffer_fits_the_budget_and_kl_placement_follows_the_estimator():
    with pytest.raises(ConfigError, match="longer than max_response_len 16") as exc:
        JobConfig(generation=GenerationConfig(max_response_len=16), ppo=PPOConfig(overlong_penalty="20,1"))
    assert exc.value.field_name == "ppo.overlong_penalty"
    assert PPOConfig(advantage_estimator="grpo").kl_in_loss and PPOConfig(advantage_estimator="dr-grpo").kl_in_loss
    assert not PPOConfig().kl_in_loss and not PPOConfig(advantage_estimator="grpo", kl_in="reward").kl_in_loss


def test_skipped_steps_in_a_row_stop_the_run_at_the_limit():
    """The reduced metrics' ``<model>_consecutive_skipped_steps`` against --max-skipped-steps (0: never); the
    iteration's ``<model>_skipped_steps`` does not count."""
    metrics = {"actor_consecutive_skipped_steps": 3.0, "actor_skipped_steps": 5.0,
               "critic_consecutive_skipped_steps": 0.0, "critic_skipped_steps": 5.0}
    for limit in (0, 4):
        stop_after_skipped_steps(metrics, limit)
    with pytest.raises(ConfigError) as exc:
        stop_after_skipped_steps(metrics, 3)
    assert exc.value.field_name == "ppo.max_skipped_steps"
    assert str(exc.value).startswith("actor: 3 optimizer steps in a row skipped for non-finite gradients (the limit "
                                     "is 3)")
