"""Sampling: greedy, temperature, top-k, top-p with a torch.Generator per sample.

Every TP rank holds the same full logits and the same generators, so every
rank draws the same tokens without communication. Sampling a row consumes
exactly one draw of that sample's generator, so results do not depend on
which other sequences share the batch (or on preemption and migration).
"""

from __future__ import annotations

import torch

from rlhf.engine.types import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits [V] with tokens outside top-k / top-p set to -inf."""
    x = logits / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # drop a token when the mass *before* it already reaches top_p (keeps at least one)
        drop = probs.cumsum(-1) - probs >= params.top_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))  # back to vocab order
    return x


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]):
    """Next tokens and their log-probs for each row of ``logits`` [S, V] (float32).

    Returns (tokens [S] int64, logprobs [S] float32). Log-probs are of the raw
    logits (``logprobs_of="raw"``, what the training model computes) or of the
    filtered distribution that was sampled from (``"sampling"``). Every id of
    the model's vocabulary can be drawn; padded ids arrive as -inf and never are
    (see docs/engine.md on vocabulary padding).
    """
    raw_logp = torch.log_softmax(logits, dim=-1)
    tokens = raw_logp.argmax(dim=-1)
    logp = raw_logp
    for row, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:  # argmax above; greedy samples from the raw distribution, so its log-probs stay raw
            continue
        filtered_logp = torch.log_softmax(filter_logits(logits[row], p), dim=-1)
        # .cpu(): the generator lives on the CPU so that its state is portable (migration)
        probs = filtered_logp.exp().cpu()
        tokens[row] = torch.multinomial(probs, 1, generator=g).to(tokens.device)[0]
        if p.logprobs_of == "sampling":
            if logp is raw_logp:
                logp = raw_logp.clone()
            logp[row] = filtered_logp
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
