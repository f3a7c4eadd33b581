"""Why every log-prob the update uses must be of logits / T: on an enumerable toy (two steps, three
tokens, sampled at temperature T != 1, a reward that depends on the first token only), the expected
policy gradient of the clipped loss with log_softmax(logits / T) equals the exact gradient of E[reward]
(autograd through the enumerated expectation) and is 0 on the second-step logits; with log-probs at
T = 1 (the old bug) it is not."""
import itertools

import torch

from rlhf.algorithms import policy_loss_per_token

TEMPERATURE = 0.7
REWARD = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)  # reward of the first token
SEQUENCES = list(itertools.product(range(3), repeat=2))  # all 9 (first, second) token pairs


def _logits():
    """First-step logits [3] and second-step logits [3 first tokens, 3] as leaves."""
    first = torch.tensor([0.2, -1.0, 0.5], dtype=torch.float64, requires_grad=True)
    second = torch.tensor([[1.0, 0.0, -1.0], [0.3, 0.3, -2.0], [-0.5, 1.5, 0.0]], dtype=torch.float64,
                          requires_grad=True)
    return first, second


def _sequence_logprobs(first, second, temperature):
    """[9, 2] log-probs of each sequence's two tokens under softmax(logits / temperature)."""
    lp_first = torch.log_softmax(first / temperature, dim=-1)
    lp_second = torch.log_softmax(second / temperature, dim=-1)
    return torch.stack([torch.stack([lp_first[a], lp_second[a, b]]) for a, b in SEQUENCES])


def _exact_gradient(first, second):
    """Gradient of E[reward] = sum over sequences of p_T(sequence) * reward, by autograd."""
    probs = _sequence_logprobs(first, second, TEMPERATURE).sum(dim=1).exp()
    expected = (probs * REWARD[[a for a, _ in SEQUENCES]]).sum()
    return torch.autograd.grad(expected, (first, second))


def _expected_policy_gradient(first, second, logprob_temperature):
    """Minus the gradient of the clipped loss at ratio 1, weighted by each sequence's sampling
    probability under softmax(logits / TEMPERATURE): the exact expectation of the update's gradient."""
    weights = _sequence_logprobs(first, second, TEMPERATURE).sum(dim=1).exp().detach()
    logprobs = _sequence_logprobs(first, second, logprob_temperature)
    advantages = REWARD[[a for a, _ in SEQUENCES]].unsqueeze(1).expand(-1, 2)
    losses, _ = policy_loss_per_token(logprobs, logprobs.detach(), advantages, torch.ones(9, 2))
    expected_loss = (weights * losses.sum(dim=1)).sum()
    return tuple(-g for g in torch.autograd.grad(expected_loss, (first, second)))


def test_tempered_logprobs_give_the_exact_gradient():
    first, second = _logits()
    exact_first, exact_second = _exact_gradient(first, second)
    pg_first, pg_second = _expected_policy_gradient(first, second, TEMPERATURE)
    torch.testing.assert_close(pg_first, exact_first, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pg_second, exact_second, rtol=0, atol=1e-12)
    assert exact_first.abs().min() > 1e-2  # the first step does learn
    assert exact_second.abs().max() < 1e-12  # the reward ignores the second token


def test_untempered_logprobs_bias_the_gradient():
    first, second = _logits()
    exact_first, _ = _exact_gradient(first, second)
    pg_first, pg_second = _expected_policy_gradient(first, second, 1.0)
    assert pg_second.abs().max() > 1e-2  # a gradient where the true one is 0
    assert not torch.allclose(pg_first, exact_first)
