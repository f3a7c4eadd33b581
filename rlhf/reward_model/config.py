"""train_reward.py's configuration: frozen dataclasses that rlhf/reward_model/arguments.py fills from the flags.

The run, logging, checkpoint and placement sections are rlhf/config.py's; the
optimizer section is rlhf.optim.OptimizerConfig with a reward-model learning
rate. A ``ConfigError`` names its dotted field (``training.micro_batch_size``)
so the argument parser reports the flag that set it.

Placement: the reward model trains on the mesh of the task table's
``reward_inf``, the task that holds its weights (rlhf.tasks.WEIGHTS_TASK),
so no task is added to the table, ``--reward-inf SPEC`` and a PPO plan file
(``--placement``, whose other entries are ignored) place it, and by default
every rank trains it, data parallel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rlhf.config import (CheckpointConfig, ConfigError, LoggingConfig, PlacementConfig, RunConfig, check_field_types,
                         check_positive_ints, check_recompute)
from rlhf.data.preferences import PreferenceDatasetConfig
from rlhf.data.tokenizer import ByteTokenizer
from rlhf.models.config import ModelConfig, preset
from rlhf.models.precision import PrecisionConfig
from rlhf.optim import OptimizerConfig
from rlhf.tasks import WEIGHTS_TASK

MODEL = "reward"
"""The model's name in the executor's runtimes and in checkpoints (``pretrain_rlhf.py --reward-model`` reads it)."""

TASK = WEIGHTS_TASK[MODEL]
"""The task whose mesh trains the reward model: the one that holds its weights in PPO (reward_inf)."""


@dataclass(frozen=True)
class RewardTrainingConfig:
    """One optimizer step per iteration on ``global_batch_size`` preference pairs; a DP replica runs
    its share in micro-batches of ``micro_batch_size`` pairs (2 sequences each: a pair's answers
    always share a micro-batch). ``center_rewards_coef`` weighs the reward-centering term of the
    loss (0: off). With eval data, held-out pairs are scored every ``eval_interval`` iterations
    and after the last one. ``recompute_granularity`` and ``recompute_num_layers``: Megatron-LM's
    activation recomputation (as ``pretrain_rlhf.py``'s; rlhf.config.check_recompute)."""

    global_batch_size: int = 64
    micro_batch_size: int = 4
    center_rewards_coef: float = 0.0
    eval_interval: int = 50
    recompute_granularity: str | None = None
    recompute_num_layers: int | None = None

    def __post_init__(self):
        check_field_types("training", self)
        check_positive_ints("training", self, ("global_batch_size", "micro_batch_size", "eval_interval"))
        check_recompute("training", self.recompute_granularity, self.recompute_num_layers)
        if not self.center_rewards_coef >= 0:
            raise ConfigError(f"center_rewards_coef={self.center_rewards_coef!r} must be >= 0 (0 turns it off)",
                              "training.center_rewards_coef")


@dataclass(frozen=True)
class RewardOptimizerConfig(OptimizerConfig):
    """rlhf.optim.OptimizerConfig (AdamW, clipping, LR schedule over optimizer steps) with a learning
    rate for fine-tuning a reward model; an invalid value raises a ConfigError naming its field."""

    lr: float = 1e-5

    def __post_init__(self):
        check_field_types("optimizer", self)
        try:
            super().__post_init__()
        except ConfigError as exc:  # OptimizerConfig's fields are this section's
            raise exc.renamed(f"optimizer.{exc.field_name}") from None


@dataclass(frozen=True)
class RewardDataConfig:
    """The tokenizer and the preference files (rlhf.data.PreferenceDataset, docs/reward_model.md).

    ``tokenizer``: "byte" or an HF tokenizer directory; None: the model directory's tokenizer when
    it has one, else "byte". ``max_len``: tokens of prompt + longer answer (None: the model's
    context). ``chat_template``: wrap text prompts as one user message in the chat template.
    """

    tokenizer: str | None = None
    train_data: str | None = None
    eval_data: str | None = None
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    margin_field: str | None = None
    chat_template: bool = False
    max_len: int | None = None
    overlong: str = "drop"
    on_error: str = "raise"

    def __post_init__(self):
        check_field_types("data", self)
        if self.tokenizer not in (None, "byte") and not os.path.isdir(self.tokenizer):
            raise ConfigError(f"tokenizer={self.tokenizer!r} is neither 'byte' nor a directory; give 'byte' or an "
                              "HF tokenizer directory", "data.tokenizer")
        for name in ("train_data", "eval_data"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{name}={path!r} is not a file; give a JSONL or Parquet file of preference "
                                  "records (prompt, chosen, rejected)", f"data.{name}")
        if self.max_len is not None:
            check_positive_ints("data", self, ("max_len",))


@dataclass(frozen=True)
class RewardJobConfig:
    """Everything ``train_reward.py`` runs with: the placement, the model (``model``: its shape;
    ``model_dir``: an HF model directory or our checkpoint root its weights start from, else seeded
    random weights; by default the tiny preset at the byte tokenizer's ids, as ``--model tiny``), and the
    sections above."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    model: ModelConfig = field(default_factory=lambda: preset("tiny-critic", ByteTokenizer.VOCAB_SIZE))
    model_dir: str | None = None
    run: RunConfig = field(default_factory=RunConfig)
    training: RewardTrainingConfig = field(default_factory=RewardTrainingConfig)
    optimizer: RewardOptimizerConfig = field(default_factory=RewardOptimizerConfig)
    data: RewardDataConfig = field(default_factory=RewardDataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)

    def __post_init__(self):
        check_field_types("job", self)
        unknown = sorted(set(self.placement.overrides) - {TASK}, key=str)
        if unknown:
            raise ConfigError(f"train_reward.py places only {TASK} (the reward model's mesh), not {unknown}",
                              "placement.overrides")
        self.logging.check_traced_iteration(self.run)
        if self.data.max_len is not None and self.data.max_len > self.model.max_seq_len:
            raise ConfigError(f"max_len={self.data.max_len} exceeds the model's context max_seq_len="
                              f"{self.model.max_seq_len}; lower it or give a model with a longer context",
                              "data.max_len")
        for path in (self.data.train_data or "train_data", self.data.eval_data):  # checks the data fields
            if path is not None:
                self.dataset_config(path)

    def dataset_config(self, path: str) -> PreferenceDatasetConfig:
        """The rlhf.data.PreferenceDatasetConfig of one preference file; a ConfigError names the field."""
        d = self.data
        try:
            return PreferenceDatasetConfig(paths=path, max_length=self.max_length, prompt_field=d.prompt_field,
                                           chosen_field=d.chosen_field, rejected_field=d.rejected_field,
                                           margin_field=d.margin_field, chat_template_for_text=d.chat_template,
                                           overlong=d.overlong, on_error=d.on_error)
        except ConfigError as exc:  # PreferenceDatasetConfig's fields are the data section's (max_length: max_len)
            name = "max_len" if exc.field_name == "max_length" else exc.field_name
            raise exc.renamed(f"data.{name}") from None

    @property
    def max_length(self) -> int:
        """Tokens of prompt + longer answer a pair may have."""
        return self.data.max_len or self.model.max_seq_len
