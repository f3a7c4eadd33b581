"""Prompt datasets: JSONL / Parquet records -> tokenized prompts -> mini-batches.

This module owns reading prompt files, checking every record, rendering chat
messages, applying the prompt-length policy, and the epoch/position bookkeeping
that lets a resumed run continue with exactly the next prompt.

Records
    JSONL: one JSON object per line (blank lines ignored). Parquet: one row per
    record. The prompt is a string field (``prompt_field``, default
    ``"prompt"``) or, with ``messages_field``, a list of ``{role, content}``
    rendered with the tokenizer's chat template. Every other field of the
    record is kept in :attr:`Prompt.metadata`.

Locations
    Problems are reported as ``path:N`` where ``N`` is the 1-based line of a
    JSONL file or the 1-based row of a Parquet file.

Malformed records (``on_error``)
    ``"raise"`` (default): :class:`PromptFormatError` ``"path:N: what is wrong"``.
    ``"skip"``: the record is dropped, counted in :class:`PromptDatasetStats`,
    and a warning naming ``path:N`` is logged (the first ``max_warnings``).

Special tokens (``add_bos``)
    By default a plain-text prompt is tokenized by the tokenizer's own rules
    (``encode(text, add_special_tokens=True)``: for an HF tokenizer the ids of
    ``AutoTokenizer(dir)(text)``, with a BOS only where it adds one) and
    chat-template text gets nothing added (the template spells out its special
    tokens, as HF ``apply_chat_template(tokenize=True)`` does). ``True`` /
    ``False`` override both: BOS first (added unless there) / nothing added.

Over-long prompts (``overlong``), ``max_prompt_length`` in tokens, BOS included
    ``"reject"``: dropped and counted. ``"truncate_left"``: keep the last
    tokens (the end of a prompt is where the answer starts); a leading BOS
    stays in front::

        bos t0 t1 t2 t3 t4 t5   (max_prompt_length=4)  ->  bos t3 t4 t5

The whole dataset is read and tokenized at construction (prompt sets are small
next to rollouts); order is the file order, then files in the given order.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from array import array
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch

from rlhf.config import ConfigError

from .tokenizer import Tokenizer

__all__ = [
    "Prompt",
    "PromptBatch",
    "PromptBatchIterator",
    "PromptDataset",
    "PromptDatasetConfig",
    "PromptDatasetStats",
    "PromptDataError",
    "PromptFormatError",
    "encode_prompt",
    "load_prompt_records",
]

logger = logging.getLogger(__name__)

_JSONL_EXTS = (".jsonl", ".json", ".ndjson")
_PARQUET_EXTS = (".parquet", ".pq")


class PromptDataError(ValueError):
    """A prompt dataset cannot be used (missing file, nothing usable, bad resume state)."""


class PromptFormatError(PromptDataError):
    """A malformed record; ``str(e)`` is ``"path:N: what is wrong"``."""

    def __init__(self, path: str, line: int, reason: str):
        self.path, self.line, self.reason = path, line, reason
        super().__init__(f"{path}:{line}: {reason}")


def _config_error(name: str, value: Any, constraint: str, fix: str) -> ConfigError:
    return ConfigError(f"PromptDatasetConfig.{name}={value!r}: {constraint}; {fix}", name)


@dataclass(frozen=True)
class PromptDatasetConfig:
    """How to read, check and cut prompts. Live inputs (tokenizer) are passed separately.

    ``paths`` accepts one path or a sequence; it is stored as a tuple.
    """

    paths: tuple[str, ...]
    format: str = "auto"  # "auto" (by extension) | "jsonl" | "parquet"
    prompt_field: str = "prompt"
    messages_field: Optional[str] = None  # set to read chat messages instead of prompt_field
    chat_template_for_text: bool = False  # wrap text prompts as one user message + template
    add_generation_prompt: bool = True
    max_prompt_length: int = 1024  # tokens, BOS included
    overlong: str = "reject"  # "reject" | "truncate_left"
    on_error: str = "raise"  # "raise" | "skip"
    add_bos: Optional[bool] = None  # None: the tokenizer's rules; True: BOS first; False: none (see above)
    max_warnings: int = 20  # skipped-record warnings logged one by one, then only counted

    def __post_init__(self):
        paths = self.paths
        if isinstance(paths, (str, os.PathLike)):
            paths = (paths,)
        if not isinstance(paths, Sequence) or not paths:
            raise _config_error("paths", self.paths, "must be a path or a non-empty list of paths",
                                "pass the JSONL/Parquet file(s) to read")
        paths = tuple(os.fspath(p) for p in paths)
        object.__setattr__(self, "paths", paths)
        if self.format not in ("auto", "jsonl", "parquet"):
            raise _config_error("format", self.format, "must be 'auto', 'jsonl' or 'parquet'",
                                "use 'auto' to choose by file extension")
        if self.format == "auto":
            for p in paths:
                if not p.lower().endswith(_JSONL_EXTS + _PARQUET_EXTS):
                    raise _config_error("paths", p, "extension is not one of "
                                        f"{', '.join(_JSONL_EXTS + _PARQUET_EXTS)}",
                                        "rename the file or set format='jsonl' / 'parquet'")
        for name in ("prompt_field", "messages_field"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise _config_error(name, v, "must be a non-empty string", "name a record field")
        if not isinstance(self.max_prompt_length, int) or self.max_prompt_length < 1:
            raise _config_error("max_prompt_length", self.max_prompt_length,
                                "must be an int >= 1 (tokens)", "e.g. 1024")
        if self.overlong not in ("reject", "truncate_left"):
            raise _config_error("overlong", self.overlong, "must be 'reject' or 'truncate_left'",
                                "'reject' drops over-long prompts, 'truncate_left' keeps their end")
        if self.on_error not in ("raise", "skip"):
            raise _config_error("on_error", self.on_error, "must be 'raise' or 'skip'",
                                "'skip' drops malformed records with a warning")
        if self.add_bos not in (None, True, False):
            raise _config_error("add_bos", self.add_bos, "must be None, True or False",
                                "None tokenizes as the tokenizer's own rules do")
        if self.max_prompt_length < 2 and self.overlong == "truncate_left":
            raise _config_error("max_prompt_length", self.max_prompt_length,
                                "must be >= 2 with truncate_left, which keeps a leading BOS",
                                "raise it (BOS + 1 token at least) or use overlong='reject'")
        if not isinstance(self.max_warnings, int) or self.max_warnings < 0:
            raise _config_error("max_warnings", self.max_warnings, "must be an int >= 0", "e.g. 20")


@dataclass(frozen=True, eq=False)
class Prompt:
    """One usable prompt.

    ``index`` is its position in the dataset (stable for given files + config);
    ``source`` is ``"path:N"``; ``text`` is the rendered prompt before
    tokenization (after the chat template, before truncation).
    """

    index: int
    token_ids: tuple[int, ...]
    text: str
    source: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class PromptDatasetStats:
    """What happened to every record read."""

    files: int = 0
    records: int = 0  # records seen (blank JSONL lines not counted)
    loaded: int = 0
    malformed: int = 0  # skipped (on_error="skip")
    rejected_overlong: int = 0
    truncated: int = 0  # kept, left-truncated
    max_prompt_length: int = 0

    def summary(self) -> str:
        """One line for the log."""
        return (f"prompts: {self.loaded} loaded from {self.records} records in {self.files} "
                f"file(s); {self.malformed} malformed skipped; {self.rejected_overlong} over-long "
                f"(> {self.max_prompt_length} tokens) rejected; {self.truncated} left-truncated")


def _record_format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    return "parquet" if path.lower().endswith(_PARQUET_EXTS) else "jsonl"


def load_prompt_records(path: str, fmt: str = "auto") -> Iterator[tuple[int, Any, Optional[str]]]:
    """Yield ``(N, record, problem)`` per record of one file.

    ``N`` is the 1-based line (JSONL) or row (Parquet). ``problem`` is ``None``
    or why the line could not be parsed (``record`` is then ``None``). Blank
    JSONL lines are not yielded. A missing or unreadable file raises
    :class:`PromptDataError` naming it.
    """
    if not os.path.isfile(path):
        raise PromptDataError(f"{path}: prompt file not found")
    if _record_format(path, fmt) == "parquet":
        yield from _parquet_records(path)
    else:
        yield from _jsonl_records(path)


def _jsonl_records(path: str):
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield n, None, f"not valid UTF-8 ({e.reason} at byte {e.start})"
                continue
            if not line.strip():
                continue
            try:
                yield n, json.loads(line), None
            except json.JSONDecodeError as e:
                yield n, None, f"invalid JSON ({e.msg} at column {e.colno})"


def _parquet_records(path: str):
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 -- pyarrow raises several types
        raise PromptDataError(f"{path}: not a readable Parquet file ({e})") from None
    n = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            n += 1
            yield n, row, None


def encode_prompt(tokenizer: Tokenizer, text: str, add_bos: Optional[bool] = None) -> list[int]:
    """Token ids of one prompt text.

    ``None``: the tokenizer's own rules (``encode(text, add_special_tokens=True)``);
    ``True``: the text's ids with ``tokenizer.bos_id`` first (added unless
    already there; none if the tokenizer has no BOS); ``False``: the text's ids alone.
    """
    if add_bos is None:
        return tokenizer.encode(text, add_special_tokens=True)
    ids = tokenizer.encode(text)
    bos = tokenizer.bos_id
    if add_bos and bos is not None and ids[:1] != [bos]:
        ids.insert(0, bos)
    return ids


class PromptDataset(Sequence[Prompt]):
    """All usable prompts of the configured files, tokenized, in file order.

    ``stats`` tells what was loaded, skipped, rejected and truncated;
    ``fingerprint`` is a sha256 over every prompt's token ids (used to refuse
    resuming a data position on different data).
    """

    Config = PromptDatasetConfig

    def __init__(self, config: PromptDatasetConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.stats = PromptDatasetStats(files=len(config.paths),
                                        max_prompt_length=config.max_prompt_length)
        self._prompts: list[Prompt] = []
        self._warned = 0
        templated = config.messages_field is not None or config.chat_template_for_text
        # a chat template spells out its special tokens: by default nothing is added to its text
        self._add_bos = False if templated and config.add_bos is None else config.add_bos
        digest = hashlib.sha256()
        for path in config.paths:
            for n, record, problem in load_prompt_records(path, config.format):
                self.stats.records += 1
                prompt = self._make_prompt(path, n, record, problem)
                if prompt is not None:
                    self._prompts.append(prompt)
                    digest.update(array("q", prompt.token_ids).tobytes())
                    digest.update(b"\xff")
        self.stats.loaded = len(self._prompts)
        self.fingerprint = digest.hexdigest()
        if self._warned < self.stats.malformed:
            logger.warning("%d more malformed prompt records skipped (warnings capped at %d)",
                           self.stats.malformed - self._warned, config.max_warnings)
        if not self._prompts:
            raise PromptDataError(f"no usable prompts in {', '.join(config.paths)} "
                                  f"({self.stats.summary()})")
        logger.info("%s", self.stats.summary())

    # -- one record -----------------------------------------------------------
    def _make_prompt(self, path: str, n: int, record: Any, problem: Optional[str]):
        try:
            if problem is not None:
                raise PromptFormatError(path, n, problem)
            text, metadata = self._render(path, n, record)
        except PromptFormatError as e:
            if self.config.on_error == "raise":
                raise
            self.stats.malformed += 1
            if self._warned < self.config.max_warnings:
                self._warned += 1
                logger.warning("skipping malformed prompt record %s", e)
            return None
        ids = encode_prompt(self.tokenizer, text, self._add_bos)
        return self._fit_length(path, n, text, ids, metadata)

    def _render(self, path: str, n: int, record: Any) -> tuple[str, dict]:
        """The prompt text and the metadata of a record; PromptFormatError if malformed."""
        cfg = self.config
        if not isinstance(record, Mapping):
            raise PromptFormatError(path, n, f"expected a JSON object, got {type(record).__name__}")
        key = cfg.messages_field or cfg.prompt_field
        if key not in record:
            raise PromptFormatError(path, n, f"missing field '{key}' "
                                    f"(fields present: {', '.join(map(str, record)) or 'none'})")
        value = record[key]
        metadata = {k: v for k, v in record.items() if k != key}
        if cfg.messages_field is not None:
            try:
                text = self.tokenizer.apply_chat_template(
                    value, add_generation_prompt=cfg.add_generation_prompt)
            except ValueError as e:
                raise PromptFormatError(path, n, f"field '{key}': {e}") from None
            return text, metadata
        if not isinstance(value, str):
            raise PromptFormatError(path, n, f"field '{key}' must be a string, "
                                    f"got {type(value).__name__}")
        if not value:
            raise PromptFormatError(path, n, f"field '{key}' is empty")
        if cfg.chat_template_for_text:
            value = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": value}],
                add_generation_prompt=cfg.add_generation_prompt)
        return value, metadata

    def _fit_length(self, path, n, text, ids, metadata) -> Optional[Prompt]:
        limit = self.config.max_prompt_length
        truncated = False
        if len(ids) > limit:
            if self.config.overlong == "reject":
                self.stats.rejected_overlong += 1
                return None
            head = ids[:1] if ids[0] == self.tokenizer.bos_id else []
            ids = head + ids[len(ids) - (limit - len(head)):]
            truncated = True
            self.stats.truncated += 1
        return Prompt(index=len(self._prompts), token_ids=tuple(ids), text=text,
                      source=f"{path}:{n}", metadata=metadata, truncated=truncated)

    # -- sequence -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i):
        return self._prompts[i]

    def __repr__(self) -> str:
        return f"PromptDataset({len(self)} prompts; {self.stats.summary()})"


@dataclass(frozen=True, eq=False)
class PromptBatch:
    """A mini-batch of prompts plus where it came from in the epoch order."""

    prompts: tuple[Prompt, ...]
    epoch: int
    start: int  # position of the first prompt in this epoch's order

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def token_ids(self) -> list[list[int]]:
        return [list(p.token_ids) for p in self.prompts]

    @property
    def indices(self) -> list[int]:
        return [p.index for p in self.prompts]

    def padded(self, pad_id: int, side: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids [B, L] int64, lengths [B] int64)``, L = longest prompt.

        Left padding (default) lines prompt ends up for generation::

            side="left":  pad pad t0 t1 t2      side="right": t0 t1 t2 pad pad
        """
        if side not in ("left", "right"):
            raise ValueError(f"side={side!r}: use 'left' or 'right'")
        lengths = torch.tensor([len(p) for p in self.prompts], dtype=torch.long)
        width = int(lengths.max()) if len(self.prompts) else 0
        ids = torch.full((len(self.prompts), width), pad_id, dtype=torch.long)
        for row, p in enumerate(self.prompts):
            t = torch.tensor(p.token_ids, dtype=torch.long)
            if side == "left":
                ids[row, width - len(t):] = t
            else:
                ids[row, :len(t)] = t
        return ids, lengths


