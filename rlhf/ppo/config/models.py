"""The models (``models.*``: shapes and starting weights) and LoRA (``lora.*``: adapters) sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from rlhf.config import ConfigError, check_field_types, check_positive_ints
from rlhf.data import ByteTokenizer
from rlhf.models.config import LORA_TARGET_MODULES, LoRAConfig, ModelConfig, ModelConfigError, preset
from rlhf.tasks import MODELS


@dataclass(frozen=True)
class ModelsConfig:
    """Shapes of the four models and the directories their starting weights come from.

    The reference has the actor's shape and the reward model the critic's
    unless given their own (``None``: the same). A model given as a preset has
    the job tokenizer's number of ids (rlhf/ppo/arguments.py; by default the
    tiny presets at the byte tokenizer's, the default job's); a JSON shape or
    a directory keeps its own vocab_size. ``weights`` maps a model to an
    HF model directory or our checkpoint root (rlhf/checkpoint/sources.py, the
    flags ``--<model>-model DIR``); a model without an entry starts from seeded
    random weights, except the reference (a copy of the actor's start) and the
    reward model (trained at start-up, or none: ``JobConfig.has_reward_model``).
    Every model reads the ids the actor generates, so none the job builds has a
    smaller vocabulary than the actor (``JobConfig`` checks the models it uses).
    ``make_vocab_size_divisible_by``: Megatron-LM's vocabulary padding
    (``rlhf.ppo.layout.padded_vocab_size``; 1 pads only what tp needs).
    """

    actor: ModelConfig = field(default_factory=lambda: preset("tiny", ByteTokenizer.VOCAB_SIZE))
    critic: ModelConfig = field(default_factory=lambda: preset("tiny-critic", ByteTokenizer.VOCAB_SIZE))
    reference: ModelConfig | None = None
    reward: ModelConfig | None = None
    weights: Mapping[str, str] = field(default_factory=dict)
    make_vocab_size_divisible_by: int = 1

    def __post_init__(self):
        check_field_types("models", self)
        check_positive_ints("models", self, ("make_vocab_size_divisible_by",))
        if not isinstance(self.weights, Mapping) or not all(isinstance(w, str) and w for w in self.weights.values()):
            raise ConfigError(f"weights={self.weights!r} must map models to directory paths", "models.weights")
        unknown = sorted(set(self.weights) - set(MODELS), key=str)
        if unknown:
            raise ConfigError(f"weights given for unknown model(s) {unknown}; models: {', '.join(MODELS)}",
                              "models.weights")
        object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))

    def check_reads_actor_ids(self, models) -> None:
        """Refuse a model of ``models`` (those the job builds) with fewer ids than the actor generates."""
        vocab = self.actor.vocab_size
        for model in models:
            if self[model].vocab_size < vocab:
                raise ConfigError(f"the {model} model's vocab_size={self[model].vocab_size} is smaller than the "
                                  f"actor's {vocab}, and it reads every id the actor generates; give a {model} "
                                  f"model with at least {vocab} ids, or an actor with fewer (--actor-model)",
                                  f"models.{model}")

    def __getitem__(self, model: str) -> ModelConfig:
        """The shape of ``model`` (one of rlhf.tasks.MODELS)."""
        return {"actor": self.actor, "reference": self.reference or self.actor, "critic": self.critic,
                "reward": self.reward or self.critic}[model]


LORA_MODELS = {"actor": "lora_", "critic": "critic_lora_"}
"""The models LoRA can train -> the prefix of their fields in AdaptersConfig (and of their flags)."""


@dataclass(frozen=True)
class AdaptersConfig:
    """LoRA adapters of the trained models (rlhf/models/lora.py, docs/lora.md): ``lora_*`` the actor's,
    ``critic_lora_*`` the critic's (as ``lr`` and ``critic_lr``), each a rlhf.models.config.LoRAConfig's
    rank (0: off, full fine-tuning), alpha (None: the rank), dropout, target modules and modules to save
    (trained in full; the critic's value head always is). ``reference_from_actor_base``: the reference
    log-probs come from actor_train with its adapters disabled, and no reference model is built or placed."""

    lora_rank: int = 0
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_target_modules: tuple = LORA_TARGET_MODULES
    lora_modules_to_save: tuple = ()
    critic_lora_rank: int = 0
    critic_lora_alpha: float | None = None
    critic_lora_dropout: float = 0.0
    critic_lora_target_modules: tuple = LORA_TARGET_MODULES
    critic_lora_modules_to_save: tuple = ()
    reference_from_actor_base: bool = False

    def __post_init__(self):
        check_field_types("lora", self)
        for model in LORA_MODELS:
            self.for_model(model)

    def for_model(self, model: str) -> LoRAConfig | None:
        """``model``'s LoRAConfig, or None without adapters (a ConfigError names the field of a bad value)."""
        if model not in LORA_MODELS:
            return None
        prefix = LORA_MODELS[model]
        try:
            config = LoRAConfig(rank=getattr(self, prefix + "rank"), alpha=getattr(self, prefix + "alpha"),
                                dropout=getattr(self, prefix + "dropout"),
                                target_modules=getattr(self, prefix + "target_modules"),
                                modules_to_save=getattr(self, prefix + "modules_to_save"))
        except ModelConfigError as exc:
            raise ConfigError(str(exc), f"lora.{prefix}{exc.field}") from None
        if model == "critic" and "lm_head" in config.modules_to_save:
            raise ConfigError("the critic has no lm_head: its value head (PEFT's score) is trained already; "
                              "drop lm_head", "lora.critic_lora_modules_to_save")
        return config if config.enabled else None

    def check_reference_from_base(self, job) -> None:
        """Refuse ``reference_from_actor_base`` where the actor without adapters is not the reference
        (``job``: the rlhf.ppo.config.JobConfig these adapters are part of)."""
        if not self.reference_from_actor_base:
            return
        actor, why = self.for_model("actor"), None
        if actor is None:
            why = "the actor has no LoRA adapters; give --lora-rank R"
        elif actor.modules_to_save:
            why = (f"the actor's modules_to_save ({','.join(actor.modules_to_save)}) are trained in full, so "
                   "without its adapters it is no longer its base; drop --lora-modules-to-save")
        elif job.models.reference is not None or "reference" in job.models.weights:
            why = "a reference model of its own is given; drop --reference-model"
        elif job.fusion.inter_stage_fusion or job.ppo.max_staleness:
            why = "inter-stage fusion and max_staleness > 0 run ref_inf on ranks of their own; drop them"
        if why:
            raise ConfigError(f"reference_from_actor_base takes the reference log-probs from the actor's base (its "
                              f"adapters disabled), but {why}", "lora.reference_from_actor_base")

    def check_shapes(self, models: "ModelsConfig", trained: dict) -> None:
        """Refuse a rank larger than a targeted projection of its model, and adapters for a model the
        job does not train (``trained``: JobConfig.trained_tasks())."""
        for model, prefix in LORA_MODELS.items():
            config = self.for_model(model)
            if config is None:
                continue
            if model not in trained:
                raise ConfigError(f"{prefix}rank {config.rank} adapts the {model}, which this job does not train "
                                  "(the advantage estimator has no critic); drop it", f"lora.{prefix}rank")
            try:
                config.check_shape(models[model])
            except ModelConfigError as exc:
                raise ConfigError(f"the {model}'s {exc}", f"lora.{prefix}rank") from None
            if models[model].is_moe:
                raise ConfigError(f"LoRA adapters on a mixture-of-experts {model} are not supported (the experts "
                                  "are not among the adaptable projections); train it in full or drop "
                                  f"--{prefix.replace('_', '-')}rank", f"lora.{prefix}rank")
