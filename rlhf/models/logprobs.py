"""Log-probabilities of target tokens from vocab-parallel logits.

Each TP rank holds the logits of a contiguous vocab slice ``[V/tp * r, V/tp * (r+1))``.
The log-softmax needs the max and the sum of exponentials over the whole
vocabulary and the target's logit from whichever rank owns it: three
all-reduces over the TP group. Backward is local (each rank's loss is the same
replicated value), as megatron's reduce-from-TP-region mapping provides.
Padded vocabulary ids arrive as -inf logits (rlhf.models.vocab): they add
nothing to the sums, and ``where`` (not a product with 0) keeps them from
turning into NaN, even on a rank whose whole slice is padding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_log_probs(logits: torch.Tensor, targets: torch.Tensor, tp_group) -> torch.Tensor:
    """log p(targets) from this rank's vocab slice of the logits.

    logits: [..., V/tp] float; targets: [...] int64 global token ids.
    Returns [...] float32 log-probabilities, differentiable w.r.t. ``logits``.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    logits = logits.float()
    vocab_local = logits.shape[-1]
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    start = rank * vocab_local

    with torch.no_grad():
        max_logit = logits.max(dim=-1).values
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - max_logit.unsqueeze(-1)
    sum_exp = tp_sum(shifted.exp().sum(dim=-1), tp_group)

    local = targets - start
    in_slice = (local >= 0) & (local < vocab_local)
    picked = shifted.gather(-1, local.clamp(0, vocab_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = tp_sum(torch.where(in_slice, picked, 0.0), tp_group)
    return target_logit - sum_exp.log()


def vocab_parallel_entropy(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """Entropy (nats) of softmax over the whole vocabulary from this rank's vocab slice.

    logits: [..., V/tp]. Returns [...] float32, differentiable w.r.t. ``logits`` when autograd is on
    (the entropy bonus of the actor loss); call it under ``torch.no_grad()`` for the metric alone. With
    ``shifted = logits - max`` and ``Z = sum exp(shifted)``: ``H = log Z - sum(exp(shifted) * shifted) / Z``,
    the two sums all-reduced together over the TP group with megatron's reduce-from-TP mapping (backward
    local, as in :func:`vocab_parallel_log_probs`). The max carries no gradient: H does not depend on the
    shift. Padded ids (-inf logits) add 0 to both sums and get a zero gradient.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region as tp_sum

    logits = logits.float()
    with torch.no_grad():
        max_logit = logits.max(dim=-1).values
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - max_logit.unsqueeze(-1)
    exp = shifted.exp()
    finite = torch.where(exp > 0, shifted, 0.0)  # exp * -inf would be NaN, in the value and the gradient
    sums = tp_sum(torch.stack([exp.sum(dim=-1), (exp * finite).sum(dim=-1)]), tp_group)
    return sums[0].log() - sums[1] / sums[0]
