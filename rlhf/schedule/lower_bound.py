"""Lower bounds on the makespan and the reference for activation memory.

**Makespan bound.**  The micro-batches of one model pipeline are interchangeable (same latencies, same
memory), so some optimal schedule runs them in index order on every stage, forwards and backwards alike:
where mb ``j`` follows mb ``i`` on stage ``s`` but preceded it on the stage before in their chain, swap the
two chains' remaining subtasks from ``s`` on; every dependency still holds at the same times and each stage
keeps its live memory, so the makespan does not grow.  In such an order the k-th forward of a model stage
waits for its chain predecessor and for the (k-1)-th forward there, so relaxing everything else on the
stages gives each subtask a *head* (the earliest it can start, :func:`chain_heads`) and, running the chains
backwards in time, a *tail* (the least time that must follow its end).  Each fused stage is one machine, so
the makespan is at least the optimum of that machine's subtasks with their heads and tails when they may
even be preempted: Jackson's preemptive schedule (always run the ready subtask with the longest tail),
:func:`preemptive_bound`.  The bound is the largest over the stages.

It is never below RLHFuse section 7.3's formula, ``min arrival + work + min tail`` over the model
pipelines on a stage (the preemptive optimum is at least that for every subset of subtasks), nor below
one model's own 1F1B makespan ``(m+p-1)(f+b)`` for uniform stages.  Where stage latencies differ it is
higher: a slow stage upstream spaces the forwards that reach a later one (65B/33B PP 16/8 with 32
micro-batches under latency model 3: 0.70% above the formula, which CP-SAT proves is the optimum's bound
too, docs/schedule_search.md).

**Memory.**  The reference (the "memory lower bound" of the issues) is the serial 1F1B peak per stage.
It is not a bound for every schedule (a schedule that runs F,B,F,B... needs less), but it is what the
non-fused baseline needs.  The true bound (:func:`min_peak_memory`) is the largest single activation on
a stage: every stage holds at least one, and running the micro-batches one at a time through the whole
problem holds no more.
"""
from __future__ import annotations

import heapq

from .generators import serial_1f1b
from .problem import Problem
from .simulate import stage_peak_memory


def chain_heads(fwd, bwd, microbatches: int, comm: float) -> tuple:
    """``(ends_f, ends_b)``: ``ends_f[k][j]`` / ``ends_b[k][j]`` is the earliest end of micro-batch
    ``k``'s forward / backward at model stage ``j`` of one pipeline (stage latencies ``fwd``, ``bwd``)
    when the micro-batches run in index order on every stage and nothing else runs there (a flow shop:
    each waits for its chain predecessor, plus ``comm``, and for micro-batch ``k - 1`` on its stage)."""
    pp = len(fwd)
    ends_f = [[0.0] * pp for _ in range(microbatches)]
    ends_b = [[0.0] * pp for _ in range(microbatches)]
    for k in range(microbatches):
        for j in range(pp):
            t = ends_f[k][j - 1] + comm if j else 0.0
            if k:
                t = max(t, ends_f[k - 1][j])
            ends_f[k][j] = t + fwd[j]
        for j in reversed(range(pp)):
            t = ends_b[k][j + 1] + comm if j < pp - 1 else ends_f[k][pp - 1]
            if k:
                t = max(t, ends_b[k - 1][j])
            ends_b[k][j] = t + bwd[j]
    return ends_f, ends_b


def stage_jobs(pb: Problem) -> list:
    """``jobs[s]``: ``(head, duration, tail)`` of every subtask on fused stage ``s`` (module docstring).
    Tails come from :func:`chain_heads` of the chain reversed in time (backwards first, last micro-batch
    first): a subtask's tail is its earliest start in the reversed problem."""
    jobs = [[] for _ in range(pb.stages)]
    for m in pb.models:
        head_f, head_b = chain_heads(m.fwd, m.bwd, m.microbatches, pb.comm)
        tail_b, tail_f = chain_heads(m.bwd, m.fwd, m.microbatches, pb.comm)  # reversed: B plays F's part
        n = m.microbatches
        for p in range(m.pipelines):
            for j in range(m.pp):
                row = jobs[m.fused_stage(p, j, pb.stages)]
                f, b = m.fwd[j], m.bwd[j]
                for k in range(n):
                    row.append((head_f[k][j] - f, f, tail_f[n - 1 - k][j] - f))
                    row.append((head_b[k][j] - b, b, tail_b[n - 1 - k][j] - b))
    return jobs


def preemptive_bound(jobs) -> float:
    """Optimum of one machine running ``jobs`` (``(head, duration, tail)``) with preemption allowed:
    max over jobs of end + tail under Jackson's rule (at every moment the released job with the longest
    tail runs); no non-preemptive schedule of the same jobs does better."""
    jobs = sorted(jobs)
    ready = []  # [-tail, remaining duration]
    t, i, best = 0.0, 0, 0.0
    while i < len(jobs) or ready:
        if not ready and t < jobs[i][0]:
            t = jobs[i][0]
        while i < len(jobs) and jobs[i][0] <= t:
            head, duration, tail = jobs[i]
            heapq.heappush(ready, [-tail, duration])
            i += 1
        top = ready[0]
        run = min(top[1], jobs[i][0] - t) if i < len(jobs) else top[1]
        t += run
        if run >= top[1]:
            heapq.heappop(ready)
            best = max(best, t - top[0])
        else:
            top[1] -= run
    return best


def makespan_lower_bound(pb: Problem) -> float:
    """The largest :func:`preemptive_bound` over the fused stages (module docstring)."""
    return max(preemptive_bound(row) for row in stage_jobs(pb) if row)


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
