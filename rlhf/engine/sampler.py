"""Sampling on the device: greedy, temperature, top-k, top-p with a counter-based uniform per token; seed mixing.

Every TP rank holds the same full logits and the same per-row inputs, so every rank draws the same tokens
without communication. A sampled row's uniform is a function of two integers only (`uniforms`): its
sample's *key*, ``mixed_seed(params.seed, sample_index)``, and a *counter*, the index of the token being
drawn (the tokens the sample has generated so far). So results do not depend on which other sequences
share the batch, on preemption or on migration (the key follows from the params and sample index, the
counter from the tokens, and both travel with a sample), and no state lives on the host: a step's sampling
reads only device tensors (`SampleInputs`), so a CUDA graph can replay it with the forward
(rlhf/engine/static_decode.py). The tokens of all sampled rows are picked at once by inverting their
filtered distributions' cumulative sums at u: no Python loop over rows touches the vocabulary.
Seeds are mixed with splitmix64 (`mixed_seed`), so the seeds of different (run, iteration, prompt, sample)
tuples do not repeat as sums of them would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.engine.types import SamplingParams

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio in 64 bits)
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # splitmix64's two multipliers
CDF_CHUNK = 128  # ids per chunk of the two-level inverse CDF (see inverse_cdf)


def _splitmix64(x: int) -> int:
    """splitmix64's output function (Steele et al. 2014): a bijection of 64-bit ints that scatters bits."""
    z = (x + GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX[0]) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX[1]) & _MASK64
    return z ^ (z >> 31)


def mixed_seed(*parts: int) -> int:
    """A seed in [0, 2**63) (an int64, as `uniforms` takes its keys) mixed from ``parts`` (ints in [0, 2**64)).

    Each part is folded in by a splitmix64 round, so for fixed earlier parts distinct last parts give distinct
    64-bit states, and unrelated tuples collide only by chance (about 2**-63 per pair). The engine keys
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
    return state >> 1  # 63 bits: non-negative in an int64


# 64-bit values on the device as (high, low) 32-bit halves in int64 tensors: every intermediate value stays
# in [0, 2**50), so no product overflows and no shift sees a sign bit; CPU and GPU give the same bits.

def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * b, for ``a`` [R] and ``b`` in [0, 2**32): b in 16-bit halves, so
    each partial product is below 2**48."""
    low, mid = a * (b & 0xFFFF), a * (b >> 16)  # a * b = mid * 2**16 + low
    low = low + ((mid & 0xFFFF) << 16)
    return (mid >> 16) + (low >> 32), low & _MASK32


def _mul64(hi: torch.Tensor, lo: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) of (hi * 2**32 + lo) * c mod 2**64, for a 64-bit constant ``c``."""
    carry, low = _mul32(lo, c & _MASK32)
    return (carry + _mul32(hi, c & _MASK32)[1] + _mul32(lo, c >> 32)[1]) & _MASK32, low


def _xor_shift(hi: torch.Tensor, lo: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) of z ^ (z >> s), for 0 < s < 32."""
    return hi ^ (hi >> s), lo ^ ((lo >> s) | ((hi << (32 - s)) & _MASK32))


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """u [R] float32 in [0, 1), a multiple of 2**-24, for each row's key (int64 [R], in [0, 2**63)) and
    counter (int64 [R], in [0, 2**32)): the top 24 bits of output number ``counter`` (from 0) of splitmix64
    seeded with ``key``, i.e. of ``_splitmix64(key + counter * GAMMA)`` (mod 2**64).

    Integer arithmetic on the keys' device, exact everywhere (above), so a row's u is the same on every
    device, in every batch, eager or replayed in a graph. splitmix64 passes BigCrush as a stream; streams of
    two keys overlap only if the keys lie within a sample's length of GAMMA steps of each other (about
    2**-51 per pair of 4,096-token samples).
    """
    hi, lo = _mul64(torch.zeros_like(counters), counters, GAMMA)
    lo = lo + (keys & _MASK32) + (GAMMA & _MASK32)  # + key + GAMMA: splitmix64's state
    hi, lo = (hi + (keys >> 32) + (GAMMA >> 32) + (lo >> 32)) & _MASK32, lo & _MASK32
    hi, lo = _mul64(*_xor_shift(hi, lo, 30), _MIX[0])
    hi, _ = _mul64(*_xor_shift(hi, lo, 27), _MIX[1])
    return (hi >> 8).float() * 2.0 ** -24  # the last z ^ (z >> 31) leaves the top 33 bits as they are


