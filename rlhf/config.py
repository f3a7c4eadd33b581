"""The job's configuration: frozen dataclasses that rlhf/ppo/arguments.py fills from the flags.

Configs hold plain values and validate themselves; live objects (process
groups, models) are built from them by the job. A ``ConfigError`` names the
field (``field_name``, dotted from the job: ``run.seq_length``) so the
argument parser can report the flag that set it.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Mapping

from rlhf.algorithms import AdvantageConfig, KLConfig, advantage_estimators
from rlhf.checks import finite_float, is_int
from rlhf.models.config import ModelConfig, preset
from rlhf.models.config import padded_vocab_size
from rlhf.tasks import MODELS, TASK_MODEL, TASKS, TRAIN_TASK


class ConfigError(ValueError):
    """An invalid configuration value; ``field_name`` is the dotted field (e.g. ``run.seq_length``)."""

    def __init__(self, message: str, field_name: str):
        super().__init__(message)
        self.field_name = field_name


def check_positive_ints(section: str, config, names) -> None:
    """Raise a ConfigError naming ``<section>.<name>`` unless each named field is an integer >= 1."""
    for name in names:
        value = getattr(config, name)
        if not is_int(value) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", f"{section}.{name}")


def check_field_types(section: str, config) -> None:
    """Raise a ConfigError naming ``<section>.<field>`` for a field whose value does not have its annotated
    type: types are checked, never coerced. An int is not a bool, a float is finite (NaN and Infinity are
    refused), a str is not empty; None only where the annotation allows it. Fields annotated otherwise
    (``Mapping[str, str]``) are left to the config's own checks."""
    for name, (classes, optional) in _field_types(type(config)).items():
        value = getattr(config, name)
        if (value is None and optional) or any(_has_type(value, cls) for cls in classes):
            continue
        wanted = " or ".join([_TYPE_WORDS.get(cls, f"a {cls.__name__}") for cls in classes] + ["None"] * optional)
        raise ConfigError(f"{name} must be {wanted}, got {value!r}", f"{section}.{name}")


_TYPE_WORDS = {bool: "True or False", int: "an integer", float: "a finite number", str: "a non-empty string"}


@functools.cache
def _field_types(cls) -> dict:
    """{field: (classes, None allowed)} of the dataclass fields of ``cls`` annotated with classes."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        args = typing.get_args(hint) if union else (hint,)
        classes = tuple(a for a in args if a is not type(None))
        if all(isinstance(a, type) for a in classes):
            out[f.name] = (classes, len(classes) < len(args))
    return out


def _has_type(value, cls) -> bool:
    if cls is int:
        return is_int(value)
    if cls is float:
        return finite_float(value) is not None
    if cls is str:
        return isinstance(value, str) and value != ""
    return isinstance(value, cls)


def _check_range(section: str, name: str, value, low: float, high: float, what: str) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{name}={value!r} must be {what}", f"{section}.{name}")


MAX_SEED = 2**28 - 1
"""Largest run seed: the per-sample seeds derived from it (rlhf/ppo/trainer.py) must fit torch's 64-bit generator."""


@dataclass(frozen=True)
class RunConfig:
    """How long: total iterations (a resumed run continues to it) and the seed."""

    iterations: int = 30
    seed: int = 1234

    def __post_init__(self):
        check_field_types("run", self)
        check_positive_ints("run", self, ("iterations",))
        _check_range("run", "seed", self.seed, 0, MAX_SEED, f"in [0, {MAX_SEED}]")


@dataclass(frozen=True)
class GenerationConfig:
    """Rollout generation: prompt and response budgets (tokens) and sampling.

    ``long_tail_median`` > 0 declares the long-tailed measurement workload
    (docs/fusion.md): each sample's response length is drawn from a lognormal
    with this median (p99.9 about 12x it), capped at ``max_response_len``,
    and EOS is ignored, so samples end at their drawn length."""

    max_prompt_len: int = 16
    max_response_len: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    long_tail_median: int = 0

    def __post_init__(self):
        check_field_types("generation", self)
        check_positive_ints("generation", self, ("max_prompt_len", "max_response_len"))
        _check_range("generation", "long_tail_median", self.long_tail_median, 0, self.max_response_len,
                     "in [0, max_response_len] (0: off)")
        _check_range("generation", "temperature", self.temperature, 0.0, float("inf"), ">= 0 (0 is greedy)")
        _check_range("generation", "top_p", self.top_p, 1e-9, 1.0, "in (0, 1]")
        _check_range("generation", "top_k", self.top_k, 0, float("inf"), ">= 0 (0 disables)")


