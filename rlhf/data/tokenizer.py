"""Tokenizers behind one small interface.

This module owns turning text (or chat messages) into token ids and back.
Two implementations:

* :class:`ByteTokenizer` -- built in, needs no files. Ids ``0..255`` are the
  UTF-8 bytes, then ``pad=256``, ``bos=257``, ``eos=258``; ``vocab_size=259``
  (models pad the embedding further themselves, e.g. megatron's
  ``make_vocab_size_divisible_by``). Used by the tiny default configuration.
* :class:`HFTokenizer` -- a Hugging Face tokenizer read from a local directory:
  through ``transformers.AutoTokenizer`` (``local_files_only=True``) when
  transformers is installed, otherwise straight from ``tokenizer.json`` with
  the ``tokenizers`` library (chat templates then rendered with jinja2).

``build_tokenizer("byte")`` gives the built-in one; any other string is a
directory path. ``stop_token_ids`` lists the ids that end a response: the EOS
and, for an HF directory, every ``eos_token_id`` of its
``generation_config.json`` (an instruct model's end-of-turn token). Nothing
here reaches the network.
"""
from __future__ import annotations

import abc
import json
import os
import shutil
from typing import Any, Mapping, Optional, Sequence, Union

from rlhf.config import ConfigError

__all__ = [
    "Tokenizer",
    "ByteTokenizer",
    "HFTokenizer",
    "TOKENIZER_FILES",
    "TokenizerError",
    "checked_tokenizer",
    "build_tokenizer",
    "named_tokenizer",
    "copy_tokenizer_files",
    "is_tokenizer_dir",
    "validate_messages",
]

Message = Mapping[str, Any]

# Files that define a tokenizer: a directory holding any one of them is a tokenizer directory.
_DEFINING_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
# Every file of an HF tokenizer (what copying one copies): the defining files plus companions
# that only complete one (BPE merges, special/added tokens, chat template, and the generation
# defaults that name the EOS ids), so they do not make a directory a tokenizer on their own.
TOKENIZER_FILES = _DEFINING_FILES + ("merges.txt", "special_tokens_map.json", "added_tokens.json",
                                     "chat_template.jinja", "generation_config.json")


class TokenizerError(ValueError):
    """A tokenizer could not be built or used (bad path, missing template...)."""


