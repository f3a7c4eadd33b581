"""The PPO job's configuration: frozen dataclasses that rlhf/ppo/arguments.py fills from the flags.

Values and their validation only; laying the job out on a placement is
rlhf/ppo/layout.py. A ``ConfigError`` names the dotted field
(``generation.max_prompt_len``) so the argument parser can report the flag that set it.
:class:`JobConfig` holds one section per concept and checks what spans sections:

    section      class              module
    generation   GenerationConfig   generation.py   prompt and response budgets, sampling, multi-turn episodes
    ppo          PPOConfig          ppo.py          batch sizes, optimizer, loss settings, asynchronous iterations
    models       ModelsConfig       models.py       the four models' shapes and starting weights
    lora         AdaptersConfig     models.py       LoRA adapters of the trained models
    data         DataConfig         data.py         tokenizer and prompts
    reward       RewardConfig       data.py         a rule reward function
    fusion       FusionConfig       fusion.py       intra-stage and inter-stage fusion
    memory       MemoryConfig       memory.py       memory between stages, activation recomputation
    run, logging, checkpoint, placement             rlhf/config.py (shared with train_reward.py)
    precision    PrecisionConfig                    rlhf/models/precision.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhf.config import CheckpointConfig, ConfigError, LoggingConfig, PlacementConfig, RunConfig, check_field_types
from rlhf.models.precision import PrecisionConfig
from rlhf.ppo.config.data import DataConfig, RewardConfig
from rlhf.ppo.config.fusion import FusionConfig
from rlhf.ppo.config.generation import GenerationConfig
from rlhf.ppo.config.memory import MemoryConfig
from rlhf.ppo.config.models import AdaptersConfig, ModelsConfig
from rlhf.ppo.config.ppo import PPOConfig
from rlhf.tasks import MODELS, TASK_MODEL, TASKS, TRAIN_TASK

__all__ = ["AdaptersConfig", "DataConfig", "FusionConfig", "GenerationConfig", "JobConfig", "MemoryConfig",
           "ModelsConfig", "PPOConfig", "RewardConfig"]


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
        budget = self.ppo.packing_budget
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
