"""Simulated annealing over per-stage orders (RLHFuse section 5, extended).

State: per fused stage, the order of its subtask ids.  Energy: the makespan
from :mod:`simulate` (longest path by event walk), plus a small tie-break
(``tie`` x the mean stage finish time) so that moves which shorten
non-critical stages are preferred on the makespan plateaus.  Temperature:
``t0`` (RLHFuse: the greedy makespan) cooled geometrically to ``t_end`` over
``iters`` proposals.  The best state ever seen is returned, so the result is
never worse than the start.

Moves, all on one random stage, never reorder a stage's subtasks of one queue
(the forwards, or the backwards, of one model pipeline: the same work for
different micro-batches), so a start in micro-batch order
(:func:`problem.in_microbatch_order`) stays in it: a reordered queue is the
same schedule with the micro-batches relabelled, or a slower one, so such
proposals only spend simulations (65B/33B 16/8 mb16 under latency model 0,
300k proposals from the pool's best: 2.56% and 3.44% above the bound with two
seeds against 3.89% and 4.45%).  A proposal that breaks a same-stage
F-before-B rule is dropped, and still counts against ``iters``; one that
deadlocks across stages is rejected by simulation:

* ``swap``  - swap two adjacent subtasks of different queues (RLHFuse's neighbour);
* ``shift`` - move one subtask to another position within ``window``, not past
  one of its own queue;
* ``cross`` - swap two subtasks of different models within ``window`` when
  nothing between them is of their queues;
* ``critical`` - pick an edge ``u -> v`` of the current critical path where
  ``v`` waited for ``u`` on their stage, and move ``v`` before ``u`` or
  ``u`` after ``v`` (up to ``window`` places): the job-shop "critical block"
  neighbourhood; only such moves can shorten the longest path.

A shift or critical move that takes ``v`` earlier jumps only over subtasks
that end after ``v``'s chain predecessor starts (*safe jumps*): one that ends
before cannot be delayed usefully (``v`` would wait for its predecessor
anyway) and may be its ancestor (an ancestor of the predecessor ends before
it starts), which would deadlock.  The jump length is drawn within that
range, so these proposals never waste a simulation on such a cycle (on the
16/16-stage problems half the unrestricted jumps deadlocked).  Moves that
take a subtask later are not restricted: delaying a forward behind later
backwards is what lowers memory under a cap.

Each proposal re-simulates only from the earliest edited position's old
start time (:func:`simulate.simulate_from`), by a walker (:func:`simulate.walker`:
the compiled one where it builds, the same end times and critical paths as the
Python one; 20k proposals on 65B/33B 16/8 mb64 under a 1.5x cap took 0.3 s
instead of 8.4 s).  With ``mem_cap`` a proposal
that lifts the edited stage's peak activation memory above the cap is
rejected, so every state visited respects the cap if the start does.

The memory pass (:func:`anneal_memory`) uses swap, shift and cross moves plus
moves that push an F past a stage's peak (or pull a B before it), with
energy = peak activation memory (max over stages, plus small weights on the
mean peak and on the mean live memory, which give every useful move a
signal), rejects any proposal that makes the makespan exceed a limit, and
stops at a floor (the serial 1F1B peak) or when it stalls.  It polishes; the
large reductions come from the search's cap ladder (annealing for makespan
under falling caps), since a fast high-memory schedule is far, in single
moves that keep the makespan, from a lean one.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace

from .problem import Problem
from .simulate import INF, order_peak, walker

MOVES = ("swap", "shift", "cross", "critical")


@dataclass(frozen=True)
class AnnealConfig:
    """``iters`` proposals; temperature from ``t0`` (None: the start's
    makespan x ``t0_scale``) down to ``t_end`` (None: t0 x 1e-4);
    ``move_weights`` for swap/shift/cross/critical (see ``MOVES``);
    ``window``: the farthest a shift, cross or critical move reaches;
    ``tie``: weight of the mean stage finish time; ``mem_cap``: per-stage
    activation cap a proposal must respect (None: no cap)."""

    iters: int = 20000
    t0: float | None = None
    t0_scale: float = 1.0
    t_end: float | None = None
    move_weights: tuple = (0.5, 1.0, 1.0, 8.0)
    window: int = 96
    tie: float = 0.05
    mem_cap: float | None = None

    def __post_init__(self):
        if self.iters < 0:
            raise ValueError(f"AnnealConfig.iters={self.iters} must be >= 0")
        if (len(self.move_weights) != len(MOVES) or any(w < 0 for w in self.move_weights)
                or sum(self.move_weights) <= 0):
            raise ValueError(f"AnnealConfig.move_weights={self.move_weights} needs {len(MOVES)} "
                             "non-negative weights (swap, shift, cross, critical), not all zero")
        if self.window < 1:
            raise ValueError(f"AnnealConfig.window={self.window} must be >= 1")
        if self.t0_scale <= 0 or (self.t0 is not None and self.t0 <= 0):
            raise ValueError(f"AnnealConfig t0={self.t0}, t0_scale={self.t0_scale}: the initial "
                             "temperature must be > 0 (t0 None or > 0, t0_scale > 0)")


@dataclass
class AnnealStats:
    proposals: int = 0
    evaluations: int = 0
    accepted: int = 0
    improved: int = 0
    seconds: float = 0.0
    start_energy: float = 0.0
    best_energy: float = 0.0

    @property
    def evals_per_second(self) -> float:
        return self.evaluations / self.seconds if self.seconds > 0 else 0.0

    def add(self, other: "AnnealStats") -> None:
        """Accumulate another pass's counts and time (a search's totals)."""
        self.proposals += other.proposals
        self.evaluations += other.evaluations
        self.accepted += other.accepted
        self.improved += other.improved
        self.seconds += other.seconds


class StageMover:
    """Draws a valid-looking edit of one stage (same-stage F-before-B kept); public so its moves are tested."""

    def __init__(self, pb: Problem, cfg: AnnealConfig, rng: random.Random):
        arr = pb.arrays
        self.model, self.is_fwd, self.mem, self.queue = arr.model, arr.is_fwd, arr.mem, arr.queue
        self.pred, self.dur, self.partner = arr.pred, arr.dur, arr.partner
        self.cfg, self.rng = cfg, rng
        total = sum(cfg.move_weights)
        acc, self.cum = 0.0, []
        for w in cfg.move_weights:
            acc += w / total
            self.cum.append(acc)

    def propose(self, orders, end, critical) -> tuple | None:
        """Returns (stage, first edited position, new stage list) or None.
        ``end``: current end times (for safe jumps); ``critical()`` gives the
        current critical stage edges (cached)."""
        rng = self.rng
        u = rng.random()
        kind = 0
        while kind < len(self.cum) - 1 and u >= self.cum[kind]:
            kind += 1
        if kind == 3:
            return self._critical(orders, end, critical())
        s = rng.randrange(len(orders))
        order = orders[s]
        n = len(order)
        if n < 2:
            return None
        if kind == 0:
            i = rng.randrange(n - 1)
            a, b = order[i], order[i + 1]
            if self.partner[a] == b or self.queue[a] == self.queue[b]:
                return None
            new = order[:]
            new[i], new[i + 1] = b, a
            return s, i, new
        w = self.cfg.window
        i = rng.randrange(n)
        if kind == 1:
            moved = self.jump(order, i, rng.random() < 0.5, end)
            return None if moved is None else (s, *moved)
        k = min(n - 1, max(0, i + rng.randint(-w, w)))
        if k == i:
            return None
        lo, hi = (i, k) if i < k else (k, i)
        a, b = order[lo], order[hi]
        if self.model[a] == self.model[b]:
            return None
        seg = order[lo:hi + 1]
        if self.partner[a] in seg or self.partner[b] in seg or not self.passes(seg, a, b):
            return None
        new = order[:]
        new[lo], new[hi] = b, a
        return s, lo, new

    def jump(self, order, i: int, earlier: bool, end) -> tuple | None:
        """(first edited position, new list) moving ``order[i]`` up to
        ``window`` places earlier or later by a safe jump (see the module
        docstring); None when no place is safe."""
        reach = (self.reach_earlier if earlier else self.reach_later)(order, i, end)
        if reach == 0:
            return None
        k = self.rng.randint(1, reach)
        v = order[i]
        if earlier:
            return i - k, order[:i - k] + [v] + order[i - k:i] + order[i + 1:]
        return i, order[:i] + order[i + 1:i + k + 1] + [v] + order[i + k + 1:]

    def reach_earlier(self, order, i: int, end) -> int:
        """How many places ``order[i]`` may jump earlier: not past its own F
        nor one of its queue, nor past a subtask that ended before its chain
        predecessor started."""
        v = order[i]
        p, f, q = self.pred[v], self.partner[v], self.queue[v]
        queue = self.queue
        ready = end[p] - self.dur[p] if p >= 0 else -INF
        k, lo = 0, max(0, i - self.cfg.window)
        for j in range(i - 1, lo - 1, -1):
            w = order[j]
            if w == f or end[w] <= ready or queue[w] == q:
                break
            k += 1
        return k

    def reach_later(self, order, i: int, end) -> int:
        """How many places ``order[i]`` may jump later: not past its own B nor one of its queue."""
        v = order[i]
        f, q = self.partner[v], self.queue[v]
        queue = self.queue
        k, hi = 0, min(len(order) - 1, i + self.cfg.window)
        for j in range(i + 1, hi + 1):
            w = order[j]
            if w == f or queue[w] == q:
                break
            k += 1
        return k

    def passes(self, seg, a: int, b: int) -> bool:
        """Whether ``a`` and ``b``, the ends of ``seg``, may trade places: nothing between them is of
        their queues (micro-batch order kept)."""
        queue = self.queue
        qa, qb = queue[a], queue[b]
        return not any(queue[w] == qa or queue[w] == qb for w in seg[1:-1])

    def _critical(self, orders, end, edges) -> tuple | None:
        if not edges:
            return None
        rng = self.rng
        s, i = edges[rng.randrange(len(edges))]  # order[s][i-1] -> order[s][i]
        if rng.random() < 0.5:  # v = order[i] jumps before earlier ones
            moved = self.jump(orders[s], i, True, end)
        else:  # u = order[i-1] jumps after later ones
            moved = self.jump(orders[s], i - 1, False, end)
        return None if moved is None else (s, *moved)


def memory_move(orders, peaks, mem, partner, queue, window: int, rng: random.Random) -> tuple | None:
    """Edit of a peak stage that lowers its peak: an F from before the first
    peak position moves past it, or a B from after it moves before it (never
    past its own partner or a subtask of its queue)."""
    top = max(peaks)
    stages = [s for s, p in enumerate(peaks) if p >= top - 1e-9]
    s = stages[rng.randrange(len(stages))]
    order = orders[s]
    live, k1 = 0.0, 0
    for k, v in enumerate(order):
        live += mem[v]
        if live >= top - 1e-9:
            k1 = k
            break
    n = len(order)
    if rng.random() < 0.5:
        i = rng.randint(max(0, k1 - window), k1)
        v = order[i]
        if mem[v] <= 0:
            return None
        j = rng.randint(k1, min(n - 1, k1 + window))
        if j <= i or any(w == partner[v] or queue[w] == queue[v] for w in order[i + 1:j + 1]):
            return None
        new = order[:i] + order[i + 1:j + 1] + [v] + order[j + 1:]
        return s, i, new
    i = rng.randint(min(n - 1, k1 + 1), min(n - 1, k1 + window))
    v = order[i]
    if mem[v] >= 0:
        return None
    j = rng.randint(max(0, k1 - window), k1)
    if j >= i or any(w == partner[v] or queue[w] == queue[v] for w in order[j:i]):
        return None
    new = order[:j] + [v] + order[j:i] + order[i + 1:]
    return s, j, new


def _area(order, mem) -> float:
    """Mean live memory over the stage's positions (a smooth memory signal)."""
    live = total = 0.0
    for v in order:
        live += mem[v]
        total += live
    return total / max(1, len(order))


