"""Fused pipeline schedules (RLHFuse section 5): problem model, cost model,
1F1B / greedy / annealed schedules, lower bound, validation, schedule files.

The search side imports no torch (see docs/schedule_search.md).
"""
from .problem import Action, ModelSpec, Problem, ProblemError
from .validate import ScheduleError, Violation, check_schedule, validate

__all__ = ["Action", "ModelSpec", "Problem", "ProblemError", "ScheduleError", "Violation",
           "check_schedule", "validate"]
