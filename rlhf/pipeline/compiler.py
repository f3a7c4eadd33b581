"""Instruction compiler: a fused schedule + the models' placements -> per-rank programs.

This module owns the mapping from fused stages to ranks, the lowering of a
schedule (rlhf/schedule) into instructions, the per-peer order in which
receives are posted, and the replay that checks the programs.  It is pure:
no torch, no communication, so a schedule that does not fit the placements
(or has a cyclic order) is refused before any rank sends a byte.

Fused stages -> ranks.  Model ``m`` with ``K`` pipelines and mesh
``(pp, dp, tp)`` runs pipeline ``p`` of data copy ``c`` on dp replica
``d = c*K + p``.  RLHFuse section 5.2: with ``tp_max`` the largest tp, a
fused stage is ``tp_max`` ranks and ``k = tp_max / tp`` consecutive placement
stages of ``m`` form one schedule stage (``pp = k * schedule pp``), each on
``tp`` of those ranks.  Placement stage ``o`` is schedule stage ``o // k``,
on fused stage ``m.fused_stage(p, o // k)``.  Every rank must get the same
(fused stage, copy) from every model, e.g. actor tp2 x pp2 "down" and critic
tp1 x pp4 "up" with ``reverse_pp`` on ranks 0..3 (critic ``k = 2``)::

    rank              0       1       2       3
    fused stage       0       0       1       1
    actor  (tp2)     s0.t0   s0.t1   s1.t0   s1.t1
    critic (tp1)     s3      s2      s1      s0
    critic schedule  |- stage 1 -|   |- stage 0 -|

Lowering.  Each compute action becomes, on a rank holding placement stage
``o`` of its model::

    F@o:  [RECV_ACT from o-1]  FORWARD   [SEND_ACT to o+1]
    B@o:  [RECV_GRAD from o+1] BACKWARD  [SEND_GRAD to o-1]

then ``WAIT_SENDS`` and per model ``REDUCE_GRADS``, ``OPTIMIZER_STEP``.  A
message's ``tag`` is the id of the schedule subtask whose compute produced it
(unique between one pair of ranks).

Order-matched receives.  NCCL (and gloo under one tag) pairs the n-th receive
that rank ``b`` posts from rank ``a`` with the n-th message ``a`` sends to
``b``.  So before a receive of the message that ``a`` sends n-th, a
``POST_RECV`` is inserted for each of ``a``'s earlier messages to ``b`` that
is not posted yet, in ``a``'s send order: those arrive into buffers held
until their own ``RECV`` (:func:`early_buffers` counts them).  Waiting for
``a``'s n-th message then completes exactly when it would under tag
matching (``a`` sends in order), so the argument below is unchanged.

Why no rank waits forever.  Sends are non-blocking and posted right after
the producing compute; a receive blocks until its message is sent, a
tensor-parallel compute until its TP group arrives.  Take any order of all
subtasks that respects the schedule's stage orders and chains (acyclic:
the validator checks) and run every rank's part of each subtask in it, a
merged stage's ``k`` parts in chain order: every receive's message was sent
by an earlier part, every TP group is at the same subtask.
:func:`check_deadlock_free` replays the programs under these rules.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from rlhf.schedule.generators import serial_1f1b
from rlhf.schedule.problem import Action, ModelSpec, Problem
from rlhf.schedule.schedule import Schedule, ScheduleError
from rlhf.schedule.validate import check_schedule

RECV_ACT, FORWARD, SEND_ACT = "RECV_ACT", "FORWARD", "SEND_ACT"
RECV_GRAD, BACKWARD, SEND_GRAD = "RECV_GRAD", "BACKWARD", "SEND_GRAD"
POST_RECV = "POST_RECV"
WAIT_SENDS, REDUCE_GRADS, OPTIMIZER_STEP = "WAIT_SENDS", "REDUCE_GRADS", "OPTIMIZER_STEP"
COMPUTE = (FORWARD, BACKWARD)
SENDS = (SEND_ACT, SEND_GRAD)
RECVS = (RECV_ACT, RECV_GRAD)


@dataclass(frozen=True)
class Instr:
    """One instruction: ``kind`` on micro-batch ``mb`` of ``model`` (pipeline,
    placement ``stage``).  SEND/RECV/POST_RECV: ``peer`` (global rank) and
    ``tag`` (the message's id between the pair).  FORWARD/BACKWARD of a
    tensor-parallel model: ``group``, the TP ranks its collectives run on."""

    kind: str
    model: str = ""
    pipeline: int = -1
    mb: int = -1
    stage: int = -1
    peer: int = -1
    tag: int = -1
    group: tuple = ()

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
    """Where a rank sits in the fused pipeline: fused stage and data copy."""

    fused: int
    copy: int


def serial_schedule(name: str, mesh, microbatches: int) -> Schedule:
    """Serial 1F1B of model ``name`` over ``mesh``'s pipeline (a TaskMesh), ``microbatches`` per
    replica: what the executor runs for an unfused model (unit costs: only the order matters)."""
    pp = mesh.strategy.pp
    spec = ModelSpec(name, pp, 1, microbatches, "up" if mesh.reverse_pp else "down", [1.0] * pp, [2.0] * pp,
                     [1.0] * pp)
    problem = Problem(pp, (spec,))
    return Schedule.from_orders(problem, serial_1f1b(problem))


def merge_factors(sched: Schedule, placements: dict) -> dict:
    """``{model: k}``: placement stages per schedule stage, ``k = tp_max / tp``."""
    tp = {name: placements[name].strategy.tp for name in sched.model_names}
    tp_max = max(tp.values())
    for name, t in tp.items():
        if tp_max % t:
            raise ScheduleError(f"model {name!r}: tp={t} does not divide the largest tp={tp_max}; "
                                "a fused stage of tp_max ranks holds tp_max/tp stages of each model")
    return {name: tp_max // t for name, t in tp.items()}


def _check_degrees(m, strategy, k: int) -> None:
    """Placement pp and dp against model ``m`` of the schedule (``k``: merge factor)."""
    if strategy.pp != k * m.pp:
        merged = (f" (tp={strategy.tp} is 1/{k} of the largest tp: {k} placement stages form one "
                  f"schedule stage, so pp={k * m.pp} is needed)") if k > 1 else ""
        raise ScheduleError(f"model {m.name!r}: schedule pp={m.pp} but placement pp={strategy.pp}{merged}")
    if strategy.dp % m.pipelines:
        raise ScheduleError(f"model {m.name!r}: schedule runs {m.pipelines} pipelines but "
                            f"placement dp={strategy.dp} is not a multiple of it")


def rank_slots(sched: Schedule, placements: dict) -> dict:
    """``{rank: Slot}`` after checking the placements (``{model name: TaskMesh}``) fit."""
    pb = sched.problem
    if set(placements) != set(sched.model_names):
        raise ScheduleError(f"schedule models {sorted(sched.model_names)} differ from the "
                            f"placed models {sorted(placements)}")
    merge = merge_factors(sched, placements)
    slots, owner = {}, {}
    for m in pb.models:
        mesh, k = placements[m.name], merge[m.name]
        _check_degrees(m, mesh.strategy, k)
        for r in mesh.ranks:
            c = mesh.coord(r)
            slot = Slot(m.fused_stage(c.dp % m.pipelines, c.pp // k, pb.stages), c.dp // m.pipelines)
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
def _lower_action(pb: Problem, a: Action, mesh, rank: int, k: int) -> list:
    """RECV? COMPUTE SEND? for this rank's part of ``a`` (see the module docstring)."""
    c, last = mesh.coord(rank), mesh.strategy.pp - 1
    o, i = c.pp, pb.model_index[a.model]
    peer = lambda j: mesh.rank(j, c.dp, c.tp)  # noqa: E731
    tag = lambda j, fwd: pb.node_id_fast(i, a.pipeline, a.mb, j // k, fwd)  # noqa: E731
    base = dict(model=a.model, pipeline=a.pipeline, mb=a.mb, stage=o)
    group = tuple(mesh.tp_ranks(o, c.dp)) if mesh.strategy.tp > 1 else ()
    if a.op == "F":
        recv = o > 0 and Instr(RECV_ACT, peer=peer(o - 1), tag=tag(o - 1, True), **base)
        send = o < last and Instr(SEND_ACT, peer=peer(o + 1), tag=tag(o, True), **base)
        core = Instr(FORWARD, group=group, **base)
    else:
        recv = o < last and Instr(RECV_GRAD, peer=peer(o + 1), tag=tag(o + 1, False), **base)
        send = o > 0 and Instr(SEND_GRAD, peer=peer(o - 1), tag=tag(o, False), **base)
        core = Instr(BACKWARD, group=group, **base)
    return [x for x in (recv, core, send) if x]


def _lowered(sched: Schedule, placements: dict, merge: dict, rank: int, slot: Slot) -> tuple:
    """The rank's instructions before receive ordering (inputs already checked)."""
    out = []
    for a in sched.stages[slot.fused]:
        out += _lower_action(sched.problem, a, placements[a.model], rank, merge[a.model])
    out.append(Instr(WAIT_SENDS))
    for name in sched.model_names:
        out += [Instr(REDUCE_GRADS, model=name), Instr(OPTIMIZER_STEP, model=name)]
    return tuple(out)


def _sends_to(program, rank: int) -> list:
    """Tags of the messages ``program`` sends to ``rank``, in send order."""
    return [i.tag for i in program if i.kind in SENDS and i.peer == rank]


def order_receives(program, send_order: dict) -> tuple:
    """``program`` with a POST_RECV before each receive for every earlier message
    from the same peer not yet posted, so receives are posted in the peer's send
    order.  ``send_order``: {peer: tags it sends to this rank, in order}."""
    recvs = {(i.peer, i.tag): i for i in program if i.kind in RECVS}
    posted = dict.fromkeys(send_order, 0)
    out = []
    for ins in program:
        if ins.kind in RECVS:
            order = send_order[ins.peer]
            n = order.index(ins.tag)
            out += [replace(recvs[ins.peer, t], kind=POST_RECV) for t in order[posted[ins.peer]:n]]
            posted[ins.peer] = max(posted[ins.peer], n + 1)
        out.append(ins)
    return tuple(out)


def _with_posts(program, rank: int, program_of) -> tuple:
    """``order_receives`` for ``rank``; ``program_of(peer)``: a peer's lowered program."""
    peers = {i.peer for i in program if i.kind in RECVS}
    return order_receives(program, {a: _sends_to(program_of(a), rank) for a in peers})


def _checked(sched: Schedule, placements: dict, microbatches: dict | None) -> tuple:
    """Validity, micro-batch counts and placements checked, then ``({rank: Slot}, merge factors)``."""
    check_schedule(sched)
    check_microbatches(sched, microbatches or {})
    return rank_slots(sched, placements), merge_factors(sched, placements)


def compile_rank(sched: Schedule, placements: dict, rank: int,
                 microbatches: dict | None = None) -> tuple:
    """This rank's instruction list; refuses (ScheduleError) a schedule that is
    cyclic or does not match ``placements`` ({model: TaskMesh}) or
    ``microbatches`` ({model: count per pipeline}), before any communication."""
    slots, merge = _checked(sched, placements, microbatches)
    if rank not in slots:
        raise ScheduleError(f"rank {rank} is not in the fused pipeline (ranks {sorted(slots)})")
    lowered = lambda r: _lowered(sched, placements, merge, r, slots[r])  # noqa: E731
    return _with_posts(lowered(rank), rank, lowered)


def compile_all(sched: Schedule, placements: dict, microbatches: dict | None = None) -> dict:
    """``{rank: instructions}`` for every rank of the fused pipeline (checked once)."""
    slots, merge = _checked(sched, placements, microbatches)
    raw = {r: _lowered(sched, placements, merge, r, slots[r]) for r in sorted(slots)}
    return {r: _with_posts(prog, r, raw.__getitem__) for r, prog in raw.items()}


def early_buffers(program) -> int:
    """Most messages this program holds at once that arrived before their RECV
    (posted by a POST_RECV, i.e. overtaken in the sender's order): the buffer
    cost of order matching.  Equals ``max over receives t of sum over peers a
    of (1 + send index of the latest-sent message taken from a by t) - (number
    of messages taken from a by t)``; 0 when every pair receives in send order."""
    early, peak = set(), 0
    for i in program:
        if i.kind == POST_RECV:
            early.add((i.peer, i.tag))
            peak = max(peak, len(early))
        elif i.kind in RECVS:
            early.discard((i.peer, i.tag))
    return peak


# -- replay ----------------------------------------------------------------------
class _Replay:
    """All ranks' programs run step by step under the executor's rules: sends
    never block; the n-th receive rank b posts from a takes the n-th message a
    sent to b (order matching); a TP compute waits for its whole group."""

    def __init__(self, programs: dict):
        self.programs = programs
        self.pos = dict.fromkeys(programs, 0)
        self.sent, self.posted, self.slot = {}, {}, {}   # (a, b) -> tags; (a, b, tag) -> n
        self.done = {}                                   # (rank, model) -> TP computes passed

    def run(self) -> None:
        progress = True
        while progress:
            progress = False
            for r, prog in self.programs.items():
                while self.pos[r] < len(prog) and self._step(r, prog[self.pos[r]]):
                    self.pos[r] += 1
                    progress = True

    def _step(self, r: int, i: Instr) -> bool:
        """Run ``i`` on rank ``r``; False if it blocks."""
        if i.kind in SENDS:
            self.sent.setdefault((r, i.peer), []).append(i.tag)
        elif i.kind == POST_RECV:
            self._post(i.peer, r, i.tag)
        elif i.kind in RECVS:
            return self._take(r, i)
        elif i.kind in COMPUTE and i.group:
            return self._collective(r, i)
        return True

    def _post(self, a: int, b: int, tag: int) -> int:
        if (a, b, tag) not in self.slot:
            self.slot[a, b, tag] = len(self.posted.setdefault((a, b), []))
            self.posted[a, b].append(tag)
        return self.slot[a, b, tag]

    def _take(self, b: int, i: Instr) -> bool:
        """Rank ``b`` receives ``i`` once its sender has sent the message it is paired with."""
        a = i.peer
        n, sent = self._post(a, b, i.tag), self.sent.get((a, b), [])
        if len(sent) <= n:
            return False
        if sent[n] != i.tag:
            raise ScheduleError(f"rank {b}'s receive #{n} from rank {a} ({i}) would get rank {a}'s "
                                f"message #{n} to it, tag {sent[n]}: an order-matching backend pairs "
                                "them (receives must be posted in the sender's order)")
        return True

    def _reached(self, q: int, model: str) -> int:
        """TP computes of ``model`` that rank ``q`` has passed or is waiting at."""
        prog, k = self.programs[q], self.pos[q]
        waiting = k < len(prog) and prog[k].kind in COMPUTE and prog[k].model == model
        return self.done.get((q, model), 0) + waiting

    def _collective(self, r: int, i: Instr) -> bool:
        n = self.done.get((r, i.model), 0)
        if any(self._reached(q, i.model) <= n for q in i.group):
            return False
        self.done[r, i.model] = n + 1
        return True

    def check_finished(self) -> None:
        stuck = {r: str(p[self.pos[r]]) for r, p in self.programs.items() if self.pos[r] < len(p)}
        if stuck:
            raise ScheduleError(f"programs deadlock; ranks wait at {stuck}")
        lost = {pair: len(tags) - len(self.posted.get(pair, ())) for pair, tags in self.sent.items()
                if len(tags) != len(self.posted.get(pair, ()))}
        if lost:
            raise ScheduleError(f"messages sent but never received (rank pair: count): {lost}")


def check_deadlock_free(programs: dict) -> None:
    """Replay ``{rank: instructions}`` (see :class:`_Replay`); raise ScheduleError
    naming where ranks wait if some never finish, a receive that would take
    another message under order matching, or messages never received."""
    replay = _Replay(programs)
    replay.run()
    replay.check_finished()
