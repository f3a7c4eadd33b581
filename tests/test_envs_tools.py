"""Tool calls (rlhf/envs/tools.py) and the incremental chat template (rlhf/envs/chat.py).

- the parser reads Hermes/Qwen ``<tool_call>`` blocks (several a turn), Llama-3 JSON turns and plain
  ``<TOOL>...</TOOL>`` tags in the order written; a malformed call is an error string, never an exception;
- the calculator is exact on big ints, follows Python's precedence, refuses oversized powers and results,
  answers division by zero with an error, and never runs Python (injection attempts are parse errors);
- ToolEnvironment answers one tool message per call, ends at the first turn without a call with its score,
  and counts calls and errors;
- SmolLM2's ChatML template continued token by token (prompt + turn + continuation_ids) equals the
  tokenizer's encoding of the whole rendered conversation, id for id; so does the byte tokenizer's.
"""

import json

import pytest

from rlhf.data.prompts import Prompt
from rlhf.data.tokenizer import ByteTokenizer, HFTokenizer
from rlhf.envs.chat import continuation_ids, continuation_text
from rlhf.envs.environment import ModelTurn, load_environment
from rlhf.envs.tools import (
    Calculator,
    Lookup,
    ToolCall,
    ToolEnvironment,
    parse_tool_calls,
    run_tool_call,
    scan_tool_calls,
)

TOOLS = {"calculator": Calculator(), "lookup": Lookup({"Paris": "capital of France", "Answer": 42})}


def _turn(text: str, index: int = 0) -> ModelTurn:
    return ModelTurn(token_ids=(1, 2), text=text, finish_reason="stop", index=index)


def _hermes(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ---------------------------------------------------------------------------------------------- parser

def test_hermes_calls_several_in_one_turn():
    text = ("I need two things.\n" + _hermes("calculator", {"expression": "2+3"}) + "\n"
            + _hermes("lookup", {"key": "paris"}))
    calls, errors = parse_tool_calls(text, TOOLS)
    assert calls == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("lookup", {"key": "paris"})]
    assert errors == []


@pytest.mark.parametrize("text", ['{"name": "lookup", "parameters": {"key": "PARIS"}}',
                                  '<|python_tag|>{"name": "lookup", "parameters": {"key": "PARIS"}}',
                                  '  {"name": "lookup", "arguments": {"key": "PARIS"}}\n'])
def test_llama3_json_turn(text):
    assert parse_tool_calls(text, TOOLS) == ([ToolCall("lookup", {"key": "PARIS"})], [])


def test_plain_tags_in_order_with_an_unclosed_one():
    items = scan_tool_calls("So <calculator> 2*3 </calculator>, <lookup>answer</lookup>, <calculator>1/0", TOOLS)
    assert items == [ToolCall("calculator", {"expression": "2*3"}), ToolCall("lookup", {"key": "answer"}),
                     "error: <calculator> without </calculator>"]
    assert [run_tool_call(i, TOOLS) for i in items] == ["6", "42", "error: <calculator> without </calculator>"]


def test_unregistered_tags_and_plain_answers_are_no_calls():
    assert scan_tool_calls("The answer is <b>42</b>.", TOOLS) == []
    assert scan_tool_calls('{"answer": 42}', TOOLS) == []
    assert scan_tool_calls("<calculator>1</calculator>", {"lookup": TOOLS["lookup"]}) == []


def test_a_tag_inside_a_tool_call_block_is_its_argument_not_a_call():
    text = _hermes("calculator", {"expression": "<lookup>x</lookup>"})
    assert scan_tool_calls(text, TOOLS) == [ToolCall("calculator", {"expression": "<lookup>x</lookup>"})]


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{bad json}</tool_call>", "not valid JSON"),
    (_hermes("search", {"query": "x"}), "unknown tool 'search' (tools: calculator, lookup)"),
    (_hermes("calculator", {"expression": 5}), 'takes arguments {"expression": "..."}'),
    (_hermes("calculator", {"expr": "1"}), 'takes arguments {"expression": "..."}'),
    (_hermes("calculator", ["1"]), 'takes arguments {"expression": "..."}'),
    ("<tool_call>[1, 2]</tool_call>", "a tool call is a JSON object"),
    ('<tool_call>{"name": "calculator"', "<tool_call> without </tool_call>"),
    ('{"name": "calculator", "parameters": {"expression": "1"}} then more', "not valid JSON"),
    ("<|python_tag|>print(1)", "not valid JSON"),
])
def test_malformed_calls_are_errors(text, error):
    calls, errors = parse_tool_calls(text, TOOLS)
    assert calls == [] and len(errors) == 1
    assert errors[0].startswith("error: ") and error in errors[0]


