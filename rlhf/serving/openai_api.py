"""An OpenAI-compatible HTTP API on the engine: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``.

A Starlette app (served by uvicorn, tools/serve.py) whose handlers turn a request into prompt ids and
`SamplingParams`, submit it to an `EngineService` and answer in the OpenAI response format, so a
program written against the ``openai`` client runs unchanged against our model::

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="smollm2", messages=[...], temperature=0, max_tokens=64)

Chat messages are rendered by the model's chat template with the generation prompt and tokenized once;
a completion's text is its tokens decoded without special tokens (the stop token that ended it left
out). Every choice also carries its ``token_ids`` (and ``prompt_token_ids``), the ids that were generated
rather than a re-tokenization of the text. What the engine cannot do is refused with a 400 naming the
parameter: streaming, stop strings (the tokenizer's stop tokens end a completion), ``logit_bias``.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import time
from typing import Any, Optional

from rlhf.data.tokenizer import readable_text
from rlhf.engine.types import CapacityError, EngineConfigError, SamplingParams

UNSUPPORTED = ("stream", "stop", "logit_bias", "tools", "functions", "response_format", "suffix", "echo",
               "best_of", "presence_penalty", "frequency_penalty")
"""Request fields the engine cannot honour: a request that sets one (to anything but its no-op value) gets a 400."""

_NO_OP = (None, False, 0, 0.0, [], {}, "")


class RequestError(ValueError):
    """A request the API refuses (HTTP 400): ``param`` names the field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def _field(body: dict, name: str, kind, default, check=None, constraint: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool or (check and not check(value)):
        raise RequestError(f"'{name}' is {value!r}; it must be {constraint or kind.__name__}", name)
    return value


class OpenAIEndpoint:
    """The request and response logic of the API on one `EngineService` and its model's tokenizer."""

    def __init__(self, service, tokenizer, model_name: str, max_model_len: int, seed: int = 0):
        self.service, self.tokenizer, self.model_name = service, tokenizer, model_name
        self.max_model_len = max_model_len
        self._seeds = itertools.count(seed)
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------

    def chat_prompt(self, body: dict) -> list[int]:
        """The prompt ids of a chat request: its messages rendered with the generation prompt."""
        return chat_prompt_ids(self.tokenizer, chat_messages(body))

    def completion_prompt(self, body: dict) -> list[int]:
        """The prompt ids of a completions request: a string (tokenized) or a list of token ids."""
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            return list(prompt)
        raise RequestError("'prompt' must be a non-empty string or a list of token ids (one prompt per request)",
                           "prompt")

    def sampling(self, body: dict, prompt_len: int, chat: bool) -> SamplingParams:
        """The request's sampling: OpenAI's defaults (temperature 1, top_p 1, n 1; max tokens 16 for a
        completion, the rest of the context for a chat), stopping at the tokenizer's stop tokens."""
        for name in UNSUPPORTED:
            if body.get(name) not in _NO_OP:
                raise RequestError(f"'{name}' is not supported by this endpoint", name)
        room = self.max_model_len - prompt_len
        if room < 1:
            raise RequestError(f"the prompt has {prompt_len} tokens, which leaves no room to generate within the "
                               f"model's context of {self.max_model_len}", "messages" if chat else "prompt")
        max_new_tokens = self.max_new_tokens(body, prompt_len, chat)
        seed = _field(body, "seed", int, None, lambda v: 0 <= v < 2 ** 63, "an integer in [0, 2**63)")
        try:
            return SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=_field(body, "temperature", float, 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]"),
                top_p=_field(body, "top_p", float, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
                n=_field(body, "n", int, 1, lambda v: 1 <= v <= 128, "an integer in [1, 128]"),
                seed=next(self._seeds) if seed is None else seed,
                stop_token_ids=tuple(self.tokenizer.stop_token_ids), logprobs_of="sampling")
        except EngineConfigError as exc:
            raise RequestError(str(exc), exc.field_name) from None

    def max_new_tokens(self, body: dict, prompt_len: int, chat: bool) -> int:
        """The request's ``max_tokens`` (``max_completion_tokens`` on a chat), refused past the context as vLLM
        and OpenAI refuse it; unasked, 16 for a completion and the rest of the context for a chat, at most
        the room left after the prompt."""
        room = self.max_model_len - prompt_len
        name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        asked = _field(body, name, int, None, lambda v: v >= 1, "an integer >= 1")
        if asked is None:
            return room if chat else min(16, room)
        if asked > room:
            where = "messages" if chat else "prompt"
            raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {prompt_len + asked} tokens ({prompt_len} in the {where}, {asked} in the "
                               f"completion). Please reduce the length of the {where} or '{name}'.", name)
        return asked

    # ---- responses ------------------------------------------------------------------

    async def complete(self, body: dict, chat: bool) -> dict:
        """Answer one request (the awaitable behind both routes)."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        prompt = self.chat_prompt(body) if chat else self.completion_prompt(body)
        params = self.sampling(body, len(prompt), chat)
        try:
            results = await asyncio.wrap_future(self.service.submit(prompt, params))
        except CapacityError as exc:
            raise RequestError(str(exc), "max_tokens") from None
        logprobs = bool(body.get("logprobs"))
        choices = [completion_choice(self.tokenizer, r.tokens, r.logprobs, r.finish_reason, i, chat, logprobs)
                   for i, r in enumerate(results)]
        return completion_response(f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}", self.model_name, chat,
                                   choices, prompt)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "rlhf"}]}


def chat_messages(body: dict) -> list[dict]:
    """A chat request's messages as plain {role, content: str} dicts (text content parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    plain = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # the content-parts form: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise RequestError("only text content parts are supported", "messages")
            content = "".join(p.get("text", "") for p in content)
        plain.append({"role": m.get("role"), "content": "" if content is None else content})
    return plain


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """``messages`` rendered by the chat template with the generation prompt, tokenized once."""
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:
        raise RequestError(str(exc), "messages") from None
    return tokenizer.encode(text)


def completion_choice(tokenizer, token_ids, logprobs, finish_reason: str, index: int, chat: bool,
                      with_logprobs: bool) -> dict:
    """One choice of a response: the text of ``token_ids`` (special tokens and the stop token that ended it
    left out), the ids themselves (``token_ids``) and, if asked, each token's log-prob."""
    ids = list(token_ids)
    text = readable_text(tokenizer, ids[:-1] if finish_reason == "stop" else ids)
    choice: dict[str, Any] = {"index": index, "finish_reason": "stop" if finish_reason == "stop" else "length",
                              "token_ids": ids, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if with_logprobs:
        tokens = [readable_text(tokenizer, [t], skip_special_tokens=False) for t in ids]
        if chat:
            choice["logprobs"] = {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                               "top_logprobs": []} for tok, lp in zip(tokens, logprobs)]}
        else:
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(logprobs)}
    return choice


