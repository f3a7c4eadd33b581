"""Agents in the training loop: a program written against the ``openai`` client, trained by swapping its
``base_url`` (``--agent MODULE:FUNCTION``).

The function is ``agent(client, prompt) -> reward``: ``client`` is an ``openai.OpenAI`` whose base URL is
tied to one sample's episode, ``prompt`` the prompt record (``rlhf.data.prompts.Prompt``: ``text``,
``metadata``). It runs on a host thread per sample, calls ``client.chat.completions.create`` as often as
it likes, and returns the episode's reward (a finite number)::

    def agent(client, prompt):
        messages = [{"role": "user", "content": prompt.text}]
        reply = client.chat.completions.create(model="policy", messages=messages)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": "Check your answer."}]
        final = client.chat.completions.create(model="policy", messages=messages)
        return float(final.choices[0].message.content.strip() == prompt.metadata["answer"])

Each request of an episode is one turn of its sample (rlhf/envs/episodes.py). The first one's messages,
rendered by the chat template, are the episode's prompt; every later one must repeat the conversation so
far (the earlier messages and the replies as they were returned) and add messages, which are rendered
as a continuation of the token sequence (rlhf/envs/chat.py): nothing the model generated is tokenized
again, so the tokens that train are the ones it sampled. The sampling is the run's (the request's
``temperature`` is ignored; ``max_tokens`` caps the turn). The first request's messages may render to at
most ``--max-prompt-len`` tokens (a 400 otherwise); a request past ``--max-turns`` or the response
budget gets an empty reply with finish_reason "length". Every reply carries its ``token_ids``.

The endpoint is an HTTP server (uvicorn) on 127.0.0.1 in the process of each generation replica's first
rank, one route per episode: ``/episodes/<prompt>.<sample>/v1/chat/completions``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import math
import numbers
import socket
import threading
from concurrent.futures import Future
from typing import Callable, Optional

from rlhf.config import ConfigError, import_named
from rlhf.envs.chat import continuation_ids
from rlhf.envs.episodes import Action, EpisodeDriver, EpisodeRunner
from rlhf.serving.openai_api import (RequestError, chat_messages, chat_prompt_ids, completion_choice,
                                     completion_response, error_response)

AgentFn = Callable[[object, object], float]


def load_agent(spec: str) -> AgentFn:
    """The function ``MODULE:FUNCTION`` names (a ConfigError naming ``generation.agent`` if there is none, or
    when the ``openai`` package, which the agents' clients are, is missing)."""
    target = import_named(spec, "generation.agent", "MODULE:FUNCTION")
    if not callable(target):
        raise ConfigError(f"{spec} is a {type(target).__name__}, not a function", "generation.agent")
    if importlib.util.find_spec("openai") is None:
        raise ConfigError(f"{spec}: agents talk through the openai client; pip install openai", "generation.agent")
    return target


class AgentDriver(EpisodeDriver):
    """Episodes driven by ``agent`` through the per-episode endpoint (module docstring); the server starts
    with the driver and serves every run of it. ``prompt_records(request_id)`` gives the agent its record."""

    def __init__(self, agent: AgentFn, tokenizer, prompt_records: Optional[Callable[[str], object]],
                 max_prompt_len: int, name: str = "agent"):
        self.agent, self.tokenizer, self.prompt_records, self.name = agent, tokenizer, prompt_records, name
        self.max_prompt_len = max_prompt_len
        self._lock = threading.Condition()
        self._actions: list = []
        self._replies: dict = {}
        self.port = _serve(self._app())

    # ---- the run (engine thread) ----------------------------------------------------------

    def begin(self, runner: EpisodeRunner, requests) -> None:
        self.runner, self.conversations, self._failure, self._closed = runner, {}, None, False
        keys = [(r.request_id, i) for r in requests for i in range(r.params.n)]
        self.pool = concurrent.futures.ThreadPoolExecutor(max(1, len(keys)), thread_name_prefix="agent")
        for key in keys:
            self.pool.submit(self._run_agent, key)

    def poll(self, block: bool) -> list[Action]:
        with self._lock:
            if block and not self._actions and self._failure is None:
                self._lock.wait(timeout=0.05)
            if self._failure is not None:
                raise self._failure
            actions, self._actions = self._actions, []
        return actions

    def turn_done(self, key, turn) -> None:
        """Answer the request that asked for this turn, and remember the reply in the conversation."""
        episode = self.runner.episodes[key]
        n = len(turn.token_ids)
        choice = completion_choice(self.tokenizer, turn.token_ids, episode.logprobs[-n:] if n else [],
                                   turn.finish_reason, 0, chat=True, with_logprobs=False)
        with self._lock:
            future, messages = self._replies.pop(key)
            self.conversations[key] = messages + [choice["message"]]
        future.set_result(completion_response(f"chatcmpl-{key[0]}.{key[1]}.{turn.index}", self.name, True,
                                              [choice], list(episode.prompt)))

    def end(self) -> None:
        """Close the batch: requests still waiting (the run stopped on an error) and any later ones get a 400,
        so every agent's thread returns."""
        with self._lock:
            self._closed = True
            for future, _ in self._replies.values():
                future.set_exception(RequestError("the run stopped before this turn was generated"))
            self._replies.clear()
        self.pool.shutdown(wait=True)

    # ---- one sample's agent (its own thread) -----------------------------------------------

    def _run_agent(self, key) -> None:
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/episodes/{key[0]}.{key[1]}/v1",
                               api_key="episode", max_retries=0, timeout=3600)
        try:
            reward = self.agent(client, self.prompt_records(key[0]))
            if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
                raise ValueError(f"it returned {reward!r}; an agent returns the episode's reward, a finite number")
            action, failure = Action("end", key, reward=float(reward)), None
        except Exception as exc:  # noqa: BLE001 -- user code: reported with the agent and the sample
            action, failure = None, RuntimeError(f"agent {getattr(self.agent, '__qualname__', self.agent)} failed on "
                                                 f"sample {key[1]} of prompt {key[0]}: {type(exc).__name__}: {exc}")
        with self._lock:
            if action is not None:
                self._actions.append(action)
            self._failure = self._failure or failure
            self._lock.notify_all()

    # ---- the endpoint (the server's thread) ------------------------------------------------

    def request(self, key, body: dict) -> Future:
        """Turn one chat request of episode ``key`` into the next action; its future resolves to the reply."""
        future: Future = Future()
        messages = chat_messages(body)
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        if not isinstance(limit, int) or limit < 0:
            raise RequestError(f"'max_tokens' is {limit!r}; it must be an integer >= 1", "max_tokens")
        with self._lock:
            if self._closed:
                raise RequestError("this batch of episodes has ended", "model")
            if key not in self.runner.episodes:
                raise RequestError(f"no episode {key[0]}.{key[1]} in this batch", "model")
            if key in self._replies:
                raise RequestError("this episode already waits for a reply: one request at a time", "messages")
            action = self._next_action(key, messages, limit)
            if action is None:  # past a limit: an empty reply, and the agent goes on as it sees fit
                episode = self.runner.episodes[key]
                future.set_result(completion_response(f"chatcmpl-{key[0]}.{key[1]}.end", self.name, True, [
                    completion_choice(self.tokenizer, [], [], "length", 0, True, False)], list(episode.prompt)))
                return future
            self._replies[key] = (future, messages)
            self._actions.append(action)
            self._lock.notify_all()
        return future

    def _next_action(self, key, messages: list[dict], limit: int) -> Optional[Action]:
        """Start or continue episode ``key`` with ``messages``; None when its limits allow no more turns."""
        episode, before = self.runner.episodes[key], self.conversations.get(key)
        if before is None:
            prompt = chat_prompt_ids(self.tokenizer, messages)
            if len(prompt) > self.max_prompt_len:
                raise RequestError(f"episode {key[0]}.{key[1]}: the first request's messages render to "
                                   f"{len(prompt)} tokens, over --max-prompt-len {self.max_prompt_len}", "messages")
            return Action("start", key, tuple(prompt), max_new_tokens=limit)
        if messages[:len(before)] != before or len(messages) == len(before):
            raise RequestError(f"episode {key[0]}.{key[1]}: the messages must repeat the conversation so far "
                               f"({len(before)} messages, the replies as returned) and add at least one",
                               "messages")
        ids = continuation_ids(self.tokenizer, messages[len(before):], after_stop=episode.last_reason == "stop")
        if not self.runner.can_continue(episode, ids):
            return None
        return Action("continue", key, tuple(ids), max_new_tokens=limit)

    def _app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def chat(request):
            rid, _, index = request.path_params["episode"].rpartition(".")
            try:
                body = await request.json()
                key = (rid, int(index))
                return JSONResponse(await asyncio.wrap_future(self.request(key, body)))
            except RequestError as exc:
                return error_response(400, str(exc), exc.param)
            except ValueError:
                return error_response(400, "the request body is not JSON, or the episode is not <prompt>.<sample>")

        return Starlette(routes=[Route("/episodes/{episode}/v1/chat/completions", chat, methods=["POST"])])


def _serve(app) -> int:
    """Serve ``app`` on 127.0.0.1 from a daemon thread (uvicorn); returns the port it listens on."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)  # connections queue up until the server's loop accepts them
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="agent-endpoint", daemon=True).start()
    return sock.getsockname()[1]
