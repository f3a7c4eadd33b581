"""Preference data: JSONL / Parquet records of (prompt, chosen, rejected) -> tokenized pairs.

This module owns reading preference files, checking every record, rendering
chat conversations, and the pair policy (identical answers, pairs longer than
the context) for reward-model training (rlhf/reward_model/trainer.py).

Record layouts (one JSON object per JSONL line, or one Parquet row)
    text      ``{"prompt": str, "chosen": str, "rejected": str}``: the prompt is
              tokenized by the tokenizer's rules (as rlhf.data.PromptDataset does;
              ``chat_template_for_text`` wraps it as one user message), each
              answer is appended as plain text.
    HH-RLHF   ``{"chosen": str, "rejected": str}`` without a prompt, each a whole
              dialogue ``"\\n\\nHuman: ...\\n\\nAssistant: ..."``: split into turns,
              rendered with the chat template like the next layout.
    chat      ``chosen`` / ``rejected`` lists of ``{role, content}`` messages:
              whole conversations (TRL's HH-RLHF, UltraFeedback binarized, whose
              string ``prompt`` repeats the user turn and is ignored) that agree
              up to their last message, an assistant answer; or, with a list
              ``prompt``, the assistant continuations of that prompt.

Chat rendering: the prompt is the shared conversation with the assistant's
opening (``add_generation_prompt``), the answer is what the template adds for
the answer message, so ``prompt + answer`` is the rendered conversation::

    render(prefix + [answer], add_generation_prompt=False)
    = render(prefix, add_generation_prompt=True) + answer_text

Tokens: ``prompt_ids + answer_ids (+ EOS)``; with ``append_eos`` every answer
ends with the tokenizer's EOS, as a finished PPO response does, so the reward
model is trained on what it scores in PPO (the value at the last token).

Pair policy (counted in :class:`PreferenceStats`)
    malformed       missing or mistyped field, empty answer, bad messages, a bad
                    margin: ``on_error="raise"`` raises :class:`PromptFormatError`
                    ``"path:N: what is wrong"``, ``"skip"`` drops and warns with ``path:N``
    identical       chosen and rejected tokenize alike: no preference, dropped
    over-long       ``len(prompt) + max(len(chosen), len(rejected)) > max_length``:
                    ``overlong="drop"`` drops it; ``"truncate_prompt"`` keeps the end of
                    the prompt (a leading BOS stays in front) and drops the pair only
                    when not one prompt token would be left. Answers are never cut: a cut
                    answer is not the answer that was judged.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
import re
from array import array
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from rlhf.config import ConfigError

from .prompts import PromptDataError, PromptFormatError, encode_prompt, load_prompt_records
from .tokenizer import Tokenizer, validate_messages

__all__ = [
    "PreferenceDataset",
    "PreferenceDatasetConfig",
    "PreferencePair",
    "PreferenceStats",
]

logger = logging.getLogger(__name__)

OVERLONG = ("drop", "truncate_prompt")
_HH_TURN = re.compile(r"\n\n(Human|Assistant): ")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def _config_error(name: str, value: Any, constraint: str, fix: str) -> ConfigError:
    return ConfigError(f"PreferenceDatasetConfig.{name}={value!r}: {constraint}; {fix}", name)


@dataclass(frozen=True)
class PreferenceDatasetConfig:
    """How to read, check and cut preference pairs. Live inputs (tokenizer) are passed separately.

    ``max_length``: tokens of prompt + the longer answer (EOS included);
    ``margin_field``: a record field holding a number the chosen answer's score
    should exceed the rejected one's by (the loss's margin; None: 0).
    """

    paths: tuple[str, ...]
    max_length: int
    format: str = "auto"  # "auto" (by extension) | "jsonl" | "parquet"
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    margin_field: Optional[str] = None
    chat_template_for_text: bool = False
    overlong: str = "drop"
    on_error: str = "raise"
    append_eos: bool = True
    add_bos: Optional[bool] = None  # a text prompt's BOS, as rlhf.data.encode_prompt
    max_warnings: int = 20

    def __post_init__(self):
        paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else tuple(self.paths)
        if not paths:
            raise _config_error("paths", self.paths, "must be a path or a non-empty list of paths",
                                "pass the JSONL/Parquet file(s) to read")
        object.__setattr__(self, "paths", tuple(os.fspath(p) for p in paths))
        if self.format not in ("auto", "jsonl", "parquet"):
            raise _config_error("format", self.format, "must be 'auto', 'jsonl' or 'parquet'",
                                "use 'auto' to choose by file extension")
        for name in ("prompt_field", "chosen_field", "rejected_field", "margin_field"):
            value = getattr(self, name)
            if (value is not None or name != "margin_field") and (not isinstance(value, str) or not value):
                raise _config_error(name, value, "must be a non-empty string", "name a record field")
        if isinstance(self.max_length, bool) or not isinstance(self.max_length, int) or self.max_length < 2:
            raise _config_error("max_length", self.max_length, "must be an int >= 2 (tokens of prompt + answer)",
                                "e.g. the model's context")
        if self.overlong not in OVERLONG:
            raise _config_error("overlong", self.overlong, f"must be one of {OVERLONG}",
                                "'drop' drops over-long pairs, 'truncate_prompt' keeps the end of their prompt")
        if self.on_error not in ("raise", "skip"):
            raise _config_error("on_error", self.on_error, "must be 'raise' or 'skip'",
                                "'skip' drops malformed records with a warning")


@dataclass(frozen=True, eq=False)
class PreferencePair:
    """One usable pair: token ids of the prompt and of both answers (EOS included), the margin,
    ``index`` (position in the dataset), ``source`` (``"path:N"``) and whether the prompt was cut."""

    index: int
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    margin: float = 0.0
    source: str = ""
    truncated: bool = False

    @property
    def length(self) -> int:
        """Tokens of the prompt and the longer answer: what the context must hold."""
        return len(self.prompt) + max(len(self.chosen), len(self.rejected))


@dataclass
class PreferenceStats:
    """What happened to every record read."""

    files: int = 0
    records: int = 0
    loaded: int = 0
    malformed: int = 0  # skipped (on_error="skip")
    identical: int = 0
    dropped_overlong: int = 0
    truncated: int = 0  # kept, prompt cut on the left
    max_length: int = 0

    def summary(self) -> str:
        """One line for the log."""
        return (f"preference pairs: {self.loaded} loaded from {self.records} records in {self.files} file(s); "
                f"{self.malformed} malformed skipped; {self.identical} with identical answers dropped; "
                f"{self.dropped_overlong} over-long (> {self.max_length} tokens) dropped; "
                f"{self.truncated} prompt-truncated")


class PreferenceDataset(Sequence[PreferencePair]):
    """Usable preference pairs in file order; ``stats`` says what was dropped, ``fingerprint`` (sha256
    over every pair's ids and margin) identifies the content, so a resumed data position
    (rlhf.data.PromptBatchIterator) is refused on other data.

    ``PreferenceDataset(config, tokenizer)`` reads files; :meth:`from_token_ids` takes pairs
    that are already token ids (the tiny default's synthetic pairs). Both apply the pair policy.
    """

    Config = PreferenceDatasetConfig

    def __init__(self, config: PreferenceDatasetConfig, tokenizer: Tokenizer):
        self._init(config)
        renderer = _Renderer(config, tokenizer)
        for path in config.paths:
            for n, record, problem in load_prompt_records(path, config.format):
                self.stats.records += 1
                try:
                    if problem is not None:
                        raise PromptFormatError(path, n, problem)
                    prompt, chosen, rejected, margin = renderer.pair(path, n, record)
                except PromptFormatError as exc:
                    self._malformed(exc)
                    continue
                self._admit(prompt, chosen, rejected, margin, f"{path}:{n}", tokenizer.bos_id)
        self._finish(", ".join(config.paths))

    @classmethod
    def from_token_ids(cls, pairs: Iterable[tuple[Sequence[int], Sequence[int], Sequence[int]]],
                       config: PreferenceDatasetConfig, bos_id: Optional[int]) -> "PreferenceDataset":
        """Pairs given as (prompt, chosen, rejected) id lists (answers used as given: no EOS added).
        ``config.paths`` holds one name for where they come from; pair ``i``'s source is ``"<name>:<i+1>"``."""
        self = cls.__new__(cls)
        self._init(config)
        for i, (prompt, chosen, rejected) in enumerate(pairs):
            self.stats.records += 1
            self._admit(list(prompt), list(chosen), list(rejected), 0.0, f"{config.paths[0]}:{i + 1}", bos_id)
        self._finish(config.paths[0])
        return self

    # -- building ------------------------------------------------------------
    def _init(self, config: PreferenceDatasetConfig) -> None:
        self.config = config
        self.stats = PreferenceStats(files=len(config.paths), max_length=config.max_length)
        self._pairs: list[PreferencePair] = []
        self._warned = 0
        self._digest = hashlib.sha256()

    def _warn(self, message: str, *args) -> None:
        if self._warned < self.config.max_warnings:
            self._warned += 1
            logger.warning(message, *args)

    def _malformed(self, exc: PromptFormatError) -> None:
        if self.config.on_error == "raise":
            raise exc
        self.stats.malformed += 1
        self._warn("skipping malformed preference record %s", exc)

    def _admit(self, prompt: list, chosen: list, rejected: list, margin: float, source: str,
               bos_id: Optional[int]) -> None:
        """Apply the pair policy (module docstring) and keep the pair if it survives."""
        if chosen == rejected:
            self.stats.identical += 1
            self._warn("dropping preference pair %s: chosen and rejected are identical", source)
            return
        room = self.config.max_length - max(len(chosen), len(rejected))
        truncated = len(prompt) > room
        if truncated:
            head = prompt[:1] if prompt[:1] == [bos_id] else []
            if self.config.overlong == "drop" or room < len(head) + 1:
                self.stats.dropped_overlong += 1
                return
            prompt = head + prompt[len(prompt) - (room - len(head)):]
            self.stats.truncated += 1
        pair = PreferencePair(len(self._pairs), tuple(prompt), tuple(chosen), tuple(rejected), margin, source,
                              truncated)
        self._pairs.append(pair)
        for ids in (pair.prompt, pair.chosen, pair.rejected):
            self._digest.update(array("q", ids).tobytes() + b"\xff")
        self._digest.update(repr(margin).encode())

    def _finish(self, where: str) -> None:
        self.stats.loaded = len(self._pairs)
        self.fingerprint = self._digest.hexdigest()
        if self._warned < self.stats.malformed + self.stats.identical:
            logger.warning("more malformed or identical preference records dropped (warnings capped at %d)",
                           self.config.max_warnings)
        if not self._pairs:
            raise PromptDataError(f"no usable preference pairs in {where} ({self.stats.summary()})")

    # -- sequence --------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, i):
        return self._pairs[i]

    def __repr__(self) -> str:
        return f"PreferenceDataset({len(self)} pairs; {self.stats.summary()})"


class _Renderer:
    """One record -> (prompt ids, chosen ids, rejected ids, margin); PromptFormatError if malformed."""

    def __init__(self, config: PreferenceDatasetConfig, tokenizer: Tokenizer):
        self.config, self.tokenizer = config, tokenizer

    def pair(self, path: str, n: int, record: Any) -> tuple[list, list, list, float]:
        cfg = self.config
        if not isinstance(record, Mapping):
            raise PromptFormatError(path, n, f"expected a JSON object, got {type(record).__name__}")
        for key in (cfg.chosen_field, cfg.rejected_field):
            if key not in record:
                raise PromptFormatError(path, n, f"missing field '{key}' "
                                        f"(fields present: {', '.join(map(str, record)) or 'none'})")
        chosen, rejected = record[cfg.chosen_field], record[cfg.rejected_field]
        try:
            if isinstance(chosen, str) and isinstance(rejected, str):
                texts = self._text_layout(record, chosen, rejected)
            elif _is_list(chosen) and _is_list(rejected):
                texts = self._chat_layout(record.get(cfg.prompt_field), list(chosen), list(rejected))
            else:
                raise ValueError(f"'{cfg.chosen_field}' and '{cfg.rejected_field}' must both be strings or both "
                                 f"lists of messages, got {type(chosen).__name__} and {type(rejected).__name__}")
        except ValueError as exc:  # includes TokenizerError (a template that cannot render them)
            raise PromptFormatError(path, n, str(exc)) from None
        return (*self._tokens(*texts), self._margin(path, n, record))

    def _text_layout(self, record: Mapping, chosen: str, rejected: str) -> tuple[str, str, str, bool]:
        """(prompt text, chosen text, rejected text, templated) of a text or HH-RLHF record."""
        cfg = self.config
        if cfg.prompt_field not in record and chosen.lstrip().startswith("Human:"):
            return self._chat_layout(None, _hh_messages(chosen, cfg.chosen_field),
                                     _hh_messages(rejected, cfg.rejected_field))
        prompt = record.get(cfg.prompt_field)
        if not isinstance(prompt, str):
            what = "missing" if prompt is None else f"a {type(prompt).__name__}"
            raise ValueError(f"field '{cfg.prompt_field}' is {what}; text answers need a string prompt "
                             "(or whole HH-RLHF dialogues, '\\n\\nHuman: ... \\n\\nAssistant: ...')")
        for key, text in ((cfg.prompt_field, prompt), (cfg.chosen_field, chosen), (cfg.rejected_field, rejected)):
            if not text:
                raise ValueError(f"field '{key}' is empty")
        if cfg.chat_template_for_text:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        return prompt, chosen, rejected, cfg.chat_template_for_text

    def _chat_layout(self, prompt, chosen: list, rejected: list) -> tuple[str, str, str, bool]:
        """(prompt text, chosen text, rejected text, templated) of message lists (module docstring)."""
        cfg = self.config
        if _is_list(prompt):
            prefix = validate_messages(list(prompt))
            answers = [validate_messages(chosen), validate_messages(rejected)]
        else:
            full = [validate_messages(chosen), validate_messages(rejected)]
            if full[0][:-1] != full[1][:-1]:
                raise ValueError(f"'{cfg.chosen_field}' and '{cfg.rejected_field}' differ before their last "
                                 "message; give conversations that share everything but the answer (or a "
                                 f"'{cfg.prompt_field}' list of messages and the answers alone)")
            prefix, answers = full[0][:-1], [full[0][-1:], full[1][-1:]]
            if not prefix:
                raise ValueError("the conversations hold only the answer; they need a user turn before it")
        for key, answer in zip((cfg.chosen_field, cfg.rejected_field), answers):
            if answer[-1]["role"] != "assistant" or not answer[-1]["content"]:
                raise ValueError(f"'{key}' must end with a non-empty assistant message, got role "
                                 f"{answer[-1]['role']!r}")
        prompt_text = self.tokenizer.apply_chat_template(prefix, add_generation_prompt=True)
        texts = [self._answer_text(prompt_text, prefix + answer) for answer in answers]
        return prompt_text, texts[0], texts[1], True

    def _answer_text(self, prompt_text: str, conversation: list) -> str:
        full = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=False)
        if not full.startswith(prompt_text):
            raise ValueError("the chat template does not render the answer as a continuation of the prompt "
                             "with the assistant's opening; this tokenizer's template cannot split the pair")
        return full[len(prompt_text):]

    def _tokens(self, prompt: str, chosen: str, rejected: str, templated: bool) -> tuple[list, list, list]:
        """Token ids: the prompt by the tokenizer's rules (a template's text gets nothing added by
        default), each answer's text alone, then EOS (``append_eos``)."""
        add_bos = self.config.add_bos if self.config.add_bos is not None or not templated else False
        prompt_ids = encode_prompt(self.tokenizer, prompt, add_bos)
        answers = [self.tokenizer.encode(text) for text in (chosen, rejected)]
        eos = self.tokenizer.eos_id
        if self.config.append_eos:
            answers = [ids if ids[-1:] == [eos] else ids + [eos] for ids in answers]
        return prompt_ids, answers[0], answers[1]

    def _margin(self, path: str, n: int, record: Mapping) -> float:
        name = self.config.margin_field
        if name is None:
            return 0.0
        value = record.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise PromptFormatError(path, n, f"field '{name}' (the margin) must be a finite number, got {value!r}")
        return float(value)


def _is_list(value) -> bool:
    """A list of messages (JSON array; a Parquet list column arrives as a list too)."""
    return isinstance(value, (list, tuple))


def _hh_messages(text: str, key: str) -> list[dict]:
    """An HH-RLHF dialogue ``"\\n\\nHuman: a\\n\\nAssistant: b"`` -> [{user: a}, {assistant: b}]."""
    parts = _HH_TURN.split("\n\n" + text.lstrip())
    if parts[0] or len(parts) < 5:
        raise ValueError(f"field '{key}' is not an HH-RLHF dialogue ('\\n\\nHuman: ...\\n\\nAssistant: ...')")
    return [{"role": _HH_ROLES[role], "content": content.strip()} for role, content in zip(parts[1::2], parts[2::2])]
