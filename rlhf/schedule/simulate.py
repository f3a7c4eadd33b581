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


class Walker:
    """A schedule the annealer edits one stage at a time, with its simulation: ``ok`` and ``makespan`` of
    the current orders, ``end[v]`` their end times.

    * ``trial(s, new, cut)`` re-simulates the orders with stage ``s`` replaced by ``new`` from the subtasks
      that started at or after ``cut`` (:func:`simulate_from`; ``cut`` must be at most the old start of the
      first edited position) and returns (makespan, mean end of the stages' last subtasks), makespan inf on
      a deadlock; ``accept()`` makes that trial current.
    * ``critical_edges(seed)``: :func:`critical_edges` of the current orders.
    * ``peak(order)``: :func:`order_peak` of a stage order.

    The compiled walker (``rlhf.schedule.native``) is the same code in C, bit for bit; :func:`walker`
    picks."""

    def __init__(self, pb: Problem, orders):
        self.pb = pb
        self.orders = [list(o) for o in orders]
        res = simulate(pb, self.orders)
        self.end, self.makespan, self.ok = res.end, res.makespan, res.ok
        self._pos = positions(self.orders)
        self._trial = None

    def trial(self, s: int, new: list, cut: float) -> tuple:
        cand = self.orders[:]
        cand[s] = new
        end, dur = self.end, self.pb.arrays.dur
        res = simulate_from(self.pb, cand, end, lambda v: end[v] - dur[v], cut)
        self._trial = (s, cand, res)
        if not res.ok:
            return INF, 0.0
        return res.makespan, sum(res.end[o[-1]] for o in cand if o) / len(cand)

    def accept(self) -> None:
        s, cand, res = self._trial
        self.orders, self.end, self.makespan, self._trial = cand, res.end, res.makespan, None
        for k, v in enumerate(cand[s]):
            self._pos[v] = k

    def critical_edges(self, seed: int) -> list:
        return critical_edges(self.pb, self.orders, self.end, self._pos, seed)

    def peak(self, order) -> float:
        return order_peak(order, self.pb.arrays.mem)


def positions(orders) -> list:
    """``pos[v]``: the place of subtask ``v`` in its stage's order."""
    pos = [0] * sum(len(o) for o in orders)
    for order in orders:
        for k, v in enumerate(order):
            pos[v] = k
    return pos


MASK64 = (1 << 64) - 1


def _splitmix(state: int) -> tuple:
    """(next state, 64 random bits): splitmix64, the walkers' one source of coin flips (same in C)."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def critical_edges(pb: Problem, orders, end: list, pos: list, seed: int) -> list:
    """Stage edges ``(s, i)`` (``orders[s][i-1]`` delayed ``orders[s][i]``) on one critical path, traced
    back from the last subtask to finish (``pos``: the orders' :func:`positions`); where both predecessors
    bind, a coin from ``seed`` (splitmix64) picks one.  Only edges a move can break are listed: not two
    subtasks of one queue, nor an F and its own B.  On 65B/33B 16/8 mb32 under latency model 3 those are
    half the edges of the pool's starts' paths, and drawing them left 9.7k of 50k proposals for simulation
    (39.6k without them)."""
    arr = pb.arrays
    pred, lag, dur, stage, queue, partner = arr.pred, arr.lag, arr.dur, arr.stage, arr.queue, arr.partner
    v, state = -1, seed & MASK64
    for order in orders:  # the last subtask to finish, the first stage's on a tie
        if order and (v < 0 or end[order[-1]] > end[v]):
            v = order[-1]
    edges = []
    eps = 1e-9 * max(1.0, end[v])
    while True:
        start = end[v] - dur[v]
        if start <= eps:
            return edges
        s, k, p = stage[v], pos[v], pred[v]
        chain_binds = p >= 0 and end[p] + lag[v] >= start - eps
        stage_binds = k > 0 and end[orders[s][k - 1]] >= start - eps
        if stage_binds and chain_binds:
            state, bits = _splitmix(state)
            stage_binds = bits >> 63 == 1
        if stage_binds:
            u = orders[s][k - 1]
            if queue[u] != queue[v] and partner[u] != v:
                edges.append((s, k))
            v = u
        elif chain_binds:
            v = p
        else:
            return edges


def walker(pb: Problem, orders):
    """The compiled walker when it builds here (``native.compiled_walker``), else :class:`Walker`; the same
    interface and end times either way."""
    from .native import compiled_walker

    compiled = compiled_walker()
    if compiled is None:
        return Walker(pb, orders)
    arr = pb.arrays
    return compiled(arr.pred, arr.lag, arr.dur, arr.mem, arr.stage, arr.queue, arr.partner, [list(o) for o in orders])


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
