"""3-rank scenario for tests/test_smollm2.py: the real SmolLM2-135M-Instruct, sharded two ways.

The HF directory converted from its GGUF is loaded with ``load_hf_weights``
at TP3 (ranks 0-2: its 9 heads and 3 KV heads admit tp 1 or 3, not 2) and
at PP2 (ranks 0-1, 15 layers a stage), one layout after the other, and runs
one forward pass of the parent's token ids. Each rank of a last stage returns
the max abs difference between its vocabulary slice of the logits and the same
columns of transformers' logits (computed by the parent).
"""

import gc

import torch
import torch.distributed as dist

from rlhf.checkpoint.hf import load_hf_weights, read_hf_config
from rlhf.models.gpt import build_model
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.pipeline.microbatch import pipeline_forward

PLAN = {"actor_train": {"ranks": "0-2", "tp": 3}, "critic_train": {"ranks": "0-1", "pp": 2}}
LAYOUTS = {"tp3": "actor_train", "pp2": "critic_train"}


def _logit_error(hf_dir: str, groups, ids: torch.Tensor, expected: torch.Tensor) -> float | None:
    """Max abs error of this rank's logit columns; None off the last stage."""
    cfg = read_hf_config(hf_dir).config
    model = build_model(cfg, "lm", groups.pg_collection, groups.stage, seed=0)
    load_hf_weights(model, groups, hf_dir)
    out = pipeline_forward(model.eval(), groups, ids)
    if out is None:
        return None
    start = groups.tp_rank * out.shape[-1]
    return (out - expected[..., start:start + out.shape[-1]]).abs().max().item()


def run(hf_dir: str, ids: torch.Tensor, expected: torch.Tensor) -> dict:
    groups = build_task_groups(Placement.from_plan(PLAN, dist.get_world_size()))
    errors = {}
    for layout, task in LAYOUTS.items():
        if groups[task] is not None:
            err = _logit_error(hf_dir, groups[task], ids, expected)
            if err is not None:
                errors[layout] = err
        gc.collect()  # one layout's model at a time
        dist.barrier()
    return errors
