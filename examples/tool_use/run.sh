#!/usr/bin/env bash
# GRPO on SmolLM2-135M-Instruct as a calculator agent, 4 CPU ranks (docs/agents.md).
#
# The agent (examples/tool_use/calculator_agent.py:solve) is a plain program on the openai client;
# pretrain_rlhf.py --agent runs it once per sample against the per-episode endpoint of the engine,
# trains the tokens the model generated (the tool results are holes in the loss mask) and rewards an
# exact final answer. Writes runs/tool_use/: prompts.jsonl, metrics.jsonl, tb/, reward.png (the reward
# and the tool-call rate, multi_turn_fraction, per iteration), summary.json.
#
# Environment: PYTHON (default .venv/bin/python), OUT (default runs/tool_use), ITERS (default 12).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/tool_use}
ITERS=${ITERS:-12}

MODEL=$("$PY" -c "from rlhf.checkpoint.gguf import smollm2_hf_dir; print(smollm2_hf_dir())" | tail -n 1)
echo "model: $MODEL"
mkdir -p "$OUT"
"$PY" examples/tool_use/calculator_agent.py --out "$OUT/prompts.jsonl" --count 256

"$PY" examples/smollm2/run_job.py --out "$OUT" -- --actor-model "$MODEL" --prompt-data "$OUT/prompts.jsonl" \
    --agent examples.tool_use.calculator_agent:solve --max-turns 3 --max-turn-tokens 24 \
    --max-prompt-len 160 --max-response-len 72 --placement examples/smollm2/placement_grpo.json \
    --advantage-estimator grpo --rollout-batch-size 8 --n-samples-per-prompt 4 --ppo-mini-batch-size 16 \
    --micro-batch-size 4 --temperature 0.7 --lr 1e-5 --seed 1 --iterations "$ITERS"
"$PY" tools/plot_metrics.py --metrics "$OUT/metrics.jsonl" --out "$OUT/reward.png" \
    --keys reward_mean multi_turn_fraction --window 3 --title "SmolLM2-135M-Instruct calculator agent, GRPO"
echo "plot: $OUT/reward.png; TensorBoard: tensorboard --logdir $OUT"
