"""rlhf/batch.py: construction from engine results, position -> response
alignment, split/concat/select, validation, and AdvantageInputs.from_batch."""
import pytest
import torch

from rlhf.algorithms import AdvantageConfig, AdvantageInputs, compute_advantages
from rlhf.batch import TENSOR_FIELDS, Batch
from rlhf.engine.types import SampleResult

PAD = 99


def _sample(request_id, index, prompt, tokens, reason):
    logprobs = tuple(-0.5 * (index + 1) - 0.125 * k for k in range(len(tokens)))
    return SampleResult(request_id, index, tuple(prompt), tuple(tokens), logprobs, reason, 0.0)


def _random_batch(seed: int, n: int, extra_t: int = 2, extra_r: int = 1) -> Batch:
    """A valid batch with every optional field set; pads and zeros where the convention says."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, 6, (n,), generator=g)
    response_lengths = torch.randint(0, 5, (n,), generator=g)
    width = int((prompt_lengths + response_lengths).max()) + extra_t
    response_width = int(response_lengths.max()) + extra_r
    tokens = torch.full((n, width), PAD)
    mask = torch.zeros(n, response_width)
    for i in range(n):
        used = int(prompt_lengths[i] + response_lengths[i])
        tokens[i, :used] = torch.randint(0, 50, (used,), generator=g)
        mask[i, :int(response_lengths[i])] = 1.0

    def response_field():
        return torch.randn(n, response_width, generator=g) * mask

    routing = torch.randint(0, 4, (n, width, 2, 2), generator=g, dtype=torch.int16)
    routing[torch.arange(width) >= (prompt_lengths + response_lengths - 1).unsqueeze(1)] = -1
    return Batch(tokens=tokens, pad_id=PAD, prompt_lengths=prompt_lengths, response_lengths=response_lengths,
                 prompt_ids=torch.arange(n) // 2, sample_indices=torch.arange(n) % 2,
                 finish_reasons=tuple(("stop", "length", "context")[i % 3] for i in range(n)),
                 rollout_logprobs=response_field(), old_logprobs=response_field(), ref_logprobs=response_field(),
                 values=response_field(), advantages=response_field(), returns=response_field(),
                 policy_versions=response_field(), loss_mask=mask * (torch.rand(n, response_width, generator=g) > 0.3),
                 turn_rewards=response_field(),
                 scores=torch.randn(n, generator=g), sample_mask=(torch.rand(n, generator=g) > 0.3).float(),
                 routing=routing)


def _assert_same(a: Batch, b: Batch) -> None:
    assert a.pad_id == b.pad_id and a.finish_reasons == b.finish_reasons
    for name in TENSOR_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name


def test_from_samples_exact_layout():
    samples = [
        _sample("q0", 0, [5, 6, 7], [8, 9], "stop"),
        _sample("q0", 1, [5, 6, 7], [10], "length"),
        _sample("q1", 0, [11], [12, 13, 14, 15], "context"),
        _sample("q2", 0, [16, 17], [], "length"),
    ]
    batch = Batch.from_samples(samples, pad_id=PAD, prompt_ids={"q0": 4, "q1": 2, "q2": 7})
    assert torch.equal(batch.tokens, torch.tensor([
        [5, 6, 7, 8, 9],
        [5, 6, 7, 10, PAD],
        [11, 12, 13, 14, 15],
        [16, 17, PAD, PAD, PAD],
    ]))
    assert batch.tokens.dtype == torch.int64 and batch.pad_id == PAD
    assert batch.prompt_lengths.tolist() == [3, 3, 1, 2]
    assert batch.response_lengths.tolist() == [2, 1, 4, 0]
    assert batch.sequence_lengths.tolist() == [5, 4, 5, 2]
    assert batch.prompt_ids.tolist() == [4, 4, 2, 7]
    assert batch.sample_indices.tolist() == [0, 1, 0, 0]
    assert batch.finish_reasons == ("stop", "length", "context", "length")
    assert batch.response_width == 4 and len(batch) == 4
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float32)
    assert batch.response_mask.dtype == torch.float32 and torch.equal(batch.response_mask, mask)
    want_logprobs = torch.tensor([[-0.5, -0.625, 0, 0], [-1.0, 0, 0, 0], [-0.5, -0.625, -0.75, -0.875], [0, 0, 0, 0]])
    assert batch.old_logprobs.dtype == torch.float32 and torch.equal(batch.old_logprobs, want_logprobs)
    assert all(getattr(batch, f) is None for f in ("ref_logprobs", "values", "advantages", "returns", "scores",
                                                   "policy_versions"))


def test_from_samples_keeps_each_tokens_policy_version():
    """An asynchronous run's engine records the weights' version per token: as floats, zero past the response."""
    samples = [SampleResult("q0", 0, (1,), (2, 3, 4), (-1.0, -1.0, -1.0), "stop", 0.0, (3, 3, 4)),
               SampleResult("q1", 0, (1,), (5,), (-1.0,), "stop", 0.0, (4,))]
    batch = Batch.from_samples(samples, PAD, {"q0": 0, "q1": 1})
    assert torch.equal(batch.policy_versions, torch.tensor([[3.0, 3.0, 4.0], [4.0, 0.0, 0.0]]))
    bad = SampleResult("q0", 0, (1,), (2, 3), (-1.0, -1.0), "stop", 0.0, (3,))
    with pytest.raises(ValueError, match=r"have policy_versions but not one per token"):
        Batch.from_samples([bad], PAD, {"q0": 0})


def test_from_samples_puts_each_computed_positions_experts_at_its_token():
    """A MoE engine's record ([P + R - 1, layers, k]: the last token is never computed) lands at the samples'
    positions, -1 at the last token and the padding; concat and with_fields_from pad with -1; the padding
    mask is True past each sample's tokens."""
    first = torch.arange(4 * 3 * 2, dtype=torch.int16).reshape(4, 3, 2)  # P=3, R=2
    second = -torch.ones(1, 3, 2, dtype=torch.int16) * 7  # P=1, R=1
    samples = [SampleResult("a", 0, (1, 2, 3), (4, 5), (-1.0, -1.0), "stop", 0.0, routing=first),
               SampleResult("b", 0, (6,), (7,), (-1.0,), "stop", 0.0, routing=second)]
    batch = Batch.from_samples(samples, PAD, {"a": 0, "b": 1})
    assert batch.routing.shape == (2, 5, 3, 2) and batch.routing.dtype == torch.int16
    assert torch.equal(batch.routing[0, :4], first) and (batch.routing[0, 4] == -1).all()
    assert torch.equal(batch.routing[1, :1], second) and (batch.routing[1, 1:] == -1).all()
    assert batch.padding_mask().tolist() == [[False] * 5, [False, False, True, True, True]]
    narrow = Batch.from_samples(samples[1:], PAD, {"b": 1})
    joined = Batch.concat([narrow, batch])
    assert joined.routing.shape == (3, 5, 3, 2) and (joined.routing[0, 1:] == -1).all()
    back = batch.with_fields(routing=None).with_fields_from([narrow, batch.select([0])], ["routing"])
    assert torch.equal(back.routing, batch.routing)
    assert Batch.from_samples([_sample("c", 0, [1], [2], "stop")], PAD, {"c": 0}).routing is None


