"""One micro-batch through this rank's pipeline stage, for tests that drive a model by hand."""

from __future__ import annotations

import torch

from rlhf.models.gpt import stage_forward
from rlhf.pipeline.p2p import recv_forward, send_forward


def stage_pass(model, groups, ids: torch.Tensor, hidden_size: int) -> tuple:
    """Receive this stage's input (not on the first stage), run it, send the output on (not on the last).
    ``ids`` [b, s]; returns (the received input [s, b, hidden] or None, the stage's output)."""
    x = None
    if not groups.is_first_stage:
        x = recv_forward((ids.shape[1], ids.shape[0], hidden_size), torch.float32, "cpu", groups.peer(-1))
    out = stage_forward(model, ids, x)
    if not groups.is_last_stage:
        send_forward(out, groups.peer(+1))
    return x, out
