"""One micro-batch through a task's pipeline: forward only, or forward + backward.

The unscheduled building block: stage i receives hidden states from stage i-1
(a global peer rank from the task mesh, so reversed pipelines work), runs its
layers and passes them on; the last stage produces logits or values. The
fused and 1F1B schedules are run by the instruction executor instead.
"""

from __future__ import annotations

from typing import Callable

import torch

from rlhf.models.gpt import stage_forward
from rlhf.models.packing import PackedLayout, sequence_shape
from rlhf.parallel.groups import TaskGroups
from rlhf.pipeline.p2p import recv_backward, recv_forward, send_backward, send_forward


def _receive_input(model, groups: TaskGroups, input_ids: torch.Tensor, packed: PackedLayout | None = None):
    if groups.is_first_stage:
        return None
    s, b = sequence_shape(input_ids, packed)
    return recv_forward((s, b, model.config.hidden_size), model.config.params_dtype, input_ids.device,
                        groups.peer(-1))


def pipeline_forward(model, groups: TaskGroups, input_ids: torch.Tensor,
                     packed: PackedLayout | None = None) -> torch.Tensor | None:
    """Inference through the pipeline (``packed``: the samples as one packed row, stage_forward); the last
    stage returns its output, others None. Callers put the model in eval mode for the whole pass
    (rlhf.models.gpt.eval_mode: dropout off)."""
    with torch.no_grad():
        out = stage_forward(model, input_ids, _receive_input(model, groups, input_ids, packed), packed)
        if groups.is_last_stage:
            return out
        send_forward(out, groups.peer(+1))
        return None


def pipeline_forward_backward(model, groups: TaskGroups, input_ids: torch.Tensor,
                              loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """Forward and backward of one micro-batch; gradients accumulate in ``model``.

    ``loss_fn`` maps the last stage's output (logits [b, s, V/tp] or values
    [b, s]) to a scalar. Returns the loss on the last stage, None elsewhere.
    """
    x = _receive_input(model, groups, input_ids)
    out = stage_forward(model, input_ids, x)
    loss = None
    if groups.is_last_stage:
        loss = loss_fn(out)
        loss.backward()
    else:
        send_forward(out, groups.peer(+1))
        out.backward(recv_backward(out, groups.peer(+1)))
    if x is not None:
        send_backward(x.grad, groups.peer(-1))
    return loss
