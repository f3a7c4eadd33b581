"""Matrix-form GAE against the recursive loop (rlhf/testing/reference.py)."""
from itertools import product

import pytest
import torch

from rlhf.algorithms import compute_gae, discounted_returns, discounted_suffix_sum
from rlhf.testing.reference import gae_loop

SETTINGS = list(product([1.0, 0.99, 0.95, 0.0], repeat=2))  # (gamma, lam)


def random_batch(rows: int, length: int, seed: int):
    """fp32 rewards/values and a bool mask: mixed lengths (0 and T included),
    masked spans inside responses, junk (nan) at masked tokens."""
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(rows, length, generator=gen)
    values = torch.randn(rows, length, generator=gen)
    lengths = torch.randint(0, length + 1, (rows, 1), generator=gen)
    lengths[0], lengths[-1] = length, 0
    pos = torch.arange(length)
    start = torch.randint(0, length, (rows, 1), generator=gen)
    span = torch.randint(0, max(length // 4, 2), (rows, 1), generator=gen)
    holes = (pos >= start) & (pos < start + span) | (torch.rand(rows, length, generator=gen) < 0.1)
    mask = (pos < lengths) & ~holes
    rewards[~mask] = float("nan")
    values[~mask] = float("nan")
    return rewards, values, mask


@pytest.mark.parametrize("length,per_setting", [(1, 4), (7, 4), (1024, 3), (8192, 2)])
def test_matrix_gae_matches_loop(length, per_setting):
    # One pass of the loop checks all 16 (gamma, lam) settings: per-row gamma/lam.
    rows = len(SETTINGS) * per_setting
    rewards, values, mask = random_batch(rows, length, seed=length)
    gammas = torch.tensor([g for g, _ in SETTINGS], dtype=torch.float64).repeat_interleave(per_setting)
    lams = torch.tensor([l for _, l in SETTINGS], dtype=torch.float64).repeat_interleave(per_setting)
    ref_adv, ref_ret = gae_loop(rewards.double(), values.double(), mask, gammas, lams)
    assert torch.isfinite(ref_adv).all()
    for k, (gamma, lam) in enumerate(SETTINGS):
        rows_k = slice(k * per_setting, (k + 1) * per_setting)
        adv, ret = compute_gae(rewards[rows_k], values[rows_k], mask[rows_k], gamma, lam)
        assert adv.dtype == torch.float32
        for got, want in ((adv, ref_adv[rows_k]), (ret, ref_ret[rows_k])):
            scale = want.abs().max().clamp(min=1.0).item()
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * scale, msg=f"{gamma=} {lam=}")


def test_hand_computed_case_with_inner_mask():
    # Valid tokens 0 and 2; token 1 (tool output) is skipped by the recursion.
    rewards = torch.tensor([[1.0, 100.0, 2.0, 0.0]])
    values = torch.tensor([[0.5, 100.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 0, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.5, lam=0.5)
    # delta2 = 2 - 1 = 1, A2 = 1; delta0 = 1 + 0.5 * 1 - 0.5 = 1, A0 = 1 + 0.25 * A2.
    torch.testing.assert_close(adv, torch.tensor([[1.25, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.75, 0.0, 2.0, 0.0]]))


def test_masked_tokens_do_not_change_valid_results():
    rewards, values, mask = random_batch(6, 300, seed=1)
    adv, ret = compute_gae(rewards, values, mask, 0.99, 0.95)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    # Same valid tokens, no holes: compaction done by hand gives the same values.
    row = 0
    valid = mask[row]
    dense = [t[row, valid][None] for t in (rewards, values)]
    dense_adv, _ = compute_gae(*dense, torch.ones(1, int(valid.sum())), 0.99, 0.95)
    torch.testing.assert_close(adv[row, valid], dense_adv[0])


@pytest.mark.parametrize("block", [2, 3, 5, 64])
@pytest.mark.parametrize("factor", [1.0, 0.9, 0.3, 0.0])
def test_discounted_suffix_sum_any_block(block, factor):
    x = torch.randn(3, 200, dtype=torch.float64)
    want = torch.zeros_like(x)
    acc = torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(200)):
        acc = x[:, t] + factor * acc
        want[:, t] = acc
    torch.testing.assert_close(discounted_suffix_sum(x, factor, block), want)


@pytest.mark.parametrize("gamma_lam", [1.0, 0.999, 1e-20, 0.0])
def test_long_sequence_is_finite_and_exact(gamma_lam):
    # T = 32k: no T x T matrix, no overflow for any factor.
    x = torch.rand(1, 32768, dtype=torch.float64)
    got = discounted_suffix_sum(x.float(), gamma_lam)
    assert torch.isfinite(got).all()
    if gamma_lam == 1.0:
        want = x.flip(1).cumsum(1).flip(1)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0.0)
    elif gamma_lam <= 1e-20:
        torch.testing.assert_close(got.double(), x, rtol=1e-6, atol=0.0)


def test_discounted_returns_are_gae_with_zero_values_and_lambda_one():
    rewards, values, mask = random_batch(5, 100, seed=2)
    ref, _ = gae_loop(rewards.double(), torch.zeros_like(values).double(), mask, 0.9, 1.0)
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.9).double(), ref, rtol=1e-5, atol=1e-5)


def test_half_precision_inputs_accumulate_in_float32():
    rewards, values, mask = random_batch(2, 50, seed=3)
    adv, _ = compute_gae(rewards.bfloat16(), values.bfloat16(), mask, 1.0, 1.0)
    assert adv.dtype == torch.float32


def test_input_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="must all be"):
        compute_gae(x, torch.zeros(2, 4), x, 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma=1.5"):
        compute_gae(x, x, x, 1.5, 1.0)