def _temperatures(cfg: AnnealConfig, reference: float) -> tuple:
    """(initial temperature, cooling factor per proposal): ``t0`` (None:
    ``reference`` x ``t0_scale``) cooled geometrically to ``t_end`` (None:
    t0 x 1e-4) over ``iters`` proposals."""
    t0 = cfg.t0 if cfg.t0 is not None else reference * cfg.t0_scale
    t_end = cfg.t_end if cfg.t_end is not None else t0 * 1e-4
    cool = (t_end / t0) ** (1.0 / max(1, cfg.iters)) if t0 > 0 else 1.0
    return t0, cool


def anneal_makespan(pb: Problem, orders, cfg: AnnealConfig, seed: int,
                    target: float | None = None) -> tuple:
    """Anneal ``orders`` for makespan; returns (best orders, AnnealStats).
    Stops early once the makespan reaches ``target`` (e.g. the lower bound)."""
    rng = random.Random(seed)
    mover = StageMover(pb, cfg, rng)
    dur, mem = pb.arrays.dur, pb.arrays.mem
    cur = [list(o) for o in orders]
    state = walker(pb, cur)
    if not state.ok:
        raise ValueError("anneal_makespan: the starting schedule deadlocks")
    end = state.end
    e_cur = state.makespan + cfg.tie * sum(end[o[-1]] for o in cur if o) / len(cur)
    best, e_best, ms_best = cur, e_cur, state.makespan
    stats = AnnealStats(start_energy=state.makespan)
    temp, cool = _temperatures(cfg, state.makespan)
    crit = []

    def critical():
        if not crit:
            crit.append(state.critical_edges(rng.getrandbits(64)))
        return crit[0]

    stop = -INF if target is None else target * (1 + 1e-9)
    tic = time.perf_counter()
    for _ in range(cfg.iters):
        if ms_best <= stop:
            break
        stats.proposals += 1
        temp *= cool
        prop = mover.propose(cur, end, critical)
        if prop is None:
            continue
        s, first, new = prop
        if cfg.mem_cap is not None and state.peak(new) > cfg.mem_cap + 1e-9:
            continue
        ms, finish = state.trial(s, new, end[cur[s][first]] - dur[cur[s][first]])
        stats.evaluations += 1
        e = ms + cfg.tie * finish if ms < INF else INF
        d = e - e_cur
        if d <= 0 or (e < INF and rng.random() < math.exp(-d / temp)):
            state.accept()
            cur, e_cur, end = _replaced(cur, s, new), e, state.end
            crit.clear()
            stats.accepted += 1
            if ms < ms_best - 1e-9 or (ms <= ms_best + 1e-9 and e < e_best):
                best, e_best, ms_best = cur, e, ms
                stats.improved += 1
    stats.seconds = time.perf_counter() - tic
    stats.best_energy = ms_best
    return best, stats