ESTIMATORS_WITH_CRITIC = ("gae",)
"""Advantage estimators that need critic values (the others place no critic tasks)."""


@dataclass(frozen=True)
class PPOConfig:
    """One PPO iteration: how many samples, how they are cut, and the loss settings.

    ``rollout_batch_size`` prompts per iteration, each sampled
    ``n_samples_per_prompt`` times; the samples are cut into mini-batches of
    ``ppo_mini_batch_size`` samples (one optimizer step each), every epoch;
    a training DP replica runs its share of a mini-batch in micro-batches of
    ``micro_batch_size`` samples (inference tasks use the same micro-batch size).
    The old log-probs are the engine's unless ``recompute_logprobs`` (then
    actor_train recomputes them before the update).
    """

    rollout_batch_size: int = 16
    n_samples_per_prompt: int = 4
    ppo_mini_batch_size: int = 32
    ppo_epochs: int = 1
    micro_batch_size: int = 4
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
    kl_coef: float = 0.01
    kl_target: float | None = None
    kl_estimator: str = "k1"
    gamma: float = 1.0
    lam: float = 0.95
    advantage_estimator: str = "gae"
    recompute_logprobs: bool = False

    def __post_init__(self):
        check_field_types("ppo", self)
        check_positive_ints("ppo", self, ("rollout_batch_size", "n_samples_per_prompt", "ppo_mini_batch_size",
                                           "ppo_epochs", "micro_batch_size"))
        for name in ("lr", "critic_lr"):
            _check_range("ppo", name, getattr(self, name), 1e-12, float("inf"), "> 0")
        _check_range("ppo", "clip_eps", self.clip_eps, 1e-9, 1.0, "in (0, 1]")
        _check_range("ppo", "clip_grad", self.clip_grad, 0.0, float("inf"), ">= 0 (0 turns clipping off)")
        _check_range("ppo", "weight_decay", self.weight_decay, 0.0, float("inf"), ">= 0")
        for name in ("gamma", "lam"):
            _check_range("ppo", name, getattr(self, name), 0.0, 1.0, "in [0, 1]")
        if self.value_clip is not None:
            _check_range("ppo", "value_clip", self.value_clip, 1e-9, float("inf"), "> 0, or None to disable")
        if self.rollout_samples % self.ppo_mini_batch_size:
            raise ConfigError(f"ppo_mini_batch_size {self.ppo_mini_batch_size} must divide the "
                              f"{self.rollout_samples} samples of an iteration (rollout_batch_size "
                              f"{self.rollout_batch_size} x n_samples_per_prompt {self.n_samples_per_prompt})",
                              "ppo.ppo_mini_batch_size")
        if self.advantage_estimator not in advantage_estimators():
            raise ConfigError(f"advantage_estimator {self.advantage_estimator!r} is not one of "
                              f"{list(advantage_estimators())}", "ppo.advantage_estimator")
        try:
            self.kl_config
        except ValueError as exc:  # "KLConfig.<field>=...": report the PPO field that set it
            kl_field = re.match(r"KLConfig\.(\w+)=", str(exc)).group(1)
            raise ConfigError(str(exc), f"ppo.kl_{kl_field}") from None
        for lr in (self.lr, self.critic_lr):
            try:
                self.optimizer_config(lr)
            except ValueError as exc:  # "OptimizerConfig.<field>=...": the PPO field of the same name
                name = re.match(r"OptimizerConfig\.(\w+)=", str(exc)).group(1)
                raise ConfigError(str(exc), f"ppo.{name}") from None

    def optimizer_config(self, lr: float):
        """The rlhf.optim.OptimizerConfig of a model trained at ``lr`` (AdamW; the LR schedule counts
        optimizer steps: ppo_epochs x mini-batches per iteration)."""
        from rlhf.optim import OptimizerConfig

        return OptimizerConfig(lr=lr, min_lr=self.min_lr, lr_warmup_iters=self.lr_warmup_iters,
                               lr_decay_iters=self.lr_decay_iters, lr_decay_style=self.lr_decay_style,
                               clip_grad=self.clip_grad, weight_decay=self.weight_decay,
                               use_distributed_optimizer=self.use_distributed_optimizer,
                               overlap_grad_reduce=self.overlap_grad_reduce)

    @property
    def kl_config(self) -> KLConfig:
        return KLConfig(coef=self.kl_coef, estimator=self.kl_estimator, target=self.kl_target)

    @property
    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(estimator=self.advantage_estimator, gamma=self.gamma, lam=self.lam)

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
        return self.advantage_estimator in ESTIMATORS_WITH_CRITIC


