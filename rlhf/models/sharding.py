"""How megatron splits a parameter over tensor-parallel ranks, read from its attributes, and the slicing
that follows: a full tensor to a rank's shard, shards back to the full tensor, and the overlap of two
layouts' shards (what resharding sends).

megatron splits a TP-parallel parameter along ``partition_dim`` into ``tp``
slices; with ``partition_stride`` k (SwiGLU's fc1 has k=2: [gate; up]) the full
dimension is k blocks, each split into tp parts, and a rank keeps its part of
every block::

    full fc1 rows:  [ gate_0 gate_1 | up_0 up_1 ]      (tp=2, k=2)
    tp rank 0:      [ gate_0 | up_0 ]    tp rank 1: [ gate_1 | up_1 ]

Parameters that are not TP-parallel (norms, the value head, the MoE router) are
whole on every TP rank, and so are a mixture of experts' routed experts: their
tensor-parallel size is 1 (megatron's ``expert_tensor_parallel_size``), and
expert parallelism splits the experts, not their tensors (``is_expert``, set by
rlhf.models.gpt.build_model; rlhf/parallel/reshard.py routes each expert to the
ranks that hold it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split across TP ranks."""

    tp: int
    dim: int = 0
    stride: int = 1
    parallel: bool = True

    @classmethod
    def of(cls, param: torch.Tensor, tp: int) -> "ShardSpec":
        """The split of ``param`` (a parameter, or a tensor carrying its attributes) over ``tp`` ranks."""
        if not getattr(param, "tensor_model_parallel", False) or getattr(param, "is_expert", False):
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