def test_calls_and_errors_keep_their_order():
    text = _hermes("nope", {}) + _hermes("calculator", {"expression": "7*6"}) + "<lookup>Paris</lookup>"
    items = scan_tool_calls(text, TOOLS)
    assert [run_tool_call(i, TOOLS) for i in items] == [
        "error: unknown tool 'nope' (tools: calculator, lookup)", "42", "capital of France"]


# ---------------------------------------------------------------------------------------------- calculator

@pytest.mark.parametrize("expression, result", [
    ("123456789123456789 * 987654321987654321", str(123456789123456789 * 987654321987654321)),
    ("2**200 - 3**100", str(2**200 - 3**100)),
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("2 * 3 ** 2", "18"), ("2 ** 3 ** 2", "512"),
    ("-2 ** 2", "-4"), ("-(3 - 5)", "2"), ("--3", "3"), ("+-+3", "-3"), ("2 ** -1", "0.5"),
    ("7 / 2", "3.5"), ("84 / 2", "42"), ("1 / 3 * 3", "1"), ("1 / 3", "0.333333333333"),
    ("10 ** 50 / 3", "3.33333333333e+49"),
    ("17 // 5", "3"), ("-7 % 3", "2"), ("0.1 + 0.2", "0.3"), ("2 ** 0.5", "1.41421356237"), ("((((1))))", "1"),
])
def test_calculator_values(expression, result):
    assert Calculator().run(expression) == result


def test_calculator_prints_ints_past_pythons_str_limit():
    assert Calculator().run("(10 ** 9) ** 900") == "1" + "0" * 8100  # str() refuses ints over 4300 digits


@pytest.mark.parametrize("expression, error", [
    ("1 / 0", "division by zero"), ("5 // (2 - 2)", "division by zero"), ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 1001", "exponent 1001 is larger than 1000"), ("9 ** 9 ** 9", "larger than 1000"),
    ("(10 ** 20) ** 600", "more than 10000 digits"), ("(10 ** 999) ** 10 * 10 ** 999", "more than 10000 digits"),
    ("(-8) ** 0.5", "fractional power"), ("2 ** 0.5 * 10 ** 300 * 10 ** 300", "too large"),
    ("1" * 501, "longer than 500 characters"), ("(" * 60 + "1" + ")" * 60, "nested more than 50 deep"),
    ("", "empty expression"), ("2 ^ 3", "write powers as **"), ("1 +", "ends where a number was expected"),
    ("(1 + 2", "missing ')'"), ("3 4", "unexpected '4'"), ("1e5", "unexpected 'e5'"),
])
def test_calculator_errors(expression, error):
    answer = Calculator().run(expression)
    assert answer.startswith("error: ") and error in answer


@pytest.mark.parametrize("expression", ["__import__('os').system('touch {path}')", "().__class__",
                                        "open('{path}', 'w')", "[x for x in ()]", "lambda: 1", "1 if 1 else 2",
                                        "x", "1; import os", "2 .real", "'a' * 3"])
def test_calculator_runs_no_python(expression, tmp_path):
    path = tmp_path / "pwned"
    answer = Calculator().run(expression.format(path=path))
    assert answer.startswith("error: unexpected")
    assert not path.exists()


# ---------------------------------------------------------------------------------------------- lookup

def test_lookup_hits_and_misses(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"Paris": "capital of France", "Pi": 3.14159}))
    lookup = Lookup.from_json(str(table))
    assert lookup.run("paris") == lookup.run("  PARIS ") == "capital of France"
    assert lookup.run("pi") == "3.14159"
    assert lookup.run("Rome") == "error: no entry for 'Rome'"
    table.write_text("[1]")
    with pytest.raises(ValueError, match="a lookup table is an object"):
        Lookup.from_json(str(table))


# ---------------------------------------------------------------------------------------------- environment

class ArithmeticEnvironment(ToolEnvironment):
    """A task environment: the final turn's last number must be the prompt's answer."""

    tools = TOOLS
    max_tool_calls = 3

    def score(self, turn):
        return float(turn.text.split()[-1].strip(".") == str(self.prompt.metadata["answer"]))


def _prompt(answer) -> Prompt:
    return Prompt(index=0, token_ids=(1,), text="q", source="test:0", metadata={"answer": answer})


def test_tool_environment_loads_by_name_and_answers_calls():
    env = load_environment("rlhf.envs.tools:ToolEnvironment")()
    assert env.reset(_prompt(0)) is None
    step = env.step(_turn("<calculator>2**100</calculator><calculator>1/0</calculator>"))
    assert step.observation == [{"role": "tool", "content": str(2**100)},
                                {"role": "tool", "content": "error: division by zero"}]
    assert (step.reward, step.done, env.tool_calls, env.tool_errors) == (0.0, False, 2, 1)
    final = env.step(_turn("It is 1267650600228229401496703205376.", 1))
    assert (final.observation, final.reward, final.done) == (None, 0.0, True)


