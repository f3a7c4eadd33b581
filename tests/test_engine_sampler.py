"""Sampler filters, log-prob modes, seeded draws and seed mixing (no model)."""

import math

import pytest
import torch

from rlhf.engine.sampler import filter_logits, mixed_seed, sample
from rlhf.engine.sequence import make_generator
from rlhf.engine.types import EngineConfigError, SamplingParams

NEG = float("-inf")


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)).tolist() == [NEG, 3.0, NEG, 2.0]
    # probs of [3, 2, 1, 0] are about [.64, .24, .09, .03]: top_p=0.8 keeps the first two
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.8)).tolist()
    assert kept == [NEG, 3.0, NEG, 2.0]
    assert filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.1)).tolist() == [NEG, 3.0, NEG, NEG]
    assert filter_logits(logits, SamplingParams(temperature=2.0)).tolist() == [0.0, 1.5, 0.5, 1.0]


def test_greedy_raw_logprobs_and_seeded_draws():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = SamplingParams()
    toks, lps = sample(logits.clone(), [greedy] * 3, [make_generator(0)] * 3)
    assert toks.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(lps, torch.log_softmax(logits, -1).max(-1).values)
    hot = SamplingParams(temperature=1.0, top_k=10, seed=4)
    a = sample(logits[:2].clone(), [hot, greedy], [make_generator(4), make_generator(0)])[0][0]
    b = sample(logits[:1].clone(), [hot], [make_generator(4)])[0][0]
    assert a == b  # one draw per sample from its own generator: batch-independent
    _, lp = sample(logits[:1].clone(), [SamplingParams(temperature=1.0, top_k=1, logprobs_of="sampling")],
                   [make_generator(1)])
    assert math.isclose(lp.item(), 0.0, abs_tol=1e-6)  # top-1 distribution: probability 1



def test_logprob_modes_tempered_raw_and_sampling():
    """tempered = log_softmax(logits / T) of the drawn token, top-k/top-p ignored (verl, OpenRLHF, TRL); raw = T 1;
    sampling = the renormalised filtered distribution; greedy rows report raw log-probs in every mode."""
    torch.manual_seed(1)
    logits = torch.cat([torch.randn(1, 50).expand(3, 50), torch.randn(1, 50)]) * 3
    kw = dict(temperature=0.7, top_k=10, top_p=0.9, seed=3)
    modes = ("tempered", "raw", "sampling")
    params = [SamplingParams(logprobs_of=m, **kw) for m in modes] + [SamplingParams(logprobs_of="tempered")]
    tokens, lps = sample(logits, params, [make_generator(3) for _ in range(4)])
    assert len(set(tokens[:3].tolist())) == 1  # the same draw from the same logits and seed in each mode
    expected = [torch.log_softmax(logits[0] / 0.7, -1), torch.log_softmax(logits[1], -1),
                torch.log_softmax(filter_logits(logits[2], params[2]), -1), torch.log_softmax(logits[3], -1)]
    for row, logp in enumerate(expected):
        assert lps[row].item() == pytest.approx(logp[tokens[row]].item(), abs=1e-6), modes[row % 3]
    assert lps[2] > lps[0]  # renormalised over the kept tokens
    assert SamplingParams().logprobs_of == "tempered"
    with pytest.raises(EngineConfigError, match="logprobs_of='old' is invalid: must be one of 'tempered', 'raw', "
                                                "'sampling'"):
        SamplingParams(logprobs_of="old")


def test_mixed_seeds_are_deterministic_in_range_and_never_repeat_on_a_grid():
    """Sample seeds mixed from (run seed, iteration, prompt) then the sample index: 491,520 distinct seeds, where
    the old sums ((run * 1_000_003 + it) * 65_537 + prompt * n + i) repeat once prompts x n exceed 65,537."""
    requests = [mixed_seed(run, it, prompt) for run in (0, 1, 2**28 - 1) for it in range(20) for prompt in range(1024)]
    seeds = [mixed_seed(r, i) for r in requests for i in range(8)]
    assert len(set(requests)) == len(requests) and len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    assert mixed_seed(7, 3, 11) == mixed_seed(7, 3, 11) != mixed_seed(7, 11, 3)
    assert mixed_seed(2**64 - 1, 0) >= 0
    old = {(0 * 1_000_003 + it) * 65_537 + prompt * 128 + i for it in range(2) for prompt in range(1024)
           for i in range(128)}
    assert len(old) < 2 * 1024 * 128  # what the mixing replaces
    for bad in (-1, 2**64, 1.5, "3"):
        with pytest.raises(ValueError, match=rf"mixed_seed part {bad!r} is invalid: each part must be an int in "
                                             r"\[0, 2\*\*64\)"):
            mixed_seed(1, bad)
    with pytest.raises(ValueError, match="at least one part"):
        mixed_seed()
    with pytest.raises(EngineConfigError, match=r"seed=-1 is invalid: must be an int in \[0, 2\*\*64\)"):
        SamplingParams(seed=-1)
    with pytest.raises(EngineConfigError, match=r"stop_token_ids=\(2, -1\) is invalid: must be token ids >= 0"):
        SamplingParams(stop_token_ids=(2, -1))
