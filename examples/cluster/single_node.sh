#!/usr/bin/env bash
# One node: torchrun --standalone on its GPUs (8 unless GPUS_PER_NODE says otherwise).
#
#   examples/cluster/single_node.sh EXAMPLE [more pretrain_rlhf.py flags]
#   DRY_RUN=1 examples/cluster/single_node.sh llama2-7b-7b     # check the launch on any machine
#
# EXAMPLE: llama2-7b-7b or llama2-13b-7b (directories beside this script); the models, data and output
# come from the environment (common.sh, docs/launch.md). Later flags override the example's.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
# shellcheck source=examples/cluster/common.sh
source "$ROOT/examples/cluster/common.sh"

NPROC=${GPUS_PER_NODE:-8}
example_flags "${1:-}" "$NPROC"
shift
FLAGS+=("$@")
dry_run_if_asked "$NPROC"

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# a rank that dies restarts every rank (at most MAX_RESTARTS times), which continue from the newest checkpoint
launch torchrun --standalone --nproc-per-node="$NPROC" --max-restarts="${MAX_RESTARTS:-2}"