def completion_response(response_id: str, model: str, chat: bool, choices: list, prompt: list) -> dict:
    """The response envelope around ``choices`` (with the prompt's ids as ``prompt_token_ids``)."""
    generated = sum(len(c["token_ids"]) for c in choices)
    return {"id": response_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "prompt_token_ids": list(prompt),
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": generated,
                      "total_tokens": len(prompt) + generated}}


def error_response(status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error"):
    """OpenAI's error body with HTTP ``status``."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


def unauthorised():
    """The 401 of a request without the API key."""
    return error_response(401, "a valid API key is needed (Authorization: Bearer ...)", kind="authentication_error")


def openai_app(endpoint: OpenAIEndpoint, api_key: Optional[str] = None):
    """The Starlette app of ``endpoint``; with ``api_key``, every request must send ``Authorization: Bearer
    <api_key>`` (401 otherwise)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def authorised(request) -> bool:
        if api_key is None:
            return True
        sent = request.headers.get("authorization", "")
        return hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode())

    def route(chat: bool):
        async def handle(request):
            if not authorised(request):
                return unauthorised()
            try:
                body = await request.json()
            except ValueError:
                return error_response(400, "the request body is not JSON")
            try:
                return JSONResponse(await endpoint.complete(body, chat))
            except RequestError as exc:
                return error_response(400, str(exc), exc.param)
        return handle

    async def models(request):
        if not authorised(request):
            return unauthorised()
        return JSONResponse(endpoint.models())

    return Starlette(routes=[Route("/v1/chat/completions", route(True), methods=["POST"]),
                             Route("/v1/completions", route(False), methods=["POST"]),
                             Route("/v1/models", models, methods=["GET"])])
