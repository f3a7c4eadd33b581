# shellcheck shell=bash
# The pretrain_rlhf.py flags of a cluster example, shared by single_node.sh and slurm.sbatch, and by
# tests/test_cluster_launch.py, which dry-runs exactly what they launch. Sourced with ROOT set to the
# repository root (docs/launch.md).
#
# An example is a directory beside this file: job.sh (model shapes; PPO flags if not the defaults
# below), plan_<N>.json (the placement on N ranks) and schedule_<N>.json (the fused actor/critic
# schedule for that plan, written by search_schedules.sh; without one the trainer searches a schedule
# after the first iteration).
#
# Environment, all optional:
#   ACTOR_MODEL, CRITIC_MODEL  an HF model directory or our checkpoint root (default: the example's
#                              Llama-2 shape, models/*.json, with random weights: a smoke run)
#   REFERENCE_MODEL            a directory (default: a copy of the actor's start)
#   REWARD_MODEL               a *ForSequenceClassification directory or our checkpoint root
#   PROMPT_DATA, TOKENIZER     --prompt-data FILE, --tokenizer DIR (default: the synthetic task)
#   REWARD_FN                  MODULE:FUNCTION (default without REWARD_MODEL and PROMPT_DATA: the
#                              synthetic task's gold rule, so no reward model is trained at start-up)
#   OUT_DIR                    checkpoints, metrics, TensorBoard (default: runs/<example>); a launch
#                              resumes from OUT_DIR/checkpoints when it holds a checkpoint
#   DRY_RUN=1                  check the launch with pretrain_rlhf.py --dry-run instead of running it
#                              (on any machine; PYTHON: its interpreter, default python)

EXAMPLES="$ROOT/examples/cluster"

# The examples' PPO flags (a job.sh may set its own PPO_FLAGS). The fused schedules (schedule_<N>.json)
# depend on --ppo-mini-batch-size and --micro-batch-size: after changing them, run search_schedules.sh
# (or delete the schedules).
DEFAULT_PPO_FLAGS=(
  --iterations 1000
  --max-prompt-len 512 --max-response-len 512
  --rollout-batch-size 64 --n-samples-per-prompt 4
  --ppo-mini-batch-size 64 --micro-batch-size 4 --ppo-epochs 1
  --lr 1e-6 --critic-lr 5e-6 --lr-warmup-iters 20 --clip-grad 1.0
  --clip-eps 0.2 --value-clip 0.2 --kl-coef 0.05 --kl-estimator k1 --gamma 1.0 --lam 0.95
  --temperature 1.0 --top-p 1.0
  --bf16 --recompute-granularity full
)

# example_flags EXAMPLE WORLD_SIZE: set FLAGS to the example's pretrain_rlhf.py flags on WORLD_SIZE ranks
# and OUT to its output directory.
example_flags() {
  local name=$1 world=$2
  local dir="$EXAMPLES/$name"
  if [[ -z $name || ! -f $dir/job.sh ]]; then
    local known
    known=$(cd "$EXAMPLES" && echo */job.sh | sed 's|/job.sh||g')
    echo "${name:+unknown example $name; }give an example as the first argument: $known" >&2
    return 2
  fi
  if [[ ! -f $dir/plan_$world.json ]]; then
    echo "example $name has no plan for $world ranks (it has: $(cd "$dir" && echo plan_*.json)); write" \
      "$dir/plan_$world.json and check it with DRY_RUN=1" >&2
    return 2
  fi
  local ACTOR_SHAPE CRITIC_SHAPE
  local -a PPO_FLAGS=("${DEFAULT_PPO_FLAGS[@]}")
  # shellcheck source=/dev/null
  source "$dir/job.sh"
  OUT=${OUT_DIR:-runs/$name}
  FLAGS=(--placement "$dir/plan_$world.json" "${PPO_FLAGS[@]}" --intra-stage-fusion)
  if [[ -f $dir/schedule_$world.json ]]; then
    FLAGS+=(--schedule "$dir/schedule_$world.json")
  fi
  FLAGS+=(--actor-model "${ACTOR_MODEL:-$EXAMPLES/models/$ACTOR_SHAPE.json}"
          --critic-model "${CRITIC_MODEL:-$EXAMPLES/models/$CRITIC_SHAPE.json}")
  local flag variable
  for flag in reference-model:REFERENCE_MODEL reward-model:REWARD_MODEL prompt-data:PROMPT_DATA \
              tokenizer:TOKENIZER reward-fn:REWARD_FN; do
    variable=${flag#*:}
    if [[ -n ${!variable:-} ]]; then
      FLAGS+=("--${flag%%:*}" "${!variable}")
    fi
  done
  if [[ -z ${REWARD_FN:-}${REWARD_MODEL:-}${PROMPT_DATA:-} ]]; then
    FLAGS+=(--reward-fn rlhf.data.synthetic:gold_reward)
  fi
  # --load is --save: a relaunch (a torchrun restart, a requeued job) continues from the newest checkpoint
  FLAGS+=(--save "$OUT/checkpoints" --load "$OUT/checkpoints" --save-interval 50 --metrics-file "$OUT/metrics.jsonl"
          --tensorboard-dir "$OUT/tensorboard" --no-progress)
}

# dry_run_if_asked WORLD_SIZE: with DRY_RUN=1, replace this shell by pretrain_rlhf.py --dry-run of FLAGS.
dry_run_if_asked() {
  if [[ ${DRY_RUN:-0} == 1 ]]; then
    exec "${PYTHON:-python}" "$ROOT/pretrain_rlhf.py" --dry-run --world-size "$1" "${FLAGS[@]}"
  fi
}

# launch COMMAND...: replace this shell by COMMAND... pretrain_rlhf.py FLAGS (COMMAND: a torchrun line).
launch() {
  mkdir -p "$OUT"
  exec "$@" "$ROOT/pretrain_rlhf.py" "${FLAGS[@]}"
}
