"""Sampler filters and seeded draws (no model)."""

import math

import torch

from rlhf.engine.sampler import filter_logits, sample
from rlhf.engine.sequence import make_generator
from rlhf.engine.types import SamplingParams

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
    a = sample(logits.clone(), [hot, greedy], [make_generator(4), make_generator(0)])[0][0]
    b = sample(logits[:1].clone(), [hot], [make_generator(4)])[0][0]
    assert a == b  # one draw per sample from its own generator: batch-independent
    _, lp = sample(logits[:1].clone(), [SamplingParams(temperature=1.0, top_k=1, logprobs_of="sampling")],
                   [make_generator(1)])
    assert math.isclose(lp.item(), 0.0, abs_tol=1e-6)  # top-1 distribution: probability 1

