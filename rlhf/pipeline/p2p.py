"""Point-to-point transfers between pipeline stages: one primitive, named wrappers.

Peers are global ranks taken from the task mesh (so reversed pipelines work);
activations travel forward as [s, b, h] tensors, their gradients backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def communicate(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    """Post all sends and receives at once, then wait for all of them.

    Posting both directions before waiting lets two stages exchange tensors
    without either blocking the other.
    """
    requests = [dist.isend(t.contiguous(), peer) for t, peer in sends]
    requests += [dist.irecv(t, peer) for t, peer in recvs]
    for request in requests:
        request.wait()


def send_forward(activation: torch.Tensor, peer: int) -> None:
    communicate([(activation.detach(), peer)], [])


def recv_forward(shape, dtype: torch.dtype, device, peer: int) -> torch.Tensor:
    """Receive the previous stage's activation as a leaf that collects its gradient."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    communicate([], [(buffer, peer)])
    return buffer.requires_grad_()


def send_backward(grad: torch.Tensor, peer: int) -> None:
    communicate([(grad, peer)], [])


def recv_backward(like: torch.Tensor, peer: int) -> torch.Tensor:
    buffer = torch.empty_like(like)
    communicate([], [(buffer, peer)])
    return buffer
