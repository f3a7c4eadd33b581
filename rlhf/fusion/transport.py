"""Moving one unfinished sample (`MigratedSequence`) between ranks in a fixed, versioned layout.

The metadata is not a pickle: a receiver never runs code from a message, and a
message from another build, or a cut one, is refused with an error naming
the sample instead of failing somewhere later. Layout (little-endian)::

    "RLHFMIG1"                         8-byte magic
    int64 x 18 header                  HEADER_FIELDS, in order
    request_id                         UTF-8, request_id_bytes
    tokens                             int64 x num_tokens (prompt + generated)
    logprobs                           float64 x num_logprobs
    params                             UTF-8 JSON of SamplingParams, params_bytes

On the wire (torch.distributed p2p, tensors on `platform.device()`)::

    sender                              receiver
    int64 [message bytes]   ------->
    uint8 [message]         ------->    decode and check
                            <-------    int64 [1 accepted | 0 refused]
    K/V (if any, accepted)  ------->
    routing (if any)        ------->    (beside the K/V: only with them)

A refused message raises `MigrationFormatError` on the receiver (naming the
sample and the source rank) and `MigrationRefused` on the sender, which still
holds the sample and keeps it (import it back into its own engine): no
sample is dropped. K/V travel only once the metadata is accepted.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.engine.migration import MigratedSequence
from rlhf.engine.types import SamplingParams

MAGIC = b"RLHFMIG1"
VERSION = 3  # 2: the routing record beside the K/V; 3: no generator state (the draws need none, rlhf.engine.sampler)
HEADER_FIELDS = ("version", "sample_index", "prompt_len", "num_tokens", "num_logprobs", "num_computed",
                 "request_id_bytes", "params_bytes", "kv_dtype",
                 "kv_layers", "kv_two", "kv_positions", "kv_heads", "kv_head_dim",
                 "routing_dtype", "routing_positions", "routing_layers", "routing_k")
_HEADER = struct.Struct(f"<8s{len(HEADER_FIELDS)}q")
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""K/V dtypes by their code in the header (-1: no K/V)."""
ROUTING_DTYPES = (torch.int16, torch.int32)
"""Routing record dtypes by their code in the header (-1: no routing)."""
TensorSpec = tuple[tuple[int, ...], torch.dtype]
"""(shape, dtype) of a tensor that follows an accepted message."""


class MigrationFormatError(ValueError):
    """A migration message this build cannot read; ``request_id`` / ``sample_index`` name the sample when known."""

    def __init__(self, message: str, request_id: str | None = None, sample_index: int | None = None):
        super().__init__(message)
        self.request_id, self.sample_index = request_id, sample_index


class MigrationRefused(RuntimeError):
    """The destination refused a sample's message; the sender still holds the sample."""


def encode_sequence(state: MigratedSequence) -> bytes:
    """The metadata of ``state`` (everything but the K/V and routing tensors) in the versioned layout."""
    rid = state.request_id.encode()
    params = json.dumps(dataclasses.asdict(state.params), sort_keys=True).encode()
    kv = state.kv
    if kv is not None and (kv.dim() != 5 or kv.dtype not in KV_DTYPES):
        raise ValueError(f"K/V of sample {state.sample_index} of {state.request_id!r} is {kv.dtype} "
                         f"{tuple(kv.shape)}; want [layers, 2, positions, kv heads, head_dim] in one of {KV_DTYPES}")
    routing = state.routing if kv is not None else None  # without K/V the importer computes it again
    if routing is not None and (routing.dim() != 3 or routing.dtype not in ROUTING_DTYPES
                                or routing.shape[0] != kv.shape[2]):
        raise ValueError(f"routing of sample {state.sample_index} of {state.request_id!r} is {routing.dtype} "
                         f"{tuple(routing.shape)}; want [positions ({kv.shape[2]}, as the K/V), layers, k] in one "
                         f"of {ROUTING_DTYPES}")
    kv_fields = (-1, 0, 0, 0, 0, 0) if kv is None else (KV_DTYPES.index(kv.dtype), *kv.shape)
    routing_fields = (-1, 0, 0, 0) if routing is None else (ROUTING_DTYPES.index(routing.dtype), *routing.shape)
    header = _HEADER.pack(MAGIC, VERSION, state.sample_index, state.prompt_len, len(state.tokens),
                          len(state.logprobs), state.num_computed, len(rid), len(params), *kv_fields,
                          *routing_fields)
    return b"".join((header, rid, struct.pack(f"<{len(state.tokens)}q", *state.tokens),
                     struct.pack(f"<{len(state.logprobs)}d", *state.logprobs), params))


