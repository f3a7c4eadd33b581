"""Where a model of the job starts: a directory holding a Hugging Face model, a Megatron-LM checkpoint
or our checkpoint.

This module owns telling them apart, reading a model's shape from either
without reading tensors (flags are parsed before any process group exists),
checking that what a directory holds can play its part, and reading its
full starting tensors by global name, only those asked for (a rank asks for
its own pipeline stage's, one model at a time, as the Trainer loads its starting weights).

    part       HF directory                            our checkpoint root (its latest iteration)
    actor      *ForCausalLM                            model "actor" (role lm)
    reference  *ForCausalLM                            model "reference", else "actor" (role lm)
    critic     *ForSequenceClassification (score),     model "critic", else "reward" (role value,
               or *ForCausalLM: a new value head       or role lm: a new value head)
    reward     *ForSequenceClassification              model "reward" (role value)

A Megatron-LM directory (rlhf/checkpoint/megatron.py) holds one model: a language
model starts the actor and reference, and the critic with a new value head; a
value model (one output row, written by ours-to-megatron) the critic and reward.

The reward model is frozen, so it needs a trained value head; the critic is
trained, so it may start from a language model with a new head,
:func:`new_value_head` (normal, std ``init_std``) from the seed the caller
gives; ``tools/convert_checkpoint.py --role value`` draws the same one.

Whatever opens a model directory goes through :func:`open_source` and
:func:`read_weights`: the job's parts, and one unsharded LM for the inference
tools (rlhf/checkpoint/loading.py). :func:`read_full_state` reads one model of
our checkpoint whole, a LoRA checkpoint's frozen base from the directory it recorded.

This module sits above the format modules (hf.py, megatron.py, rlhf_state.py), which never import it;
loading.py and the cross-format conversions (convert.py) sit above it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rlhf.checkpoint import storage
from rlhf.checkpoint.hf import HFConversionError, is_hf_dir, read_hf_config, read_hf_state
from rlhf.checkpoint.megatron import MegatronCheckpointError, is_megatron_dir, open_megatron, read_megatron_state
from rlhf.checkpoint.rlhf_state import (TOKENIZER_DIR, read_saved_state, saved_lora_config, saved_model_config,
                                        saved_models)
from rlhf.data.tokenizer import is_tokenizer_dir
from rlhf.models.config import ModelConfig
from rlhf.tasks import MODEL_KIND, TRAIN_TASK

CHECKPOINT_NAMES = {"actor": ("actor",), "reference": ("reference", "actor"), "critic": ("critic", "reward"),
                    "reward": ("reward",)}
"""The models of our checkpoint that can start each part, in order of preference."""

HEAD = "output_layer.weight"


def new_value_head(config: ModelConfig, seed: int) -> torch.Tensor:
    """A new value head [1, hidden_size] for a value model that starts from a language model: normal with std
    ``init_std``, drawn from ``seed`` alone, so every place that draws it gets the same tensor."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, config.hidden_size, generator=gen) * config.init_std


class ModelSourceError(ValueError):
    """A directory cannot start a model; the message says what it holds and what would be valid."""


@dataclass(frozen=True)
class ModelSource:
    """What a directory holds for one part (actor, reference, critic or reward).

    ``format``: "hf", "megatron" or "checkpoint"; ``checkpoint_model``: the model's name in
    our checkpoint, ``iteration`` its iteration (None: the one ``latest`` names when read);
    ``new_head``: a value model whose head is drawn, not read.
    """

    path: str
    part: str
    config: ModelConfig
    format: str
    new_head: bool = False
    checkpoint_model: str | None = None
    iteration: int | None = None

    @property
    def role(self) -> str:
        """The head the part runs with: "lm" or "value"."""
        return MODEL_KIND[self.part]

    def tokenizer_dir(self) -> str | None:
        """The tokenizer that comes with the model: the HF directory itself, ``<root>/tokenizer`` of a
        converted checkpoint, ``iter_N/tokenizer`` of Megatron-LM's; None when there is none."""
        if self.format == "hf":
            path = self.path
        elif self.format == "megatron":
            path = _open_megatron(self.path).tokenizer_dir()
        else:
            path = os.path.join(self.path, TOKENIZER_DIR)
        return path if is_tokenizer_dir(path) else None


def _is_checkpoint_root(path: str) -> bool:
    """A directory holding our checkpoints (a ``latest`` file or an iter_* directory)."""
    return os.path.isfile(os.path.join(path, storage.LATEST)) or bool(storage.list_checkpoints(path))


def open_source(path: str, part: str, trained: bool | None = None, megatron: bool = False, *,
                model_name: str | None = None, iteration: int | None = None) -> ModelSource:
    """What ``path`` holds for ``part``, checked (reads config files only; raises ModelSourceError).

    ``trained``: whether the part is trained (None: as PPO trains it, rlhf.tasks.TRAIN_TASK); a
    trained value part may start from a language model with a new value head (train_reward.py
    trains the reward model). ``megatron``: ``path`` must be a Megatron-LM checkpoint directory.
    Our checkpoint only: ``model_name`` takes that model instead of the first of
    CHECKPOINT_NAMES[part], ``iteration`` that iteration instead of ``latest``'s.
    """
    if not os.path.isdir(path):
        raise ModelSourceError(f"{path} is not a directory")
    trained = part in TRAIN_TASK if trained is None else trained
    if megatron or is_megatron_dir(path):
        return _megatron_source(path, part, trained)
    if is_hf_dir(path):
        return _hf_source(path, part, trained)
    if _is_checkpoint_root(path):
        return _checkpoint_source(path, part, trained, model_name, iteration)
    raise ModelSourceError(f"{path} is neither a Hugging Face model directory (no config.json), a Megatron-LM "
                           "checkpoint (no latest_checkpointed_iteration.txt) nor our checkpoint root (no "
                           f"'{storage.LATEST}' file, no iter_* directory)")


