"""FLOP-based cost model: model shapes and parallel layout -> a Problem.

Per transformer layer and token (LLaMA shapes, SwiGLU MLP)::

    params/layer  = 2*h*h + 2*h*h_kv  (q,o + k,v projections; h_kv = h * kv_heads / heads)
                  + 3*h*ffn           (gate, up, down)
    fwd FLOPs     = 2 * params/layer + 4 * seq * h   (matmuls + attention scores QK^T, AV)
    bwd FLOPs     = 2 * fwd FLOPs

A stage's latency per micro-batch = layers/stage * tokens * FLOPs/token /
(tp * gpu_flops * mfu), in milliseconds.  Activation memory per micro-batch
per stage = layers/stage * tokens * hidden * ``act_bytes_per_token_hidden``
/ tp bytes, in GiB (34 bytes per token and hidden unit is Korthikanti et
al.'s count for a layer with sequence parallelism, flash attention, no
recomputation).  Layers are split evenly: ``layers/pp`` may be fractional
(e.g. 60 layers on 8 stages = 7.5), so same-shaped stages get uniform
latencies; an uneven integer split is ignored on purpose.

RLHFuse section 5.2 rules, applied by :func:`build_problem`:

* **different tp** - a fused stage is ``tp_max`` GPUs.  A model with a
  smaller ``tp`` has ``k = tp_max / tp`` of its stages on one fused stage;
  they are merged into one stage (``pp / k`` stages of ``k * layers/stage``
  layers on ``tp_max`` GPUs: same work per GPU, so the same latency per
  merged stage as one original stage).
* **different pp** - after merging, the fused stage count is
  ``S = lcm(pp_i)`` and model i runs ``K_i = S / pp_i`` pipelines (its fusion
  factor; for two models K_a and K_c are coprime).  The global batch is kept:
  each of the K_i pipelines gets ``microbatches_i / K_i`` micro-batches
  (must divide).
* every model uses the same GPUs: a model's K_i pipelines are K_i of its
  data-parallel replicas (33B pp 8 with 13B pp 4 on 64 GPUs at tp 8: the
  critic's two replicas are its two pipelines).  ``gpus`` (optional) must be a
  multiple of ``S * tp_max``; each further group of ``S * tp_max`` GPUs is a
  data-parallel copy running the same schedule, and ``microbatches`` count
  per copy.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import lcm

from rlhf.checks import finite_float, is_int

from .problem import ModelSpec, Problem, ProblemError

MAX_INT = 2**31 - 1
"""Largest shape or layout number accepted (keeps the FLOP counts finite floats)."""


@dataclass(frozen=True)
class ModelShape:
    """One model's shape and parallel layout."""

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    tp: int
    pp: int
    microbatches: int
    direction: str = "down"
    kv_heads: int | None = None

    def __post_init__(self):
        for field in ("layers", "hidden", "ffn", "heads", "tp", "pp", "microbatches"):
            value = getattr(self, field)
            if not is_int(value) or not 1 <= value <= MAX_INT:
                raise ProblemError(f"model {self.name!r}: {field}={value!r} must be an integer in [1, {MAX_INT}]")
        if self.hidden % self.heads:
            raise ProblemError(f"model {self.name!r}: hidden={self.hidden} not divisible by heads={self.heads}")
        kv = self.kv_heads
        if kv is not None and not (is_int(kv) and 1 <= kv <= self.heads and self.heads % kv == 0):
            raise ProblemError(f"model {self.name!r}: kv_heads={kv!r} must be a positive integer dividing "
                               f"heads={self.heads}, or absent (= heads)")

    def flops_per_token_layer(self, seq_len: int) -> float:
        h = self.hidden
        h_kv = h * (self.kv_heads or self.heads) // self.heads
        params = 2 * h * h + 2 * h * h_kv + 3 * h * self.ffn
        return 2.0 * params + 4.0 * seq_len * h


