#!/usr/bin/env bash
# Write the fused actor/critic schedules of the cluster examples (<example>/schedule_<N>.json) with
# tools/search_schedule.py: run it again after changing an example's plan, --ppo-mini-batch-size or
# --micro-batch-size, then check with DRY_RUN=1 (docs/launch.md).
#
# A schedule must match its plan: per training model, pp, direction (reverse_pp: up) and the pipelines a
# fused stage group runs (pp of the longer pipeline / pp of the shorter). mb is the micro-batches of one
# copy of the fused pipeline (gpus / (fused stages x tp) copies): ppo_mini_batch_size / micro_batch_size /
# copies; 64 / 4 = 16 here. Stage times come from the FLOP cost model with 4 samples x 1024 tokens per
# micro-batch; only their ratios shape the schedule.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE="$ROOT/examples/cluster"
L7=layers=32,hidden=4096,ffn=11008,heads=32
L13=layers=40,hidden=5120,ffn=13824,heads=40

search() {  # search OUT GPUS ACTOR CRITIC
  "${PYTHON:-python}" "$ROOT/tools/search_schedule.py" --gpus "$2" \
    --model "name=actor,$3,direction=down" --model "name=critic,$4,direction=up" \
    --tokens 4096 --seq-len 1024 --mem-cap 1.25x --budget 5 --memory-budget 2 --out "$1"
}

search "$HERE/llama2-7b-7b/schedule_8.json" 8 "$L7,tp=2,pp=4,mb=16" "$L7,tp=2,pp=4,mb=16"
search "$HERE/llama2-7b-7b/schedule_16.json" 16 "$L7,tp=2,pp=4,mb=8" "$L7,tp=2,pp=4,mb=8"
search "$HERE/llama2-13b-7b/schedule_8.json" 8 "$L13,tp=2,pp=4,mb=16" "$L7,tp=2,pp=4,mb=16"
search "$HERE/llama2-13b-7b/schedule_16.json" 16 "$L13,tp=2,pp=8,mb=16" "$L7,tp=2,pp=4,mb=16"
