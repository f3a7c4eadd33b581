"""Schedule generators: serial 1F1B, greedy fused, and list-scheduled starts.

Every generator returns per-stage lists of subtask ids (see problem.py); the
caller turns them into Actions.  They emit compute subtasks only.

* :func:`one_f_one_b` - one model stage's 1F1B sequence with ``warmup``
  forwards before the first backward (standard: ``pp - stage - 1``).
* :func:`serial_1f1b` - each model alone with 1F1B, one after the other.
* :func:`greedy_fused` - RLHFuse's greedy: every model keeps its own 1F1B
  sequence per stage; a free stage starts the ready head of the *larger* model
  first (more work per stage), else the other's (bidirectional 1F1B).
* :func:`list_schedule` - the general event-driven list scheduler both use:
  when a stage is free it starts the best ready candidate under a priority key
  (never idles while something is ready).  With ``sequences`` the candidates
  are the heads of fixed per-(stage, model) sequences; otherwise each model
  offers its next F (if fewer than ``limit`` micro-batches are in flight on
  that stage and the memory cap allows) and its next B.
* :func:`backfill_schedule` - one model's 1F1B kept exactly as if alone (at
  its earliest times, or *lazy*: its latest times that keep its makespan),
  the others placed into its idle gaps (conservative backfilling).
* :func:`rule_schedule` - :func:`list_schedule` under a :class:`Rule`
  (warm-up depth per model, model priority, B or F first; or *balanced*:
  the model furthest behind in its own 1F1B sequence first).

``search.start_pool`` builds the annealer's starts from these.
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

from .problem import Problem
from .simulate import latest_ends, simulate


def one_f_one_b(pb: Problem, model: int, pipeline: int, stage: int, warmup: int | None = None) -> list:
    """Ids of one model stage's subtasks in 1F1B order (micro-batches in order)."""
    m = pb.models[model]
    nb = m.microbatches
    w = m.pp - stage - 1 if warmup is None else warmup
    w = max(0, min(w, nb))
    f = [pb.node_id_fast(model, pipeline, b, stage, True) for b in range(nb)]
    b_ = [pb.node_id_fast(model, pipeline, b, stage, False) for b in range(nb)]
    out = f[:w]
    for i in range(nb - w):
        out += [f[w + i], b_[i]]
    return out + b_[nb - w:]


def _model_stage_map(pb: Problem) -> list:
    """``at[s][i] = (pipeline, model stage)`` of model ``i`` on fused stage ``s``."""
    at = [[None] * len(pb.models) for _ in range(pb.stages)]
    for i, m in enumerate(pb.models):
        for p in range(m.pipelines):
            for j in range(m.pp):
                at[m.fused_stage(p, j, pb.stages)][i] = (p, j)
    return at


def per_model_1f1b(pb: Problem, extra: Sequence[int] | None = None) -> list:
    """``seq[s][i]``: model i's 1F1B sequence on fused stage s, with ``extra[i]``
    additional warm-up forwards."""
    extra = extra or [0] * len(pb.models)
    at = _model_stage_map(pb)
    return [[one_f_one_b(pb, i, p, j, pb.models[i].pp - j - 1 + extra[i])
             for i, (p, j) in enumerate(row)] for row in at]


def serial_1f1b(pb: Problem) -> list:
    """Per stage: model 0's 1F1B, then model 1's, ... (the non-fused baseline)."""
    return [sum(row, []) for row in per_model_1f1b(pb)]


def model_alone(pb: Problem, model: int) -> Problem:
    """``pb`` with only model ``model`` (its subtask ids then start at 0)."""
    return Problem(pb.stages, (pb.models[model],), pb.comm, pb.mem_cap, pb.time_unit, pb.mem_unit)


def serial_1f1b_makespan(pb: Problem) -> float:
    """Sum over models of each model's 1F1B makespan alone (training steps run
    one after the other, each ending with its flush).  For uniform stages each
    term is ``(m + pp - 1) * (f + b)``."""
    return sum(simulate(sub, serial_1f1b(sub)).makespan
               for sub in (model_alone(pb, i) for i in range(len(pb.models))))


def model_size_order(pb: Problem) -> list:
    """Model indices, the largest (most work per stage) first."""
    return sorted(range(len(pb.models)),
                  key=lambda i: (-(sum(pb.models[i].fwd) + sum(pb.models[i].bwd)) / pb.models[i].pp, i))


def greedy_fused(pb: Problem) -> list:
    """RLHFuse greedy: bidirectional 1F1B, the larger model first when both are ready."""
    rank = {i: r for r, i in enumerate(model_size_order(pb))}
    model = pb.arrays.model
    return list_schedule(pb, key=lambda v: rank[model[v]], sequences=per_model_1f1b(pb))