@dataclass(frozen=True)
class ModelsConfig:
    """Shapes of the four models and the directories their starting weights come from.

    The reference has the actor's shape and the reward model the critic's
    unless given their own (``None``: the same). ``weights`` maps a model to an
    HF model directory or our checkpoint root (rlhf/checkpoint/sources.py, the
    flags ``--<model>-model DIR``); a model without an entry starts from seeded
    random weights, except the reference (a copy of the actor's start) and the
    reward model (trained at start-up, or none: ``JobConfig.has_reward_model``).
    Every model reads the ids the actor generates, so none the job builds has a
    smaller vocabulary than the actor (``JobConfig`` checks the models it uses). ``make_vocab_size_divisible_by``: Megatron-LM's
    vocabulary padding (``JobConfig.padded_vocab_size``; 1 pads only what tp needs).
    """

    actor: ModelConfig = field(default_factory=lambda: preset("tiny"))
    critic: ModelConfig = field(default_factory=lambda: preset("tiny-critic"))
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

    def prompt_dataset_config(self, max_prompt_len: int):
        """The rlhf.data.PromptDatasetConfig of ``prompt_data``; a ConfigError names the job's field."""
        from rlhf.data import PromptDatasetConfig

        try:
            return PromptDatasetConfig(paths=self.prompt_data, prompt_field=self.prompt_field,
                                       messages_field=self.messages_field, chat_template_for_text=self.chat_template,
                                       add_generation_prompt=self.add_generation_prompt,
                                       max_prompt_length=max_prompt_len, overlong=self.prompt_overlong)
        except ValueError as exc:  # "PromptDatasetConfig.<field>=...": report the job field that set it
            name = re.match(r"PromptDatasetConfig\.(\w+)=", str(exc)).group(1)
            raise ConfigError(str(exc), PROMPT_DATASET_FIELDS[name]) from None


@dataclass(frozen=True)
class RewardConfig:
    """``reward_fn``: "module:function", a Python function ``fn(prompts, responses) -> scores`` (token-id
    lists in, one number per sample out; a response may end with the EOS id), the signature of
    rlhf.data.synthetic.gold_reward. Where the reward comes from: ``JobConfig.has_reward_model``."""

    reward_fn: str | None = None

    def __post_init__(self):
        check_field_types("reward", self)
        if self.reward_fn is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", self.reward_fn):
            raise ConfigError(f"reward_fn={self.reward_fn!r} is not MODULE:FUNCTION; give e.g. "
                              "'rlhf.data.synthetic:gold_reward'", "reward.reward_fn")


DEFAULT_PLANS = {
    4: {"actor_train": {"ranks": "0-3", "tp": 2, "pp": 2},
        "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True},
        "actor_gen": {"ranks": "0-3", "tp": 2, "dp": 2},
        "ref_inf": {"ranks": "2-3"},
        "reward_inf": {"ranks": "0-1"},
        "critic_inf": {"ranks": "0-3", "tp": 2}},
}
"""The built-in plan per world size when no plan file is given (4 ranks: every kind of layout at once,
as examples/placement_4ranks.json); other world sizes run every task data parallel on all ranks."""


