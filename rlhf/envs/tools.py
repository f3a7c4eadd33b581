"""Tool calls for agents: a parser for the formats models write calls in, two tools, and an environment.

A model calls a tool in one of three ways; `parse_tool_calls` reads all three::

    <tool_call>                                        Qwen2 / Qwen2.5 / Hermes: one block per call,
    {"name": "calculator", "arguments": {"expression": "2**64"}}        several blocks in one turn
    </tool_call>

    <|python_tag|>{"name": "lookup", "parameters": {"key": "Paris"}}     Llama-3: the whole turn is one
                                                                          JSON call, the tag optional
    <calculator>2**64</calculator>  <lookup>Paris</lookup>               plain tags, for models without
                                                                          tool support: <TOOL>argument</TOOL>

A call that cannot be run (bad JSON, an unknown tool, a missing or mistyped argument, an unclosed
block) becomes an error string, never an exception, so the model reads what it did wrong.

Each tool takes one string argument (`Tool.parameter`, what a plain tag's text fills) and answers
text, ``"error: ..."`` when the argument is bad. `Calculator` evaluates arithmetic with its own
parser (nothing the model writes is ever evaluated as Python) exactly on integers of any size;
`Lookup` answers from a local table.

`ToolEnvironment` answers each turn's calls with one ``{"role": "tool"}`` message per call (or
error), in the order they were written, and ends the episode at the first turn without a call,
rewarding it with `ToolEnvironment.score`.
"""

from __future__ import annotations

import abc
import json
import math
import re
from dataclasses import dataclass
from decimal import Context, Decimal
from fractions import Fraction
from types import MappingProxyType
from typing import Any, ClassVar, Mapping, Optional, Union

from rlhf.envs.environment import Environment, EnvironmentStep, ModelTurn

__all__ = ["Calculator", "Lookup", "Tool", "ToolCall", "ToolEnvironment", "parse_tool_calls", "run_tool_call",
           "scan_tool_calls"]


class Tool(abc.ABC):
    """A function the model calls by name with one string argument, named ``parameter``; it answers text."""

    parameter: str = "input"

    @abc.abstractmethod
    def run(self, argument: str) -> str:
        """The answer the model reads: the result, or ``"error: ..."`` for a bad argument (never an exception)."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (``{tool.parameter: text}``)."""

    name: str
    arguments: dict


# ---------------------------------------------------------------------------------------------- parsing

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
_LLAMA = re.compile(r"\A\s*(<\|python_tag\|>|(?=\{\s*\"name\"\s*:))(.*)\Z", re.DOTALL)


def scan_tool_calls(text: str, tools: Mapping[str, Tool]) -> list[Union[ToolCall, str]]:
    """The calls written in ``text``, in order: a `ToolCall` for each well-formed one, an ``"error: ..."``
    string for each malformed one. A turn that is a Llama-3 JSON call (``{"name": ...`` or the python tag
    first) is read as that one call; otherwise its ``<tool_call>`` blocks and the plain ``<TOOL>...</TOOL>``
    tags of the names in ``tools`` outside those blocks."""
    llama = _LLAMA.match(text)
    if llama:
        return [_json_call(llama.group(2).strip(), tools, "parameters")]
    found: list[tuple[int, Union[ToolCall, str]]] = []
    blocks = []
    for match in _HERMES.finditer(text):
        blocks.append(match.span())
        if not match.group(2):
            found.append((match.start(), "error: <tool_call> without </tool_call>"))
        else:
            found.append((match.start(), _json_call(match.group(1).strip(), tools, "arguments")))
    for name, tool in tools.items():
        tag = re.compile(rf"<{re.escape(name)}>(.*?)(</{re.escape(name)}>|\Z)", re.DOTALL)
        for match in tag.finditer(text):
            if any(start <= match.start() < end for start, end in blocks):
                continue
            if not match.group(2):
                found.append((match.start(), f"error: <{name}> without </{name}>"))
            else:
                found.append((match.start(), ToolCall(name, {tool.parameter: match.group(1).strip()})))
    return [item for _, item in sorted(found, key=lambda pair: pair[0])]


