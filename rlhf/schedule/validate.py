"""Validation of any fused schedule (the rules of docs/schedule_search.md, "Schedule file").

A schedule is per fused stage a sequence of :class:`Action` s.  It is valid
when

* ``placement``   - every action names a known model subtask that runs on
  the stage whose list holds it;
* ``complete``    - every subtask appears exactly once (``duplicate`` /
  ``missing`` otherwise);
* ``order``       - on its stage, a micro-batch's B comes after its own F
  (the only same-stage dependency);
* ``deadlock``    - the dependency graph (stage orders + chains) is acyclic,
  i.e. the timing simulation finishes every stage;
* ``memory``      - no stage's live activation memory exceeds the cap.

Each failure is a :class:`Violation` naming the rule, the stage and the
subtask; :func:`check_schedule` raises :class:`~rlhf.schedule.schedule.ScheduleError`
listing them.
Later rules are checked only when the earlier ones pass (a deadlock check
needs a complete schedule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .problem import Action, Problem, ProblemError
from .schedule import Schedule, ScheduleError
from .simulate import simulate


@dataclass(frozen=True)
class Violation:
    rule: str
    stage: int
    action: Action | None
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] stage {self.stage}: {self.message}"


def validate(pb: Problem, schedule: Sequence[Sequence[Action]],
             mem_cap: float | None = None) -> list:
    """All violations of ``schedule`` (empty list: valid).  ``mem_cap``
    defaults to the problem's."""
    cap = pb.mem_cap if mem_cap is None else mem_cap
    if len(schedule) != pb.stages:
        return [Violation("placement", -1, None,
                          f"schedule has {len(schedule)} stage lists, expected {pb.stages}")]
    ids, out = _placement_and_completeness(pb, schedule)
    if out:
        return out
    out = _same_stage_order(pb, ids)
    if out:
        return out
    out = _deadlock(pb, ids)
    if out:
        return out
    return _memory(pb, ids, cap)


def check_schedule(schedule: Schedule, mem_cap: float | None = None) -> list:
    """The per-stage subtask ids of a valid ``schedule``; ScheduleError listing
    every violation otherwise (``mem_cap`` defaults to the problem's)."""
    bad = validate(schedule.problem, schedule.stages, mem_cap)
    if bad:
        shown = "\n  ".join(str(v) for v in bad[:20])
        more = f"\n  ... and {len(bad) - 20} more" if len(bad) > 20 else ""
        raise ScheduleError(f"invalid schedule ({len(bad)} violations):\n  {shown}{more}", bad)
    return schedule.orders


def _placement_and_completeness(pb: Problem, schedule) -> tuple:
    out, ids, seen = [], [], {}
    stage_of = pb.arrays.stage
    for s, stage in enumerate(schedule):
        row = []
        for a in stage:
            try:
                v = pb.node_id(a)
            except ProblemError as err:
                out.append(Violation("placement", s, a, str(err)))
                continue
            if stage_of[v] != s:
                out.append(Violation("placement", s, a,
                                     f"{a} belongs on fused stage {stage_of[v]}, not {s}"))
            if v in seen:
                out.append(Violation("duplicate", s, a,
                                     f"{a} appears again (first on stage {seen[v]})"))
            seen[v] = s
            row.append(v)
        ids.append(row)
    for v in range(pb.num_nodes):
        if v not in seen:
            a = pb.action(v)
            out.append(Violation("missing", stage_of[v], a, f"{a} is not scheduled"))
    return ids, out


def _same_stage_order(pb: Problem, ids) -> list:
    out = []
    acts = pb.actions
    for s, row in enumerate(ids):
        pos = {v: k for k, v in enumerate(row)}
        for k, v in enumerate(row):
            a = acts[v]
            if a.op != "B":
                continue
            f = pb.node_id(Action(a.model, a.pipeline, a.mb, "F", a.stage))
            if pos[f] > k:
                out.append(Violation("order", s, a,
                                     f"{a} at position {k} runs before its forward "
                                     f"{acts[f]} at position {pos[f]}"))
    return out


def _deadlock(pb: Problem, ids) -> list:
    res = simulate(pb, ids)
    out = []
    acts = pb.actions
    for s, k, waits in res.stuck:
        a = acts[ids[s][k]]
        out.append(Violation("deadlock", s, a,
                             f"{a} at position {k} waits for {acts[waits]} on stage "
                             f"{pb.arrays.stage[waits]}, which never runs (cyclic dependency)"))
    return out


def _memory(pb: Problem, ids, cap) -> list:
    if cap is None:
        return []
    mem = pb.arrays.mem
    out = []
    for s, row in enumerate(ids):
        live = 0.0
        for v in row:
            live += mem[v]
            if live > cap + 1e-9:
                a = pb.action(v)
                out.append(Violation("memory", s, a,
                                     f"live activation memory {live:.4g} exceeds the cap "
                                     f"{cap:.4g} {pb.mem_unit} after {a}"))
                break
    return out