@dataclass(frozen=True)
class PlacementConfig:
    """Where tasks run: a plan file (JSON/YAML; else the built-in plan) and per-task entries merged into it."""

    file: str | None = None
    overrides: Mapping[str, Mapping] = field(default_factory=dict)

    def __post_init__(self):
        check_field_types("placement", self)
        if not isinstance(self.overrides, Mapping) or not all(
                e is None or isinstance(e, Mapping) for e in self.overrides.values()):
            raise ConfigError(f"overrides={self.overrides!r} must map tasks to plan entries (mappings) or None",
                              "placement.overrides")
        unknown = sorted(set(self.overrides) - set(TASKS), key=str)
        if unknown:
            raise ConfigError(f"unknown task(s) {unknown}; valid tasks: {', '.join(TASKS)}", "placement.overrides")
        object.__setattr__(self, "overrides", MappingProxyType(
            {t: None if e is None else dict(e) for t, e in self.overrides.items()}))

    def plan(self, world_size: int | None = None) -> dict:
        """The plan dict: the file's entries (else the built-in plan for ``world_size``) with each
        override merged field by field into its task's entry (``None`` leaves the task unplaced).

        Raises rlhf.parallel.PlacementError for an unreadable or malformed file.
        """
        from rlhf.parallel.placement import load_plan

        plan = load_plan(self.file) if self.file else copy.deepcopy(DEFAULT_PLANS.get(world_size, {}))
        for task, entry in self.overrides.items():  # field by field into the file's entry ('none': unplaced)
            base = plan.get(task) or {}
            plan[task] = None if entry is None else {**base, **entry}
        return plan


@dataclass(frozen=True)
class LoggingConfig:
    """Where metrics go. Fields map to flags ``--metrics-file``, ``--tensorboard-dir``,
    ``--trace-iteration`` (1-based; traced into ``trace_file``) and ``--no-progress``."""

    metrics_file: str | None = None
    tensorboard_dir: str | None = None
    trace_iteration: int | None = None
    progress: bool = True
    trace_file: str = "trace.json"

    def __post_init__(self):
        check_field_types("logging", self)
        if self.metrics_file is not None:
            _check_path(self.metrics_file, "metrics_file", "file")
        if self.tensorboard_dir is not None:
            _check_path(self.tensorboard_dir, "tensorboard_dir", "directory")
        _check_path(self.trace_file, "trace_file", "file")
        it = self.trace_iteration
        if it is not None and it < 1:
            raise ConfigError(f"trace_iteration must be None or an integer >= 1 (iterations count from 1), "
                              f"got {it!r}", "logging.trace_iteration")


def _check_path(value: str, name: str, kind: str) -> None:
    """Raise a ConfigError naming ``logging.<name>`` if the path ``value`` is an existing entry of the
    other kind (``kind``: "file" or "directory")."""
    other, clashes = ("directory", os.path.isdir) if kind == "file" else ("file", os.path.isfile)
    if clashes(value):
        raise ConfigError(f"{name}={value!r} is an existing {other}; give a {kind} path", f"logging.{name}")


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
            _check_range("fusion", "migration_threshold", self.migration_threshold, 0.0, 1.0,
                         "a fraction of the batch in [0, 1] (0 never migrates), or auto")
            if not self.inter_stage_fusion:
                raise ConfigError("a migration threshold is used only with inter_stage_fusion; turn it on or drop "
                                  "the threshold", "fusion.migration_threshold")
        if self.migrate_kv not in MIGRATE_KV:
            raise ConfigError(f"migrate_kv {self.migrate_kv!r} is not one of {', '.join(MIGRATE_KV)}",
                              "fusion.migrate_kv")
        check_positive_ints("fusion", self, ("migration_check_every",))


SAVE_FORMATS = ("ours", "torch_dist")
"""Checkpoint formats the trainer writes: ours always; torch_dist adds the actor as Megatron-LM's."""


@dataclass(frozen=True)
class CheckpointConfig:
    """``save``: checkpoint root written every ``save_interval`` iterations and after the last one;
    ``load``: checkpoint root to resume from (its latest complete checkpoint); ``save_format``:
    "torch_dist" also writes the actor of each checkpoint as a Megatron-LM checkpoint in
    ``<save>/megatron`` (docs/megatron_checkpoints.md)."""

    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    save_format: str = "ours"

    def __post_init__(self):
        check_field_types("checkpoint", self)
        if self.save_format not in SAVE_FORMATS:
            raise ConfigError(f"save_format {self.save_format!r} is not one of {SAVE_FORMATS}",
                              "checkpoint.save_format")
        if self.save_interval is not None:
            if self.save is None:
                raise ConfigError("save_interval needs a checkpoint root to save to (save)", "checkpoint.save_interval")
            check_positive_ints("checkpoint", self, ("save_interval",))
        if self.load is not None and not os.path.isdir(self.load):
            raise ConfigError(f"load={self.load!r} is not a directory; give the root a run saved into "
                              "(it holds iter_* directories and 'latest')", "checkpoint.load")
        if self.save is not None and os.path.isfile(self.save):
            raise ConfigError(f"save={self.save!r} is a file; give a directory (created if missing)", "checkpoint.save")


