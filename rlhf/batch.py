"""The sample batch of the PPO trainer (owns how samples are laid out, checked,
cut into micro-batches, reassembled and moved between tasks).

One :class:`Batch` carries N samples between the six tasks of an iteration
(actor generation; reference, reward and critic inference; actor and critic
training). Every field shares the leading sample dimension N; each stage adds
its fields with :meth:`Batch.with_fields` and gets a new, validated batch.

Padding convention (the only one)
    ``tokens`` [N, T]: sample i's prompt is left-aligned at columns
    ``0 .. P_i-1``, its response follows at ``P_i .. P_i+R_i-1``, then
    ``pad_id`` up to T. There is no left padding, so position ids are plain
    ``arange(T)`` and causal attention needs no mask::

        sample 0 (P=3, R=2):   p p p r r . .
        sample 1 (P=1, R=4):   p r r r r . .
        sample 2 (P=4, R=3):   p p p p r r r        (. = pad_id, T = 7)

    Response-aligned fields [N, R] (``rollout_logprobs``, ``old_logprobs``,
    ``ref_logprobs``, ``values``, ``advantages``, ``returns``,
    ``policy_versions``, ``loss_mask``, ``turn_rewards``): column k is
    response token k of the sample, right-padded with zeros past
    ``response_lengths``.

    Position-aligned fields [N, T, ...] (``routing``): column t is the
    token at position t, like ``tokens``; -1 where there is no value.

Where things live
    The per-sample metadata (lengths, prompt ids, sample indices, finish
    reasons) is host data: int64 CPU tensors that :meth:`Batch.to` does not
    move. Validation, splitting by size and token balancing then read lengths
    without a device sync; the per-token tensors and ``scores`` move with
    :meth:`Batch.to`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, NoReturn, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from rlhf.algorithms.balancing import karmarkar_karp
from rlhf.parallel.dealing import part_sizes

if TYPE_CHECKING:
    from rlhf.engine.types import SampleResult

FINISH_REASONS = ("stop", "length", "context")
HOST_FIELDS = ("prompt_lengths", "response_lengths", "prompt_ids", "sample_indices")
RESPONSE_FIELDS = ("rollout_logprobs", "old_logprobs", "ref_logprobs", "values", "advantages", "returns",
                   "policy_versions", "loss_mask", "turn_rewards")
SAMPLE_FIELDS = ("scores", "sample_mask")
POSITION_FIELDS = ("routing",)
OPTIONAL_FIELDS = RESPONSE_FIELDS + SAMPLE_FIELDS + POSITION_FIELDS
TENSOR_FIELDS = ("tokens",) + HOST_FIELDS + OPTIONAL_FIELDS


def _fail(name: str, got: str, expected: str) -> NoReturn:
    raise ValueError(f"Batch.{name}: got {got}; expected {expected}")


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {t.dtype} on {t.device}"


def _check_tensor(name: str, t, dims: int, n: int, floating: bool) -> None:
    """``t`` is a tensor of ``dims`` dims, N rows, int64 (or floating)."""
    kind = "floating" if floating else "int64"
    expected = f"a [N{', R' if dims == 2 else ''}] {kind} tensor with N = {n} (len(tokens))"
    if not isinstance(t, torch.Tensor):
        _fail(name, type(t).__name__, expected)
    dtype_ok = t.dtype.is_floating_point if floating else t.dtype == torch.int64
    if t.dim() != dims or t.shape[0] != n or not dtype_ok:
        _fail(name, _describe(t), expected)


def _max(t: torch.Tensor) -> int:
    # Host tensors only (HOST_FIELDS): no device sync.
    return int(t.max()) if t.numel() else 0


@dataclass(frozen=True, eq=False)
class Batch:
    """N samples with their per-token tensors and per-sample metadata.

    Shapes: tokens [N, T] int64; prompt_lengths, response_lengths, prompt_ids,
    sample_indices [N] int64 on the host; finish_reasons: N of "stop" |
    "length" | "context"; response-aligned fields [N, R] floating, one R for
    the batch, R >= max(response_lengths); scores, sample_mask [N] floating;
    T >= max(prompt_lengths + response_lengths). Optional fields are None
    until their stage ran: rollout_logprobs (generation: the engine's, kept
    as they were sampled), old_logprobs (generation, or recomputed by the
    trainer), ref_logprobs (reference), scores (reward), values (critic),
    advantages and returns (advantage estimation); policy_versions (an
    asynchronous run's generation, rlhf/ppo/asynchronous.py: the number of
    updates applied to the weights that sampled each token, as floats);
    loss_mask (a multi-turn episode's generation, rlhf/envs/episodes.py: 1
    at the model's tokens, 0 at the environment's observations, which are
    in the sequence but out of the losses, the KL and the value targets);
    turn_rewards (the same: each turn's reward at its last token, 0 elsewhere;
    the episode's score is their sum); sample_mask (``--skip-nonfinite-samples``,
    rlhf/ppo/reward_fn.py: 1 for a sample trained on, 0 for one whose score was
    NaN or infinite, whose tokens are then out of ``response_mask`` and so of
    every loss, the KL, the value targets and the whitening, and which the
    outcome estimators leave out of its group's statistics); routing (a
    mixture-of-experts actor's generation: [N, T, L, k] int16, the experts
    each of the L MoE layers chose for the token at each position when the
    engine computed it, -1 where it computed none: each sample's last token
    and the padding; rlhf/models/moe.py replays or compares it).

    prompt_ids: the prompt's index in this iteration's prompts (the n samples
    of one prompt share it; GRPO groups by it); sample_indices: which of those
    n samples.
    """

    tokens: torch.Tensor
    pad_id: int
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    prompt_ids: torch.Tensor
    sample_indices: torch.Tensor
    finish_reasons: tuple[str, ...]
    rollout_logprobs: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    policy_versions: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    turn_rewards: Optional[torch.Tensor] = None
    sample_mask: Optional[torch.Tensor] = None
    routing: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dim() != 2 or self.tokens.dtype != torch.int64:
            got = _describe(self.tokens) if isinstance(self.tokens, torch.Tensor) else type(self.tokens).__name__
            _fail("tokens", got, "an [N, T] int64 tensor")
        if not isinstance(self.pad_id, int) or isinstance(self.pad_id, bool):
            _fail("pad_id", repr(self.pad_id), "an int token id")
        n = len(self)
        self._check_host_fields(n)
        self._check_finish_reasons(n)
        self._check_device_fields(n)

    def _check_host_fields(self, n: int) -> None:
        for name in HOST_FIELDS:
            t = getattr(self, name)
            _check_tensor(name, t, 1, n, floating=False)
            if t.device.type != "cpu":
                _fail(name, _describe(t), "a CPU tensor (per-sample metadata stays on the host; Batch.to keeps it)")
        for name in HOST_FIELDS:
            low = 1 if name == "prompt_lengths" else 0
            smallest = int(getattr(self, name).min()) if n else low  # host tensor: no device sync
            if smallest < low:
                _fail(name, f"a value {smallest}", f"values >= {low}")
        longest = _max(self.prompt_lengths + self.response_lengths)
        if longest > self.tokens.shape[1]:
            _fail("tokens", _describe(self.tokens),
                  f"T >= {longest} = max(prompt_lengths + response_lengths)")

    def _check_finish_reasons(self, n: int) -> None:
        reasons = self.finish_reasons
        if not isinstance(reasons, tuple):
            _fail("finish_reasons", type(reasons).__name__, f"a tuple of N = {n} strings")
        if len(reasons) != n:
            _fail("finish_reasons", f"{len(reasons)} reasons", f"N = {n} (len(tokens))")
        bad = sorted({repr(r) for r in reasons if r not in FINISH_REASONS})
        if bad:
            _fail("finish_reasons", ", ".join(bad), f"each one of {FINISH_REASONS}")

    def _check_device_fields(self, n: int) -> None:
        first = None  # the first response-aligned field set: it defines R
        for name in OPTIONAL_FIELDS:
            t = getattr(self, name)
            if t is None:
                continue
            if name in POSITION_FIELDS:
                self._check_position_field(name, t)
                continue
            _check_tensor(name, t, 1 if name in SAMPLE_FIELDS else 2, n, floating=True)
            if t.device != self.tokens.device:
                _fail(name, _describe(t), f"a tensor on {self.tokens.device}, the device of tokens")
            if name in RESPONSE_FIELDS and first is not None and t.shape[1] != getattr(self, first).shape[1]:
                _fail(name, _describe(t), f"R = {getattr(self, first).shape[1]} columns, as {first} has")
            first = first or (name if name in RESPONSE_FIELDS else None)
        longest = _max(self.response_lengths)
        if first is not None and self.response_width < longest:
            _fail(first, _describe(getattr(self, first)), f"R >= {longest} = max(response_lengths)")

    def _check_position_field(self, name: str, t) -> None:
        expected = (f"an [N, T, layers, k] int16 tensor with [N, T] = {list(self.tokens.shape)} (tokens' shape) on "
                    f"{self.tokens.device}")
        if not isinstance(t, torch.Tensor):
            _fail(name, type(t).__name__, expected)
        if t.dim() != 4 or tuple(t.shape[:2]) != tuple(self.tokens.shape) or t.dtype != torch.int16 \
                or t.device != self.tokens.device:
            _fail(name, _describe(t), expected)

    # ---- sizes and derived tensors -------------------------------------------------

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_width(self) -> int:
        """R: columns of the response-aligned fields (max(response_lengths) when none is set)."""
        for name in RESPONSE_FIELDS:
            t = getattr(self, name)
            if t is not None:
                return t.shape[1]
        return _max(self.response_lengths)

    @property
    def sequence_lengths(self) -> torch.Tensor:
        """[N] int64 host tensor: P_i + R_i, the tokens of each sample (for token balancing)."""
        return self.prompt_lengths + self.response_lengths

    @property
    def response_mask(self) -> torch.Tensor:
        """[N, R] float32 0/1 on the device of tokens: 1 at column k < response_lengths[i], times
        ``loss_mask`` and ``sample_mask`` where set (the 0/1 mask the losses and estimators take: an
        observation inside a response is a hole, as verl's multi-turn masks make it; a dropped sample
        is all holes)."""
        columns = torch.arange(self.response_width, device=self.tokens.device)
        mask = (columns < self._on_device(self.response_lengths).unsqueeze(1)).float()
        if self.loss_mask is not None:
            mask = mask * self.loss_mask.float()
        return mask if self.sample_mask is None else mask * self.sample_mask.float().unsqueeze(1)

    def padding_mask(self) -> torch.Tensor:
        """[N, T] bool on the device of tokens: True at the padding past each sample's tokens (megatron's
        MoE padding mask: those tokens stay out of the load-balancing statistics)."""
        columns = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return columns >= self._on_device(self.sequence_lengths).unsqueeze(1)

    def response_from_positions(self, per_position: torch.Tensor) -> torch.Tensor:
        """Per-position model output [N, T'] (T' >= T-1) -> response-aligned [N, R].

        Output at position t has seen tokens[:, :t+1]: e.g. log p(tokens[:, t+1])
        from the logits at t, or the critic's value at t. Response token k sits
        at position P_i + k, so the output that predicts (or evaluates the state
        before) it is at position P_i - 1 + k::

            position t     0    1    2    3    4    5    6
            tokens[i]     p0   p1   p2   r0   r1   r2   pad     P_i = 3, R_i = 3
            per_position  o0   o1   o2   o3   o4   o5           (T' = T - 1 = 6)
                                     |    |    |
            column k                 0    1    2    3 ...  -> 0 past R_i

        Returns [N, R] in ``per_position``'s dtype, zeros past ``response_lengths``.
        """
        n, need = len(self), self.tokens.shape[1] - 1
        if per_position.dim() != 2 or per_position.shape[0] != n or per_position.shape[1] < need:
            raise ValueError(f"Batch.response_from_positions: per_position {_describe(per_position)}; "
                             f"expected [N = {n}, T' >= {need}] (T - 1 positions predict tokens 1..T-1)")
        k = torch.arange(self.response_width, device=per_position.device)
        valid = k < self._on_device(self.response_lengths, per_position.device).unsqueeze(1)
        positions = self._on_device(self.prompt_lengths, per_position.device).unsqueeze(1) - 1 + k
        picked = per_position.gather(1, torch.where(valid, positions, torch.zeros_like(positions)))
        return torch.where(valid, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))

    def last_token_values(self, per_position: torch.Tensor) -> torch.Tensor:
        """[N] of per-position model output [N, T] at each sample's last token, position
        P_i + R_i - 1: a reward model's score (its value once it has read the whole response)."""
        if per_position.dim() != 2 or per_position.shape != self.tokens.shape:
            raise ValueError(f"Batch.last_token_values: per_position {_describe(per_position)}; "
                             f"expected [N, T] = {tuple(self.tokens.shape)}, one output per token")
        last = self._on_device(self.sequence_lengths - 1, per_position.device)
        return per_position.gather(1, last.unsqueeze(1)).squeeze(1)

    def _on_device(self, host: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
        # non_blocking: a host -> device copy of a few ints must not wait for the queued kernels.
        return host.to(device or self.tokens.device, non_blocking=True)

    # ---- new batches ---------------------------------------------------------------

    def with_fields(self, **fields) -> Batch:
        """A new validated batch with ``fields`` replaced, e.g. ``with_fields(ref_logprobs=x)``."""
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"Batch.with_fields: unknown fields {unknown}; fields: {list(TENSOR_FIELDS)}, "
                             f"pad_id, finish_reasons")
        return dataclasses.replace(self, **fields)

    def with_fields_from(self, parts: Sequence[Batch], names: Sequence[str]) -> Batch:
        """A new batch with each field of ``names`` taken from ``parts``: batches of some of this batch's
        samples (matched by prompt id and sample index), which together hold every sample once in the
        parts that set that field. Response-aligned fields are zero-padded to this batch's R; the fields
        move to the device of ``tokens`` (an inference task's outputs, gathered from its replicas)."""
        position = {key: i for i, key in enumerate(zip(self.prompt_ids.tolist(), self.sample_indices.tolist()))}
        fields = {}
        for name in names:
            have = [part for part in parts if getattr(part, name) is not None]
            rows = [position.get(key, -1) for part in have
                    for key in zip(part.prompt_ids.tolist(), part.sample_indices.tolist())]
            if sorted(rows) != list(range(len(self))):
                raise ValueError(f"Batch.with_fields_from: the parts' {name} rows are samples {sorted(rows)}; "
                                 f"expected each of the batch's {len(self)} samples once")
            values = [getattr(part, name) for part in have]
            if name in RESPONSE_FIELDS:
                values = [F.pad(v, (0, self.response_width - v.shape[1])) for v in values]
            elif name in POSITION_FIELDS:
                values = [_pad_positions(v, self.tokens.shape[1]) for v in values]
            joined = torch.cat(values).to(self.tokens.device)
            fields[name] = joined[torch.as_tensor(rows).argsort().to(joined.device)]
        return self.with_fields(**fields)

    def to(self, device: Union[str, torch.device]) -> Batch:
        """Per-token tensors and scores moved to ``device``; host metadata stays on the host."""
        moved = {name: getattr(self, name).to(device) for name in ("tokens",) + OPTIONAL_FIELDS
                 if getattr(self, name) is not None}
        return dataclasses.replace(self, **moved)

    def select(self, indices: Union[Sequence[int], torch.Tensor]) -> Batch:
        """Samples ``indices`` (host ints in [0, N), any order, repeats allowed) as a new batch."""
        rows = torch.as_tensor(indices, dtype=torch.int64)
        if rows.dim() != 1 or rows.device.type != "cpu":
            raise ValueError(f"Batch.select: indices {_describe(rows)}; expected a 1-D sequence of host ints")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= len(self)):
            raise ValueError(f"Batch.select: indices span [{int(rows.min())}, {int(rows.max())}]; "
                             f"expected indices in [0, {len(self)})")
        reasons = tuple(self.finish_reasons[i] for i in rows.tolist())
        return self._rows(rows, self._on_device(rows), reasons)

    def split(self, sizes: Union[int, Sequence[int]]) -> list[Batch]:
        """Contiguous parts: ``sizes`` a list of part sizes summing to N, or a
        count of near-equal parts (the first N % count one sample longer).
        Parts are views of this batch's tensors (no copy); T and R are kept."""
        parts, start = [], 0
        for size in part_sizes(len(self), sizes):
            rows = slice(start, start + size)
            parts.append(self._rows(rows, rows, self.finish_reasons[rows]))
            start += size
        return parts

    def micro_batches(self, size: int, max_tokens: int | None = None, count: int | None = None) -> list[Batch]:
        """The micro-batches a DP replica runs this batch in: near-equal parts of at most ``size`` samples
        (padded to their longest), or with ``max_tokens`` consecutive samples while their tokens (prompt +
        response) fit that budget, to run packed (rlhf/models/packing.py); with ``count`` too, exactly that
        many parts balanced by tokens (Karmarkar-Karp), as a fixed schedule runs them. ValueError when a
        part is longer than the budget."""
        if max_tokens is None:
            return self.split(max(1, -(-len(self) // size)))
        lengths = self.sequence_lengths.tolist()
        if lengths and max(lengths) > max_tokens:
            longest = max(range(len(lengths)), key=lengths.__getitem__)
            raise ValueError(f"a micro-batch budget of {max_tokens} tokens is smaller than sample {longest} "
                             f"({lengths[longest]} tokens, the longest); raise the budget to at least that")
        if count is not None:
            parts = karmarkar_karp(lengths, count)
            heaviest = max(sum(lengths[i] for i in part) for part in parts)
            if heaviest > max_tokens:
                raise ValueError(f"{len(self)} samples of {sum(lengths)} tokens in {count} micro-batches balanced "
                                 f"by tokens need {heaviest} tokens in one, over the budget of {max_tokens}; raise "
                                 "the budget")
            return [self.select(part) for part in parts]
        sizes, used = [], max_tokens
        for n in lengths:
            if used + n > max_tokens:
                sizes.append(0)
                used = 0
            sizes[-1] += 1
            used += n
        return self.split(sizes or [0])

    def _rows(self, host_rows, device_rows, finish_reasons: tuple[str, ...]) -> Batch:
        picked = {}
        for name in TENSOR_FIELDS:
            t = getattr(self, name)
            picked[name] = None if t is None else t[host_rows if name in HOST_FIELDS else device_rows]
        return Batch(pad_id=self.pad_id, finish_reasons=finish_reasons, **picked)

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Samples of ``batches`` in order; T is padded to the widest with pad_id,
        R to the widest with zeros. All batches must share pad_id and set the
        same optional fields."""
        _check_concatenable(batches)
        width = max(b.tokens.shape[1] for b in batches)
        response_width = max(b.response_width for b in batches)
        joined = {}
        for name in TENSOR_FIELDS:
            parts = [getattr(b, name) for b in batches]
            if parts[0] is None:
                joined[name] = None
            elif name == "tokens":
                joined[name] = torch.cat([F.pad(t, (0, width - t.shape[1]), value=batches[0].pad_id) for t in parts])
            elif name in RESPONSE_FIELDS:
                joined[name] = torch.cat([F.pad(t, (0, response_width - t.shape[1])) for t in parts])
            elif name in POSITION_FIELDS:
                joined[name] = torch.cat([_pad_positions(t, width) for t in parts])
            else:
                joined[name] = torch.cat(parts)
        reasons = tuple(r for b in batches for r in b.finish_reasons)
        return cls(pad_id=batches[0].pad_id, finish_reasons=reasons, **joined)

    # ---- from the engine -----------------------------------------------------------

    @classmethod
    def from_samples(cls, samples: Sequence[SampleResult], pad_id: int, prompt_ids: Mapping[str, int]) -> Batch:
        """The engine's results as a batch, one row per sample in ``samples`` order,
        with ``rollout_logprobs`` and ``old_logprobs`` both the engine's log-probs (float32),
        ``policy_versions`` when every sample carries one per token (an asynchronous run's engine), and
        ``loss_mask`` when some sample has inserted tokens (``SampleResult.loss_mask``), ``routing`` when
        every sample has the experts the engine chose (``SampleResult.routing``, a MoE actor's).

        ``prompt_ids`` maps each ``request_id`` to its prompt id (e.g. the
        prompt's index in the iteration's prompt batch), given by whoever built
        the requests: a request id is a name, not a number to parse.
        Returns tokens [N, T] with T = max(P_i + R_i), old_logprobs [N, R] with
        R = max(R_i).
        """
        missing = sorted({s.request_id for s in samples} - set(prompt_ids))
        if missing:
            raise ValueError(f"Batch.from_samples: request ids {missing} have no entry in prompt_ids; "
                             f"map every request id to its prompt's index")
        uneven = [(s.request_id, s.sample_index) for s in samples if len(s.logprobs) != len(s.tokens)]
        if uneven:
            raise ValueError(f"Batch.from_samples: samples {uneven} have len(logprobs) != len(tokens)")
        prompt_lengths = [len(s.prompt) for s in samples]
        response_lengths = [len(s.tokens) for s in samples]
        width = max((p + r for p, r in zip(prompt_lengths, response_lengths)), default=0)
        response_width = max(response_lengths, default=0)
        tokens = [[*s.prompt, *s.tokens] + [pad_id] * (width - p - r)
                  for s, p, r in zip(samples, prompt_lengths, response_lengths)]
        for name in ("policy_versions", "loss_mask"):
            uneven = [(s.request_id, s.sample_index) for s in samples
                      if len(getattr(s, name)) not in (0, len(s.tokens))]
            if uneven:
                raise ValueError(f"Batch.from_samples: samples {uneven} have {name} but not one per token")

        def per_response_token(field: str, unset: float = 0.0) -> torch.Tensor:
            # right-padded with zeros; a sample without the field has ``unset`` at each of its tokens
            rows = [[*(getattr(s, field) or [unset] * r)] + [0] * (response_width - r)
                    for s, r in zip(samples, response_lengths)]
            return torch.tensor(rows, dtype=torch.float32).reshape(len(samples), response_width)

        logprobs = per_response_token("logprobs")
        versioned = bool(samples) and all(len(s.policy_versions) == len(s.tokens) for s in samples)
        return cls(
            tokens=torch.tensor(tokens, dtype=torch.int64).reshape(len(samples), width),
            pad_id=pad_id,
            prompt_lengths=torch.tensor(prompt_lengths, dtype=torch.int64),
            response_lengths=torch.tensor(response_lengths, dtype=torch.int64),
            prompt_ids=torch.tensor([prompt_ids[s.request_id] for s in samples], dtype=torch.int64),
            sample_indices=torch.tensor([s.sample_index for s in samples], dtype=torch.int64),
            finish_reasons=tuple(s.finish_reason for s in samples),
            rollout_logprobs=logprobs,
            old_logprobs=logprobs,
            policy_versions=per_response_token("policy_versions") if versioned else None,
            loss_mask=per_response_token("loss_mask", 1.0) if any(s.loss_mask for s in samples) else None,
            routing=_routing(samples, width),
        )


def _pad_positions(t: torch.Tensor, width: int) -> torch.Tensor:
    """A position-aligned field [N, T, ...] padded with -1 to ``width`` positions."""
    return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), -1)], dim=1)


def _routing(samples: Sequence[SampleResult], width: int) -> torch.Tensor | None:
    """[N, width, L, k] int16 of the samples' ``routing`` ([P + R - 1, L, k] each: the positions the engine
    computed), -1 past it; None unless every sample has one."""
    if not samples or any(s.routing is None for s in samples):
        return None
    first = samples[0].routing
    out = torch.full((len(samples), width, *first.shape[1:]), -1, dtype=torch.int16)
    for row, s in enumerate(samples):
        out[row, :s.routing.shape[0]] = s.routing
    return out


def _check_concatenable(batches: Sequence[Batch]) -> None:
    if not batches:
        raise ValueError("Batch.concat: got no batches; expected at least one")
    pad_ids = sorted({b.pad_id for b in batches})
    if len(pad_ids) > 1:
        raise ValueError(f"Batch.concat: pad_id differs between batches ({pad_ids}); expected one pad_id")
    for name in OPTIONAL_FIELDS:
        unset = [i for i, b in enumerate(batches) if getattr(b, name) is None]
        if 0 < len(unset) < len(batches):
            raise ValueError(f"Batch.concat: Batch.{name} is None in batches {unset} but set in the others; "
                             f"expected every batch to set the same optional fields")