def parse_tool_calls(text: str, tools: Mapping[str, Tool]) -> tuple[list[ToolCall], list[str]]:
    """The well-formed calls of ``text`` and the errors of its malformed ones (`scan_tool_calls`, split)."""
    items = scan_tool_calls(text, tools)
    return [i for i in items if isinstance(i, ToolCall)], [i for i in items if isinstance(i, str)]


def _json_call(body: str, tools: Mapping[str, Tool], key: str) -> Union[ToolCall, str]:
    """A JSON call ``{"name": ..., key: {...}}`` (``arguments`` and ``parameters`` both accepted), checked
    against ``tools``; an error string when it is not one."""
    try:
        call = json.loads(body)
    except ValueError as exc:
        return f"error: the tool call is not valid JSON ({exc}): {body[:200]}"
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return f'error: a tool call is a JSON object {{"name": ..., "{key}": {{...}}}}, got {body[:200]}'
    name = call["name"]
    if name not in tools:
        return f"error: unknown tool {name!r} (tools: {', '.join(tools) or 'none'})"
    arguments = call.get("arguments", call.get("parameters", {}))
    parameter = tools[name].parameter
    if not isinstance(arguments, dict) or set(arguments) != {parameter} or not isinstance(arguments[parameter], str):
        return (f'error: tool {name!r} takes {key} {{"{parameter}": "..."}} (one string), '
                f"got {json.dumps(arguments)[:200]}")
    return ToolCall(name, dict(arguments))


def run_tool_call(call: Union[ToolCall, str], tools: Mapping[str, Tool]) -> str:
    """What the model reads for one item of `scan_tool_calls`: the tool's answer, or the parse error."""
    if isinstance(call, str):
        return call
    tool = tools[call.name]
    return tool.run(call.arguments[tool.parameter])


# ---------------------------------------------------------------------------------------------- calculator

