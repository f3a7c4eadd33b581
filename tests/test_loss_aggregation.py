"""Loss aggregation is exact under data parallelism and micro-batches: per-micro-batch numerators scaled by
the mini-batch's global denominator give, after the executor's 1/micro-batches and the DP average, the loss
and the gradient of each mode's formula on the whole mini-batch (simulated ranks, no process group)."""
import pytest
import torch

from rlhf.algorithms import LOSS_AGGREGATIONS, kl_estimate, loss_denominator, loss_numerator, policy_loss_per_token

NORM_LENGTH = 8  # Dr. GRPO's constant: the maximum response length
LENGTHS = [5, 1, 6, 0, 3, 2, 4]  # unequal, one sequence with no valid token
RANKS = [[[0, 1, 2], [3]], [[4], [5], [6]]]  # rank -> micro-batches -> sample indices (uneven)


def _minibatch(theta: torch.Tensor):
    """Per-token losses [N, T] of a fixed mini-batch as a function of the shared parameters ``theta``
    (PPO clipped loss with ratios away from 1 plus a k3 KL term), and its mask."""
    gen = torch.Generator().manual_seed(3)
    n, width = len(LENGTHS), max(LENGTHS)
    features = torch.randn(n, width, theta.numel(), generator=gen, dtype=torch.float64)
    logprobs = -torch.nn.functional.softplus(features @ theta)
    old = logprobs.detach() + 0.3 * torch.randn(n, width, generator=gen, dtype=torch.float64)
    ref = logprobs.detach() + 0.2 * torch.randn(n, width, generator=gen, dtype=torch.float64)
    advantages = torch.randn(n, 1, generator=gen, dtype=torch.float64).expand(n, width)
    mask = (torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    mask[0, 2] = 0  # a hole inside a response (tool output)
    losses, _ = policy_loss_per_token(logprobs, old, advantages, mask, clip_eps=0.2)
    return losses + 0.1 * kl_estimate(logprobs, ref, "k3").double(), mask


def _formula(losses: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Each mode on the whole mini-batch, written as verl documents it (loops over sequences)."""
    sums = [(losses[i] * mask[i]).sum() for i in range(len(losses))]
    counts = [mask[i].sum() for i in range(len(losses))]
    kept = [i for i in range(len(losses)) if counts[i] > 0]
    if mode == "token-mean":
        return sum(sums) / sum(counts)
    if mode == "seq-mean-token-mean":
        return sum(sums[i] / counts[i] for i in kept) / len(kept)
    if mode == "seq-mean-token-sum":
        return sum(sums) / len(kept)
    return sum(sums) / (len(kept) * NORM_LENGTH)  # seq-mean-token-sum-norm


def _simulated_dp(theta: torch.Tensor, mode: str):
    """(loss, gradient) as the trainer gets them: each micro-batch backpropagates numerator x
    (micro_batches * dp / denominator) / micro_batches; the ranks' gradients are averaged."""
    _, mask = _minibatch(theta)
    denominator = loss_denominator(mask.sum(dim=1), mode, norm_length=NORM_LENGTH)
    dp, total_loss, total_grad = len(RANKS), 0.0, torch.zeros_like(theta)
    for micro_batches in RANKS:
        scale = len(micro_batches) * dp / denominator
        for rows in micro_batches:
            leaf = theta.detach().requires_grad_()  # this rank's replica of the parameters
            losses, mask = _minibatch(leaf)
            loss = loss_numerator(losses[rows], mask[rows], mode) * scale / len(micro_batches)
            (grad,) = torch.autograd.grad(loss, leaf)
            total_loss, total_grad = total_loss + loss.detach() / dp, total_grad + grad / dp
    return total_loss, total_grad


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregation_is_exact_across_dp_ranks_and_micro_batches(mode):
    theta = torch.tensor([0.3, -0.7, 1.1], dtype=torch.float64, requires_grad=True)
    losses, mask = _minibatch(theta)
    want = _formula(losses, mask, mode)
    (want_grad,) = torch.autograd.grad(want, theta)
    got, got_grad = _simulated_dp(theta, mode)
    # float64 losses; the float32 denominator rounds the scale by ~1e-8 relative.
    torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-6, atol=1e-9)
    assert want_grad.abs().min() > 1e-3  # the check has something to compare


def test_denominators_by_hand():
    lengths = torch.tensor(LENGTHS)
    assert loss_denominator(lengths, "token-mean") == sum(LENGTHS)
    assert loss_denominator(lengths, "seq-mean-token-mean") == 6  # the empty sequence does not count
    assert loss_denominator(lengths, "seq-mean-token-sum") == 6
    assert loss_denominator(lengths, "seq-mean-token-sum-norm", norm_length=NORM_LENGTH) == 6 * NORM_LENGTH
    assert loss_denominator(torch.zeros(3, dtype=torch.long), "token-mean") == 1  # all masked: no 0/0