@dataclass(frozen=True)
class Rule:
    """A dynamic list-scheduling rule: ``extra[i]`` warm-up forwards beyond
    1F1B for model i (``None``: unbounded), ``order``: model priority (first
    wins), ``b_first``: a ready B beats a ready F of the same model.

    With ``balance`` (a number) the priority is progress instead: a subtask's
    place in its model's own 1F1B sequence on its stage, as a fraction of that
    sequence, plus ``balance`` x the model's rank in ``order``; the stage
    starts the ready subtask of the model that is furthest behind, so the
    models advance together and their cool-downs overlap (with strict
    priority the lower model's tail runs alone at the end)."""

    extra: tuple
    order: tuple
    b_first: bool = True
    balance: float | None = None

    def key(self, pb: Problem) -> Callable[[int], tuple]:
        rank = {i: r for r, i in enumerate(self.order)}
        model, is_fwd, tail = pb.arrays.model, pb.arrays.is_fwd, pb.arrays.tail
        if self.balance is not None:
            progress = [0.0] * pb.num_nodes
            for row in per_model_1f1b(pb):
                for seq in row:
                    for k, v in enumerate(seq):
                        progress[v] = (k + 0.5) / len(seq) + self.balance * rank[model[v]]
            return lambda v: (progress[v], -tail[v])
        b_first = self.b_first
        return lambda v: (rank[model[v]], is_fwd[v] == b_first, -tail[v])


def list_schedule(pb: Problem, key: Callable[[int], object], sequences=None,
                  limits=None, mem_cap: float | None = None) -> list | None:
    """Event-driven list scheduling; returns per-stage orders or None if stuck.

    ``sequences[s][i]``: fixed order of model i on stage s (heads only are
    candidates).  Otherwise ``limits[i][j]`` caps F-minus-B in flight for model
    i at model stage j (None = unbounded) and ``mem_cap`` caps live memory.
    """
    cands = _Candidates(pb, sequences, limits, mem_cap)
    arr = pb.arrays
    end = [-1.0] * pb.num_nodes
    orders = [[] for _ in range(pb.stages)]
    idle = set(range(pb.stages))
    events: list = []
    t = 0.0
    while True:
        for s in sorted(idle):
            ready = [v for v in cands.heads(s) if _ready(arr, end, v, t)]
            if ready:
                v = min(ready, key=key)
                cands.take(s, v)
                orders[s].append(v)
                idle.discard(s)
                heapq.heappush(events, (t + arr.dur[v], s, v))
        if not events:
            break
        t = events[0][0]
        while events and events[0][0] <= t:
            _, s, v = heapq.heappop(events)
            if s < 0:
                continue  # a wake-up: a dependency's communication arrived
            end[v] = t
            idle.add(s)
            nxt = v + 1
            if nxt < len(end) and arr.pred[nxt] == v and arr.lag[nxt] > 0:
                heapq.heappush(events, (t + arr.lag[nxt], -1, -1))
    done = sum(len(o) for o in orders)
    return orders if done == pb.num_nodes else None


def _ready(arr, end, v: int, t: float) -> bool:
    p = arr.pred[v]
    return p < 0 or (end[p] >= 0.0 and end[p] + arr.lag[v] <= t + 1e-12)


class _Candidates:
    """The subtasks a stage may start next (heads of its queues)."""

    def __init__(self, pb: Problem, sequences, limits, mem_cap):
        self.pb, self.fixed = pb, sequences is not None
        at = _model_stage_map(pb)
        nm = len(pb.models)
        if self.fixed:
            self.queues = [[list(q) for q in row] for row in sequences]
        else:
            self.queues = []
            for row in at:
                qs = []
                for i, (p, j) in enumerate(row):
                    nb = pb.models[i].microbatches
                    qs.append([pb.node_id_fast(i, p, b, j, True) for b in range(nb)])
                    qs.append([pb.node_id_fast(i, p, b, j, False) for b in range(nb)])
                self.queues.append(qs)
            limits = limits or [[None] * m.pp for m in pb.models]
            self.limit = [[limits[i][at[s][i][1]] for i in range(nm)] for s in range(pb.stages)]
            self.inflight = [[0] * nm for _ in range(pb.stages)]
        self.ptr = [[0] * len(q) for q in self.queues]
        self.live = [0.0] * pb.stages
        self.cap = mem_cap

    def heads(self, s: int) -> list:
        out = []
        arr = self.pb.arrays
        for qi, q in enumerate(self.queues[s]):
            k = self.ptr[s][qi]
            if k >= len(q):
                continue
            v = q[k]
            if not self.fixed and arr.is_fwd[v]:
                i = qi // 2
                lim = self.limit[s][i]
                if lim is not None and self.inflight[s][i] >= lim:
                    continue
            if arr.is_fwd[v] and self.cap is not None and self.live[s] + arr.mem[v] > self.cap + 1e-9:
                continue
            out.append(v)
        return out

    def take(self, s: int, v: int) -> None:
        arr = self.pb.arrays
        for qi, q in enumerate(self.queues[s]):
            k = self.ptr[s][qi]
            if k < len(q) and q[k] == v:
                self.ptr[s][qi] += 1
                break
        self.live[s] += arr.mem[v]
        if not self.fixed:
            self.inflight[s][arr.model[v]] += 1 if arr.is_fwd[v] else -1


