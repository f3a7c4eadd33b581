"""Prompt data and tokenizers.

``tokenizer``: one small :class:`Tokenizer` interface, the built-in
:class:`ByteTokenizer` (``"byte"``) and :class:`HFTokenizer` (a local HF
directory), built by :func:`build_tokenizer`.
``prompts``: JSONL/Parquet prompt datasets with checked records, a prompt-length
policy and a resumable mini-batch iterator.
"""
from .prompts import (
    Prompt,
    PromptBatch,
    PromptBatchIterator,
    PromptDataError,
    PromptDataset,
    PromptDatasetConfig,
    PromptDatasetStats,
    PromptFormatError,
    load_prompt_records,
)
from .tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    validate_messages,
)

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "Prompt",
    "PromptBatch",
    "PromptBatchIterator",
    "PromptDataError",
    "PromptDataset",
    "PromptDatasetConfig",
    "PromptDatasetStats",
    "PromptFormatError",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer",
    "load_prompt_records",
    "validate_messages",
]
