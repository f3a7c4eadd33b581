"""rlhf/models/logprobs.py: the chunked log-probs and entropy against the written-out formulas (torch's
log_softmax over the whole vocabulary), values and gradients, chunked and in one piece. Their TP-sharded
use is checked in the multi-rank scenarios (the actor's entropy gradient at TP2 in tests/test_trainer.py,
training at TP2 in tests/test_executor_distributed.py and tests/test_optim.py)."""

import pytest
import torch

from rlhf.models import logprobs as lp


def _written_out(logits, targets, temperature):
    log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
    picked = log_p.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * torch.where(log_p.isfinite(), log_p, 0.0)).sum(-1)
    return picked, entropy


def _case(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 7, 40, generator=gen)).to(dtype)
    logits[..., 37:] = float("-inf")  # padded vocabulary ids (rlhf.models.vocab)
    targets = torch.randint(0, 37, (3, 7), generator=gen)
    weights = torch.randn(2, 3, 7, generator=gen)
    return logits, targets, weights


@pytest.mark.parametrize("chunk", [lp.CHUNK_ELEMENTS, 40 * 4])  # one piece; chunks of 4 rows (21 rows in all)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_written_out_log_softmax(monkeypatch, chunk, temperature):
    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", chunk)
    logits, targets, weights = _case(torch.float32)
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    got = lp.vocab_parallel_logprobs_entropy(ours, targets, None, temperature)
    want = _written_out(theirs, targets, temperature)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-6)
    sum(w_ * g for w_, g in zip(weights, got)).sum().backward()
    sum(w_ * g for w_, g in zip(weights, want)).sum().backward()
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=2e-6, atol=2e-6)  # fp32 rounding
    assert ours.grad[..., 37:].abs().max() == 0  # padded ids: no gradient, no NaN


def test_an_unused_output_adds_nothing_to_the_gradient():
    logits, targets, _ = _case(torch.float32)
    only_logprobs = logits.clone().requires_grad_()
    lp.vocab_parallel_logprobs_entropy(only_logprobs, targets, None)[0].sum().backward()
    reference = logits.clone().requires_grad_()
    _written_out(reference, targets, 1.0)[0].sum().backward()
    torch.testing.assert_close(only_logprobs.grad, reference.grad, rtol=0, atol=2e-6)


def test_bf16_logits_are_cast_chunk_by_chunk_and_their_gradient_comes_back_in_bf16(monkeypatch):
    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", 40 * 4)
    logits, targets, weights = _case(torch.bfloat16)
    ours = logits.clone().requires_grad_()
    got = lp.vocab_parallel_logprobs_entropy(ours, targets, None, 0.7)
    want = _written_out(logits, targets, 0.7)  # the same fp32 arithmetic on the cast logits
    assert all(g.dtype == torch.float32 for g in got)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-6)
    (weights[0] * got[0] + weights[1] * got[1]).sum().backward()
    assert ours.grad.dtype == torch.bfloat16 and ours.grad.isfinite().all()


def test_log_probs_alone_skip_the_entropy_and_equal_those_computed_with_it():
    logits, targets, _ = _case(torch.float32)
    alone, none = lp.vocab_parallel_logprobs_entropy(logits, targets, None, 0.7, entropy=False)
    assert none is None
    assert torch.equal(alone, lp.vocab_parallel_logprobs_entropy(logits, targets, None, 0.7)[0])