def _samples_its_logprobs(params: SamplingParams) -> bool:
    """True when the row's reported log-probs are of the very distribution it samples from (no top-k or
    top-p, and the log-probs at the sampling temperature), so that their exp can be sampled directly."""
    return params.top_k == 0 and params.top_p >= 1.0 and _logprob_temperature(params) == params.temperature


def _logprob_temperature(params: SamplingParams) -> float:
    """The temperature the reported log-probs divide the logits by: T for ``"tempered"`` (1 when greedy),
    1 for ``"raw"``; ``"sampling"`` rows are replaced by the filtered distribution in `sample`."""
    return params.temperature if params.logprobs_of == "tempered" and not params.greedy else 1.0


@dataclass(frozen=True)
class SamplePlan:
    """Which passes a step's sampling makes, from its rows' settings (host data: a recorded graph replays one
    plan, so `StaticDecode` records one per plan and bucket). ``top_k`` is the width of the top-k pass, the
    next power of two at or above the largest k of a sampled row (0: no row filters by k), so that few
    widths occur; each row still keeps its own k."""

    greedy: bool  # some row is greedy: an argmax
    sampled: bool  # some row samples: a draw
    filtered: bool  # some sampled row draws from another distribution than its log-probs' (see filter_logits)
    top_k: int
    top_p: bool  # some sampled row filters by top-p
    within: bool  # filtered, and some sampled row reports the log-probs of its filtered distribution ("sampling")
    tempered: bool  # some row's log-probs divide the logits by a temperature other than 1

    @classmethod
    def of(cls, params: list[SamplingParams]) -> SamplePlan:
        drawn = [p for p in params if not p.greedy]
        ks = [p.top_k for p in drawn if p.top_k]
        filtered = not all(_samples_its_logprobs(p) for p in drawn)
        return cls(greedy=len(drawn) < len(params), sampled=bool(drawn), filtered=filtered,
                   top_k=1 << (max(ks) - 1).bit_length() if ks else 0, top_p=any(p.top_p < 1.0 for p in drawn),
                   within=filtered and any(p.logprobs_of == "sampling" for p in drawn),
                   tempered=any(_logprob_temperature(p) != 1.0 for p in params))


@dataclass(frozen=True)
class SampleInputs:
    """A step's per-row sampling inputs, on the logits' device, and their `SamplePlan`.

    ``ints`` int64 [5, R]: key, counter (see `uniforms`), top-k (0: off), greedy (1) and "sampling" log-probs
    (1) per row; ``floats`` float32 [3, R]: temperature, the log-probs' temperature (`_logprob_temperature`)
    and top-p. A greedy row's temperature, top-k and top-p are neutral (1, 0, 1), so every row can go through
    every pass of the plan; a row of 0 ints and 1 floats samples at temperature 1 without a filter under any
    plan (a padded row of a static step, rlhf/engine/static_decode.py). ``top_k_rows`` / ``top_p_rows``: the
    rows that filter by top-k / top-p (int64 indices), when only some do, or None: every row goes through the
    pass. An eager step passes only those rows (top-p sorts each row it filters: most of a mixed step's time
    on a CPU); a recorded one has none, since its shapes cannot depend on the rows' settings.
    """

    ints: torch.Tensor
    floats: torch.Tensor
    plan: SamplePlan
    top_k_rows: torch.Tensor | None = None
    top_p_rows: torch.Tensor | None = None

    @classmethod
    def of(cls, params: list[SamplingParams], keys: list[int], counters: list[int],
           device: torch.device | str = "cpu") -> SampleInputs:
        """The inputs of rows with ``params``, ``keys`` and ``counters`` (one each per row), copied to ``device``
        without waiting for the queued kernels: the step's only host-device sync stays the engine's read of
        the sampled tokens."""
        ints = [keys, counters, [0 if p.greedy else p.top_k for p in params], [int(p.greedy) for p in params],
                [int(not p.greedy and p.logprobs_of == "sampling") for p in params]]
        floats = [[1.0 if p.greedy else p.temperature for p in params], [_logprob_temperature(p) for p in params],
                  [1.0 if p.greedy else p.top_p for p in params]]

        def some(rows: list[int]) -> torch.Tensor | None:
            return torch.tensor(rows).to(device, non_blocking=True) if 0 < len(rows) < len(params) else None
        return cls(torch.tensor(ints, dtype=torch.int64).to(device, non_blocking=True),
                   torch.tensor(floats, dtype=torch.float32).to(device, non_blocking=True), SamplePlan.of(params),
                   some([row for row, k in enumerate(ints[2]) if k]),
                   some([row for row, p in enumerate(floats[2]) if p < 1.0]))

    @property
    def greedy(self) -> torch.Tensor:
        return self.ints[3] != 0


