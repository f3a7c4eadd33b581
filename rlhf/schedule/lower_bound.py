"""Lower bounds on the makespan and the reference for activation memory.

Makespan bound, per fused stage ``s`` and every non-empty subset ``U`` of the
model pipelines on it (one per model)::

    min_{i in U} arrival_i(s) + sum_{i in U} work_i(s) + min_{i in U} tail_i(s)

``arrival``: the earliest a first forward can reach ``s`` (the forwards of the
earlier model stages plus comm); ``work``: micro-batches x (F + B) there;
``tail``: the backwards still to run below ``s`` after its last B.  The stage
cannot start any of U's work before the earliest arrival, runs all of it
serially, and after the last of it at least the shortest tail remains.  The
all-models subset is RLHFuse section 7.3's formula; a single-model subset on
the model's last stage is that model's own 1F1B makespan ``(m+p-1)(f+b)``
for uniform stages, which dominates when micro-batches are few.  One
micro-batch's full chain is a bound too.  The result is the maximum.

Memory: the reference (the "memory lower bound" of the issue) is the serial
1F1B peak per stage.  It is not a bound for every schedule (a schedule that
runs F,B,F,B... needs less), but it is what the non-fused baseline needs.
The true bound (:func:`min_peak_memory`) is the largest single activation on
a stage: every stage holds at least one, and running the micro-batches one at
a time through the whole problem holds no more.
"""
from __future__ import annotations

from itertools import combinations

from .generators import serial_1f1b
from .problem import Problem
from .simulate import stage_peak_memory


def stage_terms(pb: Problem) -> list:
    """``terms[s]``: list of (arrival, work, tail) per model on fused stage s."""
    terms = [[] for _ in range(pb.stages)]
    for m in pb.models:
        for p in range(m.pipelines):
            for j in range(m.pp):
                arrival = sum(m.fwd[:j]) + j * pb.comm
                tail = sum(m.bwd[:j]) + j * pb.comm
                work = m.microbatches * (m.fwd[j] + m.bwd[j])
                terms[m.fused_stage(p, j, pb.stages)].append((arrival, work, tail))
    return terms


def makespan_lower_bound(pb: Problem) -> float:
    best = 0.0
    for row in stage_terms(pb):
        for r in range(1, len(row) + 1):
            for sub in combinations(row, r):
                bound = (min(a for a, _, _ in sub) + sum(w for _, w, _ in sub)
                         + min(t for _, _, t in sub))
                best = max(best, bound)
    for m in pb.models:
        best = max(best, sum(m.fwd) + sum(m.bwd) + 2 * (m.pp - 1) * pb.comm)
    return best


def serial_peak_memory(pb: Problem) -> list:
    """Per-stage activation peak of the serial 1F1B schedule."""
    return stage_peak_memory(pb, serial_1f1b(pb))


def min_peak_memory(pb: Problem) -> list:
    """Per-stage activation peak that no schedule goes below (and one reaches): the largest
    ``act_mem`` of a model stage placed on the fused stage. A memory cap below its maximum is infeasible."""
    peak = [0.0] * pb.stages
    for m in pb.models:
        for p in range(m.pipelines):
            for j in range(m.pp):
                s = m.fused_stage(p, j, pb.stages)
                peak[s] = max(peak[s], m.act_mem[j])
    return peak
