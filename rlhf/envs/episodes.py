"""Multi-turn episodes on the engine: turns generated with continuous batching, environments in between.

Every sample of a request is one episode with its own environment (rlhf/envs/environment.py)::

    prompt [+ reset] | turn 1 | observation 1 | turn 2 | observation 2 | turn 3      (one sequence)
    loss_mask          1 1 1    0 0 0 0         1 1      0 0 0           1 1 1 1

A turn is one engine sample of a held request (``Request.hold``): when it finishes, its K/V stay in the
engine, the environment answers on a host thread while the engine goes on with the other samples, and
the sample continues with the observation appended (`Engine.continue_sample`): only the new tokens are
computed. A turn ends at a stop token or after ``max_turn_tokens`` tokens (0: no limit but the
response's). An episode ends when the environment says done, after ``max_turns`` turns, when the response
(turns and observations) has no token left of ``max_response_len`` (an observation that does not fit is
dropped, so a response always ends with the model's tokens), or at the context limit. The result of an
episode is an `Episode`: the engine's `SampleResult` with all turns and observations as its tokens (the
observations' log-probs 0, ``loss_mask`` 0), its rewards and its turn count.

With TP, every rank of a replica runs the same engine; the environments run on its TP rank 0, which
broadcasts, at each engine step, the answers that arrived, so the ranks continue the same samples at
the same step.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.distributed as dist

from rlhf.engine.sampler import mixed_seed
from rlhf.engine.types import Request, SampleResult
from rlhf.envs.environment import EnvironmentFactory, ModelTurn, checked_step, observation_kind


@dataclass(frozen=True)
class Episode(SampleResult):
    """One finished episode as a sample (``tokens``: every turn and observation; ``loss_mask``: which are
    the model's), with the environment's reward for each turn and the number of turns."""

    rewards: tuple[float, ...] = ()
    turns: int = 0

    @property
    def score(self) -> float:
        """The episode's reward: the sum of its turns' rewards."""
        return float(sum(self.rewards))


@dataclass
class _Open:
    """An episode in progress: what it has so far and its environment (on the rank that runs them)."""

    request: Request
    sample_index: int
    prompt: tuple[int, ...]
    env: object = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    last_reason: str = "stop"


@dataclass(frozen=True)
class _Answer:
    """The environment's answer to one turn, as the engine needs it: observation ids (None: episode over;
    ``cut``: by a limit, not by the environment)."""

    key: tuple[str, int]
    reward: float
    observation: Optional[tuple[int, ...]]
    cut: bool = False


class EpisodeRunner:
    """Runs requests as multi-turn episodes on one engine (module docstring).

    ``make_env``: the environment class (one instance per sample); ``tokenizer``: renders message and
    text observations (rlhf/envs/chat.py); ``tp_group``: the replica's TP group (None: one rank);
    ``workers``: threads for the environments' ``step`` calls.
    """

    def __init__(self, engine, make_env: EnvironmentFactory, tokenizer, max_turns: int, max_response_len: int,
                 max_turn_tokens: int = 0, tp_group=None, workers: int = 8,
                 prompt_records: Optional[Callable[[str], object]] = None):
        self.engine, self.make_env, self.tokenizer = engine, make_env, tokenizer
        self.max_turns, self.max_response_len, self.max_turn_tokens = max_turns, max_response_len, max_turn_tokens
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.runs_envs = self.tp_group is None or dist.get_rank(self.tp_group) == 0
        self.workers = workers
        self.prompt_records = prompt_records

    def run(self, requests: list[Request]) -> list[Episode]:
        """Every sample of ``requests`` as an episode; results in request order, then sample index."""
        open_ = {}
        for request in requests:
            for i in range(request.params.n):
                open_[(request.request_id, i)] = _Open(request, i, request.prompt)
        self._t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(self.workers) as pool:
            for request in self._agreed([self._reset(request, open_) for request in requests]):
                for i in range(request.params.n):
                    open_[(request.request_id, i)].prompt = request.prompt
                self.engine.add_request(request)
            done = self._loop(open_, pool)
        return [done[(r.request_id, i)] for r in requests for i in range(r.params.n)]

    def _reset(self, request: Request, open_: dict) -> Request:
        """Make and reset the environments of ``request``'s samples; the held request to generate, its prompt
        extended by their first observation (one for all of its samples: they share the prompt's K/V)."""
        if not self.runs_envs:
            return request
        extras = set()
        for i in range(request.params.n):
            episode = open_[(request.request_id, i)]
            episode.env = self.make_env()
            record = self.prompt_records(request.request_id) if self.prompt_records else None
            where = f"{type(episode.env).__name__}.reset"
            extras.add(tuple(self._observation_ids(episode.env.reset(record), where, after_stop=False)))
        if len(extras) > 1:
            raise ValueError(f"{where} returned different observations for the samples of prompt "
                             f"{request.request_id}; it must return the same one for all of them (or None)")
        params = dataclasses.replace(request.params, max_new_tokens=self._turn_budget(0))
        return Request(request.request_id, request.prompt + extras.pop(), params, hold=True)

    def _turn_budget(self, used: int) -> int:
        """New tokens the next turn may take when the response has ``used`` tokens."""
        room = self.max_response_len - used
        return min(room, self.max_turn_tokens) if self.max_turn_tokens else room

    def _agreed(self, requests: list[Request]) -> list[Request]:
        """The requests as TP rank 0 made them (its environments' first observations), on every TP rank."""
        if self.tp_group is None:
            return requests
        box = [requests]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        return box[0]

    def _loop(self, open_: dict, pool) -> dict:
        done, waiting = {}, {}
        while open_.keys() - done.keys():
            if self.engine.has_unfinished():
                for result in self.engine.step():
                    key = (result.request_id, result.sample_index)
                    waiting[key] = self._turn_done(open_[key], result, pool)
            elif self.runs_envs and waiting:
                concurrent.futures.wait(waiting.values(), return_when=concurrent.futures.FIRST_COMPLETED)
            answers = self._arrived(waiting)
            for answer in answers:
                waiting.pop(answer.key, None)
                episode = open_[answer.key]
                episode.rewards.append(answer.reward)
                if answer.observation is None:
                    self.engine.release(*answer.key)
                    done[answer.key] = self._finished(answer.key, episode, answer.cut)
                else:
                    self._continue(answer.key, episode, answer.observation)
        return done

    def _turn_done(self, episode: _Open, result: SampleResult, pool):
        """Record a finished turn; the environment's answer as a future (None on ranks without environments)."""
        episode.tokens += result.tokens
        episode.logprobs += result.logprobs
        episode.mask += [1] * len(result.tokens)
        episode.versions += result.policy_versions
        episode.turns += 1
        episode.last_reason = result.finish_reason
        if not self.runs_envs:
            return None
        text = self.tokenizer.decode(result.tokens) if self.tokenizer is not None else ""
        turn = ModelTurn(tuple(result.tokens), text, result.finish_reason, episode.turns - 1)
        return pool.submit(self._answer, (result.request_id, result.sample_index), episode, turn)

    def _answer(self, key, episode: _Open, turn: ModelTurn) -> _Answer:
        """The environment's step on ``turn`` (a host thread), with the observation as ids or None when the
        episode ends here."""
        where = f"{type(episode.env).__name__}.step"
        try:
            step = checked_step(episode.env.step(turn), where)
        except Exception as exc:  # noqa: BLE001 -- user code: reported with the environment and the sample
            raise RuntimeError(f"{where} raised {type(exc).__name__}: {exc} (turn {turn.index} of sample "
                               f"{key[1]} of prompt {key[0]})") from exc
        if step.done:
            return _Answer(key, float(step.reward), None)
        if turn.finish_reason == "context" or episode.turns >= self.max_turns:
            return _Answer(key, float(step.reward), None, cut=True)
        ids = self._observation_ids(step.observation, where, turn.finish_reason == "stop")
        room = self.max_response_len - len(episode.tokens) - len(ids)
        return _Answer(key, float(step.reward), tuple(ids) if room >= 1 else None, cut=room < 1)

    def _observation_ids(self, observation, where: str, after_stop: bool) -> list[int]:
        kind = observation_kind(observation, where)
        if kind is None:
            return []
        if kind == "ids":
            return [int(t) for t in observation]
        if kind == "text":
            return self.tokenizer.encode(observation)
        from rlhf.envs.chat import continuation_ids

        return continuation_ids(self.tokenizer, list(observation), after_stop)

    def _arrived(self, waiting: dict) -> list[_Answer]:
        """The answers that arrived (in sample order), the same on every TP rank (collective over the TP group
        when there is one; raises on every rank what an environment raised)."""
        answers = None
        if self.runs_envs:
            try:
                answers = sorted((f.result() for f in waiting.values() if f.done()), key=lambda a: a.key)
            except Exception as exc:  # noqa: BLE001 -- an environment's error, reported on every rank
                answers = exc
        if self.tp_group is not None:
            box = [answers]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
            answers = box[0]
        if isinstance(answers, Exception):
            raise answers
        return answers

    def _continue(self, key, episode: _Open, observation: tuple[int, ...]) -> None:
        episode.tokens += observation
        episode.logprobs += [0.0] * len(observation)
        episode.mask += [0] * len(observation)
        if episode.versions:
            episode.versions += [episode.versions[-1]] * len(observation)
        params = episode.request.params
        turn_params = dataclasses.replace(params, n=1, sample_max_new_tokens=(), seed=mixed_seed(params.seed, key[1],
                                          episode.turns), max_new_tokens=self._turn_budget(len(episode.tokens)))
        self.engine.continue_sample(*key, observation, turn_params)

    def _finished(self, key, episode: _Open, cut: bool) -> Episode:
        """The episode as a sample; its finish reason is its last turn's, "length" when a limit cut it."""
        reason = "length" if cut and episode.last_reason == "stop" else episode.last_reason
        now = time.perf_counter() - self._t0
        return Episode(key[0], key[1], episode.prompt, tuple(episode.tokens), tuple(episode.logprobs), reason, now,
                       tuple(episode.versions), loss_mask=tuple(episode.mask), rewards=tuple(episode.rewards),
                       turns=episode.turns)