def test_from_samples_refuses_unmapped_requests_and_uneven_logprobs():
    with pytest.raises(ValueError, match=r"request ids \['q1'\] have no entry in prompt_ids"):
        Batch.from_samples([_sample("q0", 0, [1], [2], "stop"), _sample("q1", 0, [1], [2], "stop")], PAD, {"q0": 0})
    bad = SampleResult("q0", 0, (1,), (2, 3), (-1.0,), "stop", 0.0)
    with pytest.raises(ValueError, match=r"len\(logprobs\) != len\(tokens\)"):
        Batch.from_samples([bad], PAD, {"q0": 0})


@pytest.mark.parametrize("extra_positions", [-1, 0, 3])  # T' = T - 1, T, T + 2
def test_response_from_positions_matches_loop(extra_positions):
    batch = _random_batch(seed=1, n=7)
    width = batch.tokens.shape[1] + extra_positions
    per_position = torch.randn(len(batch), width, generator=torch.Generator().manual_seed(2))
    want = torch.zeros(len(batch), batch.response_width)
    for i in range(len(batch)):
        p = int(batch.prompt_lengths[i])
        for k in range(int(batch.response_lengths[i])):
            want[i, k] = per_position[i, p - 1 + k]
    assert torch.equal(batch.response_from_positions(per_position), want)


def test_response_from_positions_turns_next_token_logprobs_into_old_logprobs():
    # Log-probs computed per position (of tokens[:, t+1] at t) land where the engine's did.
    samples = [_sample("a", 0, [3, 4, 5], [6, 7], "stop"), _sample("b", 0, [8], [9, 10, 11], "length")]
    batch = Batch.from_samples(samples, PAD, {"a": 0, "b": 1})
    per_position = torch.full((2, batch.tokens.shape[1] - 1), 123.0)
    per_position[0, 2:4] = torch.tensor(samples[0].logprobs)  # predicts tokens 3, 4
    per_position[1, 0:3] = torch.tensor(samples[1].logprobs)  # predicts tokens 1, 2, 3
    assert torch.equal(batch.response_from_positions(per_position), batch.old_logprobs)
    with pytest.raises(ValueError, match=r"per_position shape \(2, 3\).*T' >= 4"):
        batch.response_from_positions(per_position[:, :3])


