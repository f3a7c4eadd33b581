"""One sample being generated: its tokens, progress, sampling seed and status.

``tokens`` holds the prompt followed by the generated ids. ``num_computed``
counts the leading tokens whose K/V are in the cache; a step computes the next
``tokens[num_computed:]`` (a prefill chunk, or one token when decoding) and,
once every token is computed, samples the next one from the uniform of its
``seed`` and ``counter`` (`rlhf.engine.sampler.uniforms`)::

    tokens:   p0 p1 p2 p3 | g0 g1
    computed: ######################..   num_computed = 5, one token (g1) to decode
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rlhf.engine.types import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"  # a finished turn keeping its K/V for the next one
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable per-sample state owned by the engine (scheduler reads it)."""

    seq_id: int
    request_id: str
    sample_index: int
    prompt_len: int
    tokens: list[int]
    params: SamplingParams
    seed: int  # the key of its draws: mixed_seed(params.seed, sample_index)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)  # per sampled token, if the engine keeps them
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # Sample indices of the same request still to be forked off this
    # sequence once its prompt is computed (prefix sharing).
    pending_forks: list[int] = field(default_factory=list)
    hold: bool = False  # on finishing, keep the K/V for a next turn (Request.hold)

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def counter(self) -> int:
        """The counter of the draw of a step that computed its tokens up to ``num_computed``: the tokens
        generated before the one drawn (this turn), a token still in flight (`Engine.step`) included."""
        return self.num_computed - self.prompt_len

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.sample_index)

