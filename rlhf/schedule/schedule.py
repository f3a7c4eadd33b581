"""The Schedule type and its error: a problem plus, per fused stage, the order of its compute actions.

Every schedule is this one data structure: serial 1F1B, greedy-fused and
annealed schedules, what the schedule file holds (rlhf/schedule/io.py) and
what the executor's compiler lowers (rlhf/pipeline/compiler.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .problem import Action, Problem, to_actions, to_ids


class ScheduleError(ValueError):
    """A schedule that is invalid, malformed, or does not match what runs it; the message says what differs.

    ``violations`` holds the validator's findings (rlhf/schedule/validate.py)
    when the schedule itself breaks a rule; it is empty for other mismatches
    (a placement, a micro-batch count, an unreadable file).
    """

    def __init__(self, message: str, violations: Sequence = ()):
        super().__init__(message)
        self.violations = tuple(violations)


@dataclass(frozen=True)
class Schedule:
    """``stages[s]``: the compute actions fused stage ``s`` runs, in order; ``metrics``: what the search measured."""

    problem: Problem
    stages: tuple[tuple[Action, ...], ...]
    metrics: dict = field(default_factory=dict)

    @classmethod
    def from_orders(cls, pb: Problem, orders: Sequence[Sequence[int]], metrics: dict | None = None) -> "Schedule":
        """From per-stage subtask-id lists (the search's representation)."""
        return cls(pb, to_actions(pb, orders), dict(metrics or {}))

    @property
    def orders(self) -> list:
        """Per-stage subtask ids (raises ProblemError for an action the problem does not have)."""
        return to_ids(self.problem, self.stages)

    @property
    def model_names(self) -> tuple:
        return tuple(m.name for m in self.problem.models)
