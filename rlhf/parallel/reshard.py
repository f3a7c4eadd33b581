"""Move a model's weights between (mesh, strategy) layouts with point-to-point collectives.

Vocabulary: a *global name* (rlhf/models/naming.py) is a parameter's name in
the unsharded model; its *full* tensor is the unsharded one.
megatron splits a TP-parallel parameter along ``partition_dim`` into ``tp``
slices; with ``partition_stride`` k (SwiGLU's fc1 has k=2: [gate; up]) the full
dimension is k blocks, each split into tp parts, and a rank keeps its part of
every block::

    full fc1 rows:  [ gate_0 gate_1 | up_0 up_1 ]      (tp=2, k=2)
    tp rank 0:      [ gate_0 | up_0 ]    tp rank 1: [ gate_1 | up_1 ]

Fused QKV is laid out per query group, so its TP slices are contiguous along
dim 0 (stride 1) and need no special case. Non-TP parameters (norms, the value
head) are copied whole. A padded vocabulary (rlhf.models.vocab) is resharded
like any dimension: both layouts must be built with the same padded size.

Resharding computes, on every participating rank, the same plan of transfers
(parameter, source rank, destination rank, overlapping ranges) and posts the
matching isend/irecv pairs, tagged by parameter index, so every pair of ranks
sees messages in one global order (no deadlock, no file round trip).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf.models.naming import named_global_parameters, owning_stage
from rlhf.models.vocab import fit_vocab_rows
from rlhf.parallel.groups import TaskGroups


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split across TP ranks."""

    tp: int
    dim: int = 0
    stride: int = 1
    parallel: bool = True

    @classmethod
    def of(cls, param: torch.Tensor, tp: int) -> "ShardSpec":
        if not getattr(param, "tensor_model_parallel", False):
            return cls(tp=tp, parallel=False)
        return cls(tp=tp, dim=param.partition_dim, stride=getattr(param, "partition_stride", 1))

    def with_tp(self, tp: int) -> "ShardSpec":
        return ShardSpec(tp=tp, dim=self.dim, stride=self.stride, parallel=self.parallel)

    def full_size(self, local: torch.Tensor) -> int:
        return local.shape[self.dim] * (self.tp if self.parallel else 1)


def shard_ranges(spec: ShardSpec, full_size: int, tp_rank: int) -> list[tuple[int, int, int]]:
    """(start in full tensor, start in local shard, length) pieces of TP rank ``tp_rank``."""
    if not spec.parallel or spec.tp == 1:
        return [(0, 0, full_size)]
    block = full_size // spec.stride
    part = block // spec.tp
    return [(j * block + tp_rank * part, j * part, part) for j in range(spec.stride)]


def full_to_shard(full: torch.Tensor, spec: ShardSpec, tp_rank: int) -> torch.Tensor:
    """Slice a full tensor down to TP rank ``tp_rank``'s shard."""
    pieces = [full.narrow(spec.dim, s, n) for s, _, n in shard_ranges(spec, full.shape[spec.dim], tp_rank)]
    return torch.cat(pieces, dim=spec.dim)