def validate_messages(messages: Any) -> list[dict]:
    """Check a chat conversation and return it as a list of plain dicts.

    A conversation is a non-empty list of ``{"role": str, "content": str}``
    mappings (extra keys are kept). Raises ``ValueError`` saying which message
    is wrong and how.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"chat messages must be a list of {{role, content}} objects, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("chat messages are an empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"message {i} must be an object with 'role' and 'content', "
                             f"got {type(msg).__name__}")
        for key in ("role", "content"):
            if key not in msg:
                raise ValueError(f"message {i} has no '{key}' (keys: {sorted(msg)})")
            if not isinstance(msg[key], str):
                raise ValueError(f"message {i} '{key}' must be a string, "
                                 f"got {type(msg[key]).__name__}")
        out.append(dict(msg))
    return out


class Tokenizer(abc.ABC):
    """The interface every part of the system uses.

    Ids are plain Python ints. ``encode(text)`` adds no special tokens (chat
    templates spell theirs out); ``encode(text, add_special_tokens=True)``
    adds what the tokenizer's own rules add (for an HF tokenizer the ids of
    ``AutoTokenizer.from_pretrained(dir)(text).input_ids``), which is how a
    plain-text prompt is tokenized (see ``PromptDatasetConfig.add_bos``).
    """

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` plus those the tokenizer adds (e.g. a BOS)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens dropped unless asked for."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct ids (including added/special tokens)."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int:
        """End-of-sequence id; generation stops on it."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int:
        """Padding id (the EOS id when the tokenizer defines no pad token)."""

    @property
    def bos_id(self) -> Optional[int]:
        """Beginning-of-sequence id, or ``None`` when the tokenizer has none."""
        return None

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generated response, the EOS first (generation passes them all as stop ids)."""
        return (self.eos_id,)

    @abc.abstractmethod
    def _render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """Render validated messages to text with this tokenizer's template."""

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> Union[str, list[int]]:
        """Render a conversation with the chat template.

        Returns the prompt text, or its ids when ``tokenize=True`` (encoded
        with :meth:`encode` without added special tokens, as HF does). With
        ``add_generation_prompt`` the text ends where the assistant's answer
        starts. Raises ``ValueError`` for malformed messages.
        """
        text = self._render_chat(validate_messages(messages), add_generation_prompt)
        return self.encode(text) if tokenize else text


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens plus pad/bos/eos; needs no files.

    Its special-token rule: ``encode(text, add_special_tokens=True)`` prepends the BOS.

    Chat template (plain text, byte-encoded)::

        <|system|>\\nYou are terse.<|end|>\\n<|user|>\\nHi<|end|>\\n<|assistant|>\\n
    """

    PAD, BOS, EOS = 256, 257, 258
    VOCAB_SIZE = 259
    _NAMES = {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return ([self.BOS] if add_special_tokens else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            if i not in self._NAMES:
                raise TokenizerError(f"id {i} is outside the byte tokenizer's vocabulary "
                                     f"(0..{self.vocab_size - 1})")
            if not skip_special_tokens:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
                out.append(self._NAMES[i])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    @property
    def vocab_size(self) -> int:
        return self.VOCAB_SIZE

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def bos_id(self) -> Optional[int]:
        return self.BOS

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        text = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in messages)
        return text + ("<|assistant|>\n" if add_generation_prompt else "")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.VOCAB_SIZE}, pad={self.PAD}, bos={self.BOS}, eos={self.EOS})"


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer loaded from a local directory.

    ``backend="auto"`` uses transformers when importable, else ``tokenizers``
    (reading ``tokenizer.json`` and, for special tokens and the chat template,
    ``tokenizer_config.json`` / ``chat_template.jinja``).
    """

    def __init__(self, path: Union[str, os.PathLike], backend: str = "auto"):
        self.path = os.fspath(path)
        _check_tokenizer_dir(self.path)
        if backend not in ("auto", "transformers", "tokenizers"):
            raise TokenizerError(f"backend={backend!r}: use 'auto', 'transformers' or 'tokenizers'")
        self._hf = None  # transformers tokenizer
        self._tok = None  # tokenizers.Tokenizer
        errors = []
        if backend in ("auto", "transformers"):
            try:
                self._hf = _load_transformers(self.path)
            except ImportError as e:
                errors.append(f"transformers not importable ({e})")
            except Exception as e:  # noqa: BLE001 -- reported below with the path
                errors.append(f"transformers AutoTokenizer failed: {type(e).__name__}: {e}")
            if self._hf is None and backend == "transformers":
                raise TokenizerError(f"cannot load tokenizer from {self.path}: {'; '.join(errors)}")
        if self._hf is None:
            try:
                self._load_tokenizers_json()
            except TokenizerError as e:
                errors.append(str(e))
                raise TokenizerError(f"cannot load tokenizer from {self.path}: "
                                     f"{'; '.join(errors)}") from None
        self._init_special_ids()

    # -- loading ------------------------------------------------------------
    def _load_tokenizers_json(self) -> None:
        tj = os.path.join(self.path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise TokenizerError(f"no tokenizer.json in {self.path} for the 'tokenizers' backend")
        from tokenizers import Tokenizer as RawTokenizer

        self._tok = RawTokenizer.from_file(tj)
        cfg_path = os.path.join(self.path, "tokenizer_config.json")
        self._config = {}
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                self._config = json.load(f)
        template = self._config.get("chat_template")
        jinja_path = os.path.join(self.path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        self._chat_template = template

    def _token_id(self, token: Any) -> Optional[int]:
        if isinstance(token, Mapping):  # AddedToken serialised as a dict
            token = token.get("content")
        if not token:
            return None
        return self._tok.token_to_id(token)

    def _init_special_ids(self) -> None:
        if self._hf is not None:
            eos, pad, bos = (self._hf.eos_token_id, self._hf.pad_token_id, self._hf.bos_token_id)
        else:
            eos = self._token_id(self._config.get("eos_token"))
            pad = self._token_id(self._config.get("pad_token"))
            bos = self._token_id(self._config.get("bos_token"))
        if eos is None:
            raise TokenizerError(f"tokenizer in {self.path} defines no eos token; "
                                 f"set eos_token in its tokenizer_config.json")
        self._eos, self._bos = int(eos), (None if bos is None else int(bos))
        self._pad = int(eos if pad is None else pad)
        self._stop = tuple(dict.fromkeys((self._eos, *_generation_eos_ids(self.path))))

    # -- interface ------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        # the tokenizer.json post-processor is what adds special tokens here
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        if self._hf is not None:
            return len(self._hf)  # includes added tokens, unlike .vocab_size
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> Optional[int]:
        return self._bos

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The EOS, then every ``eos_token_id`` of the directory's ``generation_config.json`` (an instruct
        model's end-of-turn ids), each once."""
        return self._stop

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if self._hf is not None:
            if not getattr(self._hf, "chat_template", None):
                raise TokenizerError(f"tokenizer in {self.path} has no chat_template")
            return self._hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        if not self._chat_template:
            raise TokenizerError(f"tokenizer in {self.path} has no chat_template")
        return _render_jinja(self._chat_template, messages, add_generation_prompt, self._config)

    def __repr__(self) -> str:
        backend = "transformers" if self._hf is not None else "tokenizers"
        return (f"HFTokenizer(path={self.path!r}, backend={backend}, vocab_size={self.vocab_size}, "
                f"eos={self.eos_id}, pad={self.pad_id}, bos={self.bos_id})")


def readable_text(tokenizer: Tokenizer, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """``ids`` decoded by ``tokenizer``; an id past its vocabulary (a model may have more ids than its
    tokenizer: a JSON shape's, an HF model's padded vocabulary) shows as ``<id N>`` instead of failing."""
    text, run = [], []
    for i in [*ids, None]:
        if i is not None and i < tokenizer.vocab_size:
            run.append(i)
            continue
        text.append(tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
        run = []
        if i is not None:
            text.append(f"<id {i}>")
    return "".join(text)


def is_tokenizer_dir(path: Union[str, os.PathLike]) -> bool:
    """True for a directory holding one of the files that define a tokenizer."""
    return any(os.path.isfile(os.path.join(path, f)) for f in _DEFINING_FILES)


def copy_tokenizer_files(src: Union[str, os.PathLike], dst: Union[str, os.PathLike]) -> list[str]:
    """Copy the files of :data:`TOKENIZER_FILES` present in ``src`` to ``dst`` (created when there
    are any); returns their names."""
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    if names:
        os.makedirs(dst, exist_ok=True)
    for n in names:
        shutil.copy2(os.path.join(src, n), os.path.join(dst, n))
    return names


def _check_tokenizer_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise TokenizerError(f"tokenizer {path!r} is neither 'byte' (the built-in byte "
                             f"tokenizer) nor an existing directory")
    if not is_tokenizer_dir(path):
        raise TokenizerError(f"directory {path} holds no tokenizer (expected one of "
                             f"{', '.join(_DEFINING_FILES)})")


def _generation_eos_ids(path: str) -> list[int]:
    """The ``eos_token_id`` (an int, a list of ints, or absent/null) of ``path``/generation_config.json."""
    config_path = os.path.join(path, "generation_config.json")
    if not os.path.isfile(config_path):
        return []
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {config_path}: {e}") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_path} holds a JSON {type(config).__name__}; expected an object such as "
                             '{"eos_token_id": [2, 32000]}')
    ids = config.get("eos_token_id")
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad:
        raise TokenizerError(f"{config_path}: eos_token_id {bad[0]!r} is invalid: it must be a token id (an int "
                             ">= 0) or a list of them")
    return ids


def _load_transformers(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _render_jinja(template: str, messages: list[dict], add_generation_prompt: bool,
                  config: Mapping[str, Any]) -> str:
    """Render an HF chat template the way transformers does (sandboxed jinja2)."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise TokenizerError("rendering a chat template without transformers needs jinja2") from e

    def raise_exception(msg):
        raise TokenizerError(f"chat template error: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    specials = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        tok = config.get(key)
        specials[key] = tok.get("content") if isinstance(tok, Mapping) else (tok or "")
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **specials)


def build_tokenizer(name_or_path: Union[str, os.PathLike], *, backend: str = "auto") -> Tokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; a directory -> :class:`HFTokenizer`.

    Raises :class:`TokenizerError` naming the path when it is not a directory
    or holds no tokenizer files.
    """
    if isinstance(name_or_path, str) and name_or_path == "byte":
        return ByteTokenizer()
    return HFTokenizer(name_or_path, backend=backend)


def named_tokenizer(name: str) -> Tokenizer:
    """``build_tokenizer(name)``, or a ConfigError naming ``data.tokenizer`` (the field of both programs'
    data sections that names the tokenizer) when it cannot be built."""
    try:
        return build_tokenizer(name)
    except TokenizerError as exc:
        raise ConfigError(str(exc), "data.tokenizer") from None


def checked_tokenizer(name: str, vocab: int, model: str, model_flag: str) -> Tokenizer:
    """:func:`named_tokenizer`, refused when it has more ids than ``model``'s vocabulary ``vocab`` (set by
    ``model_flag``): a ConfigError naming ``data.tokenizer``."""
    tokenizer = named_tokenizer(name)
    if tokenizer.vocab_size > vocab:
        raise ConfigError(f"tokenizer {name!r} has {tokenizer.vocab_size} ids, more than {model}'s vocab_size="
                          f"{vocab} ({model_flag}); give a tokenizer of {model}'s vocabulary (--tokenizer) or "
                          f"a model whose vocabulary covers it ({model_flag})", "data.tokenizer")
    return tokenizer
