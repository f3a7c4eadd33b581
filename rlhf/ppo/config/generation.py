"""The generation section (``generation.*``, flags of rollout generation): budgets, sampling, episodes."""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlhf.checks import is_int
from rlhf.config import ConfigError, check_field_types, check_positive_ints, check_range


@dataclass(frozen=True)
class GenerationConfig:
    """Rollout generation: prompt and response budgets (tokens) and sampling.

    ``long_tail_median`` > 0 declares the long-tailed measurement workload
    (docs/fusion.md): each sample's response length is drawn from a lognormal
    with this median (p99.9 about 12x it), capped at ``max_response_len``,
    and EOS is ignored, so samples end at their drawn length.

    A sample stops at any of the tokenizer's stop ids (its EOS and every
    ``eos_token_id`` of the model directory's ``generation_config.json``) or
    of ``stop_token_ids``; the response keeps its stop token. Every log-prob
    the update uses is of logits / ``temperature`` (1 when greedy), as the
    engine's rollout log-probs are.

    ``environment`` ("module:Class", an rlhf.envs.environment.Environment)
    makes every sample a multi-turn episode of at most ``max_turns`` model
    turns of at most ``max_turn_tokens`` tokens (0: no limit), the
    environment answering between them; its rewards are the
    reward, and ``max_response_len`` bounds the whole response (turns and
    observations). ``agent`` ("module:function") instead runs a program
    written against the ``openai`` client per sample, its requests the
    turns, its return value the reward (rlhf/envs/agents.py).
    docs/agents.md. ``cuda_graphs``: on a GPU, the engine replays its decode
    steps as CUDA graphs (docs/engine.md); ignored on the CPU."""

    max_prompt_len: int = 16
    max_response_len: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    long_tail_median: int = 0
    stop_token_ids: tuple = ()
    environment: str | None = None
    agent: str | None = None
    max_turns: int = 4
    max_turn_tokens: int = 0
    cuda_graphs: bool = False

    @property
    def multi_turn(self) -> str | None:
        """``environment`` or ``agent``, whichever drives the episodes (None: single-turn samples)."""
        return self.environment or self.agent

    def __post_init__(self):
        check_field_types("generation", self)
        check_positive_ints("generation", self, ("max_prompt_len", "max_response_len", "max_turns"))
        check_range("generation", "max_turn_tokens", self.max_turn_tokens, 0, self.max_response_len,
                    "in [0, max_response_len] (0: no limit but the response's)")
        for name, example in (("environment", "rlhf.envs.tools:ToolEnvironment"), ("agent", "my_agents:solve")):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value):
                raise ConfigError(f"{name}={value!r} is not MODULE:NAME; give e.g. '{example}'", f"generation.{name}")
        if self.environment is not None and self.agent is not None:
            raise ConfigError("give an environment or an agent, not both: each drives the episodes",
                              "generation.agent")
        check_range("generation", "long_tail_median", self.long_tail_median, 0, self.max_response_len,
                     "in [0, max_response_len] (0: off)")
        check_range("generation", "temperature", self.temperature, 0.0, float("inf"), ">= 0 (0 is greedy)")
        check_range("generation", "top_p", self.top_p, 1e-9, 1.0, "in (0, 1]")
        check_range("generation", "top_k", self.top_k, 0, float("inf"), ">= 0 (0 disables)")
        if not isinstance(self.stop_token_ids, tuple) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids={self.stop_token_ids!r} must be token ids >= 0, e.g. '2,32000'",
                              "generation.stop_token_ids")

    @property
    def logprob_temperature(self) -> float:
        """The temperature every log-prob of the update is taken at: the sampling one, 1 when greedy."""
        return self.temperature or 1.0
