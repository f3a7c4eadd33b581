"""Sampler filters, log-prob modes, counter-based draws and seed mixing (no model)."""

import math
import random

import pytest
import torch

from rlhf.engine.sampler import CDF_CHUNK, SampleInputs, SamplePlan, filter_logits, inverse_cdf, mixed_seed, sample, \
    uniforms
from rlhf.engine.types import EngineConfigError, SamplingParams

NEG = float("-inf")
MASK64 = (1 << 64) - 1


def reference_uniform(key: int, counter: int) -> float:
    """Output number ``counter`` of splitmix64 seeded with ``key`` (Steele et al. 2014), in Python ints: its top 24
    bits as a fraction."""
    z = (key + (counter + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return ((z ^ (z >> 31)) >> 40) / 2**24


def inputs(params: list[SamplingParams], keys=None, counters=None) -> SampleInputs:
    """`SampleInputs` of ``params`` (keys and counters 0 unless given)."""
    return SampleInputs.of(params, keys or [0] * len(params), counters or [0] * len(params))


def reference_kept(row: torch.Tensor, p: SamplingParams) -> list[int]:
    """The ids a row keeps, in float64 and plain Python: its top_k largest of logits / T, then the most
    likely of those while the mass before each is below top_p."""
    x = (row.double() / p.temperature).tolist()
    order = sorted(range(len(x)), key=lambda i: -x[i])[:p.top_k or None]
    weights = [math.exp(x[i] - x[order[0]]) for i in order]
    kept, before = [], 0.0
    for i, w in zip(order, weights):
        if before >= p.top_p * sum(weights):
            break
        kept.append(i)
        before += w
    return sorted(kept)


def reference_probs(row: torch.Tensor, p: SamplingParams) -> dict[int, float]:
    """The filtered distribution over the kept ids (float64)."""
    kept = reference_kept(row, p)
    weights = [math.exp(row[i].item() / p.temperature) for i in kept]
    return {i: w / sum(weights) for i, w in zip(kept, weights)}


def reference_token(row: torch.Tensor, p: SamplingParams, key: int, counter: int) -> int:
    """A plain per-row inverse CDF: the first kept id whose cumulative probability exceeds the row's uniform."""
    u = reference_uniform(key, counter)
    cumulative = 0.0
    for i, prob in sorted(reference_probs(row, p).items()):
        cumulative += prob
        if cumulative > u:
            return i
    return i


def test_top_k_and_top_p_keep_exactly_the_expected_tokens():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=1.0, top_p=0.1), SamplingParams(temperature=2.0)]
    # probs of [3, 2, 1, 0] are about [.64, .24, .09, .03]: top_p=0.8 keeps the first two
    assert filter_logits(logits.expand(4, 4), inputs(params)).tolist() == [
        [NEG, 3.0, NEG, 2.0], [NEG, 3.0, NEG, 2.0], [NEG, 3.0, NEG, NEG], [0.0, 1.5, 0.5, 1.0]]


def test_batched_filter_matches_a_per_row_reference_whatever_the_batch():
    """Rows with their own temperature, top_k and top_p in one batch keep what each would alone."""
    torch.manual_seed(2)
    logits = torch.randn(7, 300) * 3
    params = [SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.3, top_p=0.9),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.9, top_k=50, top_p=0.8),
              SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=1.0, top_k=300, top_p=0.5),
              SamplingParams(temperature=0.5, top_k=7, top_p=0.999)]
    batched = filter_logits(logits, inputs(params))
    for row, p in enumerate(params):
        expected = torch.full((300,), NEG)
        kept = reference_kept(logits[row], p)
        expected[kept] = logits[row, kept] / p.temperature
        assert torch.equal(batched[row], expected), p
        assert torch.equal(filter_logits(logits[row:row + 1], inputs([p]))[0], expected)


def test_uniforms_equal_splitmix64_in_python_ints():
    """The device arithmetic (int64 tensors in 32-bit halves) gives the Python-int splitmix64's bits on 20,000
    random (key, counter) pairs and on the edges of both ranges."""
    rng = random.Random(0)
    keys = [rng.randrange(2**63) for _ in range(20_000)] + [0, 2**63 - 1, 2**32 - 1, 2**32] * 3
    counters = [rng.randrange(2**32) for _ in range(20_000)] + [0] * 4 + [2**32 - 1] * 4 + [1, 2**31, 7, 2**16]
    got = uniforms(torch.tensor(keys), torch.tensor(counters))
    assert got.dtype == torch.float32
    assert got.tolist() == [reference_uniform(k, c) for k, c in zip(keys, counters)]


