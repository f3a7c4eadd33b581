"""Point-to-point transfers between pipeline stages: one primitive, named wrappers.

Peers are global ranks taken from the task mesh (so reversed pipelines work);
activations travel forward as [s, b, h] tensors, their gradients backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def communicate(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                tag: int = 0, wait: bool = True) -> list:
    """Post all sends and receives at once, then (``wait``) wait for all of them.

    Posting both directions before waiting lets two stages exchange tensors
    without either blocking the other. With ``wait=False`` the pending
    requests are returned for the caller to wait on. ``tag`` tells apart
    messages between the same pair of ranks.
    """
    requests = [dist.isend(t.contiguous(), peer, tag=tag) for t, peer in sends]
    requests += [dist.irecv(t, peer, tag=tag) for t, peer in recvs]
    if not wait:
        return requests
    wait_all(requests)
    return []


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


def post_send(tensor: torch.Tensor, peer: int, tag: int) -> list:
    """Start sending ``tensor`` (kept alive by the request); returns the requests to wait on."""
    return communicate([(tensor.detach(), peer)], [], tag=tag, wait=False)


def post_recv(buffer: torch.Tensor, peer: int, tag: int) -> list:
    """Start receiving the next message from ``peer`` under ``tag`` into ``buffer``;
    returns the requests to wait on (:func:`wait_all`)."""
    return communicate([], [(buffer, peer)], tag=tag, wait=False)


def wait_all(requests: list) -> None:
    for request in requests:
        request.wait()
