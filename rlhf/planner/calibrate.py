"""Calibration: fit the hardware file's efficiency and overheads to the times of one measured run.

The trainer reports wall seconds per stage (``time_<stage>_s``: reshard,
generation, inference, advantage, training; ``time_iteration_s``); a
profiling run may add each task call's seconds (``actor_gen``, ``ref_inf``,
...). For the plan that run used, the cost model and the iteration simulator
predict the same times (stage spans: rlhf.planner.plan.stage_seconds; calls:
their span in the timeline). Given call seconds, the fit matches those
alone: a stage's wall time also holds the host work between its calls
(assembling batches, gathers), which belongs to ``host_s``, and matching the
stages too would charge it to the per-call constants (on 4 CPU ranks this
overpredicted TP-heavy placements by a fifth; docs/planner.md). Without
call seconds it matches the generation, inference and training stages. Each
call's seconds are linear in the constants::

    compute / mfu + reads / hbm_efficiency + layer passes x layer_overhead_s
        + collectives x collective_latency_s + call_overhead_s

and a simulated span is piecewise linear in the calls' seconds (a max over
paths, and with shared cores a processor-sharing walk). So :func:`calibrate`
fits them by Gauss-Newton: derivatives by finite differences, a
least-squares step on the errors relative to the measured seconds, until the
step is negligible. It fits at most ``MOST`` constants, and no more than there
are measured times, in the order of ``TERMS`` (``mfu``, ``layer_overhead_s``,
``collective_latency_s``, ``hbm_efficiency``), skipping one the run does not
exercise (no collectives, say) and setting one that comes out negative to 0;
the others keep the file's values. ``host_s`` is the measured rest of the
iteration (the iteration less reshard, generation, inference and training),
as work per rank when ranks share cores.
"""

from __future__ import annotations

from dataclasses import replace

from rlhf.planner.cost import Cluster, Workload
from rlhf.planner.errors import PlannerError
from rlhf.planner.hardware import Hardware
from rlhf.planner.plan import STAGES, Plan, evaluate, sharing, stage_seconds
from rlhf.planner.iteration_sim import Call
from rlhf.tasks import TASKS

FITTED_STAGES = ("generation", "inference", "training")
"""The measured stages the fit matches when no call seconds are given (the stages that run task calls)."""
TERMS = ("mfu", "layer_overhead_s", "collective_latency_s", "call_overhead_s", "update_overhead_s", "hbm_efficiency")
"""The constants calibration can fit."""
DEFAULT_TERMS = ("mfu", "layer_overhead_s", "collective_latency_s")
"""Those it fits unless told (large models on GPUs: the FLOPs take the time)."""
OVERHEAD_TERMS = ("layer_overhead_s", "collective_latency_s", "call_overhead_s", "update_overhead_s")
"""Those to fit where overheads take the time (a tiny model on CPU: Python, launches, gloo's latency), mfu
keeping the file's guess."""
EFFICIENCIES = ("mfu", "hbm_efficiency")
"""Terms that divide the seconds (fitted as their reciprocal, clipped to (0, 1])."""


def calibrate(hw: Hardware, plan: Plan, models: dict, wl: Workload, cluster: Cluster, measured: dict,
              terms: tuple = DEFAULT_TERMS, iterations: int = 30) -> Hardware:
    """``hw`` with ``terms`` (up to one per measured time) fitted to ``measured`` (the run of ``plan``: stage
    or task name -> seconds), and ``host_s`` from the iteration's rest."""
    wrong = [t for t in terms if t not in TERMS]
    if wrong:
        raise PlannerError(f"cannot fit {wrong}; constants calibration fits: {', '.join(TERMS)}")
    unknown = set(measured) - set(STAGES) - set(TASKS) - {"iteration"}
    if unknown:
        raise PlannerError(f"measured time(s) {sorted(unknown)} unknown; give stages ({', '.join(STAGES)}, "
                           f"iteration) or tasks ({', '.join(TASKS)})")
    # call seconds when given (a stage also holds host work, which host_s takes), else the stages
    keys = [k for k in TASKS if float(measured.get(k, 0.0)) > 0] or [
        k for k in FITTED_STAGES if float(measured.get(k, 0.0)) > 0]
    if not keys:
        raise PlannerError(f"calibration needs the seconds (> 0) of a stage ({', '.join(FITTED_STAGES)}) or a task")
    target = [float(measured[k]) for k in keys]

    def predict(x: dict) -> list[float]:
        ev = evaluate(plan, models, wl, _with(hw, x), cluster)
        times = stage_seconds(ev) | {c: ev.timeline.end[c] - ev.timeline.start[c] for c in ev.timeline.start}
        return [times.get(k, 0.0) for k in keys]

    x = {k: _value(hw, k) for k in TERMS}
    free = [k for k in terms if any(_derivative(predict, x, k))][:len(keys)]
    for _ in range(iterations):  # residuals relative to the measured seconds: each time counts alike
        columns = {k: [d / t for d, t in zip(_derivative(predict, x, k), target)] for k in free}
        step = _least_squares(columns, [1 - p / t for t, p in zip(target, predict(x))])
        x = {k: max(0.0, x[k] + step.get(k, 0.0)) if k in free else x[k] for k in TERMS}
        negative = [k for k in free if x[k] <= 0.0 and k not in EFFICIENCIES]
        free = [k for k in free if k not in negative]
        if all(abs(step[k]) <= 1e-9 * max(abs(x[k]), 1e-12) for k in step) and not negative:
            break
    fitted = _with(hw, x)
    return replace(fitted, host_s=host_work(fitted, plan, models, wl, cluster, measured),
                   name=hw.name if hw.name.endswith("(calibrated)") else f"{hw.name} (calibrated)")


def host_work(hw: Hardware, plan: Plan, models: dict, wl: Workload, cluster: Cluster, measured: dict) -> float:
    """``host_s``: what the measured iteration has beyond the simulated one without host time (the
    gathers between stages, advantages, metrics; the advantage stage when no iteration is given), as
    work per rank: the host call runs on every rank at once."""
    if "iteration" not in measured:
        seconds = float(measured.get("advantage", hw.host_s))
    else:
        bare = evaluate(plan, models, wl, replace(hw, host_s=0.0), cluster).seconds
        seconds = max(0.0, float(measured["iteration"]) - bare)
    share = sharing(hw, cluster)
    everyone = [Call("host", set().union(*(m.ranks for m in plan.meshes.values())), 1.0)]
    return seconds * (share.speeds(everyone)[0] if share else 1.0)


def _value(hw: Hardware, term: str) -> float:
    """The fitted unknown of ``term``: the reciprocal of an efficiency, else the constant itself."""
    return 1.0 / getattr(hw, term) if term in EFFICIENCIES else getattr(hw, term)


def _with(hw: Hardware, x: dict) -> Hardware:
    """``hw`` with the unknowns ``x`` (efficiencies clipped to (0, 1])."""
    return replace(hw, **{k: min(1.0, 1.0 / max(v, 1.0)) if k in EFFICIENCIES else v for k, v in x.items()})


def _derivative(predict, x: dict, term: str) -> list[float]:
    """d stage seconds / d ``term`` at ``x`` (forward difference; the spans are piecewise linear)."""
    h = 1e-4 * max(abs(x[term]), 1e-6)
    up, base = predict({**x, term: x[term] + h}), predict(x)
    return [(u - b) / h for u, b in zip(up, base)]


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
