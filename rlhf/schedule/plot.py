"""Gantt chart of a fused schedule: one row per fused stage, one colour per
model, forward light and backward dark.  matplotlib is imported lazily (Agg)."""
from __future__ import annotations

from .problem import Problem
from .simulate import simulate

# (forward, backward) colours per model: blue and orange families, then more
COLOURS = [("#9ecae1", "#08519c"), ("#fdd0a2", "#d94801"), ("#c7e9c0", "#238b45"),
           ("#dadaeb", "#54278f")]


def gantt(pb: Problem, orders, path, title: str = "") -> None:
    """Write a PNG Gantt chart of per-stage id lists ``orders`` to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    res = simulate(pb, orders)
    if not res.ok:
        raise ValueError("gantt: the schedule deadlocks; validate it first")
    arr = pb.arrays
    fig, ax = plt.subplots(figsize=(14, 0.35 * pb.stages + 1.5))
    for s, order in enumerate(orders):
        bars = {}
        for v in order:
            key = (arr.model[v], arr.is_fwd[v])
            bars.setdefault(key, []).append((res.end[v] - arr.dur[v], arr.dur[v]))
        for (i, fwd), spans in bars.items():
            colour = COLOURS[i % len(COLOURS)][0 if fwd else 1]
            ax.broken_barh(spans, (s - 0.4, 0.8), facecolors=colour, edgecolor="white",
                           linewidth=0.3)
    ax.set_ylim(pb.stages - 0.5, -0.5)
    ax.set_yticks(range(pb.stages))
    ax.set_ylabel("fused stage")
    ax.set_xlabel(f"time ({pb.time_unit})")
    ax.set_xlim(0, res.makespan)
    handles = []
    for i, m in enumerate(pb.models):
        f, b = COLOURS[i % len(COLOURS)]
        handles += [Patch(color=f, label=f"{m.name} F"), Patch(color=b, label=f"{m.name} B")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.2 / pb.stages),
              ncol=len(handles), frameon=False)
    ax.set_title(title or f"makespan {res.makespan:.1f} {pb.time_unit}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
