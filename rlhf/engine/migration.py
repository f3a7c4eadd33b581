"""Sample migration: an unfinished sequence as plain data, and moving it between ranks.

`Engine.export_sequence` produces a `MigratedSequence` (tokens, log-probs so
far, sampling params, generator state and, optionally, this TP rank's K/V of
the computed positions); `Engine.import_sequence` continues it in another
engine. Without K/V the importer re-prefills the tokens; with K/V it
continues decoding at once (same TP degree and model needed on both sides:
each TP rank sends its own KV shard to the same TP rank on the other side).

On the wire (`send_sequence` / `recv_sequence`, torch.distributed p2p): an
int64 length, the pickled metadata as uint8, then the K/V tensor if any.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.engine.types import SamplingParams


@dataclass
class MigratedSequence:
    """Everything needed to continue one sample elsewhere.

    kv: [layers, 2, num_computed, local kv heads, head_dim] or None.
    """

    request_id: str
    sample_index: int
    prompt_len: int
    tokens: list[int]
    logprobs: list[float]
    params: SamplingParams
    generator_state: torch.Tensor
    num_computed: int
    kv: torch.Tensor | None = None

    def _meta(self) -> dict:
        meta = {k: getattr(self, k) for k in ("request_id", "sample_index", "prompt_len", "tokens", "logprobs",
                                              "params", "num_computed")}
        meta["generator_state"] = self.generator_state.tolist()
        meta["kv_shape"] = None if self.kv is None else (tuple(self.kv.shape), str(self.kv.dtype))
        return meta


def send_sequence(state: MigratedSequence, dst: int, group=None) -> None:
    """Send ``state`` to global rank ``dst`` (blocking)."""
    dev = platform.device()  # NCCL sends device tensors only
    payload = torch.frombuffer(bytearray(pickle.dumps(state._meta())), dtype=torch.uint8).to(dev)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=dev), dst, group=group)
    dist.send(payload, dst, group=group)
    if state.kv is not None:
        dist.send(state.kv.to(dev).contiguous(), dst, group=group)


def recv_sequence(src: int, group=None) -> MigratedSequence:
    """Receive a sequence sent by `send_sequence` from global rank ``src`` (K/V on this device)."""
    device = platform.device()
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)  # .item(): host needs the size
    dist.recv(payload, src, group=group)
    meta = pickle.loads(payload.cpu().numpy().tobytes())
    kv_shape = meta.pop("kv_shape")
    meta["generator_state"] = torch.tensor(meta["generator_state"], dtype=torch.uint8)
    state = MigratedSequence(**meta)
    if kv_shape is not None:
        shape, dtype = kv_shape
        kv = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=device)
        dist.recv(kv, src, group=group)
        state = replace(state, kv=kv)
    return state
