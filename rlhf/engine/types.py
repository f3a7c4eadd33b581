"""Public data types of the generation engine: config, requests, results, errors.

Everything here is plain data; the live objects (model, process groups) are
passed to `Engine` separately.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class EngineConfigError(ValueError):
    """An invalid engine or sampling configuration; the message names the field, ``field_name`` holds it."""

    def __init__(self, message: str, field_name: str):
        super().__init__(message)
        self.field_name = field_name


class CapacityError(RuntimeError):
    """The KV cache cannot hold what was asked for."""


class OutOfBlocksError(CapacityError):
    """Not enough free KV blocks *now*; retry after some sequences finish."""


class NeverFitsError(CapacityError):
    """The request can never fit (longer than the context or than the whole pool)."""


def _check(cond: bool, name: str, value, constraint: str) -> None:
    if not cond:
        raise EngineConfigError(f"{name}={value!r} is invalid: must be {constraint}", name)


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and policies of one engine instance.

    ``num_blocks`` x ``block_size`` tokens of KV cache are preallocated per
    layer. ``max_tokens_per_step`` is the per-step token budget shared by
    prefill chunks and decodes. ``max_model_len`` defaults to the model's
    ``max_seq_len``. ``continuous_batching=False`` admits new sequences only
    when the running batch is empty (static batching, for comparison).
    ``prefix_sharing=False`` makes every sample prefill its own prompt.
    ``cuda_graphs=True`` runs decode steps padded to static shapes, which a GPU
    records once per batch-size bucket and replays (rlhf/engine/static_decode.py);
    without a GPU the padded steps run eagerly (callers turn it on only with one).
    A MoE model ignores it: its steps run eagerly (tokens per expert change each step).
    The n-1 samples forked off a prompt join the running batch at once, so it
    may exceed ``max_num_seqs`` by up to n-1 until they finish.
    ``record_routing=True`` (MoE models only) keeps the experts each layer chose
    for every cached position beside its K/V and returns them with each sample
    (`SampleResult.routing`, for routing replay; docs/engine.md, "Routing record").
    """

    num_blocks: int = 256
    block_size: int = 16
    max_tokens_per_step: int = 512
    max_num_seqs: int = 64
    max_model_len: int | None = None
    continuous_batching: bool = True
    prefix_sharing: bool = True
    attention_backend: str = "auto"  # "auto" | "torch" | "cpu" | "flash" | "triton" (rlhf/engine/attention_backend.py)
    cuda_graphs: bool = False  # decode steps at static shapes, replayed as CUDA graphs on a GPU (static_decode.py)
    record_routing: bool = False  # SampleResult.routing: each computed position's experts (MoE only)

    @classmethod
    def for_batch(cls, prompts: int, samples_per_prompt: int, max_model_len: int, **fields) -> EngineConfig:
        """An engine whose KV cache holds ``prompts`` x ``samples_per_prompt`` sequences of up to
        ``max_model_len`` tokens at once (each sequence's full blocks, a partly filled one and a spare) and
        which runs them all in one batch: a decode step's matmuls are most efficient with the most rows
        (``fields``: any other settings, ``block_size`` included)."""
        block_size = fields.get("block_size", cls.block_size)
        sequences = prompts * samples_per_prompt
        fields.setdefault("max_num_seqs", max(cls.max_num_seqs, sequences))
        return cls(num_blocks=sequences * (max_model_len // block_size + 2), max_model_len=max_model_len, **fields)

    def __post_init__(self):
        _check(self.num_blocks >= 1, "num_blocks", self.num_blocks, ">= 1")
        _check(self.block_size >= 1, "block_size", self.block_size, ">= 1")
        _check(self.max_tokens_per_step >= 1, "max_tokens_per_step", self.max_tokens_per_step, ">= 1")
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", self.max_model_len,
               ">= 2 or None (use the model's max_seq_len)")
        _check(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", self.attention_backend,
               f"one of {ATTENTION_BACKENDS}")


LOGPROB_MODES = ("tempered", "raw", "sampling")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "flash", "triton")
"""What `SampleResult.logprobs` holds (see `SamplingParams`)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's continuations.

    ``temperature == 0`` is greedy. ``top_k == 0`` and ``top_p == 1`` disable
    those filters. ``seed`` (an int in [0, 2**64)) keys each sample's draws
    (sample i of a request draws its token c with the uniform of
    ``rlhf.engine.sampler.mixed_seed(seed, i)`` and c), so results do not
    depend on batching. ``stop_token_ids``: generation stops after any of them, which
    stays the sample's last token. ``logprobs_of`` says what each token's
    log-prob is (greedy samples report raw log-probs in every mode):
    ``"tempered"`` (default) log_softmax(logits / temperature), top-k/top-p
    ignored, as verl, OpenRLHF and TRL compute training log-probs;
    ``"raw"`` log_softmax(logits) (temperature 1); ``"sampling"`` the log-prob
    under the distribution actually sampled from (temperature and
    top-k/top-p applied, renormalised).
    ``sample_max_new_tokens`` (one per sample, each <= ``max_new_tokens``)
    gives each sample its own length limit, as a declared workload does
    (empty: ``max_new_tokens`` for all).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    logprobs_of: str = "tempered"
    sample_max_new_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, ">= 1")
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
               "a finite number >= 0 (0 is greedy)")
        _check(self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 disables)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _check(self.n >= 1, "n", self.n, ">= 1")
        _check(isinstance(self.seed, int) and 0 <= self.seed < 2**64, "seed", self.seed, "an int in [0, 2**64)")
        _check(self.logprobs_of in LOGPROB_MODES, "logprobs_of", self.logprobs_of,
               f"one of {', '.join(map(repr, LOGPROB_MODES))}")
        stop = tuple(int(t) for t in self.stop_token_ids)
        _check(all(t >= 0 for t in stop), "stop_token_ids", stop, "token ids >= 0")
        object.__setattr__(self, "stop_token_ids", stop)
        limits = tuple(int(t) for t in self.sample_max_new_tokens)
        _check(not limits or (len(limits) == self.n and all(1 <= t <= self.max_new_tokens for t in limits)),
               "sample_max_new_tokens", limits, f"empty or {self.n} (n) limits in [1, max_new_tokens]")
        object.__setattr__(self, "sample_max_new_tokens", limits)

    def max_new_tokens_of(self, sample_index: int) -> int:
        """Sample ``sample_index``'s length limit."""
        return self.sample_max_new_tokens[sample_index] if self.sample_max_new_tokens else self.max_new_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class Request:
    """One prompt to continue ``params.n`` times. ``hold``: a sample that finishes keeps its K/V in the
    engine for a next turn (`Engine.continue_sample`) until `Engine.release` (multi-turn episodes)."""

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    hold: bool = False

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        _check(len(self.prompt) >= 1, "prompt", "()", "at least one token")


@dataclass(frozen=True)
class SampleResult:
    """One finished sample: generated ids, their log-probs, why it stopped.

    ``finish_reason`` is ``"stop"`` (a stop token, included in ``tokens``),
    ``"length"`` (max_new_tokens) or ``"context"`` (max_model_len reached).
    ``finish_time`` is seconds since the engine started generating.
    ``policy_versions``: the engine's ``policy_version`` when each token was
    sampled (empty when the engine keeps none: only asynchronous runs do).
    ``loss_mask``: per token, 1 where the model sampled it and 0 where it was
    inserted (a multi-turn episode's observations, rlhf/envs/episodes.py);
    empty when the model sampled every token.
    ``routing``: None unless the engine records routing
    (`EngineConfig.record_routing`); then int16 [P + R - 1, num_layers, k] on
    the CPU (P prompt and R generated tokens): the experts each MoE layer chose
    for positions 0 .. P+R-2 of prompt + tokens, in megatron's top-k order
    (the last token is never computed). Not compared by ``==``.
    """

    request_id: str
    sample_index: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    finish_time: float
    policy_versions: tuple[int, ...] = ()
    loss_mask: tuple[int, ...] = ()
    routing: torch.Tensor | None = field(default=None, compare=False)
