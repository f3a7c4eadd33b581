"""Instruction compiler: a fused schedule + the models' placements -> per-rank programs.

This module owns the mapping from fused stages to ranks and the lowering of a
schedule (rlhf/schedule) into instructions.  It is pure: no torch, no
communication, so a schedule that does not fit the placements (or has a
cyclic order) is refused before any rank sends a byte.

Fused stages -> ranks.  Model ``m`` with ``K`` pipelines and mesh
``(pp, dp, tp)`` runs pipeline ``p`` of data copy ``c`` on dp replica
``d = c*K + p``; its model stage ``j`` lives on ``mesh.rank(j, d, t)`` and on
fused stage ``m.fused_stage(p, j)``.  Every rank must get the same
(fused stage, copy, tp) from every model, e.g. actor pp4 "down" on ranks
0..3 and critic pp4 "up" with ``reverse_pp``::

    rank       0      1      2      3
    actor     s0     s1     s2     s3      (model stage = fused stage)
    critic    s3     s2     s1     s0      (model stage = 3 - fused stage)

Lowering.  Each compute action becomes::

    F@j:  [RECV_ACT from j-1]  FORWARD   [SEND_ACT to j+1]
    B@j:  [RECV_GRAD from j+1] BACKWARD  [SEND_GRAD to j-1]

then ``WAIT_SENDS`` and per model ``REDUCE_GRADS``, ``OPTIMIZER_STEP``.
Sends are non-blocking and posted right after the producing compute; a
receive blocks when the consumer reaches it.  Every consumer's compute is
preceded by its producer's in an acyclic schedule, so no rank waits forever
(:func:`check_deadlock_free` replays the programs to confirm).  A message's
tag is the subtask id of its producer, unique per (model, pipeline, mb,
stage, direction), so messages between one pair of ranks never mix.
"""
from __future__ import annotations

from dataclasses import dataclass

from rlhf.schedule.problem import Action, Problem
from rlhf.schedule.schedule import Schedule, ScheduleError
from rlhf.schedule.validate import check_schedule

RECV_ACT, FORWARD, SEND_ACT = "RECV_ACT", "FORWARD", "SEND_ACT"
RECV_GRAD, BACKWARD, SEND_GRAD = "RECV_GRAD", "BACKWARD", "SEND_GRAD"
WAIT_SENDS, REDUCE_GRADS, OPTIMIZER_STEP = "WAIT_SENDS", "REDUCE_GRADS", "OPTIMIZER_STEP"
COMPUTE = (FORWARD, BACKWARD)
SENDS = (SEND_ACT, SEND_GRAD)
RECVS = (RECV_ACT, RECV_GRAD)


@dataclass(frozen=True)
class Instr:
    """One instruction: ``kind`` on micro-batch ``mb`` of ``model`` (pipeline,
    model ``stage``); ``peer`` (global rank) and ``tag`` for SEND/RECV."""

    kind: str
    model: str = ""
    pipeline: int = -1
    mb: int = -1
    stage: int = -1
    peer: int = -1
    tag: int = -1

    def __str__(self) -> str:
        if not self.model:
            return self.kind
        if self.mb < 0:
            return f"{self.kind} {self.model}"
        s = f"{self.kind} {self.model}[p{self.pipeline}].mb{self.mb}@s{self.stage}"
        return s + (f" peer={self.peer} tag={self.tag}" if self.peer >= 0 else "")


# -- placements ------------------------------------------------------------------
@dataclass(frozen=True)
class Slot:
    """Where a rank sits in the fused pipeline: fused stage, data copy, TP index."""

    fused: int
    copy: int
    tp: int


def rank_slots(sched: Schedule, placements: dict) -> dict:
    """``{rank: Slot}`` after checking the placements (``{model name: TaskMesh}``) fit."""
    pb = sched.problem
    if set(placements) != set(sched.model_names):
        raise ScheduleError(f"schedule models {sorted(sched.model_names)} differ from the "
                            f"placed models {sorted(placements)}")
    slots, owner = {}, {}
    for m in pb.models:
        st = placements[m.name].strategy
        if st.pp != m.pp:
            raise ScheduleError(f"model {m.name!r}: schedule pp={m.pp} but placement pp={st.pp}")
        if st.dp % m.pipelines:
            raise ScheduleError(f"model {m.name!r}: schedule runs {m.pipelines} pipelines but "
                                f"placement dp={st.dp} is not a multiple of it")
        for r in placements[m.name].ranks:
            c = placements[m.name].coord(r)
            p, copy = c.dp % m.pipelines, c.dp // m.pipelines
            slot = Slot(m.fused_stage(p, c.pp, pb.stages), copy, c.tp)
            if slots.setdefault(r, slot) != slot:
                raise ScheduleError(
                    f"rank {r}: model {owner[r]!r} puts it on {slots[r]} but model {m.name!r} on "
                    f"{slot}; check 'direction' in the schedule against reverse_pp in the placement")
            owner.setdefault(r, m.name)
    for m in pb.models:
        if set(placements[m.name].ranks) != set(slots):
            raise ScheduleError(f"model {m.name!r} is placed on ranks {sorted(placements[m.name].ranks)}"
                                f", the fused pipeline spans {sorted(slots)}")
    return slots


