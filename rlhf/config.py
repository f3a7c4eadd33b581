"""The job's configuration: frozen dataclasses that rlhf/arguments.py fills from the flags.

Configs hold plain values and validate themselves; live objects (process
groups, models) are built from them by the job. A ``ConfigError`` names the
field (``field_name``, dotted from the job: ``run.seq_length``) so the
argument parser can report the flag that set it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from rlhf.models.config import ModelConfig, preset
from rlhf.tasks import TASKS


class ConfigError(ValueError):
    """An invalid configuration value; ``field_name`` is the dotted field (e.g. ``run.seq_length``)."""

    def __init__(self, message: str, field_name: str):
        super().__init__(message)
        self.field_name = field_name


@dataclass(frozen=True)
class RunConfig:
    """How long and how big: tokens per sample, samples per micro-batch, iterations, seed."""

    seq_length: int = 32
    micro_batch_size: int = 2
    iterations: int = 2
    seed: int = 1234

    def __post_init__(self):
        for name in ("seq_length", "micro_batch_size", "iterations"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", f"run.{name}")


@dataclass(frozen=True)
class ModelsConfig:
    """Shapes of the four models: the reference has the actor's shape, the reward model the critic's."""

    actor: ModelConfig = field(default_factory=lambda: preset("tiny"))
    critic: ModelConfig = field(default_factory=lambda: preset("tiny-critic"))

    def __getitem__(self, model: str) -> ModelConfig:
        """The shape of ``model`` (one of rlhf.tasks.MODELS)."""
        return {"actor": self.actor, "reference": self.actor, "critic": self.critic, "reward": self.critic}[model]


@dataclass(frozen=True)
class PlacementConfig:
    """Where tasks run: a plan file (JSON/YAML, optional) and per-task entries that override it."""

    file: str | None = None
    overrides: Mapping[str, Mapping] = field(default_factory=dict)

    def __post_init__(self):
        unknown = sorted(set(self.overrides) - set(TASKS))
        if unknown:
            raise ConfigError(f"unknown task(s) {unknown}; valid tasks: {', '.join(TASKS)}", "placement.overrides")
        object.__setattr__(self, "overrides", MappingProxyType({t: dict(e) for t, e in self.overrides.items()}))

    def plan(self) -> dict:
        """The plan dict: the file's entries with the overrides replacing whole task entries.

        Raises rlhf.parallel.PlacementError for an unreadable or malformed file.
        """
        from rlhf.parallel.placement import load_plan

        plan = load_plan(self.file) if self.file else {}
        plan.update({task: dict(entry) for task, entry in self.overrides.items()})
        return plan


@dataclass(frozen=True)
class JobConfig:
    """Everything ``pretrain_rlhf.py`` runs with."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        for model in ("actor", "critic"):
            context = self.models[model].max_seq_len
            if self.run.seq_length > context:
                raise ConfigError(f"seq_length {self.run.seq_length} exceeds the {model} model's context "
                                  f"max_seq_len={context}; lower it or give the model a longer context",
                                  "run.seq_length")
