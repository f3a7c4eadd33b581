"""Gantt chart of a fused schedule (one row per fused stage, one colour per
model, forward light and backward dark) and the speed/memory trade-off curve
of searches under memory caps.  matplotlib is imported lazily (Agg)."""
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


def tradeoff(points, path, title: str = "", paper=None, bound: float | None = None,
             default=None) -> None:
    """Write a PNG of the speed/memory trade-off: ``points`` are (peak
    activation memory x serial 1F1B, speedup over serial 1F1B, label) of
    searches under memory caps; ``paper`` and ``default`` optional
    (memory, speedup, label) points (the paper's, the default search's);
    ``bound`` the lower bound's speedup (dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sorted(points)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLOURS[0][1], label="annealed (ours)")
    for k, (x, y, label) in enumerate(pts):  # labels alternate below / above to keep neighbours apart
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, -11 if k % 2 == 0 else 5),
                    fontsize=8)
    for extra, marker, colour in ((paper, "s", COLOURS[1][1]), (default, "D", COLOURS[2][1])):
        if extra is not None:
            ax.plot([extra[0]], [extra[1]], marker, color=colour, label=extra[2])
    if bound is not None:
        ax.axhline(bound, linestyle="--", color="grey", linewidth=0.8, label="lower bound")
    ax.set_xlabel("peak activation memory (x serial 1F1B)")
    ax.set_ylabel("speedup over serial 1F1B")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", frameon=False)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