def _replaced(orders: list, s: int, new: list) -> list:
    """``orders`` with stage ``s`` replaced by ``new`` (a new outer list: a kept best is never edited)."""
    out = orders[:]
    out[s] = new
    return out


def anneal_memory(pb: Problem, orders, cfg: AnnealConfig, seed: int, makespan_limit: float,
                  floor: float = 0.0, patience: int | None = None) -> tuple:
    """Anneal for peak activation memory without exceeding ``makespan_limit``;
    returns (best orders, AnnealStats).  Stops early once the peak is at most
    ``floor`` (e.g. the serial 1F1B peak) or after ``patience`` proposals
    without a new best."""
    rng = random.Random(seed)
    # no critical-path moves: they serve the makespan, which only has to stay within the limit
    mover = StageMover(pb, replace(cfg, move_weights=cfg.move_weights[:3] + (0.0,)), rng)
    dur, mem = pb.arrays.dur, pb.arrays.mem
    cur = [list(o) for o in orders]
    peaks = [order_peak(o, mem) for o in cur]
    areas = [_area(o, mem) for o in cur]
    state = walker(pb, cur)

    def energy(pk, ar):
        return max(pk) + 0.1 * sum(pk) / len(pk) + 0.05 * sum(ar) / len(ar)

    e_cur = energy(peaks, areas)
    best, e_best, best_peak, since = cur, e_cur, max(peaks), 0
    stats = AnnealStats(start_energy=max(peaks))
    temp, cool = _temperatures(cfg, max(max(peaks), 1e-9))
    end = state.end
    limit = makespan_limit + 1e-9
    tic = time.perf_counter()
    for _ in range(cfg.iters):
        if best_peak <= floor + 1e-9 or (patience is not None and since >= patience):
            break
        stats.proposals += 1
        since += 1
        temp *= cool
        if rng.random() < 0.6:
            prop = memory_move(cur, peaks, mem, mover.partner, mover.queue, cfg.window, rng)
        else:
            prop = mover.propose(cur, end, list)
        if prop is None:
            continue
        s, first, new = prop
        pk, ar = peaks[:], areas[:]
        pk[s], ar[s] = order_peak(new, mem), _area(new, mem)
        if cfg.mem_cap is not None and pk[s] > cfg.mem_cap + 1e-9:
            continue
        e = energy(pk, ar)
        d = e - e_cur
        if not (d <= 0 or rng.random() < math.exp(-d / temp)):
            continue
        ms, _ = state.trial(s, new, end[cur[s][first]] - dur[cur[s][first]])
        stats.evaluations += 1
        if ms > limit:  # inf on a deadlock
            continue
        state.accept()
        cur, e_cur, end, peaks, areas = _replaced(cur, s, new), e, state.end, pk, ar
        stats.accepted += 1
        if e < e_best and max(pk) <= best_peak:  # never a higher peak for a better mean
            best, e_best, best_peak, since = cur, e, max(pk), 0
            stats.improved += 1
    stats.seconds = time.perf_counter() - tic
    stats.best_energy = best_peak
    return best, stats
