"""All command-line flags of train_reward.py, grouped, parsed into a frozen RewardJobConfig.

rlhf/cli.py's flag-table mechanism, as pretrain_rlhf.py's flags use it: each
section's flags are listed once (field, type, help), the flag is the field's
name with dashes, its default is the dataclass default, and a ConfigError on
that field is reported against that flag. The logging flags are both
programs' (``rlhf.cli.LOGGING_FLAGS``); the placement flags are
``--placement`` and ``--reward-inf`` (the reward model trains on that task's
mesh).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlhf.checkpoint.sources import ModelSourceError, open_source
from rlhf.cli import (LOGGING_FLAGS, PRECISION_FLAGS, TIMEOUT_FLAG, UsageError, add_section_flags, load_model_config,
                      parse_task_spec, section_configs, section_flag, usage_errors)
from rlhf.config import CheckpointConfig, PlacementConfig, RunConfig
from rlhf.data import named_tokenizer
from rlhf.models.config import MODEL_PRESETS, ModelConfig
from rlhf.reward_model.config import TASK, RewardDataConfig, RewardJobConfig, RewardOptimizerConfig, RewardTrainingConfig

TINY = "tiny-critic"
"""``--model tiny``: the tiny RLHF default's reward-model shape (a preset: its vocabulary is the tokenizer's)."""

REWARD_SECTIONS = {
    "run": (RunConfig, "run", [
        ("iterations", int, "total optimizer steps; a resumed run continues to this number (alias --train-iters)"),
        ("seed", int, "random seed of the starting weights (a new value head) and the data order, in [0, 2**28 - 1]"),
        TIMEOUT_FLAG,
    ]),
    "training": (RewardTrainingConfig, "reward training (pairwise Bradley-Terry loss)", [
        ("global_batch_size", int, "preference pairs per optimizer step (a multiple of dp x micro-batch size)"),
        ("micro_batch_size", int, "pairs per micro-batch; both answers of a pair always share one"),
        ("center_rewards_coef", float, "weight of the reward-centering term coef * (r_chosen + r_rejected)^2 "
                                       "(0: off)"),
        ("eval_interval", int, "score --eval-data every this many iterations (and after the last)"),
        ("recompute_granularity", str, "activation recomputation, as Megatron-LM: full (recompute whole "
                                       "transformer layers in the backward, keeping only each chunk's input) or "
                                       "selective (recompute the core attention); none by default. Same results, "
                                       "less activation memory, more compute"),
        ("recompute_num_layers", int, "with --recompute-granularity full: layers per recomputed chunk (default 1); "
                                      "must divide the layers of each pipeline stage"),
    ]),
    "optimizer": (RewardOptimizerConfig, "optimizer (AdamW; the schedule counts optimizer steps)", [
        ("lr", float, "learning rate"),
        ("min_lr", float, "the LR the decay ends at"),
        ("lr_warmup_iters", int, "steps of linear LR warm-up from 0"),
        ("lr_decay_style", str, "LR after the warm-up: constant, linear or cosine (to --min-lr at --lr-decay-iters)"),
        ("lr_decay_iters", int, "step at which the decay reaches --min-lr"),
        ("clip_grad", float, "clip the global gradient norm to this (0: off)"),
        ("weight_decay", float, "AdamW weight decay of matrices (1-D parameters get none)"),
        ("use_distributed_optimizer", bool, "shard the optimizer state and update over the DP group (ZeRO-1)"),
    ]),
    "data": (RewardDataConfig, "tokenizer and preference data", [
        ("tokenizer", str, "'byte' or an HF tokenizer directory (None: the --model directory's tokenizer, when "
                           "it has one; else byte); a --model preset has its ids"),
        ("train_data", str, "JSONL or Parquet file of preference records: prompt, chosen, rejected (strings, "
                            "or chat messages: HH-RLHF, UltraFeedback layouts); required"),
        ("eval_data", str, "held-out preference records, scored every --eval-interval iterations"),
        ("prompt_field", str, "record field holding the prompt"),
        ("chosen_field", str, "record field holding the preferred answer"),
        ("rejected_field", str, "record field holding the other answer"),
        ("margin_field", str, "record field holding a margin the chosen score should exceed the rejected one "
                              "by (None: 0)"),
        ("chat_template", bool, "wrap text prompts as one user message in the tokenizer's chat template"),
        ("max_len", int, "tokens of prompt + longer answer (None: the model's context)"),
        ("overlong", str, "longer pairs: 'drop' (counted) or 'truncate_prompt' (keep the prompt's end)"),
        ("on_error", str, "malformed records: 'raise' (stop, naming file:line) or 'skip' (drop, count, warn)"),
    ]),
    "logging": LOGGING_FLAGS,
    "precision": PRECISION_FLAGS,
    "checkpoint": (CheckpointConfig, "checkpointing", [
        ("save", str, "checkpoint root to save into (atomic; <root>/iter_N, <root>/latest); after the last "
                      "step the model is also exported to <root>/hf as an HF *ForSequenceClassification"),
        ("save_interval", int, "save every this many iterations (and after the last; default: only after the "
                               "last)"),
        ("keep_last", int, "keep only the N newest checkpoints under --save: older ones are deleted once a "
                           "newer one is complete (default: keep all)"),
        ("load", str, "checkpoint root to resume from: model, optimizer, LR schedule, RNG and data position; "
                      "the run continues to --iterations. The same root as --save makes a relaunch with the same command "
                      "(or a torchrun restart) continue from the newest complete checkpoint, or start fresh before "
                      "the first save"),
    ]),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_reward.py",
        description="Train a reward model (a decoder with a value head) from preference pairs with the pairwise "
        "Bradley-Terry loss on Megatron-Core, any (dp, pp, tp). Launch with torchrun. The result loads as "
        "pretrain_rlhf.py's --reward-model / --critic-model.")
    place = parser.add_argument_group("placement (the reward model's device mesh)")
    place.add_argument("--placement", metavar="FILE",
                       help=f"JSON/YAML plan file; its '{TASK}' entry places the reward model (a PPO plan trains it "
                            "where PPO serves it; other entries are ignored)")
    place.add_argument(f"--{TASK.replace('_', '-')}", dest=TASK, metavar="SPEC", default=None,
                       help="mesh of the reward model, e.g. 'tp=2,pp=2,ranks=0-3[,reverse_pp]', merged into the "
                            "file's entry (default: every rank, data parallel)")
    parser.add_argument("--model", default="tiny", metavar="PRESET|JSON|DIR",
                        help=f"the model to train: 'tiny' (the tiny RLHF default's reward model, preset {TINY}), a "
                             f"preset ({', '.join(sorted(MODEL_PRESETS))}; its vocabulary is the --tokenizer's ids) "
                             "or a JSON file of ModelConfig fields (seeded random weights), or a DIR: an HF "
                             "*ForSequenceClassification (head from score.weight) or *ForCausalLM (a new value "
                             "head), or our checkpoint's model 'reward' (default: tiny)")
    add_section_flags(parser, REWARD_SECTIONS)
    parser.add_argument("--train-iters", dest="iterations", type=int, help=argparse.SUPPRESS)
    return parser


def model_source(value: str, data: RewardDataConfig) -> tuple[ModelConfig, str | None]:
    """(shape, weights directory or None) of ``--model``: a preset has the ids of the tokenizer ``data``
    names (a preset has no directory whose tokenizer would be the default: byte)."""
    if Path(value).is_dir() and value not in MODEL_PRESETS:
        try:
            return open_source(value, "reward", trained=True).config, value
        except ModelSourceError as exc:
            raise UsageError(f"--model {value}: {exc}") from None
    return load_model_config(TINY if value == "tiny" else value, "--model",
                             lambda: named_tokenizer(data.tokenizer or "byte").vocab_size), None


def reward_flag_of(field_name: str) -> str:
    """The flag that sets a dotted RewardJobConfig field (``training.micro_batch_size`` -> ``--micro-batch-size``,
    ``model`` -> ``--model``)."""
    return "--model" if field_name == "model" else section_flag(field_name, REWARD_SECTIONS)


def config_from_args(args: argparse.Namespace) -> RewardJobConfig:
    """The RewardJobConfig of parsed flags; a bad value raises UsageError naming its flag."""
    if args.train_data is None:
        raise UsageError("--train-data: a JSONL or Parquet file of preference records is required "
                         "(tools/synthetic_preferences.py writes one from a hidden rule)")
    spec = getattr(args, TASK)
    overrides = {TASK: parse_task_spec(TASK, spec)} if spec else {}
    with usage_errors(reward_flag_of):
        sections = section_configs(args, REWARD_SECTIONS)
        model, model_dir = model_source(args.model, sections["data"])
        return RewardJobConfig(placement=PlacementConfig(args.placement, overrides), model=model, model_dir=model_dir,
                               **sections)


def parse_args(argv=None) -> RewardJobConfig:
    return config_from_args(build_parser().parse_args(argv))
