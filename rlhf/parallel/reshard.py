"""Move a model's weights between (mesh, strategy) layouts with point-to-point collectives.

Vocabulary: a *global name* (rlhf/models/naming.py) is a parameter's name in
the unsharded model; its *full* tensor is the unsharded one. How megatron
slices a parameter over TP ranks is rlhf/models/sharding.py's.

Fused QKV is laid out per query group, so its TP slices are contiguous along
dim 0 (stride 1) and need no special case. Non-TP parameters (norms, the value
head) are copied whole. A mixture of experts' routed experts are whole tensors
held by the ranks of one expert-parallel index (rlhf/models/naming.py's
``expert_owner``): each goes only to the ranks that hold it. A padded vocabulary (rlhf.models.vocab) is resharded
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

from rlhf.models.naming import expert_index, expert_owner, named_global_parameters, owning_stage
from rlhf.models.sharding import ShardSpec, full_to_shard, shard_overlaps, shards_to_full
from rlhf.models.vocab import fit_vocab_rows
from rlhf.parallel.groups import TaskGroups


def _holders(mesh, stage: int, tp: int, owner: int | None) -> list[int]:
    """Ranks of ``mesh`` at ``stage`` and TP index ``tp`` holding a parameter: every replica's, or for a routed
    expert those whose expert-parallel rank is its ``owner``."""
    return [mesh.rank(stage, d, tp) for d in range(mesh.strategy.dp)
            if owner is None or mesh.ep_index(stage, d, tp) == owner]


def _source_rank(candidates: list[int], dst_rank: int) -> int:
    """The src replica that serves ``dst_rank``: itself when colocated, else spread by rank."""
    return dst_rank if dst_rank in candidates else candidates[dst_rank % len(candidates)]


@dataclass(frozen=True)
class _Layouts:
    """Both layouts of one reshard, as every participating rank sees them."""

    src_mesh: object
    dst_mesh: object
    num_layers: int
    num_experts: int

    def src_tp_serving(self, spec: ShardSpec, dst_rank: int) -> list[int]:
        """Source TP indices whose shards a destination rank reads."""
        s_tp = self.src_mesh.strategy.tp
        return list(range(s_tp)) if spec.parallel else [self.dst_mesh.coord(dst_rank).tp % s_tp]

    def _owner(self, name: str, mesh) -> int | None:
        return expert_owner(name, self.num_experts, mesh.strategy.ep) if self.num_experts else None

    def src_rank(self, name: str, src_tp: int, dst_rank: int) -> int:
        m = self.src_mesh
        stage = owning_stage(name, self.num_layers, m.strategy.pp)
        return _source_rank(_holders(m, stage, src_tp, self._owner(name, m)), dst_rank)

    def dst_ranks(self, name: str) -> list[int]:
        m = self.dst_mesh
        stage = owning_stage(name, self.num_layers, m.strategy.pp)
        return [r for t in range(m.strategy.tp) for r in _holders(m, stage, t, self._owner(name, m))]


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
            src_params: dict | None = None, num_experts: int = 0) -> dict[str, int]:
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
    ``num_experts``: a mixture of experts' routed experts (0: dense), each sent only to the ranks of the
    destination's expert-parallel rank that holds it.

    Returns the bytes this rank received from other ranks, by global parameter
    name (local copies are free; rlhf.planner.reshard_bytes predicts them).
    """
    me = dist.get_rank()
    lay = _Layouts(src_mesh, dst_mesh, num_layers, num_experts)
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
    vocabulary rows included (``rlhf.models.vocab.drop_vocab_padding`` cuts them); with expert parallelism
    every expert of the stage, all-gathered over the EP group too."""
    tp = groups.mesh.strategy.tp
    out = {name: gather_tp_full(param.grad if grads else param.data, ShardSpec.of(param, tp), groups.tp)
           for name, param in named_global_parameters(model).items()}
    ep_group = groups.pg_collection.ep
    if ep_group.size() > 1:
        out.update(gather_experts(out, ep_group))
    return out


def gather_experts(local: dict[str, torch.Tensor], ep_group) -> dict[str, torch.Tensor]:
    """Every expert's tensors from the local ones (global names; other names are ignored) of each rank of
    ``ep_group`` (collective over it): EP rank r holds experts r * n .. r * n + n - 1, in the same order on
    every rank."""
    names = [n for n in local if expert_index(n) is not None]
    first = min(expert_index(n) for n in names)
    per_rank = max(expert_index(n) for n in names) - first + 1
    out = {}
    for name in names:
        parts = [torch.empty_like(local[name]) for _ in range(ep_group.size())]
        dist.all_gather(parts, local[name].contiguous(), group=ep_group)
        offset = expert_index(name) - first
        for r, part in enumerate(parts):
            out[name.replace(f".local_experts.{first + offset}.", f".local_experts.{r * per_rank + offset}.")] = part
    return out
