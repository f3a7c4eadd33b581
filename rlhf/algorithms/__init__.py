"""RLHF algorithms: pure tensor code, no process groups (see docs/algorithms.md).

- gae: matrix-form GAE and discounted returns (blocked, masked by compaction)
- kl: KL estimators k1/k2/k3 (the KL in the rewards and the KL loss term), fixed/adaptive KL
  controllers, per-token rewards
- losses: PPO clipped policy / value losses, loss aggregation (DP-exact numerator and
  denominator), truncated importance sampling, masked statistics; the reward model's
  pairwise preference loss
- estimators: advantage-estimator registry (gae, grpo, dr-grpo, rloo, reinforce++,
  reinforce++-baseline)
- balancing: token-balanced DP mini-batches (Karmarkar-Karp, LPT)
"""
from rlhf.algorithms.balancing import balanced_minibatches, karmarkar_karp, lpt_partition, partition_loads
from rlhf.algorithms.estimators import (
    AdvantageConfig,
    AdvantageInputs,
    advantage_estimators,
    compute_advantages,
    estimator_needs_critic,
    get_advantage_estimator,
    register_advantage_estimator,
)
from rlhf.algorithms.gae import compute_gae, discounted_returns, discounted_suffix_sum
from rlhf.algorithms.kl import (
    AdaptiveKLController,
    FixedKLController,
    KL_ESTIMATORS,
    KLConfig,
    kl_estimate,
    make_kl_controller,
    token_rewards,
)
from rlhf.algorithms.losses import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    loss_denominator,
    loss_numerator,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    policy_loss_per_token,
    preference_loss,
    truncated_is_weights,
    value_loss,
    value_loss_per_token,
)

__all__ = [
    "AdaptiveKLController",
    "AdvantageConfig",
    "AdvantageInputs",
    "FixedKLController",
    "KLConfig",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "advantage_estimators",
    "aggregate_loss",
    "balanced_minibatches",
    "compute_advantages",
    "estimator_needs_critic",
    "compute_gae",
    "discounted_returns",
    "discounted_suffix_sum",
    "get_advantage_estimator",
    "karmarkar_karp",
    "kl_estimate",
    "loss_denominator",
    "loss_numerator",
    "lpt_partition",
    "make_kl_controller",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "partition_loads",
    "policy_loss",
    "policy_loss_per_token",
    "preference_loss",
    "register_advantage_estimator",
    "token_rewards",
    "truncated_is_weights",
    "value_loss",
    "value_loss_per_token",
]
