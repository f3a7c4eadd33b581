"""The fused-pipeline scheduling problem: models, stages, subtasks (actions).

This module owns the problem model (docs/schedule_search.md) and the numbering of
its subtasks.  A *model* (actor, critic, ...) has ``pp`` stages and
``pipelines`` copies of its pipeline (the fusion factor); pipeline ``p``
occupies fused stages ``p*pp .. p*pp+pp-1`` ("down") or their mirror
``stages-1-s`` ("up").  Every micro-batch of every pipeline is one *chain* of
``2*pp`` subtasks::

    F(0) -> F(1) -> ... -> F(pp-1) -> B(pp-1) -> B(pp-2) -> ... -> B(0)

Subtask ids are dense integers, chain by chain, so the dependency predecessor
of subtask ``v`` is ``v - 1`` unless ``v`` opens its chain.  Schedules at the
interface are per-stage tuples of frozen :class:`Action` s; the search works on
per-stage lists of ids (``Problem.action`` / ``Problem.node_id`` convert).

No torch here: the search must stay importable without it.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from rlhf.checks import finite_float, is_int

DIRECTIONS = ("down", "up")
OPS = ("F", "B")
MAX_SUBTASKS = 1_000_000
"""Largest problem accepted (subtasks over all models): the search keeps per-subtask lists in memory."""


class ProblemError(ValueError):
    """An inconsistent problem description (names the field and the fix)."""


@dataclass(frozen=True)
class Action:
    """One subtask: ``op`` ('F' or 'B') of micro-batch ``mb`` of ``pipeline``
    of ``model`` at model stage ``stage`` (0 = the model's first layer)."""

    model: str
    pipeline: int
    mb: int
    op: str
    stage: int

    def __str__(self) -> str:
        return f"{self.model}[p{self.pipeline}].{self.op}{self.mb}@s{self.stage}"


@dataclass(frozen=True)
class ModelSpec:
    """One model's pipelines.  Lists are per model stage (length ``pp``);
    ``fwd``/``bwd`` in the problem's time unit, ``act_mem`` in its memory unit
    (activation memory held from the end of F until the end of B)."""

    name: str
    pp: int
    pipelines: int
    microbatches: int
    direction: str
    fwd: tuple
    bwd: tuple
    act_mem: tuple

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ProblemError(f"model name={self.name!r} must be a non-empty string")
        for field in ("pp", "pipelines", "microbatches"):
            value = getattr(self, field)
            if not is_int(value) or value < 1:
                raise ProblemError(
                    f"model {self.name!r}: {field}={value!r} must be a positive integer")
        if not isinstance(self.direction, str) or self.direction not in DIRECTIONS:
            raise ProblemError(
                f"model {self.name!r}: direction={self.direction!r} must be one of {DIRECTIONS}")
        for field in ("fwd", "bwd", "act_mem"):
            object.__setattr__(self, field, self._stage_numbers(field, positive=field != "act_mem"))

    def _stage_numbers(self, field: str, positive: bool) -> tuple:
        """Field ``field`` as a tuple of ``pp`` finite floats, > 0 (``positive``) or >= 0; types are
        checked, not coerced: NaN, Infinity, strings and booleans are refused by name."""
        values = getattr(self, field)
        if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
            raise ProblemError(f"model {self.name!r}: {field}={values!r} must be a list of numbers, "
                               f"one per model stage (pp={self.pp})")
        if len(values) != self.pp:
            raise ProblemError(
                f"model {self.name!r}: {field} has {len(values)} entries, "
                f"expected pp={self.pp} (one per model stage)")
        numbers = tuple(finite_float(x) for x in values)
        for j, (x, number) in enumerate(zip(values, numbers)):
            if number is None or number < 0 or (positive and number == 0):
                raise ProblemError(f"model {self.name!r}: {field}[{j}]={x!r} must be a finite number "
                                   f"{'> 0' if positive else '>= 0'}")
        return numbers

    def fused_stage(self, pipeline: int, stage: int, stages: int) -> int:
        """Fused stage running model stage ``stage`` of ``pipeline``."""
        s = pipeline * self.pp + stage
        return s if self.direction == "down" else stages - 1 - s

    @property
    def work(self) -> float:
        """Total compute of one pipeline: micro-batches x (F + B) over stages."""
        return self.microbatches * (sum(self.fwd) + sum(self.bwd))

    def to_dict(self) -> dict:
        return {"name": self.name, "pp": self.pp, "pipelines": self.pipelines,
                "microbatches": self.microbatches, "direction": self.direction,
                "fwd": list(self.fwd), "bwd": list(self.bwd), "act_mem": list(self.act_mem)}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelSpec":
        """From a problem file's model entry; values are checked as given (``"pp": 2.0`` is refused)."""
        required = ("name", "pp", "pipelines", "microbatches", "direction", "fwd", "bwd")
        if not isinstance(d, dict):
            raise ProblemError(f"model entry {d!r} must be an object with fields {', '.join(required)}[, act_mem]")
        missing = set(required) - set(d)
        if missing:
            raise ProblemError(f"model entry {d.get('name', '?')!r} lacks fields {sorted(missing)}")
        fwd = d["fwd"]
        act = d.get("act_mem", [0.0] * len(fwd) if isinstance(fwd, (list, tuple)) else None)
        return cls(name=d["name"], pp=d["pp"], pipelines=d["pipelines"], microbatches=d["microbatches"],
                   direction=d["direction"], fwd=fwd, bwd=d["bwd"], act_mem=act)


@dataclass(frozen=True)
class Problem:
    """Models fused on ``stages`` stages.  ``comm`` is the time between a
    subtask and its dependent on a neighbouring stage (0 by default);
    ``mem_cap`` optionally bounds each stage's live activation memory."""

    stages: int
    models: tuple
    comm: float = 0.0
    mem_cap: float | None = None
    time_unit: str = "ms"
    mem_unit: str = "GiB"

    def __post_init__(self):
        if not is_int(self.stages) or self.stages < 1:
            raise ProblemError(f"stages={self.stages!r} must be a positive integer")
        if isinstance(self.models, (str, bytes, Mapping)) or not isinstance(self.models, Sequence) or not all(
                isinstance(m, ModelSpec) for m in self.models):
            raise ProblemError(f"models={self.models!r} must be a list of models (ModelSpec)")
        object.__setattr__(self, "models", tuple(self.models))
        if not self.models:
            raise ProblemError("problem has no models; give at least one under 'models'")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ProblemError(f"model names {names} must be unique")
        for m in self.models:
            if m.pp * m.pipelines != self.stages:
                raise ProblemError(
                    f"model {m.name!r}: pp*pipelines = {m.pp}*{m.pipelines} = "
                    f"{m.pp * m.pipelines} must equal stages={self.stages}")
        subtasks = sum(m.pipelines * m.microbatches * 2 * m.pp for m in self.models)
        if subtasks > MAX_SUBTASKS:
            raise ProblemError(f"the problem has {subtasks} subtasks (pipelines x microbatches x 2 x pp, summed "
                               f"over the models), more than the {MAX_SUBTASKS} supported; use fewer microbatches")
        comm = finite_float(self.comm)
        if comm is None or comm < 0:
            raise ProblemError(f"comm={self.comm!r} must be a finite number >= 0")
        object.__setattr__(self, "comm", comm)
        if self.mem_cap is not None:
            cap = finite_float(self.mem_cap)
            if cap is None or cap <= 0:
                raise ProblemError(f"mem_cap={self.mem_cap!r} must be a finite number > 0, or absent for no cap")
            object.__setattr__(self, "mem_cap", cap)
        for field in ("time_unit", "mem_unit"):
            if not isinstance(getattr(self, field), str):
                raise ProblemError(f"{field}={getattr(self, field)!r} must be a string such as 'ms' or 'GiB'")

    # -- subtask numbering -------------------------------------------------
    @cached_property
    def _bases(self) -> tuple:
        bases, n = [], 0
        for m in self.models:
            bases.append(n)
            n += m.pipelines * m.microbatches * 2 * m.pp
        return tuple(bases) + (n,)

    @property
    def num_nodes(self) -> int:
        return self._bases[-1]

    @cached_property
    def model_index(self) -> dict:
        return {m.name: i for i, m in enumerate(self.models)}

    def node_id(self, a: Action) -> int:
        i = self.model_index.get(a.model)
        if i is None:
            raise ProblemError(f"{a}: unknown model {a.model!r} (known: {list(self.model_index)})")
        m = self.models[i]
        if not (0 <= a.pipeline < m.pipelines and 0 <= a.mb < m.microbatches
                and 0 <= a.stage < m.pp and a.op in OPS):
            raise ProblemError(f"{a}: pipeline/mb/stage/op out of range for model {m.name!r}")
        return self.node_id_fast(i, a.pipeline, a.mb, a.stage, a.op == "F")

    def node_id_fast(self, model: int, pipeline: int, mb: int, stage: int, fwd: bool) -> int:
        """``node_id`` by model index, without range checks."""
        m = self.models[model]
        k = stage if fwd else 2 * m.pp - 1 - stage
        return self._bases[model] + (pipeline * m.microbatches + mb) * 2 * m.pp + k

    @cached_property
    def actions(self) -> tuple:
        """``actions[v]`` is the Action of subtask id ``v``."""
        out = []
        for m in self.models:
            for p in range(m.pipelines):
                for b in range(m.microbatches):
                    out += [Action(m.name, p, b, "F", j) for j in range(m.pp)]
                    out += [Action(m.name, p, b, "B", j) for j in reversed(range(m.pp))]
        return tuple(out)

    def action(self, v: int) -> Action:
        return self.actions[v]

    @cached_property
    def arrays(self) -> "NodeArrays":
        return NodeArrays.build(self)

    # -- serialisation -----------------------------------------------------
    def to_dict(self) -> dict:
        d = {"version": 1, "stages": self.stages, "time_unit": self.time_unit,
             "mem_unit": self.mem_unit, "comm": self.comm,
             "models": [m.to_dict() for m in self.models]}
        if self.mem_cap is not None:
            d["mem_cap"] = self.mem_cap
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Problem":
        """From a parsed problem or schedule file; values are checked as given, never coerced."""
        if not isinstance(d, dict):
            raise ProblemError(f"a problem is a JSON object with 'stages' and 'models', not a {type(d).__name__}")
        for field in ("stages", "models"):
            if field not in d:
                raise ProblemError(f"problem JSON lacks {field!r} (see docs/schedule_search.md, "
                                  "'Schedule file')")
        if not isinstance(d["models"], list):
            raise ProblemError(f"models={d['models']!r} must be a list of model entries")
        return cls(stages=d["stages"],
                   models=tuple(ModelSpec.from_dict(m) for m in d["models"]),
                   comm=d.get("comm", 0.0), mem_cap=d.get("mem_cap"),
                   time_unit=d.get("time_unit", "ms"), mem_unit=d.get("mem_unit", "GiB"))

    def with_mem_cap(self, cap: float | None) -> "Problem":
        return Problem(self.stages, self.models, self.comm, cap, self.time_unit, self.mem_unit)


@dataclass(frozen=True)
class NodeArrays:
    """Flat per-subtask arrays (Python lists, for the fast pure-Python loops).

    ``pred[v]``: dependency predecessor id or -1; ``lag[v]``: communication
    time on that edge; ``dur[v]``; ``stage[v]``: fused stage; ``mem[v]``:
    +act_mem for F, -act_mem for B; ``model[v]``; ``is_fwd[v]``;
    ``tail[v]``: remaining chain work after ``v`` ends (incl. comm);
    ``queue[v]``: index of the (model, pipeline, op) ``v`` belongs to: the
    subtasks of one queue on one stage are the same work for different
    micro-batches (see :func:`in_microbatch_order`); ``partner[v]``: the
    other subtask of ``v``'s chain on its stage (F(j) <-> B(j)).
    """

    pred: list
    lag: list
    dur: list
    stage: list
    mem: list
    model: list
    is_fwd: list
    tail: list
    queue: list
    partner: list

    @classmethod
    def build(cls, pb: Problem) -> "NodeArrays":
        pred, lag, dur, stage, mem, model, is_fwd, tail, queue, partner = ([] for _ in range(10))
        fq = 0  # the next pipeline's F queue; its B queue is fq + 1
        for i, m in enumerate(pb.models):
            ks = range(2 * m.pp)
            js = [k if k < m.pp else 2 * m.pp - 1 - k for k in ks]
            d = [m.fwd[j] if k < m.pp else m.bwd[j] for k, j in zip(ks, js)]
            lg = [0.0 if (k == 0 or k == m.pp) else pb.comm for k in ks]
            tl = [sum(d[k + 1:]) + sum(lg[k + 1:]) for k in ks]
            for p in range(m.pipelines):
                st = [m.fused_stage(p, j, pb.stages) for j in js]
                for _ in range(m.microbatches):
                    base = len(pred)
                    pred += [base + k - 1 if k else -1 for k in ks]
                    lag += lg
                    dur += d
                    stage += st
                    mem += [m.act_mem[j] if k < m.pp else -m.act_mem[j] for k, j in zip(ks, js)]
                    model += [i] * len(ks)
                    is_fwd += [k < m.pp for k in ks]
                    tail += tl
                    queue += [fq if k < m.pp else fq + 1 for k in ks]
                    partner += [base + 2 * m.pp - 1 - k for k in ks]
                fq += 2
        return cls(pred, lag, dur, stage, mem, model, is_fwd, tail, queue, partner)


def stage_nodes(pb: Problem) -> list:
    """Per fused stage, the ids of all subtasks that run there (any order)."""
    out = [[] for _ in range(pb.stages)]
    for v, s in enumerate(pb.arrays.stage):
        out[s].append(v)
    return out


def to_actions(pb: Problem, orders: Sequence[Sequence[int]]) -> tuple:
    """Per-stage id lists -> per-stage tuples of Actions (the schedule data)."""
    acts = pb.actions
    return tuple(tuple(acts[v] for v in order) for order in orders)


def to_ids(pb: Problem, schedule: Sequence[Sequence[Action]]) -> list:
    """Per-stage Actions -> per-stage id lists (raises ProblemError on unknown ones)."""
    return [[pb.node_id(a) for a in stage] for stage in schedule]


def in_microbatch_order(pb: Problem, orders: Sequence[Sequence[int]]) -> list:
    """The same per-stage orders with the micro-batches relabelled so that every stage runs each queue
    (the forwards, or the backwards, of one model pipeline) in micro-batch order: the r-th forward of a
    queue on a stage becomes micro-batch r's.  The micro-batches of a queue are the same work, and at the
    old times every relabelled chain still waits for its predecessor (when the r-th subtask of a queue
    starts on a stage, r distinct predecessors have ended, so the r-th of theirs has), and a backward still
    follows its own forward; so the result is never slower, holds the same memory at every position, and
    some optimal schedule has this form."""
    acts, queue, index = pb.actions, pb.arrays.queue, pb.model_index
    out = []
    for order in orders:
        seen = {}
        new = []
        for v in order:
            a = acts[v]
            q = queue[v]
            r = seen.get(q, 0)
            seen[q] = r + 1
            new.append(pb.node_id_fast(index[a.model], a.pipeline, r, a.stage, a.op == "F"))
        out.append(new)
    return out