def _open_megatron(path: str):
    try:
        return open_megatron(path)
    except MegatronCheckpointError as exc:
        raise ModelSourceError(str(exc)) from None


def _megatron_source(path: str, part: str, trained: bool) -> ModelSource:
    ckpt = _open_megatron(path)
    what = f"Megatron-LM checkpoint {ckpt.path} ({'language' if ckpt.role == 'lm' else 'value'} model)"
    return ModelSource(path, part, ckpt.config, "megatron", _new_head(what, part, ckpt.role, trained))


def _hf_source(path: str, part: str, trained: bool) -> ModelSource:
    try:
        info = read_hf_config(path)
    except HFConversionError as exc:
        raise ModelSourceError(str(exc)) from None
    holds = "lm" if info.kind == "causal_lm" else "value"
    return ModelSource(path, part, info.config, "hf", _new_head(f"{path} ({info.architecture})", part, holds, trained))


def _new_head(what: str, part: str, holds: str, trained: bool) -> bool:
    """Whether ``part`` starts from ``what`` (a model with head ``holds``: "lm" or "value") with a new
    value head; raises ModelSourceError when it cannot start from it at all."""
    needs = MODEL_KIND[part]
    if holds == needs:
        return False
    if needs == "lm":
        raise ModelSourceError(f"{what} is a value model; the {part} is a language model: give a *ForCausalLM "
                               "directory (Llama or Qwen2) or our checkpoint with a model of role 'lm'")
    if not trained:
        raise ModelSourceError(f"{what} is a language model without a value head; the {part} model is frozen, so "
                               "it needs a trained one: give a *ForSequenceClassification directory (num_labels=1, "
                               "head in score.weight) or our checkpoint with a value model "
                               "(tools/convert_checkpoint.py --role value)")
    return True


def _checkpoint_source(root: str, part: str, trained: bool, model_name: str | None,
                       iteration: int | None) -> ModelSource:
    names = CHECKPOINT_NAMES[part] if model_name is None else (model_name,)
    try:
        path = storage.checkpoint_path(root, storage.resolve_checkpoint(root, iteration))
        saved = saved_models(storage.verify_checkpoint(path, []))
        name = next((n for n in names if n in saved), None)
        if name is None:
            raise ModelSourceError(f"checkpoint {path} holds model(s) {sorted(saved)}, none named "
                                   f"{' or '.join(map(repr, names))} to start the {part} from "
                                   "(tools/convert_checkpoint.py --model-name sets the name)")
        config, role = saved_model_config(root, name, iteration)
        lora = saved_lora_config(root, name, iteration)
    except storage.CheckpointError as exc:
        raise ModelSourceError(str(exc)) from None
    if lora is not None:  # its adapters would be left out: the model would silently be its base
        raise ModelSourceError(f"model {name!r} of checkpoint {path} has LoRA adapters; export it merged first: "
                               f"tools/convert_checkpoint.py ours-to-hf --load {root} --model-name {name} "
                               "--merge-adapters --out DIR, and give DIR (to resume the run, --load it instead)")
    what = f"model {name!r} of checkpoint {path} (role {role!r})"
    return ModelSource(root, part, config, "checkpoint", _new_head(what, part, role, trained), name, iteration)


@torch.no_grad()
def read_weights(source: ModelSource, names: list[str], head_seed: int) -> dict[str, torch.Tensor]:
    """Full tensors of ``names`` (global names) from ``source``; a new value head is drawn from ``head_seed``.

    Reads only the tensors behind ``names`` (HF: ``safe_open`` per tensor file;
    ours: the files of the stages that own them). Raises ModelSourceError for a
    name the directory does not hold.
    """
    stored = [n for n in names if not (source.new_head and n == HEAD)]
    if source.format == "hf":
        full = read_hf_state(source.path, read_hf_config(source.path), source.role, stored)
    elif source.format == "megatron":
        ckpt = _open_megatron(source.path)
        full = read_megatron_state(ckpt, [n for n in stored if n in ckpt.locations])
    else:
        full = read_full_state(source.path, source.checkpoint_model, source.iteration, names=stored)[2]
    missing = sorted(set(stored) - set(full))
    if missing:
        raise ModelSourceError(f"{source.path} holds no tensor for {missing[:5]} of the {source.part}")
    if source.new_head and HEAD in names:
        full[HEAD] = new_value_head(source.config, head_seed)
    return full


def read_full_state(root: str, model_name: str, iteration: int | None = None, names=None,
                    with_base: bool = True) -> tuple[ModelConfig, str, dict[str, torch.Tensor]]:
    """(config, role, full weights by global name) of one model of our checkpoint root, in this process alone.

    ``names`` limits what is read (default: every weight of the model). A LoRA model saved without its base
    gets its frozen tensors from the recorded base source, checked against the recorded digests (unless
    ``with_base`` is False: then only what the checkpoint holds); BaseMismatchError when that cannot be done.
    """
    cfg, role, full, missing = read_saved_state(root, model_name, iteration, names)
    if with_base and missing is not None:
        source = missing.source_dir()
        part = model_name if model_name in CHECKPOINT_NAMES else "actor"  # a model named as a part opens as it
        try:
            base = read_weights(open_source(source, part), list(missing.digests), 0)
        except ModelSourceError as e:
            raise missing.unreadable(e) from None
        missing.verify(base)
        full.update(base)
    return cfg, role, full
