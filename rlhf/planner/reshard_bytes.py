"""Bytes each rank receives when rlhf/parallel/reshard.py moves a model between two layouts.

Pure arithmetic over the same rules reshard.py follows (its tests measure
the real transfers and compare them with :func:`received_bytes`), over the
tensors of rlhf.planner.shapes.model_weights (the list the parameter counts
sum), the vocabulary padded as rlhf.models.config.padded_vocab_size pads it:

* a tensor-parallel weight is split along one dimension into tp slices (with
  stride k, each of its k blocks is); a destination shard receives, from every
  source TP index whose slice overlaps it, the overlap;
* a replicated weight (the norms, a value head) is read from the source TP
  index ``dst tp % src tp``;
* a piece costs nothing when the destination rank is itself a source replica
  of it (same stage, same TP index, any DP replica); otherwise one source
  replica sends it;
* a mixture of experts' routed expert (whole on every TP rank) is held, and
  needed, only by the DP replicas whose expert-parallel rank owns it (expert
  e of E on EP rank e // (E / ep), rlhf.models.naming.expert_owner).

HybridFlow (its section 5.4, Table 2) orders the generation mesh so that every
rank's generation shard contains its training shard (:func:`hybridflow_ranks`);
each rank then receives (tp - t_g p_g) / (t_g p_g tp) of the tensor-parallel
bytes M, against up to M / t_g for a naive (contiguous) order.
"""

from __future__ import annotations

from rlhf.models.config import ModelConfig, padded_vocab_size
from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.planner.shapes import BYTES, Weight, model_weights, weight_stage


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
    rows = vocab_rows or padded_vocab_size(cfg.vocab_size, 1, (s.tp, t.tp))

    def owner(w: Weight, ep: int) -> int | None:
        return None if w.expert is None else w.expert // (cfg.num_experts // ep)

    def holds(mesh: TaskMesh, stage: int, dp: int, tp: int, ep_rank: int | None) -> bool:
        return ep_rank is None or mesh.ep_index(stage, dp, tp) == ep_rank

    holders = {(stage, tp, o): {src.rank(stage, d, tp) for d in range(s.dp) if holds(src, stage, d, tp, o)}
               for stage in range(s.pp) for tp in range(s.tp) for o in [None, *range(s.ep)]}
    out = {r: 0 for r in dst.ranks}
    weights: dict = {}  # layers (and experts) repeat: count each (weight, source stage and owner, destination's) once
    for w in model_weights(cfg, kind, rows):
        key = (w.numel, w.rows, w.stride, w.parallel, weight_stage(w.place, cfg.num_layers, s.pp), owner(w, s.ep),
               weight_stage(w.place, cfg.num_layers, t.pp), owner(w, t.ep))
        weights[key] = weights.get(key, 0) + 1
    for (numel, n_rows, stride, parallel, s_stage, s_owner, d_stage, d_owner), count in weights.items():
        w = Weight(0, numel, n_rows, stride, parallel)
        for dp in range(t.dp):
            for tp in range(t.tp):
                if not holds(dst, d_stage, dp, tp, d_owner):
                    continue
                rank = dst.rank(d_stage, dp, tp)
                for src_tp in (range(s.tp) if parallel else [tp % s.tp]):
                    n = _overlap(w, s.tp, src_tp, t.tp, tp)
                    if n and rank not in holders[(s_stage, src_tp, s_owner)]:
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
