# shellcheck shell=bash disable=SC2034  # the variables are read by common.sh
# Llama-2 7B actor (and reference), 7B critic (and reward model), sourced by ../common.sh; the PPO
# flags are common.sh's DEFAULT_PPO_FLAGS (set PPO_FLAGS here to change them for this example).
ACTOR_SHAPE=llama2-7b
CRITIC_SHAPE=llama2-7b
