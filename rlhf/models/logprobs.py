"""Log-probabilities of target tokens, and the entropy, from vocab-parallel logits, chunked.

Each TP rank holds the logits of a contiguous vocab slice ``[V/tp * r, V/tp * (r+1))``.
The log-softmax needs the max and the sum of exponentials over the whole
vocabulary and the target's logit from whichever rank owns it; the entropy one
sum more. Backward is local (each rank's loss is the same replicated value), as
megatron's reduce-from-TP-region mapping provides. Padded vocabulary ids arrive
as -inf logits (rlhf.models.vocab): they add nothing to the sums, and ``where``
(not a product with 0) keeps them from turning into NaN, even on a rank whose
whole slice is padding.

:func:`vocab_parallel_logprobs_entropy` never holds fp32 logits of more than
``CHUNK_ELEMENTS`` at once: it runs over chunks of rows (tokens), keeps only
the model's logits and three numbers per token for the backward, and computes
the gradient there chunk by chunk, analytically::

    log p_j = x_j - lse       d log p_t / d x_j = [j = t] - p_j
    H = -sum_j p_j log p_j    d H / d x_j = -p_j (log p_j + H)

(x the tempered logits, lse their log-sum-exp). Autograd through the plain
formulas would keep several fp32 copies of a micro-batch's logits (at a
128k vocabulary and 8k tokens, 4.2 GB each). Two all-reduces per call: the
maxima, then the three sums together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = 1 << 26
"""fp32 logits one chunk of rows may make at a time (256 MiB): what the log-probs add to the logits' memory."""


def _tp_all_reduce(t: torch.Tensor, op, tp_group) -> None:
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(t, op=op, group=tp_group)


class _LogProbsEntropy(torch.autograd.Function):
    """(log p(targets), entropy) per row of [N, V/tp] logits divided by a temperature; see the module. Without
    ``with_entropy`` its sum is skipped and the entropy output is meaningless (the caller drops it)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, tp_group, with_entropy: bool):
        rows, vocab_local = logits.shape
        step = max(1, CHUNK_ELEMENTS // vocab_local)
        start = (dist.get_rank(tp_group) if tp_group is not None else 0) * vocab_local
        local = targets - start
        in_slice = (local >= 0) & (local < vocab_local)
        local = local.clamp(0, vocab_local - 1)

        def tempered(i: int) -> torch.Tensor:
            x = logits[i:i + step].float()  # a bf16 model's logits cast before the division, as the engine's are
            return x if temperature == 1.0 else x / temperature

        maxima = torch.cat([tempered(i).max(dim=-1).values for i in range(0, rows, step)])
        _tp_all_reduce(maxima, dist.ReduceOp.MAX, tp_group)
        sums = logits.new_zeros((3, rows), dtype=torch.float32)  # sum exp, sum exp * shifted, target's shifted
        for i in range(0, rows, step):
            shifted = tempered(i) - maxima[i:i + step, None]
            exp = shifted.exp()
            sums[0, i:i + step] = exp.sum(dim=-1)
            if with_entropy:
                sums[1, i:i + step] = (exp * torch.where(exp > 0, shifted, 0.0)).sum(dim=-1)  # exp * -inf is NaN
            picked = shifted.gather(-1, local[i:i + step, None]).squeeze(-1)
            sums[2, i:i + step] = torch.where(in_slice[i:i + step], picked, 0.0)
        _tp_all_reduce(sums, dist.ReduceOp.SUM, tp_group)
        log_z = sums[0].log()
        logprobs, entropy = sums[2] - log_z, log_z - sums[1] / sums[0]
        ctx.save_for_backward(logits, local, in_slice, maxima + log_z, entropy)
        ctx.temperature, ctx.step = temperature, step
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local, in_slice, lse, entropy = ctx.saved_tensors
        temperature, step = ctx.temperature, ctx.step
        grad = torch.empty_like(logits)
        for i in range(0, logits.shape[0], step):
            x = logits[i:i + step].float()
            log_p = (x if temperature == 1.0 else x / temperature) - lse[i:i + step, None]
            p = log_p.exp()
            g = torch.zeros_like(p)
            if grad_logprobs is not None:
                g_rows = grad_logprobs[i:i + step]
                g -= p * g_rows[:, None]
                g.scatter_add_(-1, local[i:i + step, None],
                               torch.where(in_slice[i:i + step], g_rows, 0.0)[:, None])
            if grad_entropy is not None:
                term = p * (torch.where(p > 0, log_p, 0.0) + entropy[i:i + step, None])
                g -= term * grad_entropy[i:i + step, None]
            grad[i:i + step] = g if temperature == 1.0 else g / temperature
        return grad, None, None, None, None


def vocab_parallel_logprobs_entropy(logits: torch.Tensor, targets: torch.Tensor, tp_group, temperature: float = 1.0,
                                    entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets), entropy in nats) of softmax(logits / ``temperature``) over the whole vocabulary, from
    this rank's vocab slice.

    logits: [..., V/tp] in the model's dtype (cast to fp32 a chunk at a time); targets: [...] int64 global
    token ids. Returns two [...] float32 tensors, both differentiable w.r.t. ``logits`` (the policy loss and
    the entropy bonus); an output the loss does not use costs nothing in the backward. ``entropy=False``
    (inference: log-probs alone) skips the entropy's sum and returns None for it.
    """
    rows = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    logprobs, entropies = _LogProbsEntropy.apply(flat, targets.reshape(-1), float(temperature), tp_group, entropy)
    return logprobs.view(rows), entropies.view(rows) if entropy else None


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, tp_group) -> torch.Tensor:
    """log p(targets) from this rank's vocab slice of the logits ([..., V/tp]; targets [...] global ids):
    [...] float32, differentiable."""
    return vocab_parallel_logprobs_entropy(logits, targets, tp_group, entropy=False)[0]