@dataclass(frozen=True)
class CostConfig:
    """Hardware and batch constants (defaults: A100 bf16 at 45% MFU)."""

    tokens_per_microbatch: int = 4096
    seq_len: int = 2048
    gpu_flops: float = 312e12
    mfu: float = 0.45
    act_bytes_per_token_hidden: float = 34.0
    bwd_over_fwd: float = 2.0
    comm: float = 0.0
    gpus: int | None = None

    def __post_init__(self):
        for field in ("tokens_per_microbatch", "seq_len"):
            value = getattr(self, field)
            if not is_int(value) or not 1 <= value <= MAX_INT:
                raise ProblemError(f"CostConfig.{field}={value!r} must be an integer in [1, {MAX_INT}]")
        for field in ("gpu_flops", "act_bytes_per_token_hidden", "bwd_over_fwd"):
            value = finite_float(getattr(self, field))
            if value is None or value <= 0:
                raise ProblemError(f"CostConfig.{field}={getattr(self, field)!r} must be a finite number > 0")
        mfu = finite_float(self.mfu)
        if mfu is None or not 0 < mfu <= 1:
            raise ProblemError(f"CostConfig.mfu={self.mfu!r} must lie in (0, 1] (model FLOPs utilisation)")
        comm = finite_float(self.comm)
        if comm is None or comm < 0:
            raise ProblemError(f"CostConfig.comm={self.comm!r} must be a finite number >= 0 (ms per transfer)")
        if self.gpus is not None and not (is_int(self.gpus) and self.gpus >= 1):
            raise ProblemError(f"CostConfig.gpus={self.gpus!r} must be a positive GPU count or None")


def build_problem(shapes, cfg: CostConfig = CostConfig(),
                  flops: Callable[[ModelShape, int], float] | None = None) -> Problem:
    """Fused problem for models sharing the same GPUs (see module docstring). ``flops(shape, seq_len)``:
    forward FLOPs per token and layer (default `ModelShape.flops_per_token_layer`; another count:
    rlhf/schedule/latency_models.py)."""
    shapes = list(shapes)
    tp_max = max(s.tp for s in shapes)
    merged = []
    for s in shapes:
        if tp_max % s.tp:
            raise ProblemError(f"model {s.name!r}: tp={s.tp} must divide the largest tp={tp_max}")
        k = tp_max // s.tp
        if s.pp % k:
            raise ProblemError(f"model {s.name!r}: pp={s.pp} must be divisible by tp_max/tp={k} "
                               "to merge its stages onto fused stages")
        merged.append(s.pp // k)
    stages = lcm(*merged)
    if cfg.gpus is not None and cfg.gpus % (stages * tp_max):
        raise ProblemError(f"gpus={cfg.gpus} must be a multiple of fused stages x tp_max = "
                           f"{stages} x {tp_max}; change gpus, tp or pp")
    models = []
    for s, pp in zip(shapes, merged):
        fusion = stages // pp
        if s.microbatches % fusion:
            raise ProblemError(f"model {s.name!r}: microbatches={s.microbatches} must be divisible "
                               f"by its fusion factor {fusion} (pipelines sharing the batch)")
        layers = s.layers / pp
        per_gpu = cfg.gpu_flops * cfg.mfu * tp_max
        per_token = flops(s, cfg.seq_len) if flops is not None else s.flops_per_token_layer(cfg.seq_len)
        fwd_ms = layers * cfg.tokens_per_microbatch * per_token / per_gpu * 1e3
        act = layers * cfg.tokens_per_microbatch * s.hidden * cfg.act_bytes_per_token_hidden / tp_max / 2**30
        models.append(ModelSpec(name=s.name, pp=pp, pipelines=fusion,
                                microbatches=s.microbatches // fusion, direction=s.direction,
                                fwd=(fwd_ms,) * pp, bwd=(fwd_ms * cfg.bwd_over_fwd,) * pp,
                                act_mem=(act,) * pp))
    return Problem(stages=stages, models=tuple(models), comm=cfg.comm)


LLAMA = {
    "7B": dict(layers=32, hidden=4096, ffn=11008, heads=32),
    "13B": dict(layers=40, hidden=5120, ffn=20480, heads=40),
    "33B": dict(layers=60, hidden=6656, ffn=26624, heads=52),
    "65B": dict(layers=80, hidden=8192, ffn=32768, heads=64),
}


def llama(name: str, size: str, tp: int, pp: int, microbatches: int, direction: str) -> ModelShape:
    """LLaMA shapes of the RLHFuse Table 3 settings (as given in issue 5)."""
    if size not in LLAMA:
        raise ProblemError(f"unknown LLaMA size {size!r}; known: {sorted(LLAMA)}")
    return ModelShape(name=name, tp=tp, pp=pp, microbatches=microbatches, direction=direction,
                      **LLAMA[size])