def test_uniforms_are_uniform_along_a_sample_and_across_samples():
    """10**5 draws as the engine makes them (counters 0..999 of 100 mixed keys) and one long stream of one key:
    the mean within 4 standard errors of 1/2, and a chi-square over 100 equal bins with p > 1e-4."""
    keys = torch.tensor([mixed_seed(11, i) for i in range(100)]).repeat_interleave(1000)
    counters = torch.arange(1000).repeat(100)
    for u in (uniforms(keys, counters), uniforms(torch.full((10**5,), mixed_seed(5)), torch.arange(10**5))):
        n = u.numel()
        assert u.min() >= 0 and u.max() < 1
        assert abs(u.double().mean().item() - 0.5) < 4 * (1 / 12 / n) ** 0.5
        counts = torch.bincount((u * 100).long(), minlength=100).double()
        chi2 = ((counts - n / 100) ** 2 / (n / 100)).sum()
        assert torch.special.gammaincc(torch.tensor(99 / 2, dtype=torch.float64), chi2 / 2) > 1e-4, chi2


def test_greedy_raw_logprobs_and_seeded_draws():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    greedy = SamplingParams()
    toks, lps = sample(logits.clone(), inputs([greedy] * 3))
    assert toks.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(lps, torch.log_softmax(logits, -1).max(-1).values)
    hot = SamplingParams(temperature=1.0, top_k=10, seed=4)
    a = sample(logits[:2].clone(), inputs([hot, greedy], [4, 0], [9, 0]))[0][0]
    b = sample(logits[:1].clone(), inputs([hot], [4], [9]))[0][0]
    assert a == b  # a row's draw is its key's and counter's: batch-independent
    _, lp = sample(logits[:1].clone(), inputs([SamplingParams(temperature=1.0, top_k=1, logprobs_of="sampling")]))
    assert math.isclose(lp.item(), 0.0, abs_tol=1e-6)  # top-1 distribution: probability 1
    unfiltered = SamplingParams(temperature=1.0, logprobs_of="sampling")  # samples the raw distribution
    tok, lp = sample(logits[:1].clone(), inputs([unfiltered], [4], [9]))
    assert tok.item() == reference_token(logits[0], unfiltered, 4, 9)
    assert lp.item() == pytest.approx(torch.log_softmax(logits[0], -1)[tok].item(), abs=1e-6)


def test_seeded_draws_are_a_per_row_inverse_cdf_of_one_uniform():
    """Each sampled row's token is what a plain inverse CDF of its filtered distribution gives at the uniform of
    its key and counter, whatever rows share its batch (greedy ones, other filters, a k at or above the
    vocabulary, which filters nothing)."""
    torch.manual_seed(3)
    kinds = [dict(temperature=1.0), dict(temperature=0.6, top_k=8), dict(temperature=1.4, top_p=0.7),
             dict(temperature=0.8, top_k=16, top_p=0.9), dict(), dict(temperature=0.7, logprobs_of="sampling"),
             dict(temperature=1.0, logprobs_of="raw"), dict(temperature=0.9, top_k=10**6)]
    keys, counters = [mixed_seed(row) for row in range(48)], [row * 37 for row in range(48)]
    for vocab in (64, 4 * CDF_CHUNK):  # one level, and chunks
        logits = torch.randn(48, vocab) * 2
        params = [SamplingParams(seed=row, **kinds[row % len(kinds)]) for row in range(48)]
        for chosen in (range(48), range(0, 48, 8), range(3, 48, 8)):  # mixed rows; only T 1 rows; only greedy
            chosen = list(chosen)
            tokens, _ = sample(logits[chosen], inputs([params[row] for row in chosen], [keys[row] for row in chosen],
                                                      [counters[row] for row in chosen]))
            for j, row in enumerate(chosen):
                p = params[row]
                expected = (logits[row].argmax().item() if p.greedy
                            else reference_token(logits[row], p, keys[row], counters[row]))
                assert tokens[j].item() == expected, (vocab, row, p)


