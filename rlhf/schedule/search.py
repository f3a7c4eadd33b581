"""The schedule search: starting pool -> makespan annealing -> memory phase.

:func:`search` is one deterministic search (same problem, config and seed:
same result).  Budgets are nominal seconds converted to a fixed number of
proposals (``RATE / subtasks**RATE_EXPONENT`` per second, fitted to the
rate of the compiled walker measured on a 2-core CI machine), never
wall-clock cut-offs, so results do not depend on machine load.  :func:`search_mpi` runs one search per MPI
rank with seed ``seed + rank`` and keeps the best (least peak memory within
the makespan limit of the best makespan any rank found, then the smallest
makespan, then the lowest rank).

Starting pool: the greedy fused schedule, backfilled schedules (one model's
1F1B fixed, the others in its gaps, with bounded or unbounded warm-up) and
dynamic list-scheduling rules (warm-up depth per model x model priority x
B-or-F first, finer depths (:func:`fine_depths`) F first for two models, and
*balanced* rules that advance the models together, also built under caps of
1.0/1.25/1.5x the serial peak), each relabelled into micro-batch order
(:func:`problem.in_microbatch_order`); only the starts within the cap are
kept: ``mem_cap``, the problem's, else ``mem_ceiling`` x the serial peak
(:func:`search_cap`; serial 1F1B is one candidate; if none fits,
:func:`pick_starts` raises ProblemError).

Makespan phase: two starts are annealed for makespan: the lowest-memory
start within 1% of the best start's makespan, within its own peak memory
(half the budget, less if it reaches the target), and the best start (the
rest), each stopping at :func:`makespan_target` (the bound, or with a slack
the makespan whose limit is 1% over the bound).  Its best makespan ``M``
sets the limit of the memory phase, :func:`makespan_limit`: ``M x (1 +
makespan_slack)`` (an ``M`` below the target counts as the target), never
beyond 1% over the lower bound unless ``M`` already is.

Memory phase (the memory budget plus makespan proposals left by an early
stop): a *cap ladder* (``ladder_share`` of it) anneals for makespan within
caps of ``ladder`` x the serial 1F1B peak, from 1.5x down while it reaches
the limit (each rung racing the ``rung_starts`` fastest starts that fit the
cap, :func:`race`, in reheated rounds), or, if 1.5x fails, upwards; the
lowest cap that reached the limit gives the schedule.  Then up to
POLISH_ROUNDS rounds (:func:`_polish`) of the memory pass
(:func:`anneal.anneal_memory`: lowers the peak further without passing the
limit, stopping at the serial peak or when it stalls) and the speed pass
(SPEED_SHARE of the round and what the memory pass left: anneals for
makespan within the peak reached).  The result is never slower than the
limit nor above the makespan phase's peak.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from itertools import product

from .anneal import AnnealConfig, AnnealStats, anneal_makespan, anneal_memory
from .generators import (Rule, backfill_schedule, greedy_fused, model_size_order, rule_schedule,
                         serial_1f1b, serial_1f1b_makespan)
from .lower_bound import makespan_lower_bound, serial_peak_memory
from .problem import Problem, ProblemError, in_microbatch_order
from .schedule import Schedule
from .simulate import simulate, stage_peak_memory
from .validate import check_schedule

# proposals per nominal second = RATE / subtasks**0.6: the compiled walker's rate on the 2-core CI VM
# (225k/s at 384 subtasks, 123k/s at 1536, 60k/s at 4096, idle, one process), less a fifth for two ranks
RATE, RATE_EXPONENT = 7.5e6, 0.6
CAP_SWEEP = (1.0, 1.25, 1.5)  # x serial 1F1B peak: list-rule starts built under these caps
BOUND_TOLERANCE = 0.01  # issue 12: "within 1% of the lower bound"
RUNG_SHARE = 0.75  # of the ladder's proposals left, for each rung but the last possible one
SPEED_SHARE = 0.2  # of a polish round's proposals: the speed pass at the reached peak (see _polish)
POLISH_ROUNDS = 3
REHEAT_S = 25.0  # nominal seconds of one annealing round of a cap-ladder rung (see _anneal_reheated)
RACE_SHARE = 0.25  # of a rung's proposals, for each racing round (see race)
BALANCE_SKEWS = (0.02, 0.05)  # balanced list-rule starts: the larger model's head start
LAZY_IN_FLIGHT = (0, 1, 2, 3, 4, 5, 6, 8, None)
"""Lazy backfill starts: the other models' micro-batches in flight at most. Each step trades memory for
makespan (65B/33B 16/8 mb64: 4 -> 2.63% above the bound at 1.48x, 6 -> 1.01% at 1.63x, 8 -> 0.04% at 1.78x),
so the cap ladder's rungs start near their cap's best."""


@dataclass(frozen=True)
class SearchConfig:
    """``budget_s``: nominal seconds of makespan annealing; ``memory_budget_s``:
    of the memory phase; ``mem_cap``: per-stage activation cap (problem units);
    ``makespan_slack``: how much the memory phase may lengthen the best
    makespan (see :func:`makespan_limit`); ``ladder``: the cap ladder's rungs
    (x the serial 1F1B peak), tried from the largest at most ``ladder_first``;
    ``ladder_share``: the ladder's part of the memory budget (the memory pass
    gets the rest); ``rung_starts``: how many starts a rung races (:func:`race`;
    1: the fastest start that fits alone); ``mem_ceiling``: without a cap (``mem_cap``, or the
    problem's), every phase holds at most this multiple of the serial 1F1B
    peak (None: no bound, the fastest schedule found is kept however much
    memory it holds); ``anneal``: annealing knobs (its ``iters`` and
    ``mem_cap`` are set here)."""

    budget_s: float = 30.0
    memory_budget_s: float = 10.0
    seed: int = 0
    mem_cap: float | None = None
    mem_ceiling: float | None = 2.0
    makespan_slack: float = 0.009
    rung_starts: int = 8
    ladder: tuple = (1.0, 1.25, 1.5, 2.0)
    ladder_first: float = 1.5
    ladder_share: float = 0.8
    anneal: AnnealConfig = field(default_factory=lambda: AnnealConfig(t0_scale=1e-3))

    def __post_init__(self):
        if self.budget_s < 0 or self.memory_budget_s < 0:
            raise ValueError(f"SearchConfig budgets ({self.budget_s}, {self.memory_budget_s}) "
                             "must be >= 0 seconds")
        if not 0 <= self.makespan_slack <= 1:
            raise ValueError(f"SearchConfig.makespan_slack={self.makespan_slack} must lie in [0, 1]")
        if not self.ladder or any(x <= 0 for x in self.ladder) or self.ladder_first <= 0:
            raise ValueError(f"SearchConfig.ladder={self.ladder}, ladder_first={self.ladder_first}: "
                             "give positive multiples of the serial 1F1B peak")
        if not (isinstance(self.rung_starts, int) and self.rung_starts >= 1):
            raise ValueError(f"SearchConfig.rung_starts={self.rung_starts!r} must be a positive integer")
        if not 0 <= self.ladder_share <= 1:
            raise ValueError(f"SearchConfig.ladder_share={self.ladder_share} must lie in [0, 1]")
        if self.mem_ceiling is not None and not self.mem_ceiling >= 1:
            raise ValueError(f"SearchConfig.mem_ceiling={self.mem_ceiling} must be >= 1 (x the serial 1F1B peak, "
                             "which serial 1F1B meets) or None")


@dataclass
class SearchResult:
    problem: Problem
    orders: list
    makespan: float
    peak_mem: list
    greedy_makespan: float
    greedy_peak_mem: list
    serial_makespan: float
    serial_peak_mem: list
    lower_bound: float
    start_name: str
    seed: int
    evaluations: int = 0
    anneal_seconds: float = 0.0
    seconds: float = 0.0
    best_makespan: float = 0.0  # the makespan phase's result, before the memory phase
    best_peak: float = 0.0
    phases: list = field(default_factory=list)  # Phase records, in the order the search ran them

    @property
    def schedule(self) -> Schedule:
        return Schedule.from_orders(self.problem, self.orders, self.metrics())

    @property
    def evals_per_second(self) -> float:
        return self.evaluations / self.anneal_seconds if self.anneal_seconds > 0 else 0.0

    @property
    def gap(self) -> float:
        """Relative excess of the makespan over the lower bound (0.01 = 1%)."""
        gap = self.makespan / self.lower_bound - 1
        return 0.0 if abs(gap) < 1e-9 else gap  # no "-0.00%" from rounding

    def metrics(self) -> dict:
        return {"makespan": self.makespan, "lower_bound": self.lower_bound,
                "serial_1f1b": self.serial_makespan, "greedy": self.greedy_makespan,
                "peak_act_mem": self.peak_mem, "serial_peak_act_mem": self.serial_peak_mem,
                "greedy_peak_act_mem": self.greedy_peak_mem, "start": self.start_name,
                "best_makespan": self.best_makespan, "best_peak_act_mem": self.best_peak,
                "seed": self.seed, "evaluations": self.evaluations,
                "evals_per_second": self.evals_per_second,
                "phases": [vars(p) for p in self.phases]}


@dataclass(frozen=True)
class Phase:
    """What one part of the search reached: its name (``start pool``, ``makespan``, ``cap 1.5x``,
    ``memory pass``, ``speed pass``), the start it worked from, the makespan and peak memory (max over
    stages) of its result, and whether the search could use that result (``kept``: false for a rung that
    missed the makespan limit)."""

    name: str
    start: str
    makespan: float
    peak: float
    kept: bool


def start_pool(pb: Problem, mem_cap: float | None) -> list:
    """(name, orders) of deadlock-free starts within ``mem_cap``, best first
    (smallest makespan, then smallest peak memory), each in micro-batch order
    (:func:`problem.in_microbatch_order`)."""
    cands = [("greedy", greedy_fused(pb))]
    serial_peak = max(serial_peak_memory(pb))
    sweep = [serial_peak * x for x in CAP_SWEEP]
    caps = [None] + [c for c in sweep if mem_cap is None or c < mem_cap] + ([] if mem_cap is None else [mem_cap])
    nm = len(pb.models)
    for first, extra, other in product(range(nm), (0, 2, 10**6), (0, 1, 2, 4, None)):
        cands.append((f"backfill(first={pb.models[first].name},extra={extra},others={other})",
                      backfill_schedule(pb, first, extra, other)))
    for first, other in product(range(nm), LAZY_IN_FLIGHT):
        cands.append((f"backfill(first={pb.models[first].name},lazy,others={other})",
                      backfill_schedule(pb, first, 0, other, lazy=True)))
    depths = (0, 2, None)
    for cap, extra in product(caps, product(depths, repeat=nm)):
        for first in range(nm):
            for b_first in (True, False):
                rule = Rule(extra, _first_then_others(nm, first), b_first)
                tag = "" if cap is None else f",cap={cap / serial_peak:.2f}x"
                cands.append((f"rule(extra={extra},first={pb.models[first].name},"
                              f"b_first={b_first}{tag})", rule_schedule(pb, rule, cap)))
    size_order = tuple(model_size_order(pb))
    fine = [fine_depths(m.pp) for m in pb.models]
    for extra in product(*fine) if nm <= 2 else ():  # 8^models starts: two models at most
        for first in range(nm) if not set(extra) <= set(depths) else ():  # those are in the loop above
            cands.append((f"rule(extra={extra},first={pb.models[first].name},b_first=False)",
                          rule_schedule(pb, Rule(extra, _first_then_others(nm, first), False))))
    extras = [(e,) * nm for e in (0, 4, 8, None)] + [(0,) + (None,) * (nm - 1), (None,) + (0,) * (nm - 1)]
    for cap, extra, balance in product(caps, extras, BALANCE_SKEWS):
        tag = "" if cap is None else f",cap={cap / serial_peak:.2f}x"
        cands.append((f"balanced(extra={extra},skew={balance}{tag})",
                      rule_schedule(pb, Rule(extra, size_order, balance=balance), cap)))
    cands.append(("serial_1f1b", serial_1f1b(pb)))
    scored = []
    for k, (name, orders) in enumerate(cands):
        if orders is None:
            continue
        orders = in_microbatch_order(pb, orders)  # the annealer's moves keep this order
        res = simulate(pb, orders)
        if not res.ok:
            continue
        peak = max(stage_peak_memory(pb, orders))
        if mem_cap is not None and peak > mem_cap + 1e-9:
            continue
        scored.append((round(res.makespan, 6), peak, k, name, orders))
    scored.sort(key=lambda x: x[:3])
    return [Start(name, orders, ms, peak) for ms, peak, _, name, orders in scored]


def _first_then_others(nm: int, first: int) -> tuple:
    """Model priority of a list rule: ``first``, then the others in index order."""
    return (first,) + tuple(i for i in range(nm) if i != first)


def fine_depths(pp: int) -> tuple:
    """Warm-up depths beyond 1F1B of the F-first list-rule starts for a model of ``pp`` stages: few, and
    fractions of ``pp``, so the cap ladder's rungs start from the fastest within their cap (65B/33B 16/8
    mb64, latency model 2: depths (1, 1) are 1.12% above the bound at 1.44x, where (0, 2, None) gave 2.73%;
    16/16 mb64, latency model 0: (2, 16) 1.82% at 1.88x, where the pool's best within 2x was 3.60%)."""
    return tuple(sorted({0, 1, 2, pp // 4, pp // 2, 3 * pp // 4, pp})) + (None,)


@dataclass(frozen=True)
class Start:
    name: str
    orders: list
    makespan: float
    peak: float


def pick_starts(pool: list, tol: float = 0.01) -> list:
    """The best-makespan start and, if different, the lowest-memory start
    within ``tol`` of its makespan (annealed under its own peak)."""
    if not pool:
        raise ProblemError("no start schedule fits the memory cap; a cap below the serial "
                           "1F1B peak (see lower_bound.serial_peak_memory) may be infeasible")
    lead = pool[0]
    lean = min((x for x in pool if x.makespan <= lead.makespan * (1 + tol)), key=lambda x: x.peak)
    return [lead] if lean is lead else [lean, lead]


def search(pb: Problem, cfg: SearchConfig = SearchConfig()) -> SearchResult:
    """One deterministic search (see the module docstring): same ``pb``, ``cfg``
    and seed give the same orders.  The result is validated within the cap
    (``cfg.mem_cap``, else ``pb.mem_cap``); ProblemError if no start fits it."""
    tic = time.perf_counter()
    cap = search_cap(pb, cfg)
    lb = makespan_lower_bound(pb)
    greedy = greedy_fused(pb)
    per_s = proposals_per_second(pb)
    pool = start_pool(pb, cap)
    stats = AnnealStats()
    iters = int(cfg.budget_s * per_s)
    starts = pick_starts(pool)  # refuses an empty pool
    phases = [Phase("start pool", pool[0].name, pool[0].makespan, pool[0].peak, True)]
    best, name = _anneal_starts(pb, starts, cap, iters, makespan_target(lb, cfg.makespan_slack), cfg, stats)
    ms, best_peak = simulate(pb, best).makespan, max(stage_peak_memory(pb, best))
    phases.append(Phase("makespan", name, ms, best_peak, True))
    limit = makespan_limit(ms, lb, cfg.makespan_slack)
    # makespan proposals left by an early stop at the bound go to the memory phase
    mem_iters = iters - stats.proposals + int(cfg.memory_budget_s * per_s)
    ladder = int(mem_iters * cfg.ladder_share)
    best, name, used = _cap_ladder(pb, pool, best, name, limit, ladder, cfg, stats, phases)
    best = _polish(pb, best, name, limit, lb, mem_iters - used, cap, cfg, stats, phases)
    res, peaks = simulate(pb, best), stage_peak_memory(pb, best)
    check_schedule(Schedule.from_orders(pb, best), mem_cap=cap)
    return SearchResult(
        problem=pb, orders=best, makespan=res.makespan,
        peak_mem=peaks, greedy_makespan=simulate(pb, greedy).makespan,
        greedy_peak_mem=stage_peak_memory(pb, greedy), serial_makespan=serial_1f1b_makespan(pb),
        serial_peak_mem=serial_peak_memory(pb), lower_bound=lb, start_name=name, seed=cfg.seed,
        evaluations=stats.evaluations, anneal_seconds=stats.seconds,
        seconds=time.perf_counter() - tic, best_makespan=ms, best_peak=best_peak, phases=phases)


def search_cap(pb: Problem, cfg: SearchConfig) -> float | None:
    """The activation cap every phase keeps: ``cfg.mem_cap``, else the problem's, else ``cfg.mem_ceiling`` x
    the serial 1F1B peak (None without any)."""
    for cap in (cfg.mem_cap, pb.mem_cap):
        if cap is not None:
            return cap
    return None if cfg.mem_ceiling is None else cfg.mem_ceiling * max(serial_peak_memory(pb))


def makespan_limit(best: float, lower_bound: float, slack: float) -> float:
    """The makespan the memory phase must keep: ``best`` x (1 + ``slack``), a ``best`` faster than
    :func:`makespan_target` counting as the target (where the makespan phase stops: its last step may
    overshoot, 65B/33B 16/8 mb64 under latency model 4 stopped 0.03% above the bound, and the overshoot
    must not tighten the limit), but not beyond BOUND_TOLERANCE over the lower bound when ``best`` is
    within it (the slack never costs the target); a ``best`` beyond it already misses the target, and
    keeps the whole slack."""
    limit = max(best, makespan_target(lower_bound, slack)) * (1 + slack)
    tolerated = lower_bound * (1 + BOUND_TOLERANCE)
    return min(limit, tolerated) if best <= tolerated else limit


def makespan_target(lower_bound: float, slack: float) -> float:
    """The makespan at which annealing for speed stops: the bound with no slack (the fastest
    schedule is asked for), else the makespan whose limit is BOUND_TOLERANCE over the bound
    (:func:`makespan_limit`): a faster one would not widen the memory phase's limit, so the
    proposals are worth more there."""
    return lower_bound if slack == 0 else lower_bound * max(1.0, (1 + BOUND_TOLERANCE) / (1 + slack))


def _anneal_starts(pb, starts, cap, iters, target, cfg, stats) -> tuple:
    """Anneal the starts (a lean one within its own peak memory, the last,
    best one within the cap only); returns the best (orders, start name) by
    makespan, then peak memory."""
    found = []
    for k, start in enumerate(starts):
        last = k == len(starts) - 1
        own = None if last else start.peak
        acfg = replace(cfg.anneal, iters=iters if last else iters // 2,
                       mem_cap=min((x for x in (own, cap) if x is not None), default=None))
        orders, st = anneal_makespan(pb, start.orders, acfg, seed=cfg.seed + 104729 * k,
                                     target=target)
        iters -= st.proposals
        stats.add(st)
        ms = simulate(pb, orders).makespan
        found.append((round(ms, 6), max(stage_peak_memory(pb, orders)), k, orders, start.name))
    _, _, _, best, name = min(found, key=lambda x: x[:3])
    return best, name


def _cap_ladder(pb, pool, best, name, limit, iters, cfg, stats, phases) -> tuple:
    """Lower the peak memory while keeping the makespan within ``limit``.

    Rungs are caps of ``cfg.ladder`` x the serial 1F1B peak below the current
    peak.  The first tried is the largest at most ``cfg.ladder_first``; each
    success tries the next lower rung, and the first failure after a success
    ends the ladder.  If the first rung fails, the higher rungs are tried in
    turn, each continuing from the previous rung's result (it fits the
    larger cap and is closer to the target than the pool's starts).  A rung
    anneals for makespan within its cap from the ``cfg.rung_starts`` best-makespan
    starts that fit it (the last rung's result among them; :func:`race`), until the makespan is within
    ``limit``; it gets RUNG_SHARE of the proposals left (the last possible
    rung all of them).  Returns (orders, name, proposals used)."""
    serial_peak = max(serial_peak_memory(pb))
    peak = max(stage_peak_memory(pb, best))
    rungs = [x for x in cfg.ladder if x * serial_peak < peak - 1e-9]
    down = sorted((x for x in rungs if x <= cfg.ladder_first), reverse=True)
    up = sorted(x for x in rungs if x > cfg.ladder_first)
    if not down:
        down, up = up[:1], up[1:]
    queue, used, found, carry, k = down, 0, None, [], 0
    while queue:
        rung = queue.pop(0)
        k += 1
        cap = rung * serial_peak
        last = not queue and (found is not None or not up)
        share = iters - used if last else int(RUNG_SHARE * (iters - used))
        fits = [x for x in carry if max(stage_peak_memory(pb, x[1])) <= cap + 1e-9]
        fits += distinct_starts([(x.makespan, x.orders, x.name) for x in pool if x.peak <= cap + 1e-9],
                          cfg.rung_starts - len(fits))
        if not fits or share <= 0:
            break
        orders, start_name, proposals = race(pb, fits, replace(cfg.anneal, mem_cap=cap), share,
                                              cfg.seed + 15485863 * k, limit, stats)
        used += proposals
        ms = simulate(pb, orders).makespan
        result = (ms, orders, f"{start_name} within cap {rung:g}x")
        carry = [result]
        reached = ms <= limit * (1 + 1e-12)
        phases.append(Phase(f"cap {rung:g}x", start_name, ms, max(stage_peak_memory(pb, orders)), reached))
        if reached:
            found = result
        elif found is not None:
            break
        else:  # no rung has reached the limit yet: continue upwards
            queue, up = up, []
    if found is None:
        return best, name, used
    return found[1], found[2], used


def distinct_starts(starts: list, count: int) -> list:
    """The first ``count`` of ``starts`` ((makespan, orders, name), best first) with different orders."""
    out, seen = [], set()
    for start in starts:
        key = tuple(map(tuple, start[1]))
        if key not in seen and len(out) < count:
            seen.add(key)
            out.append(start)
    return out


def race(pb, starts, acfg, iters, seed, target, stats) -> tuple:
    """Anneal from each of ``starts`` ((makespan, orders, name)) and keep the better half, in rounds of
    RACE_SHARE of ``iters`` each, until one is left, which gets the rest; stops at the first to reach
    ``target``.  Under a cap the start decides where the annealing ends, and the fastest start is not the
    best one: 65B/33B 16/8 mb64 under latency model 3 within 1.5x, 8 nominal s from each of the 12 fastest
    starts ended 2.05-5.49% above the bound, 4.95% from the fastest; a race over 8 of them ended at 2.32%,
    16/16 mb64 at 1.15% (a single start: 4.36% and 1.46%).  Returns (orders, start name, proposals used)."""
    cands = [[ms, orders, name] for ms, orders, name in sorted(starts, key=lambda x: x[0])]
    used, r = 0, 0
    while len(cands) > 1:
        each = int(RACE_SHARE * iters) // len(cands)
        for i, cand in enumerate(cands):
            orders, proposals = _anneal_reheated(pb, cand[1], acfg, each, seed + 7919 * r + i, target, stats)
            used += proposals
            cand[0], cand[1] = simulate(pb, orders).makespan, orders
            if cand[0] <= target * (1 + 1e-12):
                return orders, cand[2], used
        cands = sorted(cands, key=lambda x: x[0])[:len(cands) // 2]
        r += 1
    orders, proposals = _anneal_reheated(pb, cands[0][1], acfg, iters - used, seed + 7919 * r, target, stats)
    return orders, cands[0][2], used + proposals


def _polish(pb, best, name, limit, lb, iters, cap, cfg, stats, phases) -> list:
    """Up to POLISH_ROUNDS rounds of the memory pass (lower the peak within ``limit``, SPEED_SHARE of the
    round's proposals kept back) and the speed pass (anneal for makespan within the peak reached, with the
    rest).  The memory pass spends the slack up to the limit even where it wins no memory; the speed pass
    wins it back, and the next round spends it on memory again (65B/33B 16/8 mb32 under latency model 3:
    1.51x at 1.00% above the bound, then 0.47% at 1.51x, ...).  A memory pass that lowers no peak is
    dropped and its round's speed pass, the last, gets every proposal left."""
    floor = max(serial_peak_memory(pb))
    for k in range(POLISH_ROUNDS):
        share = iters // (POLISH_ROUNDS - k)
        budget = int(share * (1 - SPEED_SHARE))
        lean, st = anneal_memory(pb, best, replace(cfg.anneal, iters=budget, mem_cap=cap), seed=cfg.seed + 7919 + k,
                                 makespan_limit=limit, floor=floor, patience=max(1, budget // 4))
        stats.add(st)
        iters -= st.proposals
        peak, lowered = max(stage_peak_memory(pb, lean)), False
        if peak < max(stage_peak_memory(pb, best)) - 1e-9:
            best, lowered = lean, True
        phases.append(Phase("memory pass", name, simulate(pb, lean).makespan, peak, lowered))
        last = not lowered or peak <= floor + 1e-9 or k == POLISH_ROUNDS - 1
        peaks = stage_peak_memory(pb, best)
        scfg = replace(cfg.anneal, iters=iters if last else share - st.proposals, mem_cap=max(peaks))
        best, st = anneal_makespan(pb, best, scfg, seed=cfg.seed + 3571 + k, target=lb)
        stats.add(st)
        iters -= st.proposals
        phases.append(Phase("speed pass", name, simulate(pb, best).makespan, max(stage_peak_memory(pb, best)), True))
        if last:
            break
    return best


def _anneal_reheated(pb, orders, acfg, iters, seed, target, stats) -> tuple:
    """Anneal for makespan in rounds of REHEAT_S nominal seconds, each reheated from the best so far,
    until ``target`` or ``iters`` proposals: a rung under a cap stalls on a plateau that one long
    cooling does not leave (65B/33B 16/8 mb64, latency model 1, cap 1.5x: 1.13%, 1.11%, then 0.93%
    above the bound after three rounds of 100k). Returns (orders, proposals used)."""
    chunk = max(1, int(REHEAT_S * proposals_per_second(pb)))
    used, k = 0, 0
    while used < iters:
        n = min(chunk, iters - used)
        orders, st = anneal_makespan(pb, orders, replace(acfg, iters=n), seed=seed + k, target=target)
        used, k = used + st.proposals, k + 1
        stats.add(st)
        if st.proposals < n:  # a round ends early only at the target
            break
    return orders, used


def proposals_per_second(pb: Problem) -> float:
    """Annealing proposals per nominal second of budget for ``pb`` (module docstring)."""
    return RATE / max(1, pb.num_nodes) ** RATE_EXPONENT


def world_comm():
    """mpi4py's ``COMM_WORLD`` (one rank when not under mpiexec), or None without mpi4py."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD


def search_mpi(pb: Problem, cfg: SearchConfig = SearchConfig(), comm=None) -> SearchResult:
    """One search per MPI rank (seed + rank; odd ranks race no starts on a rung,
    ``rung_starts`` = 1); every rank returns the best: the
    least peak memory among the results within :func:`makespan_limit` of the
    best makespan any rank found (else the smallest makespan), then the
    smallest makespan, then the lowest rank.  Without mpi4py this is
    :func:`search`."""
    comm = comm if comm is not None else world_comm()
    if comm is None:
        return search(pb, cfg)
    rank = comm.Get_rank()
    # a portfolio: odd ranks anneal each rung from its fastest start alone, even ranks race the starts
    # (which wins differs by problem: under latency model 3, 16/8 mb64 1.5x 4.36% alone, 2.22% raced;
    # 16/16 mb32 0.92% alone, 1.86% raced)
    res = search(pb, replace(cfg, seed=cfg.seed + rank, rung_starts=cfg.rung_starts if rank % 2 == 0 else 1))
    keys = comm.allgather((res.makespan, max(res.peak_mem), rank, res.best_makespan))
    limit = makespan_limit(min(k[3] for k in keys), res.lower_bound, cfg.makespan_slack)
    within = [(peak, ms, r) for ms, peak, r, _ in keys if ms <= limit * (1 + 1e-12)]
    winner = min(within)[2] if within else min(keys)[2]
    best = comm.bcast(res if rank == winner else None, root=winner)
    best.evaluations = sum(comm.allgather(res.evaluations))
    best.anneal_seconds = sum(comm.allgather(res.anneal_seconds))  # rate per process
    return best


def format_summary(res: SearchResult) -> str:
    """The stdout table: serial 1F1B, greedy, annealed, lower bound."""
    pb = res.problem
    sp = max(res.serial_peak_mem)
    rows = [("serial 1F1B", res.serial_makespan, sp),
            ("greedy fused", res.greedy_makespan, max(res.greedy_peak_mem)),
            ("annealed", res.makespan, max(res.peak_mem)),
            ("lower bound", res.lower_bound, sp)]
    out = [f"{'schedule':<14}{'makespan (' + pb.time_unit + ')':>18}{'speedup':>9}"
           f"{'peak act (' + pb.mem_unit + ')':>18}{'x serial':>10}"]
    for name, ms, mem in rows:
        out.append(f"{name:<14}{ms:>18.2f}{res.serial_makespan / ms:>9.3f}{mem:>18.3f}"
                   f"{mem / sp if sp else float('nan'):>10.2f}")
    out.append(f"annealed is {100 * res.gap:.2f}% above the lower "
               f"bound; start: {res.start_name}; {res.evaluations} evaluations, "
               f"{res.evals_per_second:.0f}/s; search {res.seconds:.1f}s")
    out.append("phases (each one's result: above the bound, x the serial 1F1B peak; * kept):")
    for p in res.phases:
        above = 100 * max(0.0, p.makespan / res.lower_bound - 1)
        out.append(f"  {p.name:<12} {above:>7.2f}% {p.peak / sp if sp else 0:>6.2f}x{' *' if p.kept else '  '} "
                   f"from {p.start}")
    return "\n".join(out)