def decode_sequence(data: bytes) -> tuple[MigratedSequence, TensorSpec | None, TensorSpec | None]:
    """The sample in ``data`` (K/V and routing left None), its K/V's (shape, dtype) or None, and its
    routing's (shape, dtype) or None.

    Raises `MigrationFormatError` if ``data`` is cut, corrupt or from another version.
    """
    if len(data) < _HEADER.size:
        raise MigrationFormatError(f"truncated migration message: {len(data)} bytes, the header alone is "
                                   f"{_HEADER.size}")
    magic, *values = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise MigrationFormatError(f"not a migration message (magic {magic!r}, want {MAGIC!r})")
    h = dict(zip(HEADER_FIELDS, values))
    rid_end = _HEADER.size + h["request_id_bytes"]
    rid = data[_HEADER.size:rid_end].decode(errors="replace") if len(data) >= rid_end else None
    where = f"sample {h['sample_index']} of request {rid!r}"
    if h["version"] != VERSION:
        raise MigrationFormatError(f"migration message for {where} is version {h['version']}; this build reads "
                                   f"version {VERSION} only (run the same build on every rank)", rid,
                                   h["sample_index"])
    sizes = (h["request_id_bytes"], 8 * h["num_tokens"], 8 * h["num_logprobs"], h["params_bytes"])
    if min(sizes) < 0 or _HEADER.size + sum(sizes) != len(data):
        raise MigrationFormatError(f"truncated or corrupt migration message for {where}: {len(data)} bytes, its "
                                   f"header describes {_HEADER.size + sum(sizes)}", rid, h["sample_index"])
    at = rid_end
    tokens = list(struct.unpack_from(f"<{h['num_tokens']}q", data, at))
    at += sizes[1]
    logprobs = list(struct.unpack_from(f"<{h['num_logprobs']}d", data, at))
    at += sizes[2]
    try:
        params = SamplingParams(**json.loads(data[at:].decode()))
    except (ValueError, TypeError) as e:  # bad JSON, unknown field, invalid value
        raise MigrationFormatError(f"migration message for {where} has unreadable sampling params: {e}", rid,
                                   h["sample_index"]) from e
    state = MigratedSequence(rid, h["sample_index"], h["prompt_len"], tokens, logprobs, params, h["num_computed"])
    try:
        kv = _spec(h, "kv", KV_DTYPES, ("layers", "two", "positions", "heads", "head_dim"))
        routing = _spec(h, "routing", ROUTING_DTYPES, ("positions", "layers", "k"))
        if routing is not None and (kv is None or routing[0][0] != kv[0][2]):
            raise ValueError(f"routing of {routing[0][0]} positions with K/V of {kv[0][2] if kv else 'no'} positions")
    except ValueError as e:
        raise MigrationFormatError(f"corrupt migration message for {where}: {e}", rid, h["sample_index"]) from e
    return state, kv, routing


def _spec(h: dict, name: str, dtypes: tuple, dims: tuple[str, ...]) -> TensorSpec | None:
    """(shape, dtype) of the tensor ``name`` the header ``h`` announces, or None (dtype code -1); ValueError
    for an unknown dtype code or a negative size."""
    code, shape = h[f"{name}_dtype"], tuple(h[f"{name}_{d}"] for d in dims)
    if code < 0:
        return None
    if code >= len(dtypes) or min(shape) < 0:
        raise ValueError(f"{name} dtype code {code}, shape {shape}")
    return shape, dtypes[code]


def send_encoded(data: bytes, kv: torch.Tensor | None, dst: int, group=None,
                 routing: torch.Tensor | None = None) -> bool:
    """Send an encoded message to global rank ``dst``, then its K/V and routing (as the message announces
    them) if accepted; whether it was accepted."""
    dev = platform.device()  # NCCL sends device tensors only
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=dev), dst, group=group)
    dist.send(payload, dst, group=group)
    ack = torch.empty(1, dtype=torch.int64, device=dev)
    dist.recv(ack, dst, group=group)
    accepted = bool(ack.item())  # .item(): the host decides whether K/V follow
    if accepted and kv is not None:
        dist.send(kv.to(dev).contiguous(), dst, group=group)
        if routing is not None:
            dist.send(routing.to(dev).contiguous(), dst, group=group)
    return accepted


def send_sequence(state: MigratedSequence, dst: int, group=None) -> int:
    """Send ``state`` to global rank ``dst`` (blocking); the bytes sent.

    Raises `MigrationRefused` if ``dst`` refuses it (the caller keeps ``state``).
    """
    data = encode_sequence(state)
    if not send_encoded(data, state.kv, dst, group, state.routing):
        raise MigrationRefused(f"rank {dst} refused sample {state.sample_index} of {state.request_id!r}; "
                               "it stays with the sender")
    if state.kv is None:
        return len(data)
    return len(data) + sum(t.numel() * t.element_size() for t in (state.kv, state.routing) if t is not None)


def recv_sequence(src: int, group=None) -> MigratedSequence:
    """Receive a sequence sent by `send_sequence` from global rank ``src`` (K/V and routing on this device).

    Raises `MigrationFormatError` naming the sample and ``src`` (after telling
    the sender, who keeps the sample) if the message cannot be read.
    """
    dev = platform.device()
    size = torch.empty(1, dtype=torch.int64, device=dev)
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)  # .item(): host needs the size
    dist.recv(payload, src, group=group)
    try:
        state, *specs = decode_sequence(payload.cpu().numpy().tobytes())
    except MigrationFormatError as e:
        dist.send(torch.zeros(1, dtype=torch.int64, device=dev), src, group=group)
        raise MigrationFormatError(f"from rank {src}: {e}", e.request_id, e.sample_index) from e
    dist.send(torch.ones(1, dtype=torch.int64, device=dev), src, group=group)
    kv, routing = (None if spec is None else torch.empty(spec[0], dtype=spec[1], device=dev) for spec in specs)
    for t in (kv, routing):
        if t is not None:
            dist.recv(t, src, group=group)
    return dataclasses.replace(state, kv=kv, routing=routing)
