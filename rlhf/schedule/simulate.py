"""Timing and memory of a fixed per-stage order: the energy of the search.

A schedule fixes the order of subtasks on every fused stage.  A subtask starts
when the previous subtask on its stage and its dependency predecessor (plus
``comm``) have both finished, so the start times are the longest paths of the
DAG "stage order + dependency chains".  :func:`simulate` computes them by an
event walk over the stages: each stage runs forward through its list until its
head waits on an unfinished predecessor, and is resumed when that predecessor
finishes.  Every subtask is touched once, so it costs O(subtasks); if some
stage never finishes, the order has a dependency cycle (deadlock) and the walk
reports where each stuck stage waits.

The loop is plain Python over flat lists on purpose: it is the annealer's inner
loop, with no per-call numpy overhead for problems of a few thousand subtasks.
``simulate_from`` re-simulates only what can change after an edit of one stage
at or after a given position (see its docstring).

Memory does not depend on timing: a stage's live activation memory after its
k-th subtask is the prefix sum of +act (F) / -act (B) over its order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .problem import Problem

INF = float("inf")


@dataclass(frozen=True)
class SimResult:
    """``end[v]`` per subtask id (-1.0 if never run), ``makespan`` (inf on
    deadlock), ``stuck``: ``(stage, position, waited_on_id)`` per stage that
    could not finish (empty when the order is deadlock-free)."""

    end: list
    makespan: float
    stuck: tuple

    @property
    def ok(self) -> bool:
        return not self.stuck


def simulate(pb: Problem, orders: Sequence[Sequence[int]]) -> SimResult:
    """Simulate per-stage id lists (each stage holds its own subtasks)."""
    n = pb.num_nodes
    return _walk(pb, orders, [-1.0] * n, [0] * pb.stages, [0.0] * pb.stages)


def simulate_from(pb: Problem, orders, base_end: list, base_start_of, cut: float) -> SimResult:
    """Re-simulate after editing orders, reusing every subtask that started
    before ``cut`` in the *old* schedule (``base_end``: its end times).

    Correct when all edited positions of a stage held, in the old order,
    subtasks starting at or after ``cut``: the edited subtasks and everything
    that can depend on them then start at or after ``cut``, and the old prefix
    of each stage (starts < cut) is closed under predecessors (a predecessor
    ends before its successor starts).  ``base_start_of(v)`` gives old starts.
    """
    end = list(base_end)
    ptr, free = [], []
    for order in orders:
        # prefix of old-started-before-cut subtasks; orders are edited only at
        # or after the cut so the prefix is unchanged
        lo, hi = 0, len(order)
        while lo < hi:
            mid = (lo + hi) // 2
            if base_start_of(order[mid]) < cut:
                lo = mid + 1
            else:
                hi = mid
        k = lo
        for v in order[k:]:
            end[v] = -1.0
        ptr.append(k)
        free.append(end[order[k - 1]] if k else 0.0)
    return _walk(pb, orders, end, ptr, free)


def _walk(pb: Problem, orders, end: list, ptr: list, free: list) -> SimResult:
    arr = pb.arrays
    pred, lag, dur = arr.pred, arr.lag, arr.dur
    # waker[p] = the stage waiting for p to finish (only the stage of p's chain
    # successor can), -1 if none; a list, not a dict: this is the inner loop
    waker = [-1] * len(end)
    todo = list(range(len(orders)))
    while todo:
        s = todo.pop()
        order = orders[s]
        k, t, n = ptr[s], free[s], len(order)
        while k < n:
            v = order[k]
            p = pred[v]
            if p >= 0:
                e = end[p]
                if e < 0.0:
                    waker[p] = s
                    break
                e += lag[v]
                if e > t:
                    t = e
            t += dur[v]
            end[v] = t
            k += 1
            w = waker[v]
            if w >= 0:
                todo.append(w)
        ptr[s], free[s] = k, t
    stuck = tuple((s, ptr[s], pred[orders[s][ptr[s]]])
                  for s in range(len(orders)) if ptr[s] < len(orders[s]))
    return SimResult(end, INF if stuck else max(free), stuck)


def latest_ends(pb: Problem, orders, res: SimResult) -> list:
    """Latest end time of every subtask that keeps the per-stage ``orders`` (of
    which ``res`` is the simulation) within ``res.makespan``: the as-late-as-
    possible schedule, a backward pass over stage and chain successors."""
    arr = pb.arrays
    nxt = [-1] * pb.num_nodes
    for order in orders:
        for a, b in zip(order, order[1:]):
            nxt[a] = b
    late = [res.makespan] * pb.num_nodes
    start = [0.0] * pb.num_nodes
    n = pb.num_nodes
    # a successor ends after its predecessor, so decreasing (early) end times is a reverse topological order
    for v in sorted(range(n), key=lambda x: -res.end[x]):
        t = late[v]
        w = nxt[v]
        if w >= 0 and start[w] < t:
            t = start[w]
        c = v + 1
        if c < n and arr.pred[c] == v and start[c] - arr.lag[c] < t:
            t = start[c] - arr.lag[c]
        late[v], start[v] = t, t - arr.dur[v]
    return late


def order_peak(order, mem: list) -> float:
    """Peak of the prefix sums of ``mem`` over one stage's ``order`` (0 if empty)."""
    live = peak = 0.0
    for v in order:
        live += mem[v]
        if live > peak:
            peak = live
    return peak


def stage_peak_memory(pb: Problem, orders) -> list:
    """Peak live activation memory per fused stage (timing-independent)."""
    mem = pb.arrays.mem
    return [order_peak(order, mem) for order in orders]
