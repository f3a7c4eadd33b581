"""Seeded latency models: the fused-schedule problems under other plausible FLOP counts.

`cost_model.py` fixes one count (SwiGLU MLP, the model's own KV heads, the attention-score term, backward =
2 x forward, uniform stages). A user's profiler or own cost model gives others, and a schedule search tuned
to one count must still hold its memory under them (docs/schedule_search.md, "Robustness"). A
`LatencyModel` varies what such counts differ in:

* the MLP: 3 matrices (gate, up, down) or 2 (up, down), ``ffn`` wide either way;
* the attention-score term ``4 * seq * h`` per token and layer, on or off;
* GQA: the model's own KV heads, or 8 query heads per KV head (the largest divisor of the heads at most
  heads / 8);
* backward / forward, in [1.5, 2.5];
* each model stage's latency times its own factor in [1 - time_jitter, 1 + time_jitter] (forward and backward
  alike: a stage with more work is slower in both), and its activation memory times its own factor in
  [1 - mem_jitter, 1 + mem_jitter], both at most 0.2, drawn from ``seed``, the model's name and its stage
  count, so a problem's factors are the same in every run.

`latency_model(seed)` draws one model; `build(shapes, model)` makes the problem of model shapes under it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

from .cost_model import CostConfig, ModelShape, build_problem
from .problem import Problem, ProblemError

MAX_JITTER = 0.2
GQA_GROUP = 8  # query heads per KV head with GQA on


@dataclass(frozen=True)
class LatencyModel:
    """One FLOP count and per-stage perturbation (module docstring); the defaults are `cost_model`'s."""

    mlp_matrices: int = 3
    attention: bool = True
    gqa: bool = False
    bwd_over_fwd: float = 2.0
    time_jitter: float = 0.0
    mem_jitter: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.mlp_matrices not in (2, 3):
            raise ProblemError(f"LatencyModel.mlp_matrices={self.mlp_matrices!r} must be 2 or 3")
        if not 1.5 <= self.bwd_over_fwd <= 2.5:
            raise ProblemError(f"LatencyModel.bwd_over_fwd={self.bwd_over_fwd!r} must lie in [1.5, 2.5]")
        for name in ("time_jitter", "mem_jitter"):
            if not 0 <= getattr(self, name) <= MAX_JITTER:
                raise ProblemError(f"LatencyModel.{name}={getattr(self, name)!r} must lie in [0, {MAX_JITTER}]")

    def describe(self) -> str:
        """A short label, e.g. ``mlp2,attn,gqa,b/f=1.83,t+-0.2,m+-0.0``."""
        return (f"mlp{self.mlp_matrices},{'attn' if self.attention else 'no-attn'},"
                f"{'gqa' if self.gqa else 'mha'},b/f={self.bwd_over_fwd:.2f},"
                f"t+-{self.time_jitter:g},m+-{self.mem_jitter:g}")

    def flops(self, shape: ModelShape, seq_len: int) -> float:
        """Forward FLOPs per token and layer of ``shape`` under this count."""
        h = shape.hidden
        kv = kv_heads(shape.heads) if self.gqa else (shape.kv_heads or shape.heads)
        params = 2 * h * h + 2 * h * (h * kv // shape.heads) + self.mlp_matrices * h * shape.ffn
        return 2.0 * params + (4.0 * seq_len * h if self.attention else 0.0)


COST_MODEL = LatencyModel()
"""`cost_model.py`'s own count: what Table 3 uses."""


def kv_heads(heads: int) -> int:
    """KV heads with GQA on: the largest divisor of ``heads`` at most ``heads / GQA_GROUP`` (at least 1)."""
    return max(d for d in range(1, max(1, heads // GQA_GROUP) + 1) if heads % d == 0)


def latency_model(seed: int) -> LatencyModel:
    """The latency model drawn from ``seed``: each choice of the module docstring uniformly, the jitters
    from (0, 0.1, 0.2) for latency and (0, 0.2) for memory."""
    rng = random.Random(seed)
    return LatencyModel(mlp_matrices=rng.choice((2, 3)), attention=rng.random() < 0.5, gqa=rng.random() < 0.5,
                        bwd_over_fwd=round(rng.uniform(1.5, 2.5), 3), time_jitter=rng.choice((0.0, 0.1, 0.2)),
                        mem_jitter=rng.choice((0.0, 0.2)), seed=seed)


def build(shapes, model: LatencyModel, cfg: CostConfig = CostConfig()) -> Problem:
    """The fused problem of ``shapes`` (`cost_model.build_problem`'s rules) with ``model``'s latencies."""
    pb = build_problem(shapes, replace(cfg, bwd_over_fwd=model.bwd_over_fwd), flops=model.flops)
    return replace(pb, models=tuple(_jittered(m, model) for m in pb.models))


def _jittered(spec, model: LatencyModel):
    """``spec`` (a ModelSpec) with each stage's latencies and memory times its drawn factors."""
    rng = random.Random(f"{model.seed}/{spec.name}/{spec.pp}")
    times = [1 + rng.uniform(-model.time_jitter, model.time_jitter) for _ in range(spec.pp)]
    mems = [1 + rng.uniform(-model.mem_jitter, model.mem_jitter) for _ in range(spec.pp)]
    return replace(spec, fwd=tuple(f * x for f, x in zip(spec.fwd, times)),
                   bwd=tuple(b * x for b, x in zip(spec.bwd, times)),
                   act_mem=tuple(a * x for a, x in zip(spec.act_mem, mems)))
