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

from .problem import Action, Problem, ProblemError
from .schedule import Schedule, ScheduleError

VERSION = 1


def action_to_dict(a: Action) -> dict:
    return {"model": a.model, "pipeline": a.pipeline, "mb": a.mb, "op": a.op,
            "model_stage": a.stage}


def action_from_dict(pb: Problem, d: dict, fused_stage: int) -> Action:
    """The model stage follows from the fused stage.  A ``model_stage`` in
    ``d`` is taken as written (not checked here): :func:`validate.validate`
    reports a ``placement`` violation when it disagrees with the fused stage."""
    try:
        model = pb.models[pb.model_index[d["model"]]]
        pipeline, mb, op = int(d["pipeline"]), int(d["mb"]), str(d["op"])
    except KeyError as err:
        raise ProblemError(f"stage {fused_stage}: action {d} lacks or names unknown {err}") from None
    if "model_stage" in d:
        j = int(d["model_stage"])
    else:
        s = fused_stage if model.direction == "down" else pb.stages - 1 - fused_stage
        j = s - pipeline * model.pp
    return Action(model.name, pipeline, mb, op, j)


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
        if int(d.get("version", VERSION)) != VERSION:
            raise ProblemError(f"schedule file version {d.get('version')} is not supported "
                               f"(this reader knows version {VERSION})")
        pb = Problem.from_dict(d)
        if "schedule" not in d:
            raise ProblemError("schedule file lacks 'schedule' (a problem file has only stages/models)")
        stages = tuple(tuple(action_from_dict(pb, a, s) for a in stage)
                       for s, stage in enumerate(d["schedule"]))
    except (ProblemError, KeyError, TypeError, ValueError, AttributeError) as exc:
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
    return Problem.from_dict(json.loads(Path(path).read_text()))