def check_microbatches(sched: Schedule, given: dict) -> None:
    """``given``: {model: micro-batches per pipeline the executor received}."""
    for m in sched.problem.models:
        if m.name in given and given[m.name] != m.microbatches:
            raise ScheduleError(f"model {m.name!r}: schedule has {m.microbatches} micro-batches per "
                                f"pipeline but the executor was given {given[m.name]}")


# -- lowering --------------------------------------------------------------------
def _lower_action(pb: Problem, a: Action, mesh, replica: int, tp: int) -> list:
    """RECV? COMPUTE SEND? for one action (see the module docstring)."""
    m = pb.models[pb.model_index[a.model]]
    peer = lambda j: mesh.rank(j, replica, tp)  # noqa: E731
    v = pb.node_id(a)
    base = dict(model=a.model, pipeline=a.pipeline, mb=a.mb, stage=a.stage)
    if a.op == "F":
        recv = a.stage > 0 and Instr(RECV_ACT, peer=peer(a.stage - 1), tag=v - 1, **base)
        send = a.stage < m.pp - 1 and Instr(SEND_ACT, peer=peer(a.stage + 1), tag=v, **base)
        core = Instr(FORWARD, **base)
    else:
        recv = a.stage < m.pp - 1 and Instr(RECV_GRAD, peer=peer(a.stage + 1), tag=v - 1, **base)
        send = a.stage > 0 and Instr(SEND_GRAD, peer=peer(a.stage - 1), tag=v, **base)
        core = Instr(BACKWARD, **base)
    return [i for i in (recv, core, send) if i]


def _checked_slots(sched: Schedule, placements: dict, microbatches: dict | None) -> dict:
    """Validity, micro-batch counts and placements checked, then ``{rank: Slot}``."""
    check_schedule(sched)
    check_microbatches(sched, microbatches or {})
    return rank_slots(sched, placements)


def compile_rank(sched: Schedule, placements: dict, rank: int,
                 microbatches: dict | None = None) -> tuple:
    """This rank's instruction list; refuses (ScheduleError) a schedule that is
    cyclic or does not match ``placements`` ({model: TaskMesh}) or
    ``microbatches`` ({model: count per pipeline}), before any communication."""
    slots = _checked_slots(sched, placements, microbatches)
    if rank not in slots:
        raise ScheduleError(f"rank {rank} is not in the fused pipeline (ranks {sorted(slots)})")
    return _program(sched, placements, slots[rank])


def compile_all(sched: Schedule, placements: dict, microbatches: dict | None = None) -> dict:
    """``{rank: instructions}`` for every rank of the fused pipeline (checked once)."""
    slots = _checked_slots(sched, placements, microbatches)
    return {r: _program(sched, placements, slots[r]) for r in sorted(slots)}


def _program(sched: Schedule, placements: dict, slot: Slot) -> tuple:
    """The instructions of the rank at ``slot`` (inputs already checked)."""
    pb = sched.problem
    out = []
    for a in sched.stages[slot.fused]:
        m = pb.models[pb.model_index[a.model]]
        replica = slot.copy * m.pipelines + a.pipeline
        out += _lower_action(pb, a, placements[a.model], replica, slot.tp)
    out.append(Instr(WAIT_SENDS))
    for name in sched.model_names:
        out += [Instr(REDUCE_GRADS, model=name), Instr(OPTIMIZER_STEP, model=name)]
    return tuple(out)


def check_deadlock_free(programs: dict) -> None:
    """Replay ``{rank: instructions}`` with non-blocking sends and blocking
    receives; raise ScheduleError naming where ranks wait if some never finish
    or a message is sent but never received."""
    pos = {r: 0 for r in programs}
    sent, received = set(), set()
    progress = True
    while progress:
        progress = False
        for r, prog in programs.items():
            while pos[r] < len(prog):
                i = prog[pos[r]]
                if i.kind in RECVS:
                    if (i.peer, r, i.tag) not in sent:
                        break
                    received.add((i.peer, r, i.tag))
                elif i.kind in SENDS:
                    sent.add((r, i.peer, i.tag))
                pos[r] += 1
                progress = True
    stuck = {r: str(programs[r][k]) for r, k in pos.items() if k < len(programs[r])}
    if stuck:
        raise ScheduleError(f"programs deadlock; ranks wait at {stuck}")
    if sent != received:
        raise ScheduleError(f"messages sent but never received: {sorted(sent - received)[:4]}")


def check_pair_order(programs: dict) -> None:
    """For backends that ignore tags (NCCL): every rank pair must receive its
    messages in the order they were sent; raise ScheduleError otherwise."""
    for a, prog in programs.items():
        for b in sorted({i.peer for i in prog if i.kind in SENDS}):
            sent = [i.tag for i in prog if i.kind in SENDS and i.peer == b]
            got = [i.tag for i in programs[b] if i.kind in RECVS and i.peer == a]
            if sent != got:
                k = next(k for k, (x, y) in enumerate(zip(sent, got)) if x != y)
                raise ScheduleError(
                    f"rank {a} -> {b}: message #{k} is sent as tag {sent[k]} but received as tag "
                    f"{got[k]}; this backend matches messages by order, not tag (use gloo, or a "
                    "schedule whose neighbouring stages exchange messages in the same order)")
