"""Fused pipeline schedules (RLHFuse section 5), pure: plain Python, no torch collectives, no device.

The problem model (``problem``), its timing simulator (``simulate``), the
schedule generators (``generators``: serial 1F1B, greedy fused, list rules,
backfill), simulated annealing (``anneal``) and the search around it
(``search``), the lower bound (``lower_bound``), validation (``validate``),
the one ``Schedule`` type and ``ScheduleError`` (``schedule``), the schedule
file (``io``), the cost model from model shapes (``cost_model``) and the
Gantt chart (``plot``). The runtime that executes a schedule is rlhf/pipeline.
See docs/schedule_search.md.
"""
from .problem import Action, ModelSpec, Problem, ProblemError
from .schedule import Schedule, ScheduleError
from .validate import Violation, check_schedule, validate

__all__ = ["Action", "ModelSpec", "Problem", "ProblemError", "Schedule", "ScheduleError", "Violation",
           "check_schedule", "validate"]
