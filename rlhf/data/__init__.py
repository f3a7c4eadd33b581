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
    encode_prompt,
    load_prompt_records,
)
from .tokenizer import (
    TOKENIZER_FILES,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    validate_messages,
)

__all__ = [
    "TOKENIZER_FILES",
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
    "encode_prompt",
    "load_prompt_records",
    "validate_messages",
]
