"""The OpenAI-compatible API (rlhf/serving) without a model: requests in, engine requests out, responses in
OpenAI's format, refusals naming the parameter; and the EngineService's queue on a stand-in engine.

The model end to end (tools/serve.py, the ``openai`` client against transformers' greedy) is in
tests/test_smollm2.py.
"""

from concurrent.futures import Future

import pytest
from starlette.testclient import TestClient

from rlhf.data.tokenizer import ByteTokenizer
from rlhf.engine.types import NeverFitsError, SampleResult
from rlhf.serving.engine_service import EngineService
from rlhf.serving.openai_api import OpenAIEndpoint, openai_app

TOKENIZER = ByteTokenizer()
REPLY = TOKENIZER.encode("hey")


class RecordingService:
    """Answers every request with "hey" + EOS per sample at once, and keeps what it was asked."""

    def __init__(self):
        self.asked = []

    def submit(self, prompt, params):
        self.asked.append((prompt, params))
        future = Future()
        future.set_result([SampleResult("r", i, tuple(prompt), (*REPLY, TOKENIZER.eos_id), (-0.5,) * 4, "stop", 0.0)
                           for i in range(params.n)])
        return future


@pytest.fixture
def api():
    service = RecordingService()
    client = TestClient(openai_app(OpenAIEndpoint(service, TOKENIZER, "tiny", max_model_len=64), api_key="k"))
    client.headers["Authorization"] = "Bearer k"
    return client, service


def test_chat_request_and_response(api):
    client, service = api
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 5,
            "n": 2, "seed": 7, "logprobs": True}
    out = client.post("/v1/chat/completions", json=body).json()
    prompt, params = service.asked[0]
    assert prompt == TOKENIZER.encode("<|user|>\nhi<|end|>\n<|assistant|>\n")
    assert (params.max_new_tokens, params.temperature, params.n, params.seed) == (5, 0.0, 2, 7)
    assert params.stop_token_ids == (TOKENIZER.eos_id,)
    assert out["object"] == "chat.completion" and out["model"] == "tiny"
    assert [c["message"] for c in out["choices"]] == [{"role": "assistant", "content": "hey"}] * 2
    assert out["choices"][1]["token_ids"] == [*REPLY, TOKENIZER.eos_id] and out["choices"][1]["finish_reason"] == "stop"
    assert [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]] == [-0.5] * 4
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 8, "total_tokens": len(prompt) + 8}


def test_completions_take_text_or_ids_and_default_to_16_tokens(api):
    client, service = api
    assert client.post("/v1/completions", json={"prompt": [5, 6, 7]}).json()["choices"][0]["text"] == "hey"
    client.post("/v1/completions", json={"prompt": "ab" * 30})
    (ids, first), (text, second) = service.asked
    assert ids == [5, 6, 7] and first.max_new_tokens == 16 and first.temperature == 1.0
    assert text == TOKENIZER.encode("ab" * 30) and second.max_new_tokens == 4  # 16, cut to the 64-token context


CHAT = [{"role": "user", "content": "hi"}]  # 33 tokens once rendered: "<|user|>\nhi<|end|>\n<|assistant|>\n"


@pytest.mark.parametrize("route, body, param, where, prompt_len, unasked", [
    ("/v1/completions", {"prompt": [5] * 10}, "max_tokens", "prompt", 10, 16),
    ("/v1/chat/completions", {"messages": CHAT}, "max_tokens", "messages", 33, 31),
    ("/v1/chat/completions", {"messages": CHAT}, "max_completion_tokens", "messages", 33, 31),
])
def test_max_tokens_past_the_context_get_a_400_naming_both_lengths(api, route, body, param, where, prompt_len,
                                                                    unasked):
    """As vLLM and OpenAI: a limit asked past the 64-token context is refused naming the context, the prompt's
    tokens and the tokens asked for; one exactly filling it is served; unasked, a completion gets 16 tokens
    and a chat the rest of the context."""
    client, service = api
    out = client.post(route, json={**body, param: 10**9})
    assert out.status_code == 400 and out.json()["error"]["param"] == param
    assert out.json()["error"]["message"] == (
        f"This model's maximum context length is 64 tokens. However, you requested {prompt_len + 10**9} tokens "
        f"({prompt_len} in the {where}, 1000000000 in the completion). Please reduce the length of the {where} "
        f"or '{param}'.")
    assert client.post(route, json={**body, param: 65 - prompt_len}).status_code == 400
    assert not service.asked
    assert client.post(route, json={**body, param: 64 - prompt_len}).status_code == 200
    client.post(route, json=body)
    assert [params.max_new_tokens for _, params in service.asked] == [64 - prompt_len, unasked]


@pytest.mark.parametrize("body, param, words", [
    ({"messages": []}, "messages", "non-empty list"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]}, "stop", "not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", "an integer >= 1"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature", "in [0, 2]"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p", "in (0, 1]"),
    ({"messages": [{"role": "user", "content": "x" * 80}]}, "messages", "leaves no room to generate"),
])
def test_bad_requests_get_a_400_naming_the_parameter(api, body, param, words):
    client, service = api
    out = client.post("/v1/chat/completions", json=body)
    assert out.status_code == 400 and out.json()["error"]["param"] == param
    assert words in out.json()["error"]["message"]
    assert not service.asked


def test_api_key_and_models(api):
    client, _ = api
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    out = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert out.status_code == 401 and out.json()["error"]["type"] == "authentication_error"
    assert client.post("/v1/completions", content=b"not json").status_code == 400


class StubEngine:
    """Finishes each request one step after it was added; refuses prompts of 5 tokens or more."""

    def __init__(self):
        self.queued, self.steps = [], 0

    def add_request(self, request):
        if len(request.prompt) >= 5:
            raise NeverFitsError(f"request {request.request_id!r} never fits")
        self.queued.append(request)

    def has_unfinished(self):
        return bool(self.queued)

    def step(self):
        self.steps += 1
        done, self.queued = self.queued, []
        return [SampleResult(r.request_id, i, r.prompt, (1,), (0.0,), "length", 0.0)
                for r in reversed(done) for i in reversed(range(r.params.n))]


def test_engine_service_batches_what_arrived_and_resolves_by_request():
    from rlhf.engine.types import SamplingParams

    engine = StubEngine()
    service = EngineService(engine)
    two = service.submit([1, 2], SamplingParams(n=2))
    one = service.submit([3], SamplingParams())
    refused = service.submit([1] * 5, SamplingParams())
    service.run_round()
    assert engine.steps == 1  # both requests joined the same step
    assert [r.sample_index for r in two.result(timeout=1)] == [0, 1] and two.result()[0].prompt == (1, 2)
    assert one.result(timeout=1)[0].prompt == (3,)
    with pytest.raises(NeverFitsError, match="never fits"):
        refused.result(timeout=1)
