# shellcheck shell=bash disable=SC2034  # the variables are read by common.sh
# Llama-2 13B actor (and reference), 7B critic (and reward model): shapes and PPO flags, sourced by
# ../common.sh. The fused schedules (schedule_<N>.json) depend on --ppo-mini-batch-size and
# --micro-batch-size: after changing them, run ../search_schedules.sh (or delete the schedules).
ACTOR_SHAPE=llama2-13b
CRITIC_SHAPE=llama2-7b
PPO_FLAGS=(
  --iterations 1000
  --max-prompt-len 512 --max-response-len 512
  --rollout-batch-size 64 --n-samples-per-prompt 4
  --ppo-mini-batch-size 64 --micro-batch-size 4 --ppo-epochs 1
  --lr 1e-6 --critic-lr 5e-6 --lr-warmup-iters 20 --clip-grad 1.0
  --clip-eps 0.2 --value-clip 0.2 --kl-coef 0.05 --kl-estimator k1 --gamma 1.0 --lam 0.95
  --temperature 1.0 --top-p 1.0
)
