"""The PPO job's configuration: frozen dataclasses that rlhf/ppo/arguments.py fills from the flags.

Values and their validation only; laying the job out on a placement is
rlhf/ppo/layout.py. The run, logging, checkpoint and placement sections are
rlhf/config.py's (both programs share them); a ``ConfigError`` names the
dotted field (``generation.max_prompt_len``) so the argument parser can
report the flag that set it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Mapping

from rlhf.algorithms import AdvantageConfig, KLConfig, advantage_estimators, estimator_needs_critic
from rlhf.algorithms.losses import LOSS_AGGREGATIONS
from rlhf.checks import is_int
from rlhf.config import (CheckpointConfig, ConfigError, LoggingConfig, PlacementConfig, RunConfig, check_field_types,
                         check_positive_ints, check_range, check_recompute, check_recompute_stage)
from rlhf.data import ByteTokenizer, PromptDatasetConfig
from rlhf.models.config import LORA_TARGET_MODULES, LoRAConfig, ModelConfig, ModelConfigError, preset
from rlhf.models.precision import PrecisionConfig
from rlhf.optim import OptimizerConfig
from rlhf.tasks import MODELS, TASK_MODEL, TASKS, TRAIN_TASK


@dataclass(frozen=True)
class GenerationConfig:
    """Rollout generation: prompt and response budgets (tokens) and sampling.

    ``long_tail_median`` > 0 declares the long-tailed measurement workload
    (docs/fusion.md): each sample's response length is drawn from a lognormal
    with this median (p99.9 about 12x it), capped at ``max_response_len``,
    and EOS is ignored, so samples end at their drawn length.

    A sample stops at any of the tokenizer's stop ids (its EOS and every
    ``eos_token_id`` of the model directory's ``generation_config.json``) or
    of ``stop_token_ids``; the response keeps its stop token. Every log-prob
    the update uses is of logits / ``temperature`` (1 when greedy), as the
    engine's rollout log-probs are.

    ``environment`` ("module:Class", an rlhf.envs.environment.Environment)
    makes every sample a multi-turn episode of at most ``max_turns`` model
    turns of at most ``max_turn_tokens`` tokens (0: no limit), the
    environment answering between them; its rewards are the
    reward, and ``max_response_len`` bounds the whole response (turns and
    observations). ``agent`` ("module:function") instead runs a program
    written against the ``openai`` client per sample, its requests the
    turns, its return value the reward (rlhf/envs/agents.py).
    docs/agents.md. ``cuda_graphs``: on a GPU, the engine replays its decode
    steps as CUDA graphs (docs/engine.md); ignored on the CPU."""

    max_prompt_len: int = 16
    max_response_len: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    long_tail_median: int = 0
    stop_token_ids: tuple = ()
    environment: str | None = None
    agent: str | None = None
    max_turns: int = 4
    max_turn_tokens: int = 0
    cuda_graphs: bool = False

    @property
    def multi_turn(self) -> str | None:
        """``environment`` or ``agent``, whichever drives the episodes (None: single-turn samples)."""
        return self.environment or self.agent

    def __post_init__(self):
        check_field_types("generation", self)
        check_positive_ints("generation", self, ("max_prompt_len", "max_response_len", "max_turns"))
        check_range("generation", "max_turn_tokens", self.max_turn_tokens, 0, self.max_response_len,
                    "in [0, max_response_len] (0: no limit but the response's)")
        for name, example in (("environment", "rlhf.envs.tools:ToolEnvironment"), ("agent", "my_agents:solve")):
            value = getattr(self, name)
            if value is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value):
                raise ConfigError(f"{name}={value!r} is not MODULE:NAME; give e.g. '{example}'", f"generation.{name}")
        if self.environment is not None and self.agent is not None:
            raise ConfigError("give an environment or an agent, not both: each drives the episodes",
                              "generation.agent")
        check_range("generation", "long_tail_median", self.long_tail_median, 0, self.max_response_len,
                     "in [0, max_response_len] (0: off)")
        check_range("generation", "temperature", self.temperature, 0.0, float("inf"), ">= 0 (0 is greedy)")
        check_range("generation", "top_p", self.top_p, 1e-9, 1.0, "in (0, 1]")
        check_range("generation", "top_k", self.top_k, 0, float("inf"), ">= 0 (0 disables)")
        if not isinstance(self.stop_token_ids, tuple) or not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids={self.stop_token_ids!r} must be token ids >= 0, e.g. '2,32000'",
                              "generation.stop_token_ids")

    @property
    def logprob_temperature(self) -> float:
        """The temperature every log-prob of the update is taken at: the sampling one, 1 when greedy."""
        return self.temperature or 1.0


KL_PLACES = ("reward", "loss")
"""Where the KL penalty acts: in the token rewards, or as a loss term on the actor."""

KL_IN_LOSS_ESTIMATORS = ("grpo", "dr-grpo")
"""Estimators whose KL is a loss term unless ``kl_in`` says otherwise (TRL's GRPO ``beta``, verl's GRPO recipes)."""

TIS_MODES = ("token", "sequence")
"""Truncated importance sampling: per-token weights, or one weight per sequence."""

PARTIAL_ROLLOUT_KV = ("recompute", "keep")
"""What becomes of the K/V of samples in flight when new weights reach them (PPOConfig.partial_rollout_kv)."""


@dataclass(frozen=True)
class PPOConfig:
    """One PPO iteration: how many samples, how they are cut, and the loss settings.

    ``rollout_batch_size`` prompts per iteration, each sampled
    ``n_samples_per_prompt`` times; the samples are cut into mini-batches of
    ``ppo_mini_batch_size`` samples (one optimizer step each), every epoch;
    a training DP replica runs its share of a mini-batch in micro-batches of
    ``micro_batch_size`` samples (inference tasks use the same micro-batch size), or with
    ``max_tokens_per_microbatch`` consecutive samples while their tokens fit that budget, packed
    into one row each (rlhf/models/packing.py: no padding; training and inference alike; with a fused
    schedule, training keeps its micro-batch count and balances them by tokens).
    The old log-probs are the engine's unless ``recompute_logprobs`` (then
    actor_train recomputes them before the update). ``routing_replay``: a
    mixture-of-experts actor's recomputed old log-probs and training forwards
    use the experts the engine chose (rlhf/models/moe.py).

    Loss settings (docs/training.md has each beside verl's, OpenRLHF's and
    TRL's name): the KL penalty acts in the token rewards or as a loss term
    on the actor (``kl_in``; None: in the loss for grpo and dr-grpo, as TRL's
    ``beta``, in the rewards otherwise); clip-higher (``clip_eps_high``),
    dual-clip, the loss aggregation, an entropy bonus, GAE advantage
    whitening, truncated samples masked out of the loss or given DAPO's
    overlong penalty (``overlong_penalty`` "LEN,COEF"), truncated importance
    sampling of the rollout policy (``tis_cap``, ``tis_mode``), and
    ``critic_warmup`` iterations that update the critic alone. A model whose last
    ``max_skipped_steps`` optimizer steps were all skipped for non-finite gradients
    stops the run (0: never; rlhf.ppo.update.stop_after_skipped_steps).

    ``max_staleness`` K > 0 makes the iteration asynchronous (rlhf/ppo/asynchronous.py,
    docs/async.md): actor_gen, on ranks of its own, generates the batches of the next K
    iterations while the others train, so a batch is trained at most K policy versions after
    the weights that generated it; the old log-probs are then always recomputed (the proximal
    policy of decoupled PPO, ``recomputes_logprobs``) and ``tis_cap`` weights each token by
    proximal over behaviour (the engine's) probability. ``partial_rollouts`` lets generation run
    free between the ranks' meetings: it keeps K batches in flight and takes each update's weights
    mid-sample, the K/V of samples in flight computed again (``partial_rollout_kv`` "recompute") or
    kept ("keep"; rlhf/ppo/partial_rollouts.py).
    """

    rollout_batch_size: int = 16
    n_samples_per_prompt: int = 4
    ppo_mini_batch_size: int = 32
    ppo_epochs: int = 1
    micro_batch_size: int = 4
    max_tokens_per_microbatch: int | None = None
    lr: float = 3e-3
    critic_lr: float = 1e-3
    clip_grad: float = 1.0
    weight_decay: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "constant"
    lr_decay_iters: int | None = None
    min_lr: float = 0.0
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool | None = None
    clip_eps: float = 0.2
    value_clip: float | None = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.01
    kl_target: float | None = None
    kl_estimator: str | None = None
    kl_horizon: int = 10000
    kl_in: str | None = None
    gamma: float = 1.0
    lam: float = 0.95
    advantage_estimator: str = "gae"
    whiten_advantages: bool = True
    loss_agg: str = "token-mean"
    entropy_coef: float = 0.0
    mask_truncated: bool = False
    overlong_penalty: str | None = None
    tis_cap: float | None = None
    tis_mode: str = "token"
    critic_warmup: int = 0
    max_skipped_steps: int = 10
    recompute_logprobs: bool = False
    max_staleness: int = 0
    partial_rollouts: bool = False
    partial_rollout_kv: str = "recompute"
    routing_replay: bool = False

    def __post_init__(self):
        check_field_types("ppo", self)
        check_positive_ints("ppo", self, ("rollout_batch_size", "n_samples_per_prompt", "ppo_mini_batch_size",
                                           "ppo_epochs", "micro_batch_size"))
        if self.max_tokens_per_microbatch is not None:
            check_range("ppo", "max_tokens_per_microbatch", self.max_tokens_per_microbatch, 1, float("inf"),
                        ">= 1 tokens (prompt + response), or None for micro-batches of micro_batch_size samples")
        for name in ("lr", "critic_lr"):
            check_range("ppo", name, getattr(self, name), 1e-12, float("inf"), "> 0")
        check_range("ppo", "clip_eps", self.clip_eps, 1e-9, 1.0, "in (0, 1]")
        check_range("ppo", "clip_grad", self.clip_grad, 0.0, float("inf"), ">= 0 (0 turns clipping off)")
        check_range("ppo", "weight_decay", self.weight_decay, 0.0, float("inf"), ">= 0")
        for name in ("gamma", "lam"):
            check_range("ppo", name, getattr(self, name), 0.0, 1.0, "in [0, 1]")
        if self.value_clip is not None:
            check_range("ppo", "value_clip", self.value_clip, 1e-9, float("inf"), "> 0, or None to disable")
        if self.rollout_samples % self.ppo_mini_batch_size:
            raise ConfigError(f"ppo_mini_batch_size {self.ppo_mini_batch_size} must divide the "
                              f"{self.rollout_samples} samples of an iteration (rollout_batch_size "
                              f"{self.rollout_batch_size} x n_samples_per_prompt {self.n_samples_per_prompt})",
                              "ppo.ppo_mini_batch_size")
        if self.advantage_estimator not in advantage_estimators():
            raise ConfigError(f"advantage_estimator {self.advantage_estimator!r} is not one of "
                              f"{list(advantage_estimators())}", "ppo.advantage_estimator")
        self._check_loss_options()
        try:
            self.kl_config
        except ConfigError as exc:  # KLConfig's field <name> is the PPO field kl_<name>
            raise exc.renamed(f"ppo.kl_{exc.field_name}") from None
        for lr in (self.lr, self.critic_lr):
            try:
                self.optimizer_config(lr)
            except ConfigError as exc:  # OptimizerConfig's fields are the PPO fields of the same name
                raise exc.renamed(f"ppo.{exc.field_name}") from None

    def _check_loss_options(self) -> None:
        """The loss settings each in range, and no combination that cannot act (ConfigError naming the field)."""
        choices = {"kl_in": (None, *KL_PLACES), "loss_agg": tuple(LOSS_AGGREGATIONS), "tis_mode": TIS_MODES,
                   "partial_rollout_kv": PARTIAL_ROLLOUT_KV}
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                names = ", ".join("auto" if v is None else v for v in valid)
                raise ConfigError(f"{name} {getattr(self, name)!r} is not one of {names}", f"ppo.{name}")
        if self.clip_eps_high is not None:
            check_range("ppo", "clip_eps_high", self.clip_eps_high, self.clip_eps, 10.0, "in [clip_eps, 10]")
        if self.dual_clip is not None:
            check_range("ppo", "dual_clip", self.dual_clip, 1.0 + 1e-9, float("inf"), "> 1, or None to disable")
        check_range("ppo", "entropy_coef", self.entropy_coef, 0.0, float("inf"), ">= 0 (0: off)")
        check_range("ppo", "critic_warmup", self.critic_warmup, 0, float("inf"), ">= 0 iterations")
        check_range("ppo", "max_skipped_steps", self.max_skipped_steps, 0, float("inf"),
                    ">= 0 optimizer steps (0: never stop)")
        check_range("ppo", "max_staleness", self.max_staleness, 0, float("inf"),
                    ">= 0 policy versions (0: synchronous)")
        if self.partial_rollouts and not self.max_staleness:
            raise ConfigError("partial_rollouts hands weight updates to samples in flight, which only an "
                              "asynchronous run has; give --max-staleness >= 1 (2 or more for samples to span "
                              "an update) or drop it", "ppo.partial_rollouts")
        if self.tis_cap is not None:
            check_range("ppo", "tis_cap", self.tis_cap, 1.0, float("inf"), ">= 1 (the importance weights' cap)")
            if not self.recomputes_logprobs:
                raise ConfigError("tis_cap corrects the engine's rollout log-probs against the trainer's, which only "
                                  "--recompute-logprobs (or --max-staleness > 0) computes; turn it on or drop the "
                                  "cap", "ppo.tis_cap")
        if self.overlong_penalty is not None:
            self.overlong_punishment  # noqa: B018 -- parses "LEN,COEF" (ConfigError naming the field)
        if self.kl_in_loss and self.kl_estimator_name == "k1":
            raise ConfigError("k1 as a loss term has zero expected gradient (on-policy, E[grad log pi] = 0): the KL "
                              "would not act; use k3 (TRL, verl's low_var_kl) or k2 with the KL in the loss, or "
                              "--kl-in reward", "ppo.kl_estimator")
        if self.kl_target is not None and self.kl_coef == 0:
            raise ConfigError("kl_target adapts the KL coefficient by scaling it, and from kl_coef 0 it never moves; "
                              "give an initial kl_coef > 0 or drop the target", "ppo.kl_target")
        if self.critic_warmup and not self.uses_critic:
            raise ConfigError(f"critic_warmup trains the critic alone first, but {self.advantage_estimator!r} has no "
                              "critic; drop it or pick gae", "ppo.critic_warmup")

    @property
    def recomputes_logprobs(self) -> bool:
        """Whether actor_train recomputes the old log-probs: asked for, or asynchronous (``max_staleness``)."""
        return self.recompute_logprobs or self.max_staleness > 0

    @property
    def kl_in_loss(self) -> bool:
        """Whether the KL penalty is a loss term on the actor (else it is in the token rewards)."""
        return (self.kl_in or ("loss" if self.advantage_estimator in KL_IN_LOSS_ESTIMATORS else "reward")) == "loss"

    @property
    def kl_estimator_name(self) -> str:
        """The per-token KL estimator: ``kl_estimator``, else k3 with the KL in the loss (TRL's GRPO, verl's
        low_var_kl) and k1 in the rewards."""
        return self.kl_estimator or ("k3" if self.kl_in_loss else "k1")

    @property
    def overlong_punishment(self) -> tuple[int, float] | None:
        """(LEN, COEF) of ``overlong_penalty``: DAPO's soft overlong punishment, or None."""
        if self.overlong_penalty is None:
            return None
        length, _, coef = self.overlong_penalty.partition(",")
        try:
            length, coef = int(length), float(coef)
        except ValueError:
            length = coef = None
        if length is None or length < 1 or not 0 <= coef < float("inf"):
            raise ConfigError(f"overlong_penalty {self.overlong_penalty!r} must be LEN,COEF: a buffer of LEN >= 1 "
                              "tokens before max_response_len and a penalty coefficient >= 0, e.g. '4,1.0'",
                              "ppo.overlong_penalty")
        return length, coef

    def optimizer_config(self, lr: float) -> OptimizerConfig:
        """The rlhf.optim.OptimizerConfig of a model trained at ``lr`` (AdamW; the LR schedule counts
        optimizer steps: ppo_epochs x mini-batches per iteration)."""
        return OptimizerConfig(lr=lr, min_lr=self.min_lr, lr_warmup_iters=self.lr_warmup_iters,
                               lr_decay_iters=self.lr_decay_iters, lr_decay_style=self.lr_decay_style,
                               clip_grad=self.clip_grad, weight_decay=self.weight_decay,
                               use_distributed_optimizer=self.use_distributed_optimizer,
                               overlap_grad_reduce=self.overlap_grad_reduce)

    @property
    def kl_config(self) -> KLConfig:
        return KLConfig(coef=self.kl_coef, estimator=self.kl_estimator_name, target=self.kl_target,
                        horizon=self.kl_horizon)

    @property
    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(estimator=self.advantage_estimator, gamma=self.gamma, lam=self.lam,
                               whiten=self.whiten_advantages)

    @property
    def rollout_samples(self) -> int:
        """Samples per iteration."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def minibatches(self) -> int:
        """Optimizer steps per epoch."""
        return self.rollout_samples // self.ppo_mini_batch_size

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator reads critic values (its registry entry says), so the critic's tasks run."""
        return estimator_needs_critic(self.advantage_estimator)


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

    def check_reference_from_base(self, job: "JobConfig") -> None:
        """Refuse ``reference_from_actor_base`` where the actor without adapters is not the reference."""
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


MIGRATE_KV = ("yes", "no", "auto")
"""How migrated samples travel: with their K/V, as tokens to re-prefill, or the cheaper one as measured."""


@dataclass(frozen=True)
class FusionConfig:
    """Intra-stage fusion: actor and critic training run as one fused pipeline schedule instead of one
    serial 1F1B schedule each: the ``schedule`` file (tools/search_schedule.py), or without one a
    schedule searched after the first iteration from its measured stage times (``search_budget``
    nominal seconds of annealing, rlhf/schedule/search.py).

    Inter-stage fusion (docs/fusion.md): once the batch's unfinished samples fall to
    ``migration_threshold`` (a fraction; None: auto, chosen by rlhf.fusion.policy from the lengths
    and times measured so far), they migrate to a few generation instances (``migrate_kv``) and the
    freed ranks infer the finished samples while the rest generate. Instances count their
    unfinished samples every ``migration_check_every`` engine steps."""

    intra_stage_fusion: bool = False
    schedule: str | None = None
    search_budget: float = 10.0
    inter_stage_fusion: bool = False
    migration_threshold: float | None = None
    migrate_kv: str = "auto"
    migration_check_every: int = 4

    def __post_init__(self):
        check_field_types("fusion", self)
        if self.search_budget <= 0:
            raise ConfigError(f"search_budget={self.search_budget!r} must be a finite number of seconds > 0",
                              "fusion.search_budget")
        if self.schedule is not None and not self.intra_stage_fusion:
            raise ConfigError("a schedule is run only with intra_stage_fusion; turn it on or drop the schedule",
                              "fusion.schedule")
        if self.migration_threshold is not None:
            check_range("fusion", "migration_threshold", self.migration_threshold, 0.0, 1.0,
                         "a fraction of the batch in [0, 1] (0 never migrates), or auto")
            if not self.inter_stage_fusion:
                raise ConfigError("a migration threshold is used only with inter_stage_fusion; turn it on or drop "
                                  "the threshold", "fusion.migration_threshold")
        if self.migrate_kv not in MIGRATE_KV:
            raise ConfigError(f"migrate_kv {self.migrate_kv!r} is not one of {', '.join(MIGRATE_KV)}",
                              "fusion.migrate_kv")
        check_positive_ints("fusion", self, ("migration_check_every",))


@dataclass(frozen=True)
class MemoryConfig:
    """What is freed between the stages of an iteration (rlhf/memory.py; docs/training.md, "Memory
    between stages"), and what training keeps for its backward. ``offload_ref_reward``: the reference
    and reward weights stay in host memory except during their inference. ``release_generation_memory``:
    actor_gen's weights and the KV cache are freed after generation and allocated again at the next
    reshard. ``recompute_granularity`` (None, "full", "selective") and ``recompute_num_layers``:
    Megatron-LM's activation recomputation of the trained models (actor_train, critic_train): full
    recomputes chunks of ``recompute_num_layers`` layers (default 1; it must divide each training
    pipeline stage's layers, rlhf.ppo.layout checks), selective the core attention. None changes results."""

    offload_ref_reward: bool = False
    release_generation_memory: bool = False
    recompute_granularity: str | None = None
    recompute_num_layers: int | None = None

    def __post_init__(self):
        check_field_types("memory", self)
        check_recompute("memory", self.recompute_granularity, self.recompute_num_layers)

    @property
    def recompute(self) -> dict:
        """rlhf.models.gpt.build_model's recompute arguments for a trained model."""
        return {"recompute_granularity": self.recompute_granularity,
                "recompute_num_layers": self.recompute_num_layers}

    def check_stage_layers(self, task: str, stage_layers: int) -> None:
        """ConfigError unless a full recompute's chunk divides the ``stage_layers`` layers of a pipeline
        stage of ``task`` (megatron's uniform method recomputes whole chunks)."""
        check_recompute_stage("memory", task, self.recompute_granularity, self.recompute_num_layers, stage_layers)


@dataclass(frozen=True)
class JobConfig:
    """Everything ``pretrain_rlhf.py`` runs with."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    lora: AdaptersConfig = field(default_factory=AdaptersConfig)

    def __post_init__(self):
        check_field_types("job", self)
        self.lora.check_shapes(self.models, self.trained_tasks())
        self.lora.check_reference_from_base(self)
        if self.checkpoint.save_format == "torch_dist" and self.lora.for_model("actor") is not None:
            raise ConfigError("torch_dist writes the actor as a Megatron-LM checkpoint, which has no place for LoRA "
                              "adapters yet; save 'ours' (tools/convert_checkpoint.py exports the adapters)",
                              "checkpoint.save_format")
        self.logging.check_traced_iteration(self.run)
        overlong = self.ppo.overlong_punishment
        if overlong is not None and overlong[0] > self.generation.max_response_len:
            raise ConfigError(f"overlong_penalty's buffer of {overlong[0]} tokens is longer than max_response_len "
                              f"{self.generation.max_response_len}; give a buffer within it", "ppo.overlong_penalty")
        used = [m for m in MODELS if any(TASK_MODEL[t] == m for t in self.needed_tasks())]  # the models built
        self.models.check_reads_actor_ids([m for m in ("reference", "critic", "reward") if m in used])
        if self.ppo.partial_rollouts and self.memory.release_generation_memory:
            raise ConfigError("partial_rollouts keeps samples in flight between iterations, so actor_gen's "
                              "weights and KV cache cannot be released; drop one of the two",
                              "memory.release_generation_memory")
        if self.ppo.max_staleness and self.fusion.inter_stage_fusion:
            raise ConfigError("inter-stage fusion lends generation's ranks to inference once the long tail "
                              "migrates, but with max_staleness > 0 generation has ranks of its own and never "
                              "waits for inference; drop one of the two", "ppo.max_staleness")
        self._check_environment()
        self._check_routing_replay()
        total = self.generation.max_prompt_len + self.generation.max_response_len
        budget = self.ppo.max_tokens_per_microbatch
        if budget is not None and budget < total:
            raise ConfigError(f"max_tokens_per_microbatch {budget} is smaller than the longest sample: "
                              f"max_prompt_len {self.generation.max_prompt_len} + max_response_len "
                              f"{self.generation.max_response_len} = {total} tokens; give at least {total}",
                              "ppo.max_tokens_per_microbatch")
        for model in used:
            context = self.models[model].max_seq_len
            if total > context:
                raise ConfigError(f"max_prompt_len + max_response_len = {total} exceeds the {model} model's "
                                  f"context max_seq_len={context}; shorten them or give the model a longer context",
                                  "generation.max_response_len")
        self._check_inputs()

    def _check_routing_replay(self) -> None:
        """Routing replay needs experts to replay, and forwards that read the engine's choices (a full
        recompute in the backward would route on its own)."""
        if not self.ppo.routing_replay:
            return
        if not self.models.actor.is_moe:
            raise ConfigError("routing_replay replays the experts the engine chose, but the actor is dense "
                              "(num_experts 0); give a mixture-of-experts actor or drop it", "ppo.routing_replay")
        if self.memory.recompute_granularity == "full":
            raise ConfigError("routing_replay with recompute_granularity 'full': the recomputed forward in the "
                              "backward would route on its own; use 'selective' or none", "ppo.routing_replay")

    def _check_environment(self) -> None:
        """An environment's (or agent's) rewards are the reward, and its episodes run in the synchronous loop."""
        driver = self.generation.multi_turn
        if driver is None:
            return
        clashes = {"reward.reward_fn": self.reward.reward_fn is not None,
                   "reward.skip_nonfinite_samples": self.reward.skip_nonfinite_samples,
                   "models.reward": "reward" in self.models.weights,
                   "ppo.max_staleness": self.ppo.max_staleness > 0,
                   "ppo.partial_rollouts": self.ppo.partial_rollouts,
                   "fusion.inter_stage_fusion": self.fusion.inter_stage_fusion,
                   "generation.long_tail_median": self.generation.long_tail_median > 0}
        for name, clash in clashes.items():
            if clash:
                raise ConfigError(f"{name} cannot go with an environment or agent ({driver}): its "
                                  "rewards are the reward, and its episodes run in the synchronous loop without "
                                  "a declared workload; drop one of the two", name)

    # ---- tokenizer, prompts and rewards (docs/training.md, "Models, tokenizer, prompts and rewards")

    @property
    def has_reward_model(self) -> bool:
        """Whether a reward model scores the samples (reward_inf runs).

        Yes with reward model weights (``models.weights["reward"]``), or with neither a
        reward function nor an environment (a reward model trained on the synthetic task's
        preference pairs).
        Without one, ``reward.reward_fn``'s score is the reward; with both, the
        model's score is and the function's is logged as ``gold_reward_mean``
        (for the synthetic task the function defaults to its gold rule).
        """
        unscored = self.reward.reward_fn is None and self.generation.multi_turn is None
        return "reward" in self.models.weights or unscored

    def prompt_dataset_config(self):
        """The rlhf.data.PromptDatasetConfig of ``data.prompt_data`` (a ConfigError names the field)."""
        return self.data.prompt_dataset_config(self.generation.max_prompt_len)

    def _check_inputs(self) -> None:
        """A tokenizer the prompts can use, and a reward source for prompt data (ConfigError naming the field)."""
        if self.data.prompt_data is None:
            if self.data.tokenizer not in (None, "byte"):
                raise ConfigError(f"tokenizer {self.data.tokenizer!r} needs prompt data (--prompt-data): the "
                                  "built-in synthetic task's prompts are byte-tokenizer ids", "data.tokenizer")
            return
        if self.has_reward_model and "reward" not in self.models.weights:
            raise ConfigError("prompt data needs a reward source: a reward model (--reward-model DIR), a reward "
                              "function (--reward-fn MODULE:FUNCTION) or both; a reward model is trained at "
                              "start-up only for the synthetic task (train_reward.py trains one from preference "
                              "data)", "data.prompt_data")
        self.prompt_dataset_config()

    def needed_tasks(self) -> tuple:
        """The tasks this job runs: all six, without the critic's when the estimator needs none,
        without reward_inf when there is no reward model (``has_reward_model``), and without ref_inf when
        actor_train gives the reference log-probs (``lora.reference_from_actor_base``)."""
        return tuple(t for t in TASKS if (self.ppo.uses_critic or t not in ("critic_inf", "critic_train"))
                     and (self.has_reward_model or t != "reward_inf")
                     and not (self.lora.reference_from_actor_base and t == "ref_inf"))

    def trained_tasks(self) -> dict:
        """{model: its training task} of the models this job trains (no critic without a critic estimator)."""
        return {m: t for m, t in TRAIN_TASK.items() if self.ppo.uses_critic or m != "critic"}