@dataclass(frozen=True)
class MemoryConfig:
    """What is freed between the stages of an iteration (rlhf/memory.py; docs/training.md, "Memory
    between stages"). ``offload_ref_reward``: the reference and reward weights stay in host memory
    except during their inference. ``release_generation_memory``: actor_gen's weights and the KV cache
    are freed after generation and allocated again at the next reshard. Neither changes results."""

    offload_ref_reward: bool = False
    release_generation_memory: bool = False

    def __post_init__(self):
        check_field_types("memory", self)


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
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def __post_init__(self):
        check_field_types("job", self)
        trace = self.logging.trace_iteration
        if trace is not None and trace > self.run.iterations:
            raise ConfigError(f"trace_iteration {trace} is past the last iteration {self.run.iterations}",
                              "logging.trace_iteration")
        used = [m for m in MODELS if any(TASK_MODEL[t] == m for t in self.needed_tasks())]  # the models built
        self.models.check_reads_actor_ids([m for m in ("reference", "critic", "reward") if m in used])
        total = self.generation.max_prompt_len + self.generation.max_response_len
        for model in used:
            context = self.models[model].max_seq_len
            if total > context:
                raise ConfigError(f"max_prompt_len + max_response_len = {total} exceeds the {model} model's "
                                  f"context max_seq_len={context}; shorten them or give the model a longer context",
                                  "generation.max_response_len")
        self._check_inputs()

    # ---- tokenizer, prompts and rewards (docs/training.md, "Models, tokenizer, prompts and rewards")

    @property
    def has_reward_model(self) -> bool:
        """Whether a reward model scores the samples (reward_inf runs).

        Yes with reward model weights (``models.weights["reward"]``), or with no
        reward function (a reward model trained on the synthetic task's preference pairs).
        Without one, ``reward.reward_fn``'s score is the reward; with both, the
        model's score is and the function's is logged as ``gold_reward_mean``
        (for the synthetic task the function defaults to its gold rule).
        """
        return "reward" in self.models.weights or self.reward.reward_fn is None

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
        """The tasks this job runs: all six, without the critic's when the estimator needs none, and
        without reward_inf when there is no reward model (``has_reward_model``)."""
        return tuple(t for t in TASKS if (self.ppo.uses_critic or t not in ("critic_inf", "critic_train"))
                     and (self.has_reward_model or t != "reward_inf"))

    def trained_tasks(self) -> dict:
        """{model: its training task} of the models this job trains (no critic without a critic estimator)."""
        return {m: t for m, t in TRAIN_TASK.items() if self.ppo.uses_critic or m != "critic"}

    def padded_vocab_size(self, model: str, placement) -> int:
        """Embedding / output rows of ``model`` in every layout: its vocab_size rounded up to a multiple of
        make_vocab_size_divisible_by x the lcm of the tps its weights are resharded between (its tasks';
        the actor's and the reference's together, since the reference starts as a reshard of
        actor_train), as Megatron-LM pads (rlhf.models.vocab)."""
        family = ("actor", "reference") if model in ("actor", "reference") else (model,)
        tps = [mesh.strategy.tp for task, mesh in placement.meshes.items() if TASK_MODEL[task] in family]
        return padded_vocab_size(self.models[model].vocab_size, self.models.make_vocab_size_divisible_by, tps)

    def microbatches(self, placement, task: str) -> int:
        """Micro-batches one DP replica of ``task`` runs per mini-batch."""
        return self.ppo.ppo_mini_batch_size // (placement[task].strategy.dp * self.ppo.micro_batch_size)

    def build_placement(self, world_size: int):
        """This job's Placement on ``world_size`` ranks, checked against the models' shapes and the
        batch sizes (PlacementError or ConfigError naming what to change)."""
        from rlhf.parallel import Placement

        placement = Placement.from_plan(self.placement.plan(world_size), world_size)
        placement.validate_models({model: self.models[model] for model in MODELS})
        self.check_placement(placement)
        return placement

    def check_placement(self, placement) -> None:
        """Refuse batch sizes that the placement's DP sizes cannot split, and a fused schedule that does not
        fit the training placements (ConfigError naming the field)."""
        ppo = self.ppo
        missing = [t for t in self.needed_tasks() if t not in placement.meshes]
        critic = [t for t in missing if t in ("critic_inf", "critic_train")]
        if critic:
            raise ConfigError(f"advantage estimator {ppo.advantage_estimator!r} needs a critic, but "
                              f"{', '.join(critic)} is not placed; place it, or pick an estimator without a "
                              "critic (grpo, reinforce++)", "ppo.advantage_estimator")
        if missing:
            from rlhf.parallel import PlacementError

            raise PlacementError(f"{', '.join(missing)} must be placed: every run needs it")
        for task in self.trained_tasks().values():
            dp = placement[task].strategy.dp
            if ppo.ppo_mini_batch_size % (dp * ppo.micro_batch_size):
                raise ConfigError(f"ppo_mini_batch_size {ppo.ppo_mini_batch_size} must be a multiple of {task}'s "
                                  f"dp {dp} x micro_batch_size {ppo.micro_batch_size} (each DP replica runs "
                                  "whole micro-batches)", "ppo.ppo_mini_batch_size")
        if self.fusion.intra_stage_fusion:
            self.fused_schedule(placement)
        if self.fusion.inter_stage_fusion and placement["actor_gen"].strategy.dp < 2:
            raise ConfigError(f"inter-stage fusion migrates samples between generation instances, but actor_gen "
                              f"has dp {placement['actor_gen'].strategy.dp}; place actor_gen with dp >= 2",
                              "fusion.inter_stage_fusion")

    def fused_schedule(self, placement):
        """The fused schedule file checked against the training placements and micro-batch counts
        before anything runs, or None when the schedule is to be searched (then the placements are
        checked with a stand-in schedule). ConfigError names the schedule and what differs."""
        from rlhf.schedule.generators import serial_1f1b
        from rlhf.schedule.io import load_schedule
        from rlhf.schedule.problem import ProblemError
        from rlhf.schedule.schedule import Schedule, ScheduleError

        try:
            if self.fusion.schedule is None:
                problem = self.fusion_problem(placement, {m: None for m in self.trained_tasks()})
                self.check_fused(Schedule.from_orders(problem, serial_1f1b(problem)), placement)
                return None
            schedule = load_schedule(self.fusion.schedule)
            self.check_fused(schedule, placement)
        except (ScheduleError, ProblemError) as exc:
            where = self.fusion.schedule or "intra_stage_fusion"
            raise ConfigError(f"{where}: {exc}", "fusion.schedule" if self.fusion.schedule else
                              "fusion.intra_stage_fusion") from None
        return schedule

    def check_fused(self, schedule, placement) -> None:
        """ScheduleError unless ``schedule`` runs on the training placements with this job's micro-batches."""
        from rlhf.pipeline.compiler import compile_all

        trained = self.trained_tasks()
        compile_all(schedule, {m: placement[t] for m, t in trained.items()},
                    {m: self.microbatches(placement, t) for m, t in trained.items()})

    def fusion_problem(self, placement, costs: dict):
        """The fused-schedule problem of the training placements: per model, ``costs[model]`` =
        (forward seconds, backward seconds) per stage, or None for unit costs. Activation memory per
        stage is taken as proportional to hidden size x layers per stage (relative units)."""
        from rlhf.schedule.problem import ModelSpec, Problem

        trained = self.trained_tasks()
        stages = max(placement[t].strategy.pp for t in trained.values())
        specs = []
        for model, task in trained.items():
            mesh, cfg = placement[task], self.models[model]
            pp = mesh.strategy.pp
            fwd, bwd = costs[model] or ([1.0] * pp, [2.0] * pp)
            memory = cfg.hidden_size * cfg.num_layers / pp
            # a shorter pipeline runs stages // pp of its DP replicas side by side (RLHFuse's fusion
            # factor); every replica is one pipeline with its own micro-batches
            specs.append(ModelSpec(model, pp, stages // pp, self.microbatches(placement, task),
                                   "up" if mesh.reverse_pp else "down", fwd, bwd, [memory] * pp))
        return Problem(stages, tuple(specs), time_unit="s", mem_unit="rel")
