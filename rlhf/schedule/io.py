"""Reading and writing the schedule file (format: docs/schedule_search.md, "Schedule file").

The file holds the problem (``stages``, ``models``, units, ``comm``), the
``schedule`` (one list of actions per fused stage, in order) and ``metrics``.
Each action is ``{"model", "pipeline", "mb", "op", "model_stage"}``; the
model stage is implied by the fused stage and is written for readers.  A
problem file (``--problem``) is the same JSON without ``schedule``.
"""
from __future__ import annotations

import json
from pathlib import Path

from rlhf.checks import is_int

from .problem import OPS, Action, Problem, ProblemError
from .schedule import Schedule, ScheduleError

VERSION = 1


def action_to_dict(a: Action) -> dict:
    return {"model": a.model, "pipeline": a.pipeline, "mb": a.mb, "op": a.op,
            "model_stage": a.stage}


def action_from_dict(pb: Problem, d: dict, fused_stage: int) -> Action:
    """The model stage follows from the fused stage.  A ``model_stage`` in
    ``d`` is taken as written (not checked here): :func:`validate.validate`
    reports a ``placement`` violation when it disagrees with the fused stage.
    Types are checked, never coerced (``"mb": 1.0`` is refused)."""
    where = f"stage {fused_stage}: action {d!r}"
    if not isinstance(d, dict) or any(k not in d for k in ("model", "pipeline", "mb", "op")):
        raise ProblemError(f"{where} must be an object with model, pipeline, mb, op (and optionally model_stage)")
    if not isinstance(d["model"], str) or d["model"] not in pb.model_index:
        raise ProblemError(f"{where} names an unknown model; known: {list(pb.model_index)}")
    model = pb.models[pb.model_index[d["model"]]]
    for key in ("pipeline", "mb", "model_stage"):
        if key in d and not is_int(d[key]):
            raise ProblemError(f"{where}: {key}={d[key]!r} must be an integer")
    if d["op"] not in OPS:
        raise ProblemError(f"{where}: op={d['op']!r} must be one of {OPS}")
    if "model_stage" in d:
        j = d["model_stage"]
    else:
        s = fused_stage if model.direction == "down" else pb.stages - 1 - fused_stage
        j = s - d["pipeline"] * model.pp
    return Action(model.name, d["pipeline"], d["mb"], d["op"], j)


def schedule_to_dict(sched: Schedule) -> dict:
    d = sched.problem.to_dict()
    d["version"] = VERSION
    d["schedule"] = [[action_to_dict(a) for a in stage] for stage in sched.stages]
    d["metrics"] = dict(sched.metrics)
    return d


def schedule_from_dict(d: dict) -> Schedule:
    """The Schedule of a parsed file; ScheduleError ("malformed schedule: ...") if it is not one.

    Only the structure is checked here; :func:`validate.check_schedule` checks the rules.
    """
    try:
        pb = Problem.from_dict(d)
        version = d.get("version", VERSION)
        if not is_int(version) or version != VERSION:
            raise ProblemError(f"schedule file version {version!r} is not supported "
                               f"(this reader knows version {VERSION})")
        if not isinstance(d.get("schedule"), list) or not all(isinstance(x, list) for x in d["schedule"]):
            raise ProblemError("schedule file lacks 'schedule', one list of actions per fused stage "
                               "(a problem file has only stages/models)")
        if not isinstance(d.get("metrics", {}), dict):
            raise ProblemError(f"metrics={d['metrics']!r} must be an object")
        stages = tuple(tuple(action_from_dict(pb, a, s) for a in stage)
                       for s, stage in enumerate(d["schedule"]))
    except ProblemError as exc:
        raise ScheduleError(f"malformed schedule: {exc}") from None
    return Schedule(pb, stages, dict(d.get("metrics") or {}))


def save_schedule(path, sched: Schedule) -> None:
    Path(path).write_text(json.dumps(schedule_to_dict(sched), indent=1))


def load_schedule(path) -> Schedule:
    """Read a schedule file; ScheduleError naming ``path`` if it is unreadable or malformed."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ScheduleError(f"schedule file {path}: {exc}") from None
    try:
        return schedule_from_dict(d)
    except ScheduleError as exc:
        raise ScheduleError(f"schedule file {path}: {exc}") from None


def load_problem(path) -> Problem:
    """Read a problem file; ProblemError naming ``path`` if it is unreadable or malformed."""
    try:
        return Problem.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError) as exc:  # ValueError: bad JSON, bad text encoding, or a ProblemError
        raise ProblemError(f"problem file {path}: {exc}") from None