Number = Union[int, Fraction, float]
_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|(\*\*|//|[-+*/%()]))")
_LOG10_2 = math.log10(2)


class _CalcError(Exception):
    """A bad expression; its message is what the model reads after "error: "."""


class Calculator(Tool):
    """Arithmetic on a safe parser: numbers, ``+ - * / // % **``, unary signs and parentheses.

    Integers stay exact Python ints of any size; ``/`` is exact when it divides and exact fractions
    carry on (``1/3*3`` is ``1``); a result that is not an integer is shown to 12 significant digits.
    Guarded: an expression of at most ``max_length`` characters nested at most ``max_depth`` deep,
    exponents of at most ``max_exponent`` in size, results of at most ``max_digits`` digits.
    """

    parameter = "expression"

    def __init__(self, max_length: int = 500, max_exponent: int = 1000, max_digits: int = 10000,
                 max_depth: int = 50):
        self.max_length, self.max_exponent = max_length, max_exponent
        self.max_digits, self.max_depth = max_digits, max_depth

    def run(self, argument: str) -> str:
        """The value of the expression ``argument``, or ``"error: ..."`` (division by zero, a bad token...)."""
        if len(argument) > self.max_length:
            return f"error: the expression is longer than {self.max_length} characters"
        try:
            return _format(self._evaluate(argument))
        except _CalcError as exc:
            return f"error: {exc}"
        except OverflowError:
            return "error: the result is too large"

    def _evaluate(self, text: str) -> Number:
        tokens, pos = [], 0
        text = text.rstrip()
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if not match:
                hint = " (write powers as **)" if text[pos:].lstrip().startswith("^") else ""
                raise _CalcError(f"unexpected {text[pos:].lstrip()[:10]!r} at position {pos}{hint}")
            number, op = match.groups()
            tokens.append(op if number is None else _number(number))
            pos = match.end()
        if not tokens:
            raise _CalcError("empty expression")
        return _Parser(tokens, self).parse()

    def _check(self, value: Number) -> Number:
        """``value`` if within the digit limit (and finite), else a _CalcError."""
        if isinstance(value, float):
            if not math.isfinite(value):
                raise _CalcError("the result is too large")
            return value
        parts = (value,) if isinstance(value, int) else (value.numerator, value.denominator)
        if any(abs(p).bit_length() * _LOG10_2 > self.max_digits for p in parts):
            raise _CalcError(f"the result has more than {self.max_digits} digits")
        return value

    def _power(self, base: Number, exponent: Number) -> Number:
        """``base ** exponent``, exact for an exact base and an integer exponent, refused when too large."""
        if isinstance(exponent, Fraction) and exponent.denominator == 1:
            exponent = exponent.numerator
        if abs(exponent) > self.max_exponent:
            raise _CalcError(f"exponent {_format(exponent)} is larger than {self.max_exponent} in size")
        if isinstance(exponent, int) and not isinstance(base, float):
            bits = max(abs(Fraction(base).numerator).bit_length(), Fraction(base).denominator.bit_length())
            if bits * abs(exponent) * _LOG10_2 > self.max_digits + 1:
                raise _CalcError(f"the result has more than {self.max_digits} digits")
            if base == 0 and exponent < 0:
                raise _CalcError("division by zero")
            return base ** exponent if exponent >= 0 else 1 / Fraction(base) ** -exponent
        if base < 0:
            raise _CalcError("a negative number to a fractional power")
        if base == 0 and exponent < 0:
            raise _CalcError("division by zero")
        return float(base) ** float(exponent)


def _number(text: str) -> Number:
    return int(text) if text.isdigit() else Fraction(text)


def _divide(op: str, left: Number, right: Number) -> Number:
    if right == 0:
        raise _CalcError("division by zero")
    if op == "//":
        return left // right
    if op == "%":
        return left % right
    if isinstance(left, float) or isinstance(right, float):
        return left / right
    return Fraction(left, right)


class _Parser:
    """Recursive descent over the tokens, evaluating as it goes (Python's precedence)::

        expr  := term (("+" | "-") term)*
        term  := unary (("*" | "/" | "//" | "%") unary)*
        unary := ("+" | "-") unary | power
        power := atom ("**" unary)?          right-associative; -2**2 is -4
        atom  := NUMBER | "(" expr ")"
    """

    def __init__(self, tokens: list, calculator: Calculator):
        self.tokens, self.pos, self.depth, self.calc = tokens, 0, 0, calculator

    def parse(self) -> Number:
        value = self.expr()
        if self.pos < len(self.tokens):
            raise _CalcError(f"unexpected {_show(self.tokens[self.pos])!r} after a complete expression")
        return value

    def take(self, *ops: str) -> Optional[str]:
        token = self.tokens[self.pos] if self.pos < len(self.tokens) else None
        if isinstance(token, str) and token in ops:
            self.pos += 1
            return token
        return None

    def expr(self) -> Number:
        value = self.term()
        while op := self.take("+", "-"):
            right = self.term()
            value = self.calc._check(value + right if op == "+" else value - right)
        return value

    def term(self) -> Number:
        value = self.unary()
        while op := self.take("*", "/", "//", "%"):
            right = self.unary()
            value = self.calc._check(value * right if op == "*" else _divide(op, value, right))
        return value

    def unary(self) -> Number:
        if op := self.take("+", "-"):
            value = self.nested(self.unary)
            return -value if op == "-" else value
        return self.power()

    def power(self) -> Number:
        base = self.atom()
        if self.take("**"):
            return self.calc._check(self.calc._power(base, self.nested(self.unary)))
        return base

    def atom(self) -> Number:
        if self.take("("):
            value = self.nested(self.expr)
            if not self.take(")"):
                raise _CalcError("missing ')'")
            return value
        if self.pos >= len(self.tokens):
            raise _CalcError("the expression ends where a number was expected")
        token = self.tokens[self.pos]
        if isinstance(token, str):
            raise _CalcError(f"unexpected {token!r} where a number was expected")
        self.pos += 1
        return token

    def nested(self, rule) -> Number:
        """``rule()`` one level deeper (a sign, a parenthesis, an exponent): refused past the depth limit, so
        the recursion stays far from Python's."""
        self.depth += 1
        if self.depth > self.calc.max_depth:
            raise _CalcError(f"the expression is nested more than {self.calc.max_depth} deep")
        value = rule()
        self.depth -= 1
        return value


def _show(token: Any) -> str:
    return token if isinstance(token, str) else _format(token)


def _format(value: Number) -> str:
    """An int in full (in chunks: Python refuses str() of ints over 4300 digits), anything else to 12
    significant digits."""
    if isinstance(value, Fraction) and value.denominator == 1:
        value = value.numerator
    if isinstance(value, int):
        chunk = 10 ** 1000
        parts, rest = [], abs(value)
        while rest >= chunk:
            rest, low = divmod(rest, chunk)
            parts.append(str(low).zfill(1000))
        return ("-" if value < 0 else "") + str(rest) + "".join(reversed(parts))
    if isinstance(value, Fraction):
        decimal = Context(prec=12).divide(Decimal(value.numerator), Decimal(value.denominator))
        return _strip(format(decimal, "f") if abs(decimal.adjusted()) < 12 else format(decimal, "e"))
    return format(value, ".12g")


def _strip(text: str) -> str:
    """Decimal's rendering without trailing zeros of the fraction part."""
    mantissa, e, exponent = text.partition("e")
    if "." in mantissa:
        mantissa = mantissa.rstrip("0").rstrip(".")
    return mantissa + e + exponent


# ---------------------------------------------------------------------------------------------- lookup

class Lookup(Tool):
    """Answers a key's entry from a local table (keys matched without regard to case or surrounding space)."""

    parameter = "key"

    def __init__(self, table: Mapping[str, Any]):
        self.table = {_key(k): v if isinstance(v, str) else json.dumps(v) for k, v in table.items()}

    @classmethod
    def from_json(cls, path: str) -> "Lookup":
        """The table of a JSON file holding one object (key -> entry)."""
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
        if not isinstance(table, dict):
            raise ValueError(f"{path} holds a JSON {type(table).__name__}; a lookup table is an object")
        return cls(table)

    def run(self, argument: str) -> str:
        """The entry of ``argument``, or ``"error: no entry for '...'"``."""
        entry = self.table.get(_key(argument))
        return entry if entry is not None else f"error: no entry for {argument.strip()!r}"


def _key(key: str) -> str:
    return key.strip().casefold()


# ---------------------------------------------------------------------------------------------- environment

class ToolEnvironment(Environment):
    """Answers the model's tool calls until it writes a turn without one, which ends the episode.

    A turn with calls gets one ``{"role": "tool", "content": ...}`` message per call or malformed call,
    in the order written, and reward 0; a turn without is rewarded ``score(turn)`` and ends the episode.
    Calls past ``max_tool_calls`` in an episode are not run: each is answered with an error.

    Subclass to change the tools (``tools``: name -> `Tool`), the limit, or the score; the prompt of
    the episode is ``self.prompt``. ``tool_calls`` counts the calls attempted (malformed ones
    included), ``tool_errors`` those answered with an error, for a trainer's tool-call rates.
    """

    tools: ClassVar[Mapping[str, Tool]] = MappingProxyType({"calculator": Calculator()})
    max_tool_calls: ClassVar[int] = 10

    def __init__(self):
        self.prompt = None
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self, prompt):
        """Keep ``prompt`` (for `score`) and zero the counters; nothing is appended to the prompt."""
        self.prompt = prompt
        self.tool_calls = self.tool_errors = 0
        return None

    def step(self, turn: ModelTurn) -> EnvironmentStep:
        """The tool messages answering ``turn``'s calls, or, with no call in it, the end and its score."""
        calls = scan_tool_calls(turn.text, self.tools)
        if not calls:
            return EnvironmentStep(reward=float(self.score(turn)), done=True)
        messages = []
        for call in calls:
            self.tool_calls += 1
            if self.tool_calls > self.max_tool_calls:
                answer = f"error: no more tool calls (at most {self.max_tool_calls} an episode); give your answer"
            else:
                answer = run_tool_call(call, self.tools)
            self.tool_errors += int(answer.startswith("error:"))
            messages.append({"role": "tool", "content": answer})
        return EnvironmentStep(observation=messages)

    def score(self, turn: ModelTurn) -> float:
        """The reward of the final turn (one without a tool call): 0 here; subclasses check the answer."""
        return 0.0