def test_tool_environment_errors_limit_and_score():
    env = ArithmeticEnvironment()
    env.reset(_prompt(56088))
    step = env.step(_turn(_hermes("calculator", {"expression": 123}) + "<lookup>answer</lookup>"))
    assert step.observation == [
        {"role": "tool", "content": 'error: tool \'calculator\' takes arguments {"expression": "..."} (one string), '
                                    'got {"expression": 123}'},
        {"role": "tool", "content": "42"}]
    assert (env.tool_calls, env.tool_errors, step.done) == (2, 1, False)
    step = env.step(_turn("<calculator>123*456</calculator> <calculator>1+1</calculator>", 1))
    assert [m["content"] for m in step.observation] == [
        "56088", "error: no more tool calls (at most 3 an episode); give your answer"]
    assert (env.tool_calls, env.tool_errors) == (4, 2)
    assert env.step(_turn("The answer is 56088.", 2)) == env.step(_turn("56088", 3))
    assert env.step(_turn("56088", 3)).reward == 1.0 and env.step(_turn("56089", 3)).reward == 0.0
    env.reset(_prompt(1))
    assert (env.tool_calls, env.tool_errors) == (0, 0)


# ---------------------------------------------------------------------------------------------- chat

@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (ChatML, a default system prompt, <|im_end|> its stop token)."""
    from rlhf.checkpoint import gguf

    return HFTokenizer(gguf.smollm2_hf_dir())


def _continued(tokenizer, messages: list[dict], turns: list[tuple[str, list[dict]]], stop: bool) -> list[int]:
    """The ids of ``messages`` then each (assistant turn, environment messages), token in, token out: the
    prompt encoded once, each turn's ids (its stop token last when ``stop``), each continuation."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    for text, observation in turns:
        ids += tokenizer.encode(text) + ([tokenizer.stop_token_ids[0]] if stop else [])
        ids += continuation_ids(tokenizer, observation, after_stop=stop)
    return ids


def _rendered(tokenizer, messages: list[dict], turns: list[tuple[str, list[dict]]]) -> list[int]:
    """The ids of the whole conversation rendered by the template and encoded at once."""
    for text, observation in turns:
        messages = messages + [{"role": "assistant", "content": text}] + observation
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


TURNS = [(_hermes("calculator", {"expression": "123456789 * 987654321"}) + "\n<lookup>Paris</lookup>",
          [{"role": "tool", "content": "121932631112635269"}, {"role": "tool", "content": "capital of France"}]),
         ("So it is 121932631112635269.", [{"role": "user", "content": "Thanks! And 2**64?"}])]


@pytest.mark.parametrize("stop", [True, False], ids=["stopped", "cut-at-length"])
def test_smollm2_continuation_equals_the_rendered_conversation(smollm2_tokenizer, stop):
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "What is 123456789 * 987654321? Use the tools."}]
    assert continuation_text(tok, TURNS[0][1], after_stop=True).startswith("\n<|im_start|>tool\n121932631112635269")
    assert continuation_text(tok, [], after_stop=False) == "<|im_end|>\n<|im_start|>assistant\n"
    # stopped: the turn's <|im_end|> is the template's; cut at length: the continuation adds it. Id for id
    # either way, as special tokens bound every piece encoded apart (no BPE merge crosses them).
    assert _continued(tok, messages, TURNS, stop) == _rendered(tok, messages, TURNS)
    with_system = [{"role": "system", "content": "You compute."}] + messages
    assert _continued(tok, with_system, TURNS, stop) == _rendered(tok, with_system, TURNS)


def test_byte_tokenizer_continuation():
    tok = ByteTokenizer()
    messages = [{"role": "user", "content": "2+2?"}]
    expected = "<|end|>\n<|tool|>\n4<|end|>\n<|assistant|>\n"
    assert continuation_text(tok, [{"role": "tool", "content": "4"}], True) == expected
    assert _continued(tok, messages, TURNS, stop=False) == _rendered(tok, messages, TURNS)
    # its stop token is the EOS, "</s>", which no template text starts with: the EOS stays, E is added whole
    stopped, rendered = _continued(tok, messages, TURNS, stop=True), _rendered(tok, messages, TURNS)
    assert [i for i in stopped if i != tok.EOS] == rendered and stopped.count(tok.EOS) == len(TURNS)


class _RewritingTokenizer(ByteTokenizer):
    """A template that drops earlier assistant turns (as reasoning templates drop earlier thinking)."""

    def _render_chat(self, messages, add_generation_prompt):
        last = max(i for i, m in enumerate(messages) if m["role"] != "assistant")
        kept = [m for i, m in enumerate(messages) if m["role"] != "assistant" or i > last]
        return super()._render_chat(kept, add_generation_prompt)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    with pytest.raises(ValueError, match="rewrites earlier turns"):
        continuation_ids(_RewritingTokenizer(), [{"role": "user", "content": "more"}], after_stop=True)
