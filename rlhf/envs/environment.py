"""The environment API: what answers the model between the turns of one multi-turn episode.

An environment class is named on the command line as ``--environment MODULE:CLASS``. The
rollout makes one instance per sample (``CLASS()``), calls ``reset(prompt)`` once, then, after
each model turn, ``step(turn)``::

    prompt [+ reset's observation]  ->  turn 1  ->  step -> observation 1  ->  turn 2  ->  step -> done

A turn ends at a stop token (kept as the turn's last token) or at its token budget. ``step``
returns an `EnvironmentStep`: the observation (token ids, appended as they are; chat messages,
rendered by the chat template as a continuation of the conversation; or plain text, encoded
without a template), the turn's reward and whether the episode is over. The trained sequence is
exactly the engine's tokens and the observations' tokens, each tokenized once: observation tokens
are in the sequence but out of the policy loss, the KL and the value targets (``Batch.loss_mask``).
The episode's score is the sum of its rewards.

Environments run on the host, on a thread pool beside the engine: a sample waiting on its
environment does not hold up the others. ``step`` may block (a tool call, a subprocess); it must not
touch torch.distributed.
"""

from __future__ import annotations

import abc
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from rlhf.config import ConfigError, import_named

Observation = Union[Sequence[int], Sequence[dict], str, None]
"""Token ids, chat messages ({role, content}), plain text, or nothing."""


@dataclass(frozen=True)
class ModelTurn:
    """One turn of the model: its token ids (the stop token included when it stopped at one), their
    text (special tokens skipped), why it ended ("stop" or "length") and its 0-based index."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    index: int


@dataclass(frozen=True)
class EnvironmentStep:
    """What the environment answers a turn: an observation for the next turn (ignored when ``done``),
    the turn's reward, and whether the episode is over."""

    observation: Observation = None
    reward: float = 0.0
    done: bool = False


class Environment(abc.ABC):
    """One episode's world (module docstring). Subclasses implement `step`; `reset` may add an
    observation before the first turn."""

    def reset(self, prompt) -> Observation:
        """Start an episode for ``prompt`` (an ``rlhf.data.prompts.Prompt``: ``token_ids``, ``text``,
        ``metadata`` with the record's other fields); returns what to append to the prompt (default:
        nothing)."""
        return None

    @abc.abstractmethod
    def step(self, turn: ModelTurn) -> EnvironmentStep:
        """Answer the model's ``turn``."""


EnvironmentFactory = Callable[[], Environment]


def load_environment(spec: str) -> EnvironmentFactory:
    """The class ``MODULE:CLASS`` names (a ConfigError naming ``generation.environment`` if it is not an
    Environment subclass that imports)."""
    target = import_named(spec, "generation.environment", "MODULE:CLASS")
    if not (isinstance(target, type) and issubclass(target, Environment)):
        raise ConfigError(f"{spec} is not a subclass of rlhf.envs.environment.Environment", "generation.environment")
    return target


def checked_step(step: Any, where: str) -> EnvironmentStep:
    """``step`` if it is a well-formed EnvironmentStep, else a ValueError naming ``where``."""
    if not isinstance(step, EnvironmentStep):
        raise ValueError(f"{where} returned a {type(step).__name__}; it must return an EnvironmentStep")
    reward = step.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise ValueError(f"{where} returned reward {reward!r}; it must be a finite number")
    return step


def observation_kind(observation: Observation, where: str) -> Optional[str]:
    """"ids", "messages", "text" or None (nothing to append); a ValueError naming ``where`` otherwise."""
    if observation is None or (not isinstance(observation, str) and len(observation) == 0):
        return None
    if isinstance(observation, str):
        return "text"
    if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in observation):
        return "ids"
    if all(isinstance(m, dict) for m in observation):
        return "messages"
    raise ValueError(f"{where} returned observation {observation!r:.200}; give token ids, chat messages "
                     "({role, content} dicts), text or None")