def rule_schedule(pb: Problem, rule: Rule, mem_cap: float | None = None) -> list | None:
    """:func:`list_schedule` under ``rule``: model i keeps at most
    ``pp - j + rule.extra[i]`` micro-batches in flight at model stage j."""
    limits = [[None if e is None else m.pp - j + e for j in range(m.pp)]
              for m, e in zip(pb.models, rule.extra)]
    return list_schedule(pb, rule.key(pb), limits=limits, mem_cap=mem_cap)


def backfill_schedule(pb: Problem, first: int, extra: int = 0, other_extra: int | None = None,
                      lazy: bool = False) -> list:
    """Model ``first`` runs its 1F1B (``extra`` more warm-up forwards) exactly as
    if alone; every other model's subtasks are then placed, in order of their
    ready times, into the earliest idle gap of their stage that fits them
    (conservative backfilling), so the first model is never delayed.  With
    ``other_extra`` the other models keep at most ``pp - stage + other_extra``
    micro-batches in flight per stage (a forward waits for the backward that
    frees its slot); None means unbounded.  With ``lazy`` the first model's
    subtasks sit at their latest times that keep its makespan
    (:func:`simulate.latest_ends`): its forwards come just in time, which
    opens gaps early on, while it holds few activations, for the others.
    Returns per-stage orders sorted by the placed start times."""
    arr = pb.arrays
    sub = model_alone(pb, first)
    seq = [row[0] for row in per_model_1f1b(sub, [extra])]
    alone = simulate(sub, seq)
    if not alone.ok:
        raise ValueError(f"backfill_schedule: 1F1B of model {first} deadlocks")
    ends = latest_ends(sub, seq, alone) if lazy else alone.end
    offset = pb.node_id_fast(first, 0, 0, 0, True)
    busy = [[] for _ in range(pb.stages)]  # sorted (start, end, id) per stage
    for s, order in enumerate(seq):
        for v in order:
            e = ends[v]
            busy[s].append((e - arr.dur[v + offset], e, v + offset))
    slot_of = _inflight_slots(pb, first, other_extra)
    placed = {}
    parked = {}
    heap = []
    for i, m in enumerate(pb.models):
        if i == first:
            continue
        for p in range(m.pipelines):
            for b in range(m.microbatches):
                v = pb.node_id_fast(i, p, b, 0, True)
                heapq.heappush(heap, (0.0, -arr.tail[v], v))
    while heap:
        ready, _, v = heapq.heappop(heap)
        gate = slot_of.get(v)
        if gate is not None:
            if gate not in placed:
                parked[gate] = v
                continue
            ready = max(ready, placed[gate])
        s, d = arr.stage[v], arr.dur[v]
        start = _earliest_gap(busy[s], ready, d)
        bisect.insort(busy[s], (start, start + d, v))
        placed[v] = start + d
        nxt = v + 1
        if nxt < pb.num_nodes and arr.pred[nxt] == v:
            heapq.heappush(heap, (start + d + arr.lag[nxt], -arr.tail[nxt], nxt))
        if v in parked:
            w = parked.pop(v)
            heapq.heappush(heap, (ready, -arr.tail[w], w))
    return [[v for _, _, v in stage] for stage in busy]


def _inflight_slots(pb: Problem, first: int, other_extra: int | None) -> dict:
    """``{F of mb k at stage j: B of mb k - L at stage j}`` for the models
    other than ``first``, with in-flight limit ``L = pp - j + other_extra``."""
    gates = {}
    if other_extra is None:
        return gates
    for i, m in enumerate(pb.models):
        if i == first:
            continue
        for p in range(m.pipelines):
            for j in range(m.pp):
                lim = m.pp - j + other_extra
                for b in range(lim, m.microbatches):
                    gates[pb.node_id_fast(i, p, b, j, True)] = pb.node_id_fast(i, p, b - lim, j, False)
    return gates


def _earliest_gap(intervals: list, ready: float, d: float) -> float:
    """Earliest t >= ready with [t, t+d) free of the sorted ``intervals``."""
    t = ready
    k = bisect.bisect_left(intervals, (ready,))
    if k > 0 and intervals[k - 1][1] > t:
        t = intervals[k - 1][1]
    while k < len(intervals):
        s0, e0, _ = intervals[k]
        if s0 >= t + d - 1e-12:
            return t
        t = max(t, e0)
        k += 1
    return t
