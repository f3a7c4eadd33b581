"""Multi-turn episodes on the engine: turns generated with continuous batching, something else in between.

Every sample of a request is one episode::

    prompt [+ reset] | turn 1 | observation 1 | turn 2 | observation 2 | turn 3      (one sequence)
    loss_mask          1 1 1    0 0 0 0         1 1      0 0 0           1 1 1 1

A turn is one engine sample of a held request (``Request.hold``): when it finishes, its K/V stay in the
engine, what answers it works on a host thread while the engine goes on with the other samples, and
the sample continues with the observation appended (`Engine.continue_sample`): only the new tokens are
computed. A turn ends at a stop token or after ``max_turn_tokens`` tokens (0: no limit but the
response's). What answers a turn is a *driver*: `EnvironmentDriver` (an rlhf.envs.environment.Environment
per sample) or rlhf.envs.agents.AgentDriver (an agent program calling an OpenAI-compatible endpoint).
A driver hands the runner `Action` s (start an episode's first turn, continue it with an observation,
end it with a reward); an episode also ends after ``max_turns`` turns, when the response (turns and
observations) has no token left of ``max_response_len`` (an observation that does not fit is dropped,
so a response always ends with the model's tokens), or at the context limit. The result of an episode
is an `Episode`: the engine's `SampleResult` with all turns and observations as its tokens (the
observations' log-probs 0, ``loss_mask`` 0), its rewards and its turn count; with the engine's routing
record on, its ``routing`` is the last turn's, which covers every position of the episode but the last.

With TP, every rank of a replica runs the same engine; the driver runs on its TP rank 0, which
broadcasts, at each engine step, the actions that arrived, so the ranks continue the same samples at
the same step.
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlhf.data.tokenizer import readable_text
from rlhf.engine.sampler import mixed_seed
from rlhf.engine.types import Request, SampleResult, SamplingParams
from rlhf.envs.environment import EnvironmentFactory, ModelTurn, checked_step, observation_kind


@dataclass(frozen=True)
class Episode(SampleResult):
    """One finished episode as a sample (``tokens``: every turn and observation; ``loss_mask``: which are
    the model's), with the reward of each answered turn, the response column of that turn's last token
    (``reward_positions``; -1 before any token) and the number of turns."""

    rewards: tuple[float, ...] = ()
    reward_positions: tuple[int, ...] = ()
    turns: int = 0

    @property
    def score(self) -> float:
        """The episode's reward: the sum of its rewards."""
        return float(sum(self.rewards))


@dataclass(frozen=True)
class EpisodeFailure:
    """What an environment or agent raised on one generation replica, sent in place of its samples so that
    every rank stops with the same message (rather than that replica alone)."""

    message: str


@dataclass(frozen=True)
class Action:
    """What happens next to episode ``key`` (request id, sample index), decided by the driver.

    ``"start"``: its first turn from prompt ``ids`` (``samples`` > 1: samples 0..samples-1 of the request at
    once, sharing the prompt's K/V); ``"continue"``: its next turn after observation ``ids``; ``"end"``: it is
    over. ``reward`` is added to the episode's rewards (continue and end); ``max_new_tokens`` caps the turn
    (0: the runner's limits alone); ``cut``: a limit, not the driver, ended it."""

    kind: str
    key: tuple[str, int]
    ids: tuple[int, ...] = ()
    reward: float = 0.0
    samples: int = 1
    max_new_tokens: int = 0
    cut: bool = False


@dataclass
class EpisodeState:
    """An episode in progress, as the runner records it (drivers read it)."""

    request: Request
    prompt: tuple[int, ...]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    reward_positions: list[int] = field(default_factory=list)
    turns: int = 0
    last_reason: str = "stop"
    engine_key: Optional[tuple[str, int]] = None  # where the engine holds it, once started
    routing: Optional[torch.Tensor] = None  # the last turn's SampleResult.routing: every position so far but the last


class EpisodeDriver(abc.ABC):
    """What answers the model between turns (on TP rank 0 only). The runner calls `begin` once, `turn_done`
    after each turn and `poll` after each engine step."""

    @abc.abstractmethod
    def begin(self, runner: EpisodeRunner, requests: list[Request]) -> None:
        """Start the episodes of ``requests`` (their first "start" actions come from `poll`)."""

    @abc.abstractmethod
    def turn_done(self, key: tuple[str, int], turn: ModelTurn) -> None:
        """Episode ``key``'s turn ``turn`` finished (its tokens are in the runner's state)."""

    @abc.abstractmethod
    def poll(self, block: bool) -> list[Action]:
        """The actions ready now (waiting briefly for one when ``block``: the engine has nothing to do);
        raises what user code raised."""

    def end(self) -> None:
        """Every episode of this run ended."""


class EpisodeRunner:
    """Runs requests as multi-turn episodes on one engine with ``driver`` (module docstring).

    ``tokenizer`` decodes each turn for the driver; ``tp_group``: the replica's TP group (None: one rank).
    """

    def __init__(self, engine, driver: Optional[EpisodeDriver], tokenizer, max_turns: int, max_response_len: int,
                 max_turn_tokens: int = 0, tp_group=None):
        self.engine, self.driver, self.tokenizer = engine, driver, tokenizer
        self.max_turns, self.max_response_len, self.max_turn_tokens = max_turns, max_response_len, max_turn_tokens
        self.tp_group = tp_group if tp_group is not None and dist.get_world_size(tp_group) > 1 else None
        self.runs_driver = self.tp_group is None or dist.get_rank(self.tp_group) == 0
        self.episodes: dict[tuple[str, int], EpisodeState] = {}

    def run(self, requests: list[Request]) -> list[Episode]:
        """Every sample of ``requests`` as an episode; results in request order, then sample index."""
        self.episodes = {(r.request_id, i): EpisodeState(r, r.prompt) for r in requests for i in range(r.params.n)}
        self._keys: dict[tuple[str, int], tuple[str, int]] = {}  # engine (request id, sample) -> episode key
        self._t0, done = time.perf_counter(), {}
        if self.runs_driver:
            self.driver.begin(self, requests)
        try:
            while self.episodes.keys() - done.keys():
                if self.engine.has_unfinished():
                    for result in self.engine.step():
                        self._turn_done(result)
                for action in self._agreed(self._poll()):
                    ended = self._apply(action)
                    if ended is not None:
                        done[action.key] = ended
        finally:
            if self.runs_driver:
                self.driver.end()
        return [done[(r.request_id, i)] for r in requests for i in range(r.params.n)]

    def turn_budget(self, episode: EpisodeState) -> int:
        """New tokens the episode's next turn may take (0: none; it has to end)."""
        room = self.max_response_len - len(episode.tokens)
        return max(0, min(room, self.max_turn_tokens) if self.max_turn_tokens else room)

    def can_continue(self, episode: EpisodeState, observation) -> bool:
        """Whether the episode may take another turn after ``observation`` (ids): fewer than ``max_turns``
        turns so far, its last turn not stopped by the context, and room for the observation and a token."""
        return (episode.turns < self.max_turns and episode.last_reason != "context"
                and len(episode.tokens) + len(observation) < self.max_response_len)

    def _poll(self):
        """The driver's actions, or the exception it raised (to be raised on every TP rank); None off rank 0."""
        if not self.runs_driver:
            return None
        try:
            return self.driver.poll(not self.engine.has_unfinished())
        except Exception as exc:  # noqa: BLE001 -- what user code raised, raised again on every rank
            return exc

    def _turn_done(self, result: SampleResult) -> None:
        key = self._keys[(result.request_id, result.sample_index)]
        episode = self.episodes[key]
        episode.tokens += result.tokens
        episode.logprobs += result.logprobs
        episode.mask += [1] * len(result.tokens)
        episode.versions += result.policy_versions
        episode.turns += 1
        episode.last_reason = result.finish_reason
        episode.routing = result.routing
        if self.runs_driver:
            text = readable_text(self.tokenizer, result.tokens) if self.tokenizer is not None else ""
            self.driver.turn_done(key, ModelTurn(tuple(result.tokens), text, result.finish_reason, episode.turns - 1))

    def _agreed(self, actions):
        """The driver's actions (or its exception) as TP rank 0 has them, on every TP rank; raised if an
        exception."""
        if self.tp_group is not None:
            box = [actions]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
            actions = box[0]
        if isinstance(actions, Exception):
            raise actions
        return actions

    def _apply(self, action: Action) -> Optional[Episode]:
        """Carry out ``action`` on the engine; the finished episode when it ends one."""
        key, episode = action.key, self.episodes[action.key]
        if action.kind == "start":
            self._start(action)
            return None
        episode.rewards.append(action.reward)
        episode.reward_positions.append(len(episode.tokens) - 1)  # the answered turn's last token
        if action.kind == "end":
            if episode.engine_key is not None:
                self.engine.release(*episode.engine_key)
            return self._finished(key, episode, action.cut)
        episode.tokens += action.ids
        episode.logprobs += [0.0] * len(action.ids)
        episode.mask += [0] * len(action.ids)
        if episode.versions:
            episode.versions += [episode.versions[-1]] * len(action.ids)
        self.engine.continue_sample(*episode.engine_key, action.ids, self._turn_params(episode, action, key[1]))
        return None

    def _start(self, action: Action) -> None:
        """Several samples start as the request's own (sharing the prompt's K/V, the request's seed); one
        starts alone as request "<id>#<sample>" (seeded by the request's seed, the sample and turn 0)."""
        rid, index = action.key
        shared = action.samples > 1
        for i in range(index, index + action.samples):
            episode = self.episodes[(rid, i)]
            episode.prompt = action.ids
            episode.engine_key = (rid, i) if shared else (f"{rid}#{i}", 0)
            self._keys[episode.engine_key] = (rid, i)
        params = self._turn_params(episode, action, index)
        if shared:
            params = dataclasses.replace(params, n=action.samples, seed=episode.request.params.seed)
        self.engine.add_request(Request(episode.engine_key[0], action.ids, params, hold=True))

    def _turn_params(self, episode: EpisodeState, action: Action, index: int) -> SamplingParams:
        """The next turn's sampling: the request's, one sample, seeded by (seed, sample, turn), capped."""
        cap = self.turn_budget(episode)
        if action.max_new_tokens:
            cap = min(cap, action.max_new_tokens)
        params = episode.request.params
        return dataclasses.replace(params, n=1, sample_max_new_tokens=(), max_new_tokens=cap,
                                   seed=mixed_seed(params.seed, index, episode.turns))

    def _finished(self, key, episode: EpisodeState, cut: bool) -> Episode:
        """The episode as a sample; its finish reason is its last turn's, "length" when a limit cut it."""
        reason = "length" if cut and episode.last_reason == "stop" else episode.last_reason
        now = time.perf_counter() - self._t0
        return Episode(key[0], key[1], episode.prompt, tuple(episode.tokens), tuple(episode.logprobs), reason, now,
                       tuple(episode.versions), loss_mask=tuple(episode.mask), rewards=tuple(episode.rewards),
                       reward_positions=tuple(episode.reward_positions), turns=episode.turns,
                       routing=episode.routing)


def turn_reward_rows(episodes: list[Episode], width: int) -> torch.Tensor:
    """[N, width] float32: each episode's rewards at their turns' last tokens (the Batch's ``turn_rewards``);
    a reward given before the episode had a token goes to its last token, if any."""
    rows = torch.zeros(len(episodes), width, dtype=torch.float32)
    for row, episode in zip(rows, episodes):
        last = len(episode.tokens) - 1
        for reward, position in zip(episode.rewards, episode.reward_positions):
            if last >= 0:
                row[position if position >= 0 else last] += reward
    return rows


def observation_ids(tokenizer, observation, where: str, after_stop: bool) -> list[int]:
    """An observation (environment.Observation) as token ids: ids as they are, text encoded, chat messages
    rendered as a continuation of the conversation (rlhf/envs/chat.py)."""
    kind = observation_kind(observation, where)
    if kind is None:
        return []
    if kind == "ids":
        return [int(t) for t in observation]
    if kind == "text":
        return tokenizer.encode(observation)
    from rlhf.envs.chat import continuation_ids

    return continuation_ids(tokenizer, list(observation), after_stop)


class EnvironmentDriver(EpisodeDriver):
    """Episodes answered by environments (rlhf/envs/environment.py): one ``make_env()`` per sample, its
    ``step`` on a thread pool of ``workers`` threads; ``prompt_records(request_id)`` gives `reset` its record."""

    def __init__(self, make_env: EnvironmentFactory, tokenizer, workers: int = 8,
                 prompt_records: Optional[Callable[[str], object]] = None):
        self.make_env, self.tokenizer, self.workers = make_env, tokenizer, workers
        self.prompt_records = prompt_records

    def begin(self, runner: EpisodeRunner, requests: list[Request]) -> None:
        self.runner, self.envs, self.waiting = runner, {}, {}
        self.pool = concurrent.futures.ThreadPoolExecutor(self.workers)
        self.ready = [self._reset(request) for request in requests]

    def _reset(self, request: Request) -> Action:
        """Make and reset the environments of ``request``'s samples; its start action, the prompt extended by
        their first observation (one for all of its samples: they share the prompt's K/V)."""
        extras = set()
        for i in range(request.params.n):
            env = self.envs[(request.request_id, i)] = self.make_env()
            record = self.prompt_records(request.request_id) if self.prompt_records else None
            where = f"{type(env).__name__}.reset"
            extras.add(tuple(observation_ids(self.tokenizer, env.reset(record), where, after_stop=False)))
        if len(extras) > 1:
            raise ValueError(f"{where} returned different observations for the samples of prompt "
                             f"{request.request_id}; it must return the same one for all of them (or None)")
        return Action("start", (request.request_id, 0), request.prompt + extras.pop(), samples=request.params.n)

    def turn_done(self, key, turn: ModelTurn) -> None:
        self.waiting[key] = self.pool.submit(self._answer, key, turn)

    def _answer(self, key, turn: ModelTurn) -> Action:
        """The environment's step on ``turn`` (a host thread) as the next action."""
        env, episode = self.envs[key], self.runner.episodes[key]
        where = f"{type(env).__name__}.step"
        try:
            step = checked_step(env.step(turn), where)
        except Exception as exc:  # noqa: BLE001 -- user code: reported with the environment and the sample
            raise RuntimeError(f"{where} raised {type(exc).__name__}: {exc} (turn {turn.index} of sample "
                               f"{key[1]} of prompt {key[0]})") from exc
        reward = float(step.reward)
        if step.done:
            return Action("end", key, reward=reward)
        ids = observation_ids(self.tokenizer, step.observation, where, turn.finish_reason == "stop")
        if not self.runner.can_continue(episode, ids):
            return Action("end", key, reward=reward, cut=True)
        return Action("continue", key, tuple(ids), reward)

    def poll(self, block: bool) -> list[Action]:
        if block and self.waiting and not self.ready:
            concurrent.futures.wait(self.waiting.values(), return_when=concurrent.futures.FIRST_COMPLETED)
        ready, self.ready = self.ready, []
        for key in sorted(k for k, f in self.waiting.items() if f.done()):
            ready.append(self.waiting.pop(key).result())
        return ready

    def end(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
