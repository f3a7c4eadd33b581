"""Prompt data and tokenizers.

``tokenizer``: one small :class:`Tokenizer` interface, the built-in
:class:`ByteTokenizer` (``"byte"``) and :class:`HFTokenizer` (a local HF
directory), built by :func:`build_tokenizer`.
``prompts``: JSONL/Parquet prompt datasets with checked records, a prompt-length
policy and a resumable mini-batch iterator.
``preferences``: JSONL/Parquet preference pairs (prompt, chosen, rejected) for
reward-model training, with the same record checks.
``synthetic``: the built-in task that needs no files: seeded prompts and the
rule-based gold reward.
"""
from .preferences import PreferenceDataset, PreferenceDatasetConfig, PreferencePair, PreferenceStats
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
from .synthetic import GOLD_TARGET_IDS, SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
from .tokenizer import (
    TOKENIZER_FILES,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    checked_tokenizer,
    copy_tokenizer_files,
    named_tokenizer,
    validate_messages,
)

__all__ = [
    "GOLD_TARGET_IDS",
    "TOKENIZER_FILES",
    "ByteTokenizer",
    "HFTokenizer",
    "PreferenceDataset",
    "PreferenceDatasetConfig",
    "PreferencePair",
    "PreferenceStats",
    "Prompt",
    "PromptBatch",
    "PromptBatchIterator",
    "PromptDataError",
    "PromptDataset",
    "PromptDatasetConfig",
    "PromptDatasetStats",
    "PromptFormatError",
    "SyntheticPromptConfig",
    "SyntheticPromptDataset",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer",
    "checked_tokenizer",
    "copy_tokenizer_files",
    "encode_prompt",
    "gold_reward",
    "load_prompt_records",
    "named_tokenizer",
    "validate_messages",
]
