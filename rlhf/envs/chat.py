r"""The chat template applied incrementally: the tokens that continue a conversation after a model turn.

Token in, token out: the prompt and each model turn are tokenized once and never again, so the text
between a finished assistant turn and the next one (the end of that turn, the environment's
messages, the next turn's header) is rendered on its own and encoded once. The template is asked
for it by difference, so no template needs to be known here. For ChatML (SmolLM2, Qwen) and a tool
result "42"::

    R0 = template([user "x", assistant "y"])                                  (no generation prompt)
       = "<|im_start|>system\n...<|im_end|>\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\ny" + E
    E  = "<|im_end|>\n"                                                       (the end of a turn)
    R1 = template([user "x", assistant "y", tool "42"], add_generation_prompt=True)
       = R0 + "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"

    continuation = E + R1[len(R0):], without E's "<|im_end|>" when the turn ended with that stop token:
                 = "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"

A system prompt the template inserts by default is in both renderings, so it cancels out. Encoding
the continuation apart from the turn gives the ids of encoding the whole conversation at once when a
special token separates them (ChatML's <|im_end|> and <|im_start|>); a template that ends turns with
plain text may merge differently across that boundary, which token-in, token-out accepts.
"""

from __future__ import annotations

from typing import Sequence

from rlhf.data.tokenizer import Tokenizer

__all__ = ["continuation_ids", "continuation_text"]

_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def continuation_text(tokenizer: Tokenizer, messages: Sequence[dict], after_stop: bool) -> str:
    """The text that follows a finished assistant turn when the conversation goes on with ``messages``
    (tool results, a user message...) and the next assistant turn's generation prompt (module docstring).

    With ``after_stop`` the turn ended with a stop token: the end-of-turn text then loses that token's text
    from its front (the longest of ``tokenizer.stop_token_ids``' texts it starts with), as it is already in
    the sequence. Raises ValueError when the template renders the longer conversation other than by
    appending to the shorter one (token-in, token-out continuation is then impossible).
    """
    base = tokenizer.apply_chat_template(_BASE, add_generation_prompt=False)
    extended = tokenizer.apply_chat_template(_BASE + list(messages), add_generation_prompt=True)
    if not extended.startswith(base):
        raise ValueError(f"the chat template rewrites earlier turns when a conversation goes on: it renders "
                         f"[user, assistant] as {base!r:.300} but, followed by {len(messages)} more message(s), "
                         f"as {extended!r:.300}; a template that only appends is needed to continue a "
                         "conversation token by token")
    end = base[base.rfind(_BASE[-1]["content"]) + len(_BASE[-1]["content"]):]
    if after_stop:
        stops = [tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.stop_token_ids]
        stop = max((s for s in stops if s and end.startswith(s)), key=len, default="")
        end = end[len(stop):]
    return end + extended[len(base):]


def continuation_ids(tokenizer: Tokenizer, messages: Sequence[dict], after_stop: bool) -> list[int]:
    """The token ids of `continuation_text`, encoded once (no special tokens added): what to append to a
    sequence that ends with an assistant turn so that the model's next turn can start."""
    return tokenizer.encode(continuation_text(tokenizer, messages, after_stop))