class PromptBatchIterator:
    """Endless (or ``num_epochs``-long) mini-batches over a dataset, resumable.

    Epoch ``e`` visits the dataset in ``permutation(seed, e)`` order (or file
    order without shuffle). The position is ``(epoch, index)``: ``index`` is
    how many prompts of the epoch's order were already handed out. With
    ``drop_last`` an epoch's tail shorter than ``batch_size`` is skipped;
    otherwise it is returned as a short batch. :meth:`state_dict` is plain
    ints (JSON-safe) so it goes into the checkpoint's JSON state; restoring it
    yields exactly the batches the original run would have yielded next.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, seed: int = 1234,
                 shuffle: bool = True, drop_last: bool = True, num_epochs: Optional[int] = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be an int >= 1")
        if drop_last and batch_size > len(dataset):
            raise ValueError(f"batch_size={batch_size} is larger than the dataset "
                             f"({len(dataset)} prompts) and drop_last=True would yield nothing; "
                             f"lower batch_size or set drop_last=False")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs={num_epochs!r}: must be >= 1 or None (endless)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.num_epochs = num_epochs
        self.epoch = 0
        self.index = 0
        self._order_epoch: Optional[int] = None
        self._order: Optional[np.ndarray] = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch ``epoch`` visits them."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                self._order = rng.permutation(n)
            else:
                self._order = np.arange(n)
            self._order_epoch = epoch
        return self._order

    def _epoch_end(self) -> int:
        n = len(self.dataset)
        return n - n % self.batch_size if self.drop_last else n

    def __iter__(self) -> "PromptBatchIterator":
        return self

    def __next__(self) -> PromptBatch:
        if self.index >= self._epoch_end():
            self.epoch, self.index = self.epoch + 1, 0
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        order = self.epoch_order(self.epoch)
        stop = min(self.index + self.batch_size, self._epoch_end())
        batch = PromptBatch(prompts=tuple(self.dataset[int(i)] for i in order[self.index:stop]),
                            epoch=self.epoch, start=self.index)
        self.index = stop
        return batch

    def state_dict(self) -> dict:
        """The position, JSON-safe: epoch, index, seed and dataset identity."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "shuffle": self.shuffle, "num_prompts": len(self.dataset),
                "fingerprint": self.dataset.fingerprint}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Continue from a saved position.

        The saved seed and shuffle flag are adopted. With ``strict`` a dataset
        of a different size or content raises :class:`PromptDataError` (the
        position would point at other prompts); ``strict=False`` only warns.
        """
        missing = [k for k in ("epoch", "index", "seed") if k not in state]
        if missing:
            raise PromptDataError(f"data position state lacks {missing} (got keys {sorted(state)})")
        problems = []
        if state.get("num_prompts", len(self.dataset)) != len(self.dataset):
            problems.append(f"saved for {state['num_prompts']} prompts, dataset has "
                            f"{len(self.dataset)}")
        elif state.get("fingerprint", self.dataset.fingerprint) != self.dataset.fingerprint:
            problems.append("dataset content differs (fingerprint mismatch)")
        if problems:
            msg = (f"cannot resume data position: {'; '.join(problems)}; use the same prompt "
                   f"files and dataset config, or load_state_dict(..., strict=False)")
            if strict:
                raise PromptDataError(msg)
            logger.warning("%s", msg)
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or index < 0:
            raise PromptDataError(f"invalid data position epoch={epoch} index={index}")
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.epoch, self.index = epoch, index
        self._order_epoch = None
