"""Bytes each rank receives when rlhf/parallel/reshard.py moves a model between two layouts.

Pure arithmetic over the same rules reshard.py follows (its tests measure
the real transfers and compare them with :func:`received_bytes`):

* a tensor-parallel weight is split along one dimension into tp slices (with
  stride k, each of its k blocks is); a destination shard receives, from every
  source TP index whose slice overlaps it, the overlap;
* a replicated weight (the norms, a value head) is read from the source TP
  index ``dst tp % src tp``;
* a piece costs nothing when the destination rank is itself a source replica
  of it (same stage, same TP index, any DP replica); otherwise one source
  replica sends it.

HybridFlow (its section 5.4, Table 2) orders the generation mesh so that every
rank's generation shard contains its training shard (:func:`hybridflow_ranks`);
each rank then receives (tp - t_g p_g) / (t_g p_g tp) of the tensor-parallel
bytes M, against up to M / t_g for a naive (contiguous) order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlhf.models.config import ModelConfig
from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.planner.models import BYTES, kv_width


@dataclass(frozen=True)
class Weight:
    """One parameter as resharding sees it: ``place`` a layer index, ``"first"`` (the embedding) or
    ``"last"`` (final norm, head); ``rows`` its full size along the split dimension."""

    place: int | str
    numel: int
    rows: int
    stride: int = 1
    parallel: bool = True


def padded_rows(vocab_size: int, tps) -> int:
    """Vocabulary rows of both layouts: rlhf.models.vocab.padded_vocab_size with divisible_by=1."""
    multiple = math.lcm(1, *tps)
    return -(-vocab_size // multiple) * multiple


def model_weights(cfg: ModelConfig, kind: str, vocab_rows: int) -> list[Weight]:
    """The parameters of a megatron GPT model of ``kind`` (``lm`` or ``value``) with ``vocab_rows`` rows."""
    h, ffn, qkv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.hidden_size + 2 * kv_width(cfg)
    out = [Weight("first", vocab_rows * h, vocab_rows)]
    for layer in range(cfg.num_layers):
        out += [Weight(layer, h, h, parallel=False),            # input_layernorm
                Weight(layer, qkv * h, qkv),                     # linear_qkv (per query group: stride 1)
                Weight(layer, h * h, h),                         # linear_proj (row-parallel, dim 1)
                Weight(layer, h, h, parallel=False),             # pre_mlp_layernorm
                Weight(layer, 2 * ffn * h, 2 * ffn, stride=2),   # linear_fc1 [gate; up]
                Weight(layer, h * ffn, ffn)]                     # linear_fc2 (row-parallel, dim 1)
        if cfg.qkv_bias:
            out.append(Weight(layer, qkv, qkv))
    out.append(Weight("last", h, h, parallel=False))             # final_layernorm
    out.append(Weight("last", vocab_rows * h, vocab_rows) if kind == "lm" else
               Weight("last", h, h, parallel=False))             # output_layer | value head
    return out


def _stage(place, num_layers: int, pp: int) -> int:
    """rlhf.models.naming.owning_stage for a Weight."""
    if place == "first":
        return 0
    return pp - 1 if place == "last" else place // (num_layers // pp)


def _overlap(w: Weight, src_tp: int, s: int, dst_tp: int, d: int) -> int:
    """Elements source TP slice ``s`` (of ``src_tp``) shares with destination slice ``d`` (of ``dst_tp``)."""
    if not w.parallel:
        return w.numel
    block = w.rows // w.stride
    ss, ds = block // src_tp, block // dst_tp
    rows = max(0, min((s + 1) * ss, (d + 1) * ds) - max(s * ss, d * ds)) * w.stride
    return rows * (w.numel // w.rows)


def received_bytes(cfg: ModelConfig, kind: str, src: TaskMesh, dst: TaskMesh,
                   vocab_rows: int | None = None) -> dict[int, int]:
    """Bytes (bf16) every rank of ``dst`` receives from other ranks when resharding from ``src``."""
    s, t = src.strategy, dst.strategy
    rows = vocab_rows or padded_rows(cfg.vocab_size, (s.tp, t.tp))
    holders = {(stage, tp): {src.rank(stage, d, tp) for d in range(s.dp)}
               for stage in range(s.pp) for tp in range(s.tp)}
    out = {r: 0 for r in dst.ranks}
    weights: dict = {}  # layers repeat: count each (weight, source stage, destination stage) once
    for w in model_weights(cfg, kind, rows):
        key = (w.numel, w.rows, w.stride, w.parallel, _stage(w.place, cfg.num_layers, s.pp),
               _stage(w.place, cfg.num_layers, t.pp))
        weights[key] = weights.get(key, 0) + 1
    for (numel, n_rows, stride, parallel, s_stage, d_stage), count in weights.items():
        w = Weight(0, numel, n_rows, stride, parallel)
        for dp in range(t.dp):
            for tp in range(t.tp):
                rank = dst.rank(d_stage, dp, tp)
                for src_tp in (range(s.tp) if parallel else [tp % s.tp]):
                    n = _overlap(w, s.tp, src_tp, t.tp, tp)
                    if n and rank not in holders[(s_stage, src_tp)]:
                        out[rank] += n * BYTES * count
    return out


def parallel_bytes(cfg: ModelConfig, kind: str, vocab_rows: int) -> int:
    """M: the bytes of the model's tensor-parallel weights (what HybridFlow's formula counts)."""
    return sum(w.numel for w in model_weights(cfg, kind, vocab_rows) if w.parallel) * BYTES


def hybridflow_fraction(train: ParallelStrategy, gen: ParallelStrategy) -> float:
    """HybridFlow Table 2: the share of M each rank receives, (tp - t_g p_g) / (t_g p_g tp) (pp = 1)."""
    return (train.tp - gen.tp * gen.pp) / (gen.tp * gen.pp * train.tp)


def hybridflow_ranks(train: TaskMesh, gen: ParallelStrategy) -> tuple[int, ...] | None:
    """Generation ranks in mesh order such that each rank's generation shard holds its training shard.

    Each training model-parallel group (p x t ranks of one DP replica) hosts
    (p / p_g) x (t / t_g) generation replicas; replica (a, b) takes training
    stages a, a + p/p_g, ... and TP indices b, b + t/t_g, ... (HybridFlow
    Figure 8: with t=4, t_g=2 the generation TP groups are {0, 2} and {1, 3}).
    None when the degrees do not nest (t_g must divide t, p_g must divide p).
    """
    s = train.strategy
    if s.tp % gen.tp or s.pp % gen.pp or gen.size != s.size:
        return None
    kp, kt = s.pp // gen.pp, s.tp // gen.tp
    order = {}
    for d in range(s.dp):
        for a in range(kp):
            for b in range(kt):
                replica = (d * kp + a) * kt + b
                for stage in range(gen.pp):
                    for j in range(gen.tp):
                        order[(stage, replica, j)] = train.rank(stage * kp + a, d, j * kt + b)
    return tuple(order[(stage, replica, j)] for stage in range(gen.pp)
                 for replica in range(gen.dp) for j in range(gen.tp))
