"""Sampling: greedy, temperature, top-k, top-p with a torch.Generator per sample, and seed mixing.

Every TP rank holds the same full logits and the same generators, so every
rank draws the same tokens without communication. Sampling a row consumes
exactly one draw of that sample's generator, so results do not depend on
which other sequences share the batch (or on preemption and migration).
Seeds are mixed with splitmix64 (`mixed_seed`), so the seeds of different
(run, iteration, prompt, sample) tuples do not repeat as sums of them would.
"""

from __future__ import annotations

import torch

from rlhf.engine.types import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """splitmix64's output function (Steele et al. 2014): a bijection of 64-bit ints that scatters bits."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mixed_seed(*parts: int) -> int:
    """A seed in [0, 2**63) mixed from ``parts`` (each an int in [0, 2**64)), for ``torch.Generator.manual_seed``.

    Each part is folded in by a splitmix64 round, so for fixed earlier parts distinct last parts give distinct
    64-bit states, and unrelated tuples collide only by chance (about 2**-63 per pair). The engine seeds
    sample i of a request with ``mixed_seed(params.seed, i)``; a trainer makes a request's seed with
    ``mixed_seed(run_seed, iteration, prompt_index)``.
    """
    if not parts:
        raise ValueError("mixed_seed() needs at least one part (e.g. run seed, iteration, prompt index)")
    state = 0
    for part in parts:
        if not isinstance(part, int) or not 0 <= part <= _MASK64:
            raise ValueError(f"mixed_seed part {part!r} is invalid: each part must be an int in [0, 2**64)")
        state = _splitmix64(state ^ part)
    return state >> 1  # 63 bits: non-negative as manual_seed accepts


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


def _logprob_temperature(params: SamplingParams) -> float:
    """The temperature the reported log-probs divide the logits by: T for ``"tempered"`` (1 when greedy),
    1 for ``"raw"``; ``"sampling"`` rows are replaced by the filtered distribution in `sample`."""
    return params.temperature if params.logprobs_of == "tempered" and not params.greedy else 1.0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]):
    """Next tokens and their log-probs for each row of ``logits`` [S, V] (float32).

    Returns (tokens [S] int64, logprobs [S] float32). Log-probs are, per row's
    ``logprobs_of``: log_softmax(logits / T) with no top-k/top-p (``"tempered"``,
    what a trainer computing log-probs at the sampling temperature gets), of the
    raw logits (``"raw"``, T = 1) or of the filtered distribution that was sampled
    from (``"sampling"``); greedy rows report raw log-probs in every mode. Every id
    of the model's vocabulary can be drawn; padded ids arrive as -inf and never are
    (see docs/engine.md on vocabulary padding).
    """
    temperatures = torch.tensor([_logprob_temperature(p) for p in params], dtype=logits.dtype, device=logits.device)
    logp = torch.log_softmax(logits / temperatures[:, None], dim=-1)  # x / 1.0 is exact: raw rows stay raw
    tokens = logp.argmax(dim=-1)  # the greedy rows' tokens (their temperature above is 1)
    for row, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        filtered_logp = torch.log_softmax(filter_logits(logits[row], p), dim=-1)
        # .cpu(): the generator lives on the CPU so that its state is portable (migration)
        probs = filtered_logp.exp().cpu()
        tokens[row] = torch.multinomial(probs, 1, generator=g).to(tokens.device)[0]
        if p.logprobs_of == "sampling":
            logp[row] = filtered_logp
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