def test_the_plan_names_the_passes_a_batch_needs():
    """Top-k's width is a power of two (few plans, few recorded graphs); greedy rows' filters count for nothing."""
    plain, greedy = SamplingParams(temperature=1.0), SamplingParams(top_k=5, top_p=0.5, logprobs_of="sampling")
    assert SamplePlan.of([plain, plain]) == SamplePlan(greedy=False, sampled=True, filtered=False, top_k=0,
                                                        top_p=False, within=False, tempered=False)
    assert SamplePlan.of([greedy]) == SamplePlan(greedy=True, sampled=False, filtered=False, top_k=0, top_p=False,
                                                 within=False, tempered=False)
    mixed = SamplePlan.of([plain, greedy, SamplingParams(temperature=0.5, top_k=33, logprobs_of="sampling"),
                           SamplingParams(temperature=2.0, top_k=3, top_p=0.9)])
    assert (mixed.greedy, mixed.filtered, mixed.top_k, mixed.top_p, mixed.within, mixed.tempered) == (
        True, True, 64, True, True, True)


def test_inverse_cdf_float_edges_never_pick_a_zero_probability_token():
    """u = 0 and u rounding to 1, padded -inf ids at both ends and inside, probabilities that underflow to 0
    and sums that miss 1, with one level (7 ids) and two (49,152 ids in chunks of CDF_CHUNK, whole chunks of
    zeros among them): the token always has nonzero probability, and u = 1 takes the last one."""
    rows = torch.tensor([[NEG, NEG, 0.0, NEG, 1.0, -200.0, NEG],
                         [NEG, 2.0, -150.0, 2.0, NEG, 1e-3, NEG],
                         [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]).softmax(-1)
    positive = rows > 0
    one_below = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)).item()
    for u in (0.0, 1e-30, 0.5, one_below, 1.0):
        tokens = inverse_cdf(rows, torch.full((3,), u))
        assert all(positive[row, token] for row, token in enumerate(tokens.tolist())), u
    assert inverse_cdf(rows, torch.zeros(3)).tolist() == [2, 1, 0]
    assert inverse_cdf(rows, torch.ones(3)).tolist() == [4, 5, 6]
    # every u on the boundaries of the cumulative sums, and between them
    cdf = rows.cumsum(-1)
    grid = torch.cat([cdf / cdf[:, -1:], torch.linspace(0, 1, 1001).expand(3, 1001)], dim=1)
    for column in grid.T:
        assert positive.gather(1, inverse_cdf(rows, column)[:, None]).all()
    many = torch.randn(4, 49152) * 8
    many[:, -100:] = NEG
    many[:, :CDF_CHUNK] = NEG  # the first chunk holds nothing
    many[1, 5 * CDF_CHUNK:9 * CDF_CHUNK] = NEG
    many = many.softmax(-1)
    assert (many.cumsum(-1)[:, -1] != 1).any()  # 49,152 float32 terms: the sum misses 1
    chunk_sums = many.view(4, -1, CDF_CHUNK).sum(-1).cumsum(-1)
    edges = torch.cat([chunk_sums / chunk_sums[:, -1:], chunk_sums.roll(1, 1) / chunk_sums[:, -1:]], dim=1)
    for column in torch.cat([edges, torch.tensor([[0.0, 1e-30, one_below, 1.0]]).expand(4, 4)], dim=1).T:
        assert (many.gather(1, inverse_cdf(many, column.contiguous())[:, None]) > 0).all()
    last = inverse_cdf(many, torch.ones(4))  # u = 1: in the last chunk that raises the sum of chunks
    assert torch.equal(last // CDF_CHUNK, (chunk_sums == chunk_sums[:, -1:]).int().argmax(-1))


def test_token_frequencies_match_the_filtered_distribution():
    """20,000 draws per setting (temperature, top-k, top-p, both; padded -inf ids): a chi-square test of the
    counts against the filtered distribution computed in float64. Under a correct sampler the p-value is
    uniform, so requiring p > 1e-4 fails a correct sampler for one seed in 10,000; an error d in a token of
    probability q adds about 20,000 d**2 / q to the statistic (60 for d = 0.03, q = 0.3), above its 1e-4
    critical value (21 to 37 for these 3 to 11 degrees of freedom). Filtered and padded ids never appear."""
    torch.manual_seed(5)
    row = torch.cat([torch.randn(12) * 1.5, torch.full((4,), NEG)])
    settings = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=4),
                SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, top_k=6, top_p=0.9)]
    draws = 20_000
    params = [p for p in settings for _ in range(draws)]
    # as the engine draws: 800 samples (keys) of 100 tokens (counters) per setting
    keys, counters = [mixed_seed(7, i // 100) for i in range(len(params))], [i % 100 for i in range(len(params))]
    tokens, _ = sample(row.expand(len(params), 16), inputs(params, keys, counters))
    for k, p in enumerate(settings):
        counts = torch.bincount(tokens[k * draws:(k + 1) * draws], minlength=16).double()
        probs = reference_probs(row, p)
        expected = torch.zeros(16, dtype=torch.float64)
        expected[list(probs)] = torch.tensor(list(probs.values()), dtype=torch.float64) * draws
        assert counts[expected == 0].sum() == 0, p  # nothing outside the filter, no padded id
        kept = expected > 0
        chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum()
        p_value = torch.special.gammaincc(torch.tensor((kept.sum().item() - 1) / 2.0, dtype=torch.float64), chi2 / 2)
        assert p_value > 1e-4, (p, chi2.item(), counts.tolist(), expected.tolist())


def test_logprob_modes_tempered_raw_and_sampling():
    """tempered = log_softmax(logits / T) of the drawn token, top-k/top-p ignored (verl, OpenRLHF, TRL); raw = T 1;
    sampling = the renormalised filtered distribution; greedy rows report raw log-probs in every mode."""
    torch.manual_seed(1)
    logits = torch.cat([torch.randn(1, 50).expand(3, 50), torch.randn(1, 50)]) * 3
    kw = dict(temperature=0.7, top_k=10, top_p=0.9, seed=3)
    modes = ("tempered", "raw", "sampling")
    params = [SamplingParams(logprobs_of=m, **kw) for m in modes] + [SamplingParams(logprobs_of="tempered")]
    tokens, lps = sample(logits, inputs(params, [3] * 4, [5] * 4))
    assert len(set(tokens[:3].tolist())) == 1  # the same draw from the same logits, key and counter in each mode
    expected = [torch.log_softmax(logits[0] / 0.7, -1), torch.log_softmax(logits[1], -1),
                torch.log_softmax(filter_logits(logits[2:3], inputs(params[2:3]))[0], -1),
                torch.log_softmax(logits[3], -1)]
    for row, logp in enumerate(expected):
        assert lps[row].item() == pytest.approx(logp[tokens[row]].item(), abs=1e-6), modes[row % 3]
    assert lps[2] > lps[0]  # renormalised over the kept tokens
    assert SamplingParams().logprobs_of == "tempered"
    with pytest.raises(EngineConfigError, match="logprobs_of='old' is invalid: must be one of 'tempered', 'raw', "
                                                "'sampling'"):
        SamplingParams(logprobs_of="old")


def test_mixed_seeds_are_deterministic_in_range_and_never_repeat_on_a_grid():
    """Sample seeds mixed from (run seed, iteration, prompt) then the sample index: 491,520 distinct seeds, where
    the old sums ((run * 1_000_003 + it) * 65_537 + prompt * n + i) repeat once prompts x n exceed 65,537."""
    requests = [mixed_seed(run, it, prompt) for run in (0, 1, 2**28 - 1) for it in range(20) for prompt in range(1024)]
    seeds = [mixed_seed(r, i) for r in requests for i in range(8)]
    assert len(set(requests)) == len(requests) and len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    assert mixed_seed(7, 3, 11) == mixed_seed(7, 3, 11) != mixed_seed(7, 11, 3)
    assert mixed_seed(2**64 - 1, 0) >= 0
    old = {(0 * 1_000_003 + it) * 65_537 + prompt * 128 + i for it in range(2) for prompt in range(1024)
           for i in range(128)}
    assert len(old) < 2 * 1024 * 128  # what the mixing replaces
    for bad in (-1, 2**64, 1.5, "3"):
        with pytest.raises(ValueError, match=rf"mixed_seed part {bad!r} is invalid: each part must be an int in "
                                             r"\[0, 2\*\*64\)"):
            mixed_seed(1, bad)
    with pytest.raises(ValueError, match="at least one part"):
        mixed_seed()
    with pytest.raises(EngineConfigError, match=r"seed=-1 is invalid: must be an int in \[0, 2\*\*64\)"):
        SamplingParams(seed=-1)
    with pytest.raises(EngineConfigError, match=r"stop_token_ids=\(2, -1\) is invalid: must be token ids >= 0"):
        SamplingParams(stop_token_ids=(2, -1))
