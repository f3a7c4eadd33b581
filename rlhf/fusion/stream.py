"""Streaming the long tail into inference: finished samples from the destinations to the freed ranks.

After the migration each destination instance (its TP rank 0) sends, every
k engine steps, the samples it finished since its last message (possibly
none) to every freed rank that infers, and a last message when it is done.
Each freed rank takes the messages in turns: one from each destination still
generating, in a fixed order. So every freed rank sees the same sequence of
batches, and the replicas of one inference task, which may span several
freed ranks, infer the same batches in the same order. Point-to-point only:
the destinations never wait for the freed ranks (isend), and a freed rank
busy inferring holds up no one.

The batch that arrives after every destination is done is not streamed:
generation is over, so every replica of every task infers it in the
trainer's last phase, as an unfused run would.

Messages: int64 [payload bytes, last] on ``platform.device()``, then the
payload, a pickle of a list of `SampleResult` (as the trainer's object
all-gathers carry samples between the ranks of one job).
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from rlhf import platform

HEADER, PAYLOAD = 0x5E00, 0x5E01
"""p2p tags of the two parts of a message."""


def _read(header: torch.Tensor, src: int) -> tuple[list, bool]:
    """The payload that follows ``header`` (received) from ``src``, unpickled; and the last flag."""
    size, last = header.tolist()
    if not size:
        return [], bool(last)
    body = torch.empty(size, dtype=torch.uint8, device=platform.device())
    dist.recv(body, src=src, tag=PAYLOAD)
    return pickle.loads(body.cpu().numpy().tobytes()), bool(last)


class StreamSender:
    """A destination's side: ``send(samples, last)`` every k steps (non-blocking), then ``close()``."""

    def __init__(self, receivers: list[int]):
        self.receivers, self._works = receivers, []

    def send(self, samples: list, last: bool) -> None:
        payload = pickle.dumps(samples) if samples else b""
        header = torch.tensor([len(payload), int(last)], dtype=torch.int64, device=platform.device())
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(platform.device()) if payload else None
        for dst in self.receivers:  # the tensors stay alive in _works until close()
            self._works.append((dist.isend(header, dst, tag=HEADER), header))
            if body is not None:
                self._works.append((dist.isend(body, dst, tag=PAYLOAD), body))

    def close(self) -> None:
        for work, _ in self._works:
            work.wait()
        self._works = []


def receive(sources: list[int], on_batch) -> None:
    """A freed rank's side: the destinations' (``sources``) messages in turns until each sent its last;
    every batch that arrives while a destination still generates goes to ``on_batch``."""
    active = list(sources)
    while active:
        for src in list(active):
            header = torch.empty(2, dtype=torch.int64, device=platform.device())
            dist.recv(header, src=src, tag=HEADER)
            samples, last = _read(header, src)
            if last:
                active.remove(src)
            if samples and active:  # once every destination is done, the last phase infers the rest
                on_batch(samples)
