"""The PPO section (``ppo.*``): batch sizes, the optimizer, the loss settings, asynchronous iterations."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.algorithms import AdvantageConfig, KLConfig, advantage_estimators, estimator_needs_critic
from rlhf.algorithms.losses import LOSS_AGGREGATIONS
from rlhf.config import ConfigError, check_field_types, check_positive_ints, check_range
from rlhf.optim import OptimizerConfig

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
    schedule, training keeps its micro-batch count and balances them by tokens). 0 keeps them padded;
    None (``auto``) lets the job choose on its device (rlhf/ppo/memory_plan.py: packed to what fits a GPU's
    memory, padded on the CPU) and is padded until then (:attr:`packing_budget`).
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

    @property
    def packing_budget(self) -> int | None:
        """The tokens per packed micro-batch, or None: padded micro-batches of ``micro_batch_size`` (0, or an
        automatic budget not yet chosen: rlhf.ppo.memory_plan.resolve_micro_batches)."""
        return self.max_tokens_per_microbatch or None

    def __post_init__(self):
        check_field_types("ppo", self)
        check_positive_ints("ppo", self, ("rollout_batch_size", "n_samples_per_prompt", "ppo_mini_batch_size",
                                           "ppo_epochs", "micro_batch_size"))
        if self.max_tokens_per_microbatch is not None:
            check_range("ppo", "max_tokens_per_microbatch", self.max_tokens_per_microbatch, 0, float("inf"),
                        ">= 1 tokens (prompt + response), 0 for padded micro-batches of micro_batch_size samples, "
                        "or auto (None) for the job to choose")
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