def _top_k_drop(x: torch.Tensor, k: torch.Tensor, width: int) -> torch.Tensor:
    """Where x [R, V] lies below its row's k-th largest value, for the rows whose k [R] is in [1, V) (``width``
    >= every such k: the width of the top-k pass)."""
    vocab = x.shape[-1]
    width = min(width, vocab)
    kth = torch.topk(x, width).values.gather(-1, k.clamp(1, width)[:, None] - 1)
    return (x < kth) & ((k > 0) & (k < vocab))[:, None]


def _top_p_drop(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Where a token of x [R, V] falls outside its row's nucleus, for the rows whose p [R] is below 1: the
    tokens before it in descending order already hold mass >= p (so at least one token is kept)."""
    sorted_x, order = torch.sort(x, descending=True)
    probs = sorted_x.softmax(-1)
    drop = (probs.cumsum(-1) - probs >= p[:, None]) & (p < 1.0)[:, None]
    return torch.zeros_like(drop).scatter(-1, order, drop)  # back to vocab order


def _drop_rows(x: torch.Tensor, index: torch.Tensor | None, drop, setting: torch.Tensor, *args) -> torch.Tensor:
    """x with -inf where ``drop(x, setting, *args)`` says (``setting`` [R]: each row's k or p), for the rows
    ``index`` only, or for every row when it is None."""
    if index is None:
        return x.masked_fill(drop(x, setting, *args), float("-inf"))
    rows = x[index]
    return x.index_copy(0, index, rows.masked_fill(drop(rows, setting[index], *args), float("-inf")))


def filter_logits(logits: torch.Tensor, rows: SampleInputs) -> torch.Tensor:
    """Logits [S, V] divided by each row's temperature, with the tokens outside that row's top-k, then top-p,
    set to -inf; all rows at once (rows with different settings share one batch)."""
    x = logits / rows.floats[0, :, None]
    if rows.plan.top_k:
        x = _drop_rows(x, rows.top_k_rows, _top_k_drop, rows.ints[2], rows.plan.top_k)
    if rows.plan.top_p:
        x = _drop_rows(x, rows.top_p_rows, _top_p_drop, rows.floats[2])
    return x


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


def sample(logits: torch.Tensor, rows: SampleInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their log-probs for each row of ``logits`` [S, V] (float32), per ``rows`` (S rows).

    Returns (tokens [S] int64, logprobs [S] float32). Log-probs are, per row's
    ``logprobs_of``: log_softmax(logits / T) with no top-k/top-p (``"tempered"``,
    what a trainer computing log-probs at the sampling temperature gets), of the
    raw logits (``"raw"``, T = 1) or of the filtered distribution that was sampled
    from (``"sampling"``); greedy rows report raw log-probs in every mode. Every id
    of the model's vocabulary can be drawn; padded ids arrive as -inf and never are
    (see docs/engine.md on vocabulary padding). Each sampled row takes the uniform of
    its key and counter (`uniforms`) and `inverse_cdf` picks every row's token. Every
    row goes through the passes of ``rows.plan`` and keeps its own result (no row is
    gathered out by a host list), so the step has fixed shapes and no host sync.
    """
    plan = rows.plan
    x = logits / rows.floats[1, :, None] if plan.tempered else logits  # the reported distribution's logits
    top = x.max(-1, keepdim=True).values
    weights = (x - top).exp_()  # its probabilities, times a constant per row: no [S, V] log-probs are kept
    log_total = weights.sum(-1, keepdim=True).log_()
    # the greedy rows' tokens (their temperature above is 1); an argmax costs a pass over the vocabulary
    tokens = x.argmax(dim=-1) if plan.greedy else None
    if plan.sampled:
        u = uniforms(rows.ints[0], rows.ints[1])
        if plan.filtered:
            filtered = filter_logits(logits, rows)
            drawn = inverse_cdf(filtered.softmax(-1), u)
        else:  # the reported distribution is the sampled one
            drawn = inverse_cdf(weights, u)
        tokens = drawn if tokens is None else torch.where(rows.greedy, tokens, drawn)
    logprobs = ((x.gather(-1, tokens[:, None]) - top) - log_total).squeeze(-1)  # as log_softmax rounds it
    if not plan.within:
        return tokens, logprobs
    within = (filtered.gather(-1, tokens[:, None]) - filtered.logsumexp(-1, keepdim=True)).squeeze(-1)
    return tokens, torch.where(rows.ints[4] != 0, within, logprobs)
