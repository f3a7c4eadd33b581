"""Calibration: fit the hardware file's efficiencies and overheads to the stage times of a measured run.

The trainer reports wall seconds per stage (``time_<stage>_s``: reshard,
generation, inference, advantage, training; ``time_iteration_s``). For a plan
the cost model splits each stage's predicted seconds into a part that scales
with 1 / ``mfu`` (compute), one that scales with 1 / ``hbm_efficiency``
(decode reads), a fixed part (communication), ``call_overhead_s`` per task
call and ``step_overhead_s`` per sequential step. :func:`calibrate` solves for
those four by linear least squares over the generation, inference and
training stages (with fewer stages than unknowns it keeps the call overhead,
then the read efficiency, as they were); ``host_s`` is the measured iteration
less those stages and the reshards.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlhf.planner.errors import PlannerError
from rlhf.planner.hardware import Hardware

STAGE_TASKS = {"generation": ("actor_gen",), "inference": ("ref_inf", "reward_inf", "critic_inf"),
               "training": ("actor_train", "critic_train")}
"""The trainer's timed stages that run task calls, and those calls (one after the other)."""
OTHER_STAGES = ("reshard", "advantage", "iteration")
COMPUTE_PARTS = ("compute", "bubble", "prefill", "decode_compute")
MEMORY_PARTS = ("decode",)


@dataclass(frozen=True)
class Observation:
    """One measured stage next to the cost model's terms for it (seconds): ``compute_s`` scales with
    1 / mfu, ``memory_s`` with 1 / hbm_efficiency, ``fixed_s`` (communication) is not fitted, ``calls``
    call overheads."""

    compute_s: float
    memory_s: float
    fixed_s: float
    calls: int
    steps: int
    measured_s: float


def observations(costs: dict, measured: dict) -> list[Observation]:
    """One Observation per measured stage that runs task calls (``measured``: stage name -> seconds;
    ``costs``: the plan's TaskCost per task)."""
    unknown = set(measured) - set(STAGE_TASKS) - set(OTHER_STAGES)
    if unknown:
        raise PlannerError(f"measured stage(s) {sorted(unknown)} unknown; stages: "
                           f"{', '.join(tuple(STAGE_TASKS) + OTHER_STAGES)}")
    out = []
    for stage in (s for s in STAGE_TASKS if s in measured):
        tasks = [costs[t] for t in STAGE_TASKS[stage] if t in costs]
        compute = sum(c.parts.get(k, 0.0) for c in tasks for k in COMPUTE_PARTS)
        memory = sum(c.parts.get(k, 0.0) for c in tasks for k in MEMORY_PARTS)
        fixed = sum(v for c in tasks for k, v in c.parts.items()
                    if k not in COMPUTE_PARTS + MEMORY_PARTS + ("overhead",))
        out.append(Observation(compute, memory, fixed, len(tasks), sum(c.steps for c in tasks),
                               float(measured[stage])))
    return out


def host_seconds(measured: dict) -> float:
    """Measured seconds outside the task calls: the iteration less the reshard and task stages (or the
    advantage stage alone when the iteration is not given)."""
    if "iteration" not in measured:
        return float(measured.get("advantage", 0.0))
    inside = sum(float(measured.get(s, 0.0)) for s in tuple(STAGE_TASKS) + ("reshard",))
    return max(0.0, float(measured["iteration"]) - inside)


def calibrate(hw: Hardware, obs: list[Observation], host_s: float | None = None) -> Hardware:
    """``hw`` with ``mfu``, ``hbm_efficiency``, ``call_overhead_s`` and ``step_overhead_s`` fitted by least
    squares (and ``host_s`` when given).

    Model: measured = compute_s a + memory_s b + fixed_s + calls x call_overhead + steps x step_overhead,
    with a = old mfu / new mfu and b likewise for hbm_efficiency. A term no stage exercises, or one
    beyond the number of stages, keeps its value; a fitted efficiency is clipped to (0, 1]; a negative
    overhead is refitted without that term.
    """
    if not obs:
        raise PlannerError("calibration needs at least one measured stage")
    columns = {"compute": [o.compute_s for o in obs], "steps": [float(o.steps) for o in obs],
               "memory": [o.memory_s for o in obs], "calls": [float(o.calls) for o in obs]}
    names = [k for k, col in columns.items() if any(col)][:len(obs)]
    target = [o.measured_s - o.fixed_s for o in obs]
    x = _least_squares({k: columns[k] for k in names}, target)
    while any(x[k] < 0 for k in ("steps", "calls") if k in x):
        names = [k for k in names if not (k in ("steps", "calls") and x[k] < 0)]
        x = _least_squares({k: columns[k] for k in names}, target)
    eff = {"compute": hw.mfu, "memory": hw.hbm_efficiency}
    new = {k: min(1.0, eff[k] / x[k]) if x.get(k, 0) > 0 else eff[k] for k in eff}
    rest = {"call_overhead_s": x.get("calls", hw.call_overhead_s),
            "step_overhead_s": x.get("steps", hw.step_overhead_s)}
    return replace(hw, mfu=new["compute"], hbm_efficiency=new["memory"], host_s=hw.host_s if host_s is None
                   else host_s, name=hw.name if hw.name.endswith("(calibrated)") else f"{hw.name} (calibrated)",
                   **rest)


def _least_squares(columns: dict, target: list[float]) -> dict:
    """The coefficient of each named column minimising |A x - target| (normal equations)."""
    cols = list(columns.values())
    ata = [[sum(a * b for a, b in zip(ci, cj)) for cj in cols] for ci in cols]
    atb = [sum(a * b for a, b in zip(ci, target)) for ci in cols]
    return dict(zip(columns, _solve(ata, atb)))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a x = b by Gaussian elimination with partial pivoting; a singular column gets 0."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-30:
            continue
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c and m[r][c]:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-30 else 0.0 for i in range(n)]
