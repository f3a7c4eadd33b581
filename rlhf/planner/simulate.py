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
class Timeline:
    """Start and end of every call (seconds from the iteration's start)."""

    start: dict
    end: dict

    @property
    def seconds(self) -> float:
        return max(self.end.values(), default=0.0)

    def rows(self) -> list[tuple[str, float, float]]:
        """(call, start, end) in start order."""
        return sorted(((n, self.start[n], self.end[n]) for n in self.start), key=lambda r: (r[1], r[2]))


def schedule(calls: list[Call]) -> Timeline:
    """List-schedule ``calls`` (see the module docstring); errors name an unknown input or a cycle."""
    by_name = {c.name: c for c in calls}
    if len(by_name) != len(calls):
        raise PlannerError("call names must be unique")
    for c in calls:
        unknown = [p for p, _ in c.inputs if p not in by_name]
        if unknown:
            raise PlannerError(f"call {c.name!r}: unknown input(s) {unknown}; calls: {', '.join(by_name)}")
    free: dict = {}
    start, end = {}, {}
    pending = list(calls)
    while pending:
        ready = [c for c in pending if all(p in end for p, _ in c.inputs)]
        if not ready:
            raise PlannerError(f"calls {[c.name for c in pending]} wait on each other (a cycle)")

        def earliest(c: Call) -> float:
            arrived = max((end[p] + x for p, x in c.inputs), default=0.0)
            return max([arrived] + [free.get(r, 0.0) for r in c.ranks])

        call = min(ready, key=earliest)  # min keeps the first of equal starts: the given order
        start[call.name] = earliest(call)
        end[call.name] = start[call.name] + call.seconds
        for r in call.ranks:
            free[r] = end[call.name]
        pending.remove(call)
    return Timeline(start, end)
