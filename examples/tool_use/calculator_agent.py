"""Arithmetic that needs a calculator, solved by an agent written against the ``openai`` client.

The prompts ask ``What is A * B?`` or ``What is A + B?`` with numbers of 4 to 5 digits (too large for a
135M model to multiply in its head). `solve` is the agent that ``pretrain_rlhf.py --agent
examples.tool_use.calculator_agent:solve`` runs once per sample: it shows the model one worked example
(a calculator call, the tool's answer, the final number), asks the question, runs every calculator call
the model writes (``<calculator>EXPRESSION</calculator>``, parsed and evaluated by rlhf.envs.tools: never
``eval``) and sends the result back as a ``tool`` message, until the model answers without a call (at most
3 turns). The reward is 1.0 when the last integer of the final answer is the exact result, else 0.0.

    python examples/tool_use/calculator_agent.py --out prompts.jsonl [--count 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys

from rlhf.envs.tools import Calculator, run_tool_call, scan_tool_calls

TOOLS = {"calculator": Calculator()}
EXAMPLE = [{"role": "user", "content": "What is 3817 * 642?"},
           {"role": "assistant", "content": "<calculator>3817 * 642</calculator>"},
           {"role": "tool", "content": "2450514"},
           {"role": "assistant", "content": "2450514"}]
"""The worked example every episode starts with (one shot: without it the model never writes a call)."""
MAX_TURNS = 3
_INTEGER = re.compile(r"-?\d+")


def make_prompts(count: int, seed: int) -> list[dict]:
    """``count`` records {"prompt": question, "question": question, "answer": exact result} drawn with ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b, op = rng.randint(1000, 99999), rng.randint(100, 9999), rng.choice("*+")
        question = f"What is {a} {op} {b}?"
        out.append({"prompt": question, "question": question, "answer": str(a * b if op == "*" else a + b)})
    return out


def solve(client, prompt) -> float:
    """One episode (module docstring): the reward of the model's final answer to ``prompt``'s question."""
    messages = EXAMPLE + [{"role": "user", "content": prompt.metadata["question"]}]
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
        text = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        calls = scan_tool_calls(text, TOOLS)  # the well-formed calls and the malformed ones' errors, in order
        if not calls:
            break
        messages += [{"role": "tool", "content": run_tool_call(call, TOOLS)} for call in calls]
    numbers = _INTEGER.findall(messages[-1]["content"]) if messages[-1]["role"] == "assistant" else []
    return 1.0 if numbers and numbers[-1] == prompt.metadata["answer"] else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSONL file of prompt records to write")
    ap.add_argument("--count", type=int, default=256, help="how many prompts")
    ap.add_argument("--seed", type=int, default=0, help="the seed of the numbers")
    args = ap.parse_args(argv)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in make_prompts(args.count, args.seed))
    print(f"{args.count} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