@pytest.mark.parametrize("sizes", [1, 3, 4, 9, [2, 0, 5, 2], [9], [0, 9]])
def test_split_then_concat_is_identity(sizes):
    batch = _random_batch(seed=3, n=9)
    parts = batch.split(sizes)
    want_sizes = sizes if isinstance(sizes, list) else [9 // sizes + (i < 9 % sizes) for i in range(sizes)]
    assert [len(p) for p in parts] == want_sizes
    start = 0
    for part in parts:  # each part is its own contiguous rows
        _assert_same(part, batch.select(range(start, start + len(part))))
        start += len(part)
    _assert_same(Batch.concat(parts), batch)


def test_split_near_equal_and_bad_sizes():
    batch = _random_batch(seed=4, n=7)
    assert [len(p) for p in batch.split(3)] == [3, 2, 2]
    with pytest.raises(ValueError, match="summing to len"):
        batch.split([3, 3])
    with pytest.raises(ValueError, match="count >= 1"):
        batch.split(0)


def test_micro_batches_by_samples_or_by_a_token_budget():
    """Without a budget: near-equal parts of at most ``size`` samples. With one: consecutive samples while
    their tokens fit (next-fit), whatever ``size``; a sample longer than the budget is refused naming it."""
    batch = _random_batch(seed=5, n=9)
    assert [len(p) for p in batch.micro_batches(4)] == [3, 3, 3]
    lengths = batch.sequence_lengths.tolist()
    for budget in (max(lengths), 12, 20, sum(lengths)):
        parts = batch.micro_batches(4, budget)
        _assert_same(Batch.concat(parts), batch)  # every sample once, in order
        used = [int(p.sequence_lengths.sum()) for p in parts]
        assert max(used) <= budget
        # next-fit: each part ends because the next sample would not fit
        assert all(u + int(nxt.sequence_lengths[0]) > budget for u, nxt in zip(used, parts[1:]))
    longest = max(range(9), key=lengths.__getitem__)
    with pytest.raises(ValueError, match=rf"budget of {max(lengths) - 1} tokens is smaller than sample {longest} "
                                         rf"\({max(lengths)} tokens"):
        batch.micro_batches(4, max(lengths) - 1)


def test_micro_batches_of_a_fixed_count_are_balanced_by_tokens():
    """With a count (a fused schedule's): exactly that many parts, every sample once, tokens balanced as
    Karmarkar-Karp balances them; a part over the budget is refused."""
    from rlhf.algorithms import karmarkar_karp

    batch = _random_batch(seed=6, n=9)
    lengths = batch.sequence_lengths.tolist()
    parts = batch.micro_batches(4, sum(lengths), count=3)
    assert len(parts) == 3
    rows = sorted(int(i) * 2 + int(j) for p in parts for i, j in zip(p.prompt_ids, p.sample_indices))
    assert rows == [int(i) * 2 + int(j) for i, j in zip(batch.prompt_ids, batch.sample_indices)]
    loads = sorted(int(p.sequence_lengths.sum()) for p in parts)
    assert loads == sorted(sum(lengths[i] for i in part) for part in karmarkar_karp(lengths, 3))
    with pytest.raises(ValueError, match=rf"need {loads[-1]} tokens in one, over the budget of {loads[-1] - 1}"):
        batch.micro_batches(4, loads[-1] - 1, count=3)


@pytest.mark.parametrize("indices", [[4, 0, 3, 1, 2], [2, 2, 0, 4, 2, 0], []])
def test_select_matches_per_sample_rows(indices):
    batch = _random_batch(seed=5, n=5)
    picked = batch.select(indices)
    assert len(picked) == len(indices)
    assert picked.finish_reasons == tuple(batch.finish_reasons[i] for i in indices)
    for name in TENSOR_FIELDS:
        for row, i in enumerate(indices):
            assert torch.equal(getattr(picked, name)[row], getattr(batch, name)[i]), (name, row)
    with pytest.raises(ValueError, match=r"expected indices in \[0, 5\)"):
        batch.select([0, 5])


def test_concat_pads_tokens_and_response_fields():
    narrow = Batch.from_samples([_sample("a", 0, [1, 2], [3], "stop")], PAD, {"a": 0})
    wide = Batch.from_samples([_sample("b", 0, [4], [5, 6, 7], "length")], PAD, {"b": 1})
    joined = Batch.concat([narrow, wide])
    assert torch.equal(joined.tokens, torch.tensor([[1, 2, 3, PAD], [4, 5, 6, 7]]))
    assert torch.equal(joined.old_logprobs, torch.tensor([[-0.5, 0, 0], [-0.5, -0.625, -0.75]]))
    assert torch.equal(joined.response_mask, torch.tensor([[1.0, 0, 0], [1, 1, 1]]))
    assert joined.prompt_ids.tolist() == [0, 1] and joined.finish_reasons == ("stop", "length")


def test_with_fields_and_to():
    batch = Batch.from_samples([_sample("a", 0, [1, 2], [3, 4], "stop")], PAD, {"a": 0})
    ref = torch.tensor([[-1.0, -2.0]])
    added = batch.with_fields(ref_logprobs=ref, scores=torch.tensor([0.5]))
    assert batch.ref_logprobs is None and added.ref_logprobs is ref and torch.equal(added.tokens, batch.tokens)
    with pytest.raises(ValueError, match="Batch.with_fields: unknown fields \\['ref_logprob'\\]"):
        batch.with_fields(ref_logprob=ref)
    moved = added.to("meta")  # metadata stays on the host
    assert moved.tokens.is_meta and moved.old_logprobs.is_meta and moved.scores.is_meta
    assert not moved.prompt_lengths.is_meta and moved.prompt_lengths.tolist() == [2]


def test_with_fields_from_puts_outputs_back_by_sample():
    """Outputs of replicas (any order, narrower R) land on their own samples, padded with zeros."""
    batch = _random_batch(seed=9, n=6).with_fields(ref_logprobs=None, scores=None)
    mask = batch.response_mask
    ref = torch.randn(6, batch.response_width) * mask
    scores = torch.randn(6)
    bare = batch.with_fields(rollout_logprobs=None, old_logprobs=None, values=None, advantages=None, returns=None,
                             policy_versions=None, loss_mask=None, turn_rewards=None)
    parts = []
    for index in ([4, 1], [0, 5, 2], [3]):  # three replicas' shares
        part = bare.select(index)
        width = int(part.response_lengths.max())  # a sub-batch built from its own samples is narrower
        parts.append(part.with_fields(ref_logprobs=ref[index][:, :width]))
        parts.append(part.with_fields(scores=scores[index]))
    out = batch.with_fields_from(parts[::-1], ["ref_logprobs", "scores"])
    assert torch.equal(out.ref_logprobs, ref) and torch.equal(out.scores, scores)
    assert torch.equal(out.old_logprobs, batch.old_logprobs)
    with pytest.raises(ValueError, match=r"the parts' scores rows are samples \[0, 1, 2, 3, 4, 5, 5\]"):
        batch.with_fields_from(parts + [bare.select([5]).with_fields(scores=scores[[5]])], ["scores"])
    with pytest.raises(ValueError, match=r"rows are samples \[0, 1, 2, 4, 5\]; expected each"):
        batch.with_fields_from(parts[:-2] + parts[-1:], ["ref_logprobs"])


def _bad(batch: Batch, **fields):
    return lambda: batch.with_fields(**fields)


def _validation_cases():
    b = Batch.from_samples([_sample("a", 0, [1, 2], [3, 4], "stop"), _sample("a", 1, [1, 2], [5], "length")],
                           PAD, {"a": 0})
    return [
        ("prompt_ids", r"Batch.prompt_ids: got shape \(3,\).*N = 2", _bad(b, prompt_ids=torch.tensor([0, 0, 0]))),
        ("values rows", r"Batch.values: got shape \(3, 2\).*N = 2", _bad(b, values=torch.zeros(3, 2))),
        ("R too small", r"Batch.rollout_logprobs: got shape \(2, 1\).*R >= 2 = max\(response_lengths\)",
         _bad(b, rollout_logprobs=torch.zeros(2, 1), old_logprobs=torch.zeros(2, 1))),
        ("R differs", r"Batch.values: got shape \(2, 3\).*R = 2 columns, as rollout_logprobs",
         _bad(b, values=torch.zeros(2, 3))),
        ("T too small", r"Batch.tokens: got shape \(2, 3\).*T >= 4", _bad(b, tokens=b.tokens[:, :3])),
        ("tokens dtype", r"Batch.tokens: got shape \(2, 4\) torch.float32.*int64", _bad(b, tokens=b.tokens.float())),
        ("logprobs dtype", r"Batch.ref_logprobs: got shape \(2, 2\) torch.int64.*floating",
         _bad(b, ref_logprobs=torch.zeros(2, 2, dtype=torch.int64))),
        ("lengths dtype", r"Batch.response_lengths: got shape \(2,\) torch.int32",
         _bad(b, response_lengths=torch.tensor([2, 1], dtype=torch.int32))),
        ("finish reason", r"Batch.finish_reasons: got 'eos'; expected each one of", _bad(b, finish_reasons=("stop", "eos"))),
        ("finish count", r"Batch.finish_reasons: got 1 reasons", _bad(b, finish_reasons=("stop",))),
        ("empty prompt", r"Batch.prompt_lengths: got a value 0; expected values >= 1",
         _bad(b, prompt_lengths=torch.tensor([0, 2]))),
        ("host metadata", r"Batch.sample_indices: got .* on meta; expected a CPU tensor",
         _bad(b, sample_indices=torch.zeros(2, dtype=torch.int64, device="meta"))),
        ("scores device", r"Batch.scores: got .* on meta; expected a tensor on cpu", _bad(b, scores=torch.zeros(2, device="meta"))),
        ("pad_id", r"Batch.pad_id: got 1.5", _bad(b, pad_id=1.5)),
        ("routing shape", r"Batch.routing: got shape \(2, 3, 1, 2\).*\[N, T\] = \[2, 4\]",
         _bad(b, routing=torch.zeros(2, 3, 1, 2, dtype=torch.int16))),
        ("routing dtype", r"Batch.routing: got shape \(2, 4, 1, 2\) torch.int64.*int16",
         _bad(b, routing=torch.zeros(2, 4, 1, 2, dtype=torch.int64))),
        ("concat fields", r"Batch.concat: Batch.scores is None in batches \[0\]",
         lambda: Batch.concat([b, b.with_fields(scores=torch.zeros(2))])),
        ("concat pad_id", r"Batch.concat: pad_id differs between batches \(\[0, 99\]\)",
         lambda: Batch.concat([b, b.with_fields(pad_id=0)])),
        ("concat empty", r"Batch.concat: got no batches", lambda: Batch.concat([])),
    ]


@pytest.mark.parametrize("case", _validation_cases(), ids=lambda c: c[0])
def test_validation_names_the_field(case):
    _, message, build = case
    with pytest.raises(ValueError, match=message):
        build()


def test_advantage_inputs_from_batch_grpo_groups_by_prompt_id():
    batch = _random_batch(seed=6, n=8).with_fields(prompt_ids=torch.tensor([3, 0, 3, 0, 1, 1, 3, 2]))
    rewards = torch.randn(len(batch), batch.response_width) * batch.response_mask
    penalty = torch.randn(len(batch), batch.response_width) * batch.response_mask
    config = AdvantageConfig(estimator="grpo")
    got = compute_advantages(AdvantageInputs.from_batch(batch, rewards, penalty), config)
    mask = torch.zeros(len(batch), batch.response_width)
    for i, length in enumerate(batch.response_lengths.tolist()):
        mask[i, :length] = 1
    mask = mask * batch.loss_mask * batch.sample_mask[:, None]  # the observations' holes, the dropped samples' rows
    assert 0 < batch.sample_mask.sum() < len(batch)
    by_hand = AdvantageInputs(rewards, mask, scores=batch.scores, group_index=torch.tensor([3, 0, 3, 0, 1, 1, 3, 2]),
                              sample_mask=batch.sample_mask, kl_penalty=penalty)
    want = compute_advantages(by_hand, config)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"token_rewards shape \(8, 1\)"):
        AdvantageInputs.from_batch(batch, rewards[:, :1], penalty)
    with pytest.raises(ValueError, match=r"kl_penalty shape \(8, 1\)"):
        AdvantageInputs.from_batch(batch, rewards, penalty[:, :1])


def test_advantage_inputs_from_batch_gae_uses_values_and_mask():
    batch = _random_batch(seed=7, n=6)
    rewards = torch.randn(len(batch), batch.response_width)
    inputs = AdvantageInputs.from_batch(batch, rewards, torch.zeros_like(rewards))
    assert inputs.values is batch.values and inputs.scores is batch.scores
    assert torch.equal(inputs.group_index, batch.prompt_ids)
    config = AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8)
    want = compute_advantages(AdvantageInputs(rewards, batch.response_mask, values=batch.values), config)
    torch.testing.assert_close(compute_advantages(inputs, config), want, rtol=0, atol=0)
