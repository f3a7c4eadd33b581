"""The data (``data.*``: tokenizer and prompts) and reward (``reward.*``: a rule reward) sections."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

from rlhf.config import ConfigError, check_field_types
from rlhf.data import PromptDatasetConfig

PROMPT_DATASET_FIELDS = {"paths": "data.prompt_data", "prompt_field": "data.prompt_field",
                         "messages_field": "data.messages_field", "chat_template_for_text": "data.chat_template",
                         "add_generation_prompt": "data.add_generation_prompt",
                         "overlong": "data.prompt_overlong", "max_prompt_length": "generation.max_prompt_len"}
"""rlhf.data.PromptDatasetConfig field -> the job's field that sets it."""


@dataclass(frozen=True)
class DataConfig:
    """The tokenizer and the prompts.

    ``tokenizer``: "byte" or an HF tokenizer directory; None: the actor
    directory's tokenizer when there is prompt data and the actor comes with
    one, else "byte". Without ``prompt_data`` (a JSONL or Parquet file, read
    by rlhf.data.PromptDataset) the built-in synthetic task runs, whose
    prompts are byte-tokenizer ids. The other fields are PromptDatasetConfig's
    (``chat_template``: its ``chat_template_for_text``; ``prompt_overlong``:
    its ``overlong``); its ``max_prompt_length`` is ``generation.max_prompt_len``.
    """

    tokenizer: str | None = None
    prompt_data: str | None = None
    prompt_field: str = "prompt"
    messages_field: str | None = None
    chat_template: bool = False
    add_generation_prompt: bool = True
    prompt_overlong: str = "reject"

    def __post_init__(self):
        check_field_types("data", self)
        if self.tokenizer not in (None, "byte") and not os.path.isdir(self.tokenizer):
            raise ConfigError(f"tokenizer={self.tokenizer!r} is neither 'byte' nor a directory; give 'byte' or an "
                              "HF tokenizer directory", "data.tokenizer")
        if self.prompt_data is not None and not os.path.isfile(self.prompt_data):
            raise ConfigError(f"prompt_data={self.prompt_data!r} is not a file; give a JSONL or Parquet file of "
                              "prompt records", "data.prompt_data")
        if self.prompt_data is None:
            unused = [f.name for f in fields(self) if f.name not in ("tokenizer", "prompt_data")
                      and getattr(self, f.name) != f.default]
            if unused:
                raise ConfigError(f"{unused[0]} applies to prompt data; give a prompt file or drop it",
                                  f"data.{unused[0]}")

    def prompt_dataset_config(self, max_prompt_len: int) -> PromptDatasetConfig:
        """The rlhf.data.PromptDatasetConfig of ``prompt_data``; a ConfigError names the job's field."""
        try:
            return PromptDatasetConfig(paths=self.prompt_data, prompt_field=self.prompt_field,
                                       messages_field=self.messages_field, chat_template_for_text=self.chat_template,
                                       add_generation_prompt=self.add_generation_prompt,
                                       max_prompt_length=max_prompt_len, overlong=self.prompt_overlong)
        except ConfigError as exc:  # the job field that set PromptDatasetConfig's field
            raise exc.renamed(PROMPT_DATASET_FIELDS[exc.field_name]) from None


@dataclass(frozen=True)
class RewardConfig:
    """``reward_fn``: "module:function", a Python function ``fn(prompts, responses) -> scores`` (token-id
    lists in, one number per sample out; a response may end with the EOS id), the signature of
    rlhf.data.synthetic.gold_reward. Where the reward comes from: ``JobConfig.has_reward_model``.
    ``skip_nonfinite_samples``: a sample whose score (the function's or the reward model's) is NaN or
    infinite is dropped from training and counted, instead of stopping the run (rlhf/ppo/reward_fn.py)."""

    reward_fn: str | None = None
    skip_nonfinite_samples: bool = False

    def __post_init__(self):
        check_field_types("reward", self)
        if self.reward_fn is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", self.reward_fn):
            raise ConfigError(f"reward_fn={self.reward_fn!r} is not MODULE:FUNCTION; give e.g. "
                              "'rlhf.data.synthetic:gold_reward'", "reward.reward_fn")