def shards_to_full(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Reassemble the full tensor from the shards of all TP ranks (in TP order)."""
    if not spec.parallel or len(shards) == 1:
        return shards[0]
    k = spec.stride
    blocks = [list(s.chunk(k, dim=spec.dim)) for s in shards]
    return torch.cat([blocks[t][j] for j in range(k) for t in range(len(shards))], dim=spec.dim)


def shard_overlaps(src: ShardSpec, src_rank: int, dst: ShardSpec, dst_rank: int, full_size: int):
    """Pieces (src local start, dst local start, length) that src shard sends to dst shard."""
    out = []
    for s_full, s_loc, s_len in shard_ranges(src, full_size, src_rank):
        for d_full, d_loc, d_len in shard_ranges(dst, full_size, dst_rank):
            lo, hi = max(s_full, d_full), min(s_full + s_len, d_full + d_len)
            if lo < hi:
                out.append((s_loc + lo - s_full, d_loc + lo - d_full, hi - lo))
    return out


def _source_rank(src_mesh, stage: int, src_tp: int, dst_rank: int) -> int:
    """The src replica that serves ``dst_rank``: itself when colocated, else spread by rank."""
    candidates = [src_mesh.rank(stage, d, src_tp) for d in range(src_mesh.strategy.dp)]
    return dst_rank if dst_rank in candidates else candidates[dst_rank % len(candidates)]


@dataclass(frozen=True)
class _Layouts:
    """Both layouts of one reshard, as every participating rank sees them."""

    src_mesh: object
    dst_mesh: object
    num_layers: int

    def src_tp_serving(self, spec: ShardSpec, dst_rank: int) -> list[int]:
        """Source TP indices whose shards a destination rank reads."""
        s_tp = self.src_mesh.strategy.tp
        return list(range(s_tp)) if spec.parallel else [self.dst_mesh.coord(dst_rank).tp % s_tp]

    def src_rank(self, name: str, src_tp: int, dst_rank: int) -> int:
        stage = owning_stage(name, self.num_layers, self.src_mesh.strategy.pp)
        return _source_rank(self.src_mesh, stage, src_tp, dst_rank)

    def dst_ranks(self, name: str) -> list[int]:
        m = self.dst_mesh
        stage = owning_stage(name, self.num_layers, m.strategy.pp)
        return [m.rank(stage, d, t) for d in range(m.strategy.dp) for t in range(m.strategy.tp)]


def _sends(lay: _Layouts, params: dict, my_tp: int, me: int) -> list:
    """isend ops carrying this rank's overlapping ranges to every destination it serves."""
    ops = []
    s_tp, d_tp = lay.src_mesh.strategy.tp, lay.dst_mesh.strategy.tp
    for name, param in params.items():
        spec = ShardSpec.of(param, s_tp)
        for dst_rank in lay.dst_ranks(name):
            if dst_rank == me or my_tp not in lay.src_tp_serving(spec, dst_rank):
                continue
            if lay.src_rank(name, my_tp, dst_rank) != me:
                continue
            ranges = shard_overlaps(spec, my_tp, spec.with_tp(d_tp), lay.dst_mesh.coord(dst_rank).tp,
                                    spec.full_size(param))
            if ranges:
                payload = torch.cat([param.data.narrow(spec.dim, s, n) for s, _, n in ranges], dim=spec.dim)
                ops.append(dist.P2POp(dist.isend, payload.contiguous(), dst_rank, tag=_tag(name)))
    return ops


def _recvs(lay: _Layouts, params: dict, local_src: dict, my_tp: int, me: int) -> tuple[list, list]:
    """irecv ops (and where to unpack them) for this rank's shards; local ranges copied directly."""
    ops, unpack = [], []
    s_tp, d_tp = lay.src_mesh.strategy.tp, lay.dst_mesh.strategy.tp
    for name, param in params.items():
        spec = ShardSpec.of(param, d_tp)
        for src_tp in lay.src_tp_serving(spec, me):
            ranges = shard_overlaps(spec.with_tp(s_tp), src_tp, spec, my_tp, spec.full_size(param))
            if not ranges:
                continue
            src_rank = lay.src_rank(name, src_tp, me)
            if src_rank == me:
                for s_loc, d_loc, n in ranges:
                    param.data.narrow(spec.dim, d_loc, n).copy_(local_src[name].data.narrow(spec.dim, s_loc, n))
                continue
            shape = list(param.shape)
            shape[spec.dim] = sum(n for _, _, n in ranges)
            buffer = torch.empty(shape, dtype=param.dtype, device=param.device)
            ops.append(dist.P2POp(dist.irecv, buffer, src_rank, tag=_tag(name)))
            unpack.append((name, param, spec.dim, ranges, buffer))
    return ops, unpack


@torch.no_grad()
def reshard(src_mesh, src: tuple, dst_mesh, dst: tuple, num_layers: int,
            src_params: dict | None = None) -> dict[str, int]:
    """Copy weights of the model laid out on ``src_mesh`` into the one on ``dst_mesh``.

    ``src`` / ``dst`` are this rank's ``(TaskGroups, model)`` in each layout, or
    ``(None, None)`` where the rank is not in that mesh. Every rank of either
    mesh must call this; others need not. Each destination shard receives only
    the overlapping ranges from one source replica per source TP shard.

    Both sides order a pair's messages by the model's parameter order and post
    them in one batch, so the exchange cannot deadlock even where messages are
    matched by order rather than tag (NCCL).

    ``src_params``: what the source sends instead of its model's parameters, by global name (tensors with
    the parameters' TP attributes; a LoRA model's merged weights, rlhf.models.lora.merged_parameters).

    Returns the bytes this rank received from other ranks, by global parameter
    name (local copies are free; rlhf.planner.reshard_bytes predicts them).
    """
    me = dist.get_rank()
    lay = _Layouts(src_mesh, dst_mesh, num_layers)
    (src_groups, src_model), (dst_groups, dst_model) = src, dst
    if src_params is None:
        src_params = named_global_parameters(src_model) if src_model is not None else {}
    ops = _sends(lay, src_params, src_groups.tp_rank, me) if src_model is not None else []
    unpack = []
    if dst_model is not None:
        recv_ops, unpack = _recvs(lay, named_global_parameters(dst_model), src_params, dst_groups.tp_rank, me)
        ops += recv_ops
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    received: dict[str, int] = {}
    for name, param, dim, ranges, buffer in unpack:
        offset = 0
        for _, d_loc, n in ranges:
            param.data.narrow(dim, d_loc, n).copy_(buffer.narrow(dim, offset, n))
            offset += n
        received[name] = received.get(name, 0) + buffer.numel() * buffer.element_size()
    return received


def _tag(name: str) -> int:
    """Message tag for a parameter: the same on sender and receiver, distinct per name."""
    return zlib.crc32(name.encode()) & 0x7FFFFFF


@torch.no_grad()
def load_full_weights(model: torch.nn.Module, groups: TaskGroups, full: dict[str, torch.Tensor],
                      names=None) -> None:
    """Fill this stage's shards from a full (unsharded) state dict keyed by global name.

    Vocabulary parameters may come without the model's padded rows (rlhf.models.vocab): they get zeros.
    ``names``: fill only the parameters whose global name it holds (default: every parameter of the stage;
    LoRA adapters are loaded apart from their base).
    """
    tp = groups.mesh.strategy.tp
    for name, param in named_global_parameters(model).items():
        if names is not None and name not in names:
            continue
        if name not in full:
            raise KeyError(f"full state dict has no tensor {name!r} needed by this stage")
        spec = ShardSpec.of(param, tp)
        shape = list(param.shape)
        shape[spec.dim] = spec.full_size(param)
        tensor = fit_vocab_rows(name, full[name], shape[0])
        if list(tensor.shape) != shape:
            raise ValueError(f"full tensor {name!r} has shape {list(full[name].shape)}; the model's unsharded "
                             f"shape is {shape} (vocabulary rows may be fewer: padding is added)")
        param.data.copy_(full_to_shard(tensor, spec, groups.tp_rank))


@torch.no_grad()
def gather_tp_full(local: torch.Tensor, spec: ShardSpec, tp_group) -> torch.Tensor:
    """The full tensor of TP shard ``local`` (a parameter, its gradient or an optimizer moment).

    Collective over ``tp_group`` for TP-parallel tensors; a copy otherwise.
    """
    local = local.detach().contiguous()
    if not spec.parallel or spec.tp == 1:
        return local.clone()
    shards = [torch.empty_like(local) for _ in range(spec.tp)]
    dist.all_gather(shards, local, group=tp_group)
    return shards_to_full(shards, spec)


def gather_tp_full_weights(model: torch.nn.Module, groups: TaskGroups, grads: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors of this stage's parameters (or their gradients), all-gathered over TP, padded
    vocabulary rows included (``rlhf.models.vocab.drop_vocab_padding`` cuts them)."""
    tp = groups.mesh.strategy.tp
    return {name: gather_tp_full(param.grad if grads else param.data, ShardSpec.of(param, tp), groups.tp)
            for name, param in named_global_parameters(model).items()}
