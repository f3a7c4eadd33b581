"""What ``train_reward.py`` runs: the tokenizer, the preference data, the starting weights, then the
RewardTrainer; and, after training, the HF export (docs/reward_model.md).

- tokenizer: ``--tokenizer`` (byte or an HF directory); by default the
  ``--model`` directory's (the HF directory, or ``<root>/tokenizer`` of our
  checkpoint), else the byte tokenizer. Its ids must fit the model's vocabulary.
- data: ``--train-data`` (required by the flags) and ``--eval-data`` through
  rlhf.data.PreferenceDataset; each file's counts are printed on rank 0.
- starting weights: a ``--model`` directory is read lazily by
  rlhf/checkpoint/sources.py (a rank reads its own stage's tensors; a language
  model gets a new value head, seeded by ``--seed``, as PPO seeds one); a preset or shape starts
  from seeded random weights; with ``--load`` the checkpoint holds them.
- outputs: our checkpoint under ``--save`` with the HF tokenizer files in
  ``<save>/tokenizer``, and after the last step ``<save>/hf``, an HF
  ``*ForSequenceClassification`` of the saved model.

Every refusal is a ConfigError naming its field, raised alike on every rank.
"""

from __future__ import annotations

import functools
import json
import os

import torch.distributed as dist

from rlhf.checkpoint.convert import export_saved_model
from rlhf.checkpoint.rlhf_state import TOKENIZER_DIR
from rlhf.checkpoint.sources import ModelSourceError, open_source, read_weights
from rlhf.config import ConfigError
from rlhf.data import PreferenceDataset, PromptDataError, Tokenizer, checked_tokenizer, copy_tokenizer_files
from rlhf.parallel import Placement, PlacementError
from rlhf.reward_model.config import MODEL, TASK, RewardJobConfig
from rlhf.reward_model.trainer import RewardTrainer, check_placement
from rlhf.tasks import MODEL_SEEDS, TASKS

HF_EXPORT = "hf"
"""``<save>/hf``: the HF export of the last checkpoint."""


def build_placement(config: RewardJobConfig, world_size: int) -> Placement:
    """The Placement of the reward model's mesh on ``world_size`` ranks (every other task unplaced),
    checked against the model's shape and the batch sizes (PlacementError or ConfigError)."""
    entry = config.placement.plan().get(TASK, {})
    if entry is None:
        raise PlacementError(f"{TASK}: the reward model's mesh is 'none'; give it ranks (or leave it out: "
                             "every rank, data parallel)")
    placement = Placement.from_plan({**{task: None for task in TASKS}, TASK: entry}, world_size)
    placement.validate_models({MODEL: config.model})
    check_placement(config, placement)
    return placement


def build_reward_trainer(config: RewardJobConfig, placement) -> tuple[RewardTrainer, Tokenizer]:
    """The RewardTrainer of ``config`` and its tokenizer (collective: every rank calls it)."""
    tokenizer = checked_tokenizer(config.data.tokenizer or default_tokenizer(config), config.model.vocab_size,
                                  "the model", "--model")
    train = preference_data(config, "train_data", tokenizer)
    eval_data = preference_data(config, "eval_data", tokenizer) if config.data.eval_data else None
    weights = None
    if config.model_dir is not None and config.checkpoint.load is None:
        weights = functools.partial(read_weights, _source(config), head_seed=config.run.seed + MODEL_SEEDS[MODEL])
    return RewardTrainer(config, placement, train, tokenizer.pad_id, eval_data, weights), tokenizer


def default_tokenizer(config: RewardJobConfig) -> str:
    """The model directory's tokenizer, when it has one; else "byte"."""
    return (_source(config).tokenizer_dir() if config.model_dir is not None else None) or "byte"


def _source(config: RewardJobConfig):
    try:
        return open_source(config.model_dir, "reward", trained=True)
    except ModelSourceError as exc:
        raise ConfigError(str(exc), "model") from None


def preference_data(config: RewardJobConfig, name: str, tokenizer: Tokenizer) -> PreferenceDataset:
    """The pairs of ``data.<name>`` (a ConfigError naming it for a malformed or unusable file)."""
    path = getattr(config.data, name)
    try:
        dataset = PreferenceDataset(config.dataset_config(path), tokenizer)
    except PromptDataError as exc:  # includes PromptFormatError: "path:N: what is wrong"
        raise ConfigError(str(exc), f"data.{name}") from None
    if dist.get_rank() == 0:
        print(f"{path}: {dataset.stats.summary()}", flush=True)
    return dataset


def save_tokenizer(config: RewardJobConfig, tokenizer: Tokenizer) -> None:
    """Copy an HF tokenizer's files to ``<save>/tokenizer`` (rank 0), so the checkpoint carries them."""
    path = getattr(tokenizer, "path", None)
    if config.checkpoint.save and path is not None and dist.get_rank() == 0:
        copy_tokenizer_files(path, os.path.join(config.checkpoint.save, TOKENIZER_DIR))


def export_reward_model(root: str, tokenizer: Tokenizer) -> str:
    """Write ``<root>/hf``: the latest checkpoint's reward model as an HF *ForSequenceClassification with
    the tokenizer files and its special ids (rank 0 writes; collective: every rank waits for it)."""
    out = os.path.join(root, HF_EXPORT)
    if dist.get_rank() == 0:
        export_saved_model(root, out, MODEL)
        _record_special_ids(out, tokenizer)
    dist.barrier()
    return out


def _record_special_ids(out: str, tokenizer: Tokenizer) -> None:
    """Add the tokenizer's BOS/EOS ids, and its pad id when it has its own, to ``<out>/config.json``: with
    a pad id transformers scores a right-padded batch at each row's last token before the padding."""
    path = os.path.join(out, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
    if tokenizer.pad_id != tokenizer.eos_id:  # a pad that is the EOS would hide each answer's last token
        config["pad_token_id"] = tokenizer.pad_id
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
