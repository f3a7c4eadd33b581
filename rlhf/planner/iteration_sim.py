"""One PPO iteration as a graph of calls over rank sets, timed by list scheduling (ReaL Algorithm 1).

A :class:`Call` is a task call (or a weight reallocation) that occupies a set
of ranks for some seconds once its inputs have arrived. An input is an edge
``(call, transfer seconds)``: data produced by an earlier call, moved to this
call's ranks. Scheduling walks the calls in list order::

    ready(c) = max over inputs (p, x) of end(p) + x          data has arrived
    start(c) = max(ready(c), max over ranks r of c of free(r))
    end(c)   = start(c) + seconds(c);  free(r) = end(c) for every rank r of c

Among the calls whose inputs are all scheduled, the one that can start first
goes next (ties: the order given). The end-time update is per rank and
exact: every rank of a call becomes free at that call's end, and only those
ranks; a rank's free time never moves back, because a call starts no earlier
than every one of its ranks is free. The iteration's time is the last end.

With :class:`Sharing` (ranks that share a CPU host's cores) a call's
``seconds`` are its work at full speed, and it runs at
min(1, cores / busy ranks of its node) while other calls keep ranks of that
node busy, so ``end(c)`` is only known as the calls around it end. The walk
is then event by event: at each moment every call whose inputs have arrived
and whose ranks are free starts (in list order), and time moves to the next
arrival or end at the current speeds. Picks are made at non-decreasing
times in both walks, so with every speed 1 the two give the same timeline.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.planner.errors import PlannerError


@dataclass(frozen=True)
class Call:
    """``name`` runs on ``ranks`` for ``seconds`` after every input ``(call name, transfer seconds)``."""

    name: str
    ranks: frozenset
    seconds: float
    inputs: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "ranks", frozenset(self.ranks))
        object.__setattr__(self, "inputs", tuple((p, float(x)) for p, x in self.inputs))
        if not self.ranks or self.seconds < 0 or any(x < 0 for _, x in self.inputs):
            raise PlannerError(f"call {self.name!r}: needs ranks and seconds >= 0 (got {sorted(self.ranks)}, "
                               f"{self.seconds}, inputs {self.inputs})")


@dataclass(frozen=True)
class IterationTimeline:
    """Start and end of every call (seconds from the iteration's start)."""

    start: dict
    end: dict

    @property
    def seconds(self) -> float:
        return max(self.end.values(), default=0.0)

    def rows(self) -> list[tuple[str, float, float]]:
        """(call, start, end) in start order."""
        return sorted(((n, self.start[n], self.end[n]) for n in self.start), key=lambda r: (r[1], r[2]))


@dataclass(frozen=True)
class Sharing:
    """Each node's ``ranks_per_node`` consecutive ranks share ``cores`` compute units (a CPU host)."""

    ranks_per_node: int
    cores: float

    def speeds(self, running: list[Call]) -> list[float]:
        """The speed of each running call: min over its nodes of min(1, cores / busy ranks there)."""
        busy: dict = {}
        for c in running:
            for r in c.ranks:
                busy[r // self.ranks_per_node] = busy.get(r // self.ranks_per_node, 0) + 1
        return [min(min(1.0, self.cores / busy[r // self.ranks_per_node]) for r in c.ranks) for c in running]


def schedule_calls(calls: list[Call], sharing: Sharing | None = None) -> IterationTimeline:
    """List-schedule ``calls`` (see the module docstring); errors name an unknown input or a cycle."""
    by_name = {c.name: c for c in calls}
    if len(by_name) != len(calls):
        raise PlannerError("call names must be unique")
    for c in calls:
        unknown = [p for p, _ in c.inputs if p not in by_name]
        if unknown:
            raise PlannerError(f"call {c.name!r}: unknown input(s) {unknown}; calls: {', '.join(by_name)}")
    return (_list_walk if sharing is None else _event_walk)(calls, sharing)


def _cycle(pending: list[Call]) -> PlannerError:
    return PlannerError(f"calls {[c.name for c in pending]} wait on each other (a cycle)")


def _list_walk(calls: list[Call], _sharing=None) -> IterationTimeline:
    """Every call at its own speed: each pick's end is known when it starts."""
    free: dict = {}
    start, end = {}, {}
    pending = list(calls)
    while pending:
        ready = [c for c in pending if all(p in end for p, _ in c.inputs)]
        if not ready:
            raise _cycle(pending)

        def earliest(c: Call) -> float:
            arrived = max((end[p] + x for p, x in c.inputs), default=0.0)
            return max([arrived] + [free.get(r, 0.0) for r in c.ranks])

        call = min(ready, key=earliest)  # min keeps the first of equal starts: the given order
        start[call.name] = earliest(call)
        end[call.name] = start[call.name] + call.seconds
        for r in call.ranks:
            free[r] = end[call.name]
        pending.remove(call)
    return IterationTimeline(start, end)


def _event_walk(calls: list[Call], sharing: Sharing) -> IterationTimeline:
    """Calls that share cores: event by event, each running call at its current speed."""
    start, end, left = {}, {}, {}
    pending, running, now = list(calls), [], 0.0

    def arrival(c: Call) -> float | None:
        """When all of ``c``'s inputs are in (None while one has not ended)."""
        if all(p in end for p, _ in c.inputs):
            return max((end[p] + x for p, x in c.inputs), default=0.0)
        return None

    def can_start(c: Call) -> bool:
        a = arrival(c)
        return a is not None and a <= now and not busy & c.ranks

    while pending or running:
        busy = {r for c in running for r in c.ranks}
        while c := next(filter(can_start, pending), None):  # the first in the list that can start, again
            start[c.name], left[c.name] = now, c.seconds
            pending.remove(c)
            if c.seconds:
                running.append(c)
                busy |= c.ranks
            else:  # ends as it starts: its ranks are free for the next call in the list
                end[c.name] = now
        arrivals = [a for c in pending if (a := arrival(c)) is not None and a > now]
        if not running and not arrivals:
            if pending:
                raise _cycle(pending)
            break
        speeds = sharing.speeds(running)
        finish = [now + left[c.name] / v for c, v in zip(running, speeds)]
        step = min(finish + arrivals) - now
        for c, v, t in zip(list(running), speeds, finish):
            left[c.name] -= v * step
            if t <= now + step:
                end[c.name] = t
                running.remove(c)
        now += step
    return IterationTimeline(start, end)
