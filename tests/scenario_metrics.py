"""4-rank scenario for tests/test_metrics.py: reduce_metrics over subsets of ranks, and a trace.

Values are dyadic, so every expected mean, sum and max is exact. The stage
timer runs on a fake clock (each rank's starting at a different time), so the
traced spans are exact too.
"""

import torch
import torch.distributed as dist

from rlhf.metrics import StageTimer, reduce_metrics, write_trace
from rlhf.pipeline.timeline import Timeline


class FakeClock:
    """Seconds that move only when told to."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def local_metrics(rank: int) -> dict:
    """What rank ``rank`` reports: keys by subsets of ranks, floats and 0-dim tensors mixed."""
    local = {"reward_mean": float(rank), "time_generation_s": [0.5, 2.0, 1.0, 1.5][rank]}
    if rank >= 2:  # last pipeline stage: knows the loss
        local["value_loss"] = torch.tensor([1.0, 4.0][rank - 2])
    if rank in (0, 2):  # one rank per DP replica counts its samples
        local["samples_count"] = torch.tensor(8.0, dtype=torch.float64)
    if rank == 1:
        local["response_length_max"] = 7.0
        local["gold_reward_mean"] = 0.25
    if rank == 3:
        local["penalty_max"] = -3.0  # a max over one negative value is that value, not 0
        local["reward_sum"] = -2.0
    return local


def traced_timer(rank: int, trace_path: str) -> dict:
    """Two iterations on a fake clock, the second traced; returns the timer's metrics per iteration."""
    clock = FakeClock(100.0 * rank)
    timer = StageTimer(trace_iteration=2, clock=clock, sync=lambda: None)
    per_iteration = {}
    for iteration in (1, 2):
        timer.start_iteration(iteration)
        with timer.stage("generation"):
            clock.advance(rank + 1.0)
        with timer.stage("inference"):
            clock.advance(0.25)
            if rank >= 2:
                with timer.stage("ref_inf"):
                    clock.advance(0.5)
        step = Timeline(rank, origin=clock())  # an executor step's timeline, same clock
        step.record("actor F0", "FORWARD", clock() + 0.125, clock() + 0.375)
        with timer.stage("training"):
            clock.advance(1.0)
        timer.include(step)
        per_iteration[iteration] = timer.metrics()
        if timer.timeline is not None:
            write_trace(trace_path, timer.timeline)
    return per_iteration


def run(trace_path: str) -> dict:
    rank = dist.get_rank()
    pair = dist.new_group([1, 2])  # collective: every rank creates it
    out = {"world": reduce_metrics(local_metrics(rank)),
           "empty": reduce_metrics({}),
           "only_rank0": reduce_metrics({"kl_mean": 0.5} if rank == 0 else {})}
    if rank in (1, 2):
        out["pair"] = reduce_metrics(local_metrics(rank), group=pair)
    out["timer"] = traced_timer(rank, trace_path)
    return out
