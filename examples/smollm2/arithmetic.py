"""Verifiable arithmetic for SmolLM2-135M-Instruct: the prompts and the ``--reward-fn`` that scores them.

A prompt asks ``What is A+B? Answer with just the number.`` (A, B in 1..9;
``pretrain_rlhf.py --chat-template`` wraps it as one user message). The reward
of a response (token ids, maybe ending with the EOS):

    1.0  exactness: the last integer in the response is A+B
  + 0.5  format: the response is that bare integer and nothing else, ended by the EOS

For "What is 3+5?": "8" scores 1.5, "3 + 5 = 8" 1.0, "The answer is 9." 0.0, and a
response cut at --max-response-len (no EOS) gets no format bonus.

    python examples/smollm2/arithmetic.py --out prompts.jsonl [--count 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import sys

QUESTION = "What is {a}+{b}? Answer with just the number."
_QUESTION = re.compile(r"What is (\d+)\+(\d+)\?")
_INTEGER = re.compile(r"-?\d+")
EXACT, FORMAT = 1.0, 0.5


def make_prompts(count: int, seed: int) -> list[dict]:
    """``count`` records {"prompt": question, "answer": A+B} drawn with ``seed``."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append({"prompt": QUESTION.format(a=a, b=b), "answer": a + b})
    return out


def score_text(prompt: str, response: str, finished: bool) -> float:
    """The reward of ``response`` (text, special tokens removed) to the question in ``prompt``.

    ``finished``: the response ended with the EOS (rather than at the length limit).
    """
    question = _QUESTION.search(prompt)
    if question is None:
        raise ValueError(f"no 'What is A+B?' question in the prompt {prompt!r}")
    answer = int(question.group(1)) + int(question.group(2))
    numbers = _INTEGER.findall(response)
    exact = bool(numbers) and int(numbers[-1]) == answer
    bare = finished and response.strip() == str(answer)
    return EXACT * exact + FORMAT * bare


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from rlhf.checkpoint.gguf import smollm2_hf_dir
    from rlhf.data import build_tokenizer

    return build_tokenizer(smollm2_hf_dir())


def reward(prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
    """``--reward-fn examples.smollm2.arithmetic:reward``: one score per sample (see the module docstring)."""
    tok = _tokenizer()
    scores = []
    for prompt, response in zip(prompts, responses):
        finished = bool(response) and response[-1] == tok.eos_id
        text = tok.decode(response[:-1] if finished else response, skip_special_tokens=True)
        scores.append(score_text(tok.decode(prompt, skip_special_tokens=True), text, finished))
    return scores


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="prompts JSONL to write")
    p.add_argument("--count", type=int, default=256, help="number of prompts")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn numbers")
    args = p.parse_args(argv)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in make_prompts(args.count, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
