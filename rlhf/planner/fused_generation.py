"""Inter-stage fusion in a plan: generation and the inference after it as one call (RLHFuse section 4.2).

The trainer's ``--inter-stage-fusion`` migrates generation's long tail to a
few instances and runs reference, reward and critic inference on the ranks
it frees (rlhf.fusion). A plan can do this when actor_gen has instances to
free (dp >= 2) and every inference task sits on actor_gen's ranks. The fused
call takes the unfused seconds (generation, then the inference calls' span)
times the fusion policy's simulated fused-over-unfused time
(rlhf.fusion.policy.choose_threshold at its chosen R, or at the plan's
``migration_threshold``), over ``TRIALS``
batches drawn from the workload's lengths: the trainer's long-tailed
lognormal when ``Workload.long_tail_median`` is set, else every sample at
``response_len`` (no tail: fusion gains nothing). Hosts whose ranks share
cores are refused: there the freed ranks' inference slows the destinations,
which the policy's model leaves out.

The policy's time model is set from the cost model: ``step_s`` makes an
unfused, full-length generation take actor_gen's predicted seconds;
``infer_s`` is one instance's share of the inference span per sample;
``migrate_s`` moves one sample's K/V at half the response over the
generation ranks' link; ``b_sat`` is the cost model's saturating batch.
"""

from __future__ import annotations

import math
import random
from functools import lru_cache

from rlhf.fusion.policy import GenerationCost, LengthDistribution, ThresholdChoice, choose_threshold, \
    long_tailed_lengths, sweep
from rlhf.parallel.mesh import TaskMesh
from rlhf.planner.cost import Cluster, Workload, saturating_batch
from rlhf.planner.hardware import Hardware
from rlhf.planner.shapes import kv_bytes_per_token
from rlhf.tasks import INFERENCE_TASKS

TRIALS = 8
"""Simulated batches per threshold (the trainer's auto R uses as many)."""
LENGTH_SAMPLE = 4096
"""Lengths drawn from the long-tailed lognormal to stand for the workload."""


def refusal(meshes: dict, hw: Hardware) -> str | None:
    """Why these meshes cannot fuse generation with inference on ``hw`` (None: they can)."""
    if hw.shared_cores:
        return (f"inter-stage fusion is not modelled on {hw.name}, whose ranks share cores: the freed ranks' "
                "inference would slow the destinations' generation (measured 0.84x on CPU, docs/fusion.md)")
    gen = meshes["actor_gen"]
    if gen.strategy.dp < 2:
        return f"inter-stage fusion needs actor_gen dp >= 2 (instances to free); it has {gen.strategy}"
    outside = [t for t in INFERENCE_TASKS if not set(meshes[t].ranks) <= set(gen.ranks)]
    if outside:
        return f"inter-stage fusion needs the inference tasks on actor_gen's ranks; {', '.join(outside)} are not"
    return None


def generation_cost(cfg, gen: TaskMesh, wl: Workload, hw: Hardware, cluster: Cluster, gen_s: float,
                    inference_s: float) -> GenerationCost:
    """The fusion policy's time model of ``gen``'s instances (see the module docstring)."""
    n = gen.strategy.dp
    b_sat = saturating_batch(cfg, gen, wl.prompt_len + wl.response_len / 2, hw)
    step_s = gen_s / wl.response_len / max(1.0, math.ceil(wl.samples / n) / b_sat)
    kv = kv_bytes_per_token(cfg) * (wl.prompt_len + wl.response_len / 2) / gen.strategy.tp
    return GenerationCost(instances=n, step_s=step_s, b_sat=b_sat, infer_s=inference_s * n / wl.samples,
                          migrate_s=kv / cluster.bandwidth(gen.ranks, hw))


@lru_cache(maxsize=None)
def workload_lengths(wl: Workload) -> LengthDistribution:
    """The response lengths that stand for ``wl``: the long-tailed lognormal's sample, or response_len."""
    if not wl.long_tail_median:
        return LengthDistribution([wl.response_len])
    return LengthDistribution(long_tailed_lengths(LENGTH_SAMPLE, random.Random(0), median=wl.long_tail_median,
                                                  cap=wl.response_len))


@lru_cache(maxsize=None)
def threshold_choice(cost: GenerationCost, wl: Workload) -> ThresholdChoice:
    """The policy's R for ``cost`` on ``wl``'s lengths, with the simulated times behind it (remembered)."""
    return choose_threshold(workload_lengths(wl), cost, wl.samples, trials=TRIALS, seed=0)


def fused_seconds(cost: GenerationCost, wl: Workload, unfused_s: float,
                  threshold: float | None = None) -> tuple[float, float]:
    """(seconds of the fused generation + inference call, its R): ``unfused_s`` times the simulated fused
    over unfused time at ``threshold``, or at the policy's R when None."""
    choice = threshold_choice(cost, wl)
    if threshold is None:
        threshold = choice.threshold
        fused = dict(choice.sweep)[threshold]
    else:  # the batches choose_threshold simulated: drawn from the same seed in the same order
        rng = random.Random(0)
        fused = sweep([workload_lengths(wl).draw(wl.samples, rng) for _ in range(TRIALS)], cost, [threshold])[0][1]
    return unfused_s * fused / choice.unfused_s, threshold
