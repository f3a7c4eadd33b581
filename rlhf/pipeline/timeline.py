"""Execution timeline: start and end of every instruction on every rank.

Each rank records ``(label, kind, start, end)`` in seconds from the step's
start (taken right after a barrier, so ranks share a time origin to within
the barrier's skew).  :func:`gather` brings all ranks' events to every rank;
:func:`write_chrome_trace` writes them as Chrome trace JSON (one process per
rank; open in https://ui.perfetto.dev or chrome://tracing).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

COMPUTE_KINDS = ("FORWARD", "BACKWARD")


@dataclass(frozen=True)
class Event:
    label: str
    kind: str
    start: float
    end: float


@dataclass
class Timeline:
    """One rank's events, in seconds since ``origin`` (a ``perf_counter`` value)."""

    rank: int
    origin: float = field(default_factory=time.perf_counter)
    events: list = field(default_factory=list)

    def record(self, label: str, kind: str, start: float, end: float) -> None:
        """Record an instruction that ran from ``start`` to ``end`` (perf_counter values)."""
        self.events.append(Event(label, kind, start - self.origin, end - self.origin))

    def compute_busy(self) -> float:
        """Seconds spent in FORWARD/BACKWARD."""
        return _compute_busy(self.to_list())

    def compute_end(self) -> float:
        """End of the last FORWARD/BACKWARD (0 if none)."""
        return _compute_end(self.to_list())

    def to_list(self) -> list:
        return [(e.label, e.kind, e.start, e.end) for e in self.events]


def gather(timeline: Timeline, group=None) -> list:
    """Every rank's event list, indexed by rank order in ``group`` (collective)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (timeline.rank, timeline.to_list()), group=group)
    return out


def _compute_busy(events: list) -> float:
    """Seconds of FORWARD/BACKWARD in ``(label, kind, start, end)`` events."""
    return sum(end - start for _, kind, start, end in events if kind in COMPUTE_KINDS)


def _compute_end(events: list) -> float:
    """End of the last FORWARD/BACKWARD in ``(label, kind, start, end)`` events (0 if none)."""
    return max((end for _, kind, _, end in events if kind in COMPUTE_KINDS), default=0.0)


def makespan(per_rank: list) -> float:
    """Longest compute end over ranks: the measured counterpart of the simulator's makespan."""
    return max((_compute_end(evs) for _, evs in per_rank), default=0.0)


def bubble_fractions(per_rank: list) -> dict:
    """``{rank: idle share of the makespan}``: 1 - compute busy time / makespan."""
    span = makespan(per_rank)
    return {rank: 1.0 - _compute_busy(evs) / span for rank, evs in per_rank} if span > 0 else {}


def chrome_trace(per_rank: list) -> dict:
    """Chrome trace JSON ('X' complete events, microseconds); pid = rank."""
    events = []
    for rank, evs in per_rank:
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        for label, kind, start, end in evs:
            events.append({"name": label, "cat": kind, "ph": "X", "pid": rank, "tid": 0,
                           "ts": start * 1e6, "dur": (end - start) * 1e6})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, per_rank: list) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(per_rank)))


def idle_fraction(timelines: list) -> float | None:
    """One rank's idle share of its steps (``timelines``, one per step), from the start of each step
    to its last FORWARD/BACKWARD; None when the rank computed nothing."""
    busy = sum(t.compute_busy() for t in timelines)
    span = sum(t.compute_end() for t in timelines)
    return 1.0 - busy / span if span > 0 else None


class StageTimes:
    """FORWARD/BACKWARD seconds per (model, pipeline stage), from the executor's timelines."""

    def __init__(self):
        self.seconds: dict = {}  # (model, stage, kind) -> [seconds]

    def add(self, timeline, stages: dict) -> None:
        """Record ``timeline``'s compute events; ``stages``: {model: this rank's stage of it}."""
        for label, kind, start, end in timeline.to_list():
            model = label.split()[0]
            if kind in COMPUTE_KINDS and model in stages:
                self.seconds.setdefault((model, stages[model], kind), []).append(end - start)

    def per_stage(self, stage_counts: dict, group=None) -> dict:
        """{model: (forward seconds per stage, backward seconds per stage)} for ``stage_counts``
        ({model: pp}), means over the ranks that ran each stage (collective: gathered over ``group``)."""
        import torch.distributed as dist

        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, list(self.seconds.items()), group=group)
        sums: dict = {}
        for (model, stage, kind), values in (item for part in parts for item in part):
            total, count = sums.get((model, stage, kind), (0.0, 0))
            sums[model, stage, kind] = (total + sum(values), count + len(values))
        return {model: tuple([sums[model, s, kind][0] / sums[model, s, kind][1] for s in range(pp)]
                             for kind in COMPUTE_KINDS) for model, pp in stage_counts.items()}

