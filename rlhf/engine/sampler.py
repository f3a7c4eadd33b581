"""Sampling: greedy, temperature, top-k, top-p with a torch.Generator per sample, and seed mixing.

Every TP rank holds the same full logits and the same generators, so every
rank draws the same tokens without communication. Sampling a row consumes
exactly one draw of that sample's generator (a uniform u in [0, 1)), so
results do not depend on which other sequences share the batch (or on
preemption and migration). The tokens of all sampled rows are then picked at
once by inverting their filtered distributions' cumulative sums at u: no
Python loop over rows touches the vocabulary.
Seeds are mixed with splitmix64 (`mixed_seed`), so the seeds of different
(run, iteration, prompt, sample) tuples do not repeat as sums of them would.
"""

from __future__ import annotations

import torch

from rlhf.engine.types import SamplingParams

_MASK64 = (1 << 64) - 1
CDF_CHUNK = 128  # ids per chunk of the two-level inverse CDF (see inverse_cdf)


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


def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row host values as a tensor on ``device``, copied without waiting for the queued kernels: the
    step's only host-device sync stays the engine's read of the sampled tokens."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _divided(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """logits [S, V] divided by each row's temperature; the logits themselves when every one is 1 (x / 1.0 is
    exact, and a pass over the vocabulary is saved)."""
    if all(t == 1.0 for t in temperatures):
        return logits
    return logits / _on_device(temperatures, logits.dtype, logits.device)[:, None]


def _top_k_drop(x: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Where x [R, V] lies below its row's k-th largest value (each k in [1, V))."""
    k = _on_device(ks, torch.int64, x.device)
    kth = torch.topk(x, max(ks)).values.gather(-1, k[:, None] - 1)
    return x < kth


def _top_p_drop(x: torch.Tensor, ps: list[float]) -> torch.Tensor:
    """Where a token of x [R, V] falls outside its row's nucleus: the tokens before it in descending order
    already hold mass >= p (so at least one token is kept)."""
    sorted_x, order = torch.sort(x, descending=True)
    probs = sorted_x.softmax(-1)
    drop = probs.cumsum(-1) - probs >= _on_device(ps, x.dtype, x.device)[:, None]
    return torch.zeros_like(drop).scatter(-1, order, drop)  # back to vocab order


def _drop_rows(x: torch.Tensor, settings: dict[int, float], drop) -> torch.Tensor:
    """x with -inf where ``drop(rows, values)`` says, for the rows in ``settings`` (row -> its k or p) only."""
    if not settings:
        return x
    if len(settings) == x.shape[0]:  # every row filters: no gather / scatter of rows
        return x.masked_fill(drop(x, list(settings.values())), float("-inf"))
    index = _on_device(list(settings), torch.int64, x.device)
    rows = x[index]
    return x.index_copy(0, index, rows.masked_fill(drop(rows, list(settings.values())), float("-inf")))


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits [S, V] divided by each row's temperature, with the tokens outside that row's top-k, then top-p,
    set to -inf; all rows at once (rows with different settings share one batch). Temperatures must be > 0."""
    x = _divided(logits, [p.temperature for p in params])
    x = _drop_rows(x, {row: p.top_k for row, p in enumerate(params) if 0 < p.top_k < x.shape[-1]}, _top_k_drop)
    return _drop_rows(x, {row: p.top_p for row, p in enumerate(params) if p.top_p < 1.0}, _top_p_drop)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of ``weights`` [R, V] (probabilities, or any non-negative weights), the token whose
    interval of the row's cumulative sum holds u [R] (in [0, 1], dtype of ``weights``) times the row's total:
    token i with probability weight_i / total.

    Two levels, because a cumulative sum over the whole vocabulary is a slow serial pass: the sums of chunks
    of ``CDF_CHUNK`` ids (when that divides V) and their cumulative sum pick the chunk, and the cumulative sum
    of that chunk alone picks the token. At each level a target that rounds up to the sum takes the last
    entry that raises it, so a token of weight 0 is never picked: the first cumulative value above the
    target belongs to an entry that raises it. (A token's share is its step of the float32 sums, so one far
    below their resolution may get a step of 0 or of one ulp.)
    """
    rows, vocab = weights.shape
    chunk = CDF_CHUNK if vocab % CDF_CHUNK == 0 else vocab
    chunks = weights.view(rows, vocab // chunk, chunk)
    coarse = chunks.sum(-1).cumsum(-1)
    target = u[:, None] * coarse[:, -1:]
    which = _last_raising(coarse, target)  # [R, 1]
    before = torch.where(which > 0, coarse.gather(1, (which - 1).clamp(min=0)), 0.0)
    fine = chunks[torch.arange(rows, device=weights.device), which[:, 0]].cumsum(-1)
    return (which * chunk + _last_raising(fine, target - before)).squeeze(-1)


def _last_raising(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[R, 1] index of the first entry of ``cdf`` [R, n] above ``target`` [R, 1], or, where none is (the target
    rounded up to the sum), the first that reaches the sum: the last entry that raises it."""
    total = cdf[:, -1:].contiguous()  # searchsorted copies a strided input
    return torch.minimum(torch.searchsorted(cdf, target, right=True), torch.searchsorted(cdf, total))


def _samples_its_logprobs(params: SamplingParams) -> bool:
    """True when the row's reported log-probs are of the very distribution it samples from (no top-k or
    top-p, and the log-probs at the sampling temperature), so that their exp can be sampled directly."""
    return params.top_k == 0 and params.top_p >= 1.0 and _logprob_temperature(params) == params.temperature


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
    (see docs/engine.md on vocabulary padding). Each sampled row takes one uniform
    from its own generator (on the CPU, so that its state is portable for migration);
    the uniforms go to the device in one copy and `inverse_cdf` picks every row's token.
    """
    x = _divided(logits, [_logprob_temperature(p) for p in params])  # the reported distribution's logits
    top = x.max(-1, keepdim=True).values
    weights = (x - top).exp_()  # its probabilities, times a constant per row: no [S, V] log-probs are kept
    log_total = weights.sum(-1, keepdim=True).log_()
    rows = [row for row, p in enumerate(params) if not p.greedy]
    # the greedy rows' tokens (their temperature above is 1); an argmax costs a pass over the vocabulary
    tokens = x.argmax(dim=-1) if len(rows) < len(params) else None
    exact = None
    if rows:
        u = _on_device([torch.rand((), dtype=torch.float64, generator=generators[row]).item() for row in rows],
                       logits.dtype, logits.device)
        index = _on_device(rows, torch.int64, logits.device)
        chosen, every = [params[r] for r in rows], len(rows) == len(params)
        if all(_samples_its_logprobs(p) for p in chosen):  # the reported distribution is the sampled one
            drawn = inverse_cdf(weights if every else weights[index], u)
        else:
            filtered = filter_logits(logits if every else logits[index], chosen)
            drawn = inverse_cdf(filtered.softmax(-1), u)
            within = [j for j, p in enumerate(chosen) if p.logprobs_of == "sampling"]
            if within:
                within = _on_device(within, torch.int64, logits.device)
                picked = filtered[within].gather(-1, drawn[within, None])
                exact = index[within], (picked - filtered[within].logsumexp(-1, keepdim=True)).squeeze(-1)
        tokens = drawn if tokens is None else tokens.index_copy(0, index, drawn)
    logprobs = ((x.gather(-1, tokens[:, None]) - top) - log_total).squeeze(-1)  # as log_softmax rounds it
    return tokens, logprobs if exact is None else logprobs.index_copy(0, *exact)
