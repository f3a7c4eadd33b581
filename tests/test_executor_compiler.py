"""Compiler and timeline unit tests (pure: no torch.distributed, no processes).

Exact instruction lists for a small pipeline and a mixed-TP one, deadlock
freedom under order-matched receives and TP collectives for many valid
schedules (serial, greedy, annealed, random topological orders) on several
placements, the early-receive buffer bound (exact on small examples, equal
to its formula on random ones), and every refusal's message.
"""
import json
import random

import pytest

from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.pipeline import compiler as C
from rlhf.pipeline.timeline import Timeline, bubble_fractions, chrome_trace, makespan
from rlhf.schedule.anneal import AnnealConfig, anneal_makespan
from rlhf.schedule.cost_model import ModelShape, build_problem
from rlhf.schedule.generators import greedy_fused, serial_1f1b
from rlhf.schedule.io import load_schedule, schedule_from_dict, schedule_to_dict
from rlhf.schedule.problem import ModelSpec, Problem
from rlhf.schedule.schedule import Schedule, ScheduleError
from rlhf.schedule.validate import check_schedule


def spec(name, pp, pipelines, mbs, direction, f=1.0, b=2.0):
    return ModelSpec(name, pp, pipelines, mbs, direction, [f] * pp, [b] * pp, [1.0] * pp)


def mesh(task, ranks, pp, dp=1, reverse=False, tp=1):
    return TaskMesh(task, tuple(ranks), ParallelStrategy(dp=dp, pp=pp, tp=tp), reverse)


# actor pp4 down, critic pp4 up (reverse_pp) on ranks 0-3
PB = Problem(4, (spec("actor", 4, 1, 4, "down"), spec("critic", 4, 1, 4, "up", 0.7, 1.4)))
PLACE = {"actor": mesh("actor_train", range(4), 4), "critic": mesh("critic_train", range(4), 4, reverse=True)}
# actor pp2 x 2 pipelines (dp2) with critic pp4 up: pipeline p stage j on rank 2p + j
PB_K2 = Problem(4, (spec("actor", 2, 2, 3, "down"), spec("critic", 4, 1, 4, "up")))
PLACE_K2 = {"actor": mesh("actor_train", [0, 2, 1, 3], 2, dp=2),
            "critic": mesh("critic_train", range(4), 4, reverse=True)}
# two data copies of the fused pipeline on 8 ranks
PLACE_X2 = {"actor": mesh("actor_train", [0, 4, 1, 5, 2, 6, 3, 7], 4, dp=2),
            "critic": mesh("critic_train", [0, 4, 1, 5, 2, 6, 3, 7], 4, dp=2, reverse=True)}
# both tp2 x pp2 (TP collectives in every compute)
PB_2 = Problem(2, (spec("actor", 2, 1, 4, "down"), spec("critic", 2, 1, 4, "up", 0.7, 1.4)))
PLACE_TP2 = {"actor": mesh("actor_train", range(4), 2, tp=2),
             "critic": mesh("critic_train", range(4), 2, reverse=True, tp=2)}
# mixed TP (RLHFuse 5.2): actor tp2 x pp2, critic tp1 x pp4 up; critic stages 2k, 2k+1 form
# its schedule stage k (ranks 3, 2 = schedule stage 0 on fused stage 1)
PLACE_MIXED = {"actor": mesh("actor_train", range(4), 2, tp=2),
               "critic": mesh("critic_train", range(4), 4, reverse=True)}
PLACEMENTS = [(PB, PLACE), (PB_K2, PLACE_K2), (PB, PLACE_X2), (PB_2, PLACE_TP2), (PB_2, PLACE_MIXED)]


def random_topological(pb, seed):
    """A random valid order: emit the next subtask of a random chain, split by stage."""
    rng, arr = random.Random(seed), pb.arrays
    heads = [v for v in range(pb.num_nodes) if arr.pred[v] < 0]
    orders = [[] for _ in range(pb.stages)]
    while heads:
        v = heads.pop(rng.randrange(len(heads)))
        orders[arr.stage[v]].append(v)
        if v + 1 < pb.num_nodes and arr.pred[v + 1] == v:
            heads.append(v + 1)
    return orders


def test_exact_program_two_stage_serial():
    pb = Problem(2, (spec("a", 2, 1, 2, "down"),))
    place = {"a": mesh("actor_train", [5, 7], 2)}
    progs = C.compile_all(Schedule.from_orders(pb, serial_1f1b(pb)), place)
    assert [str(i) for i in progs[5]] == [
        "FORWARD a[p0].mb0@s0", "SEND_ACT a[p0].mb0@s0 peer=7 tag=0",
        "FORWARD a[p0].mb1@s0", "SEND_ACT a[p0].mb1@s0 peer=7 tag=4",
        "RECV_GRAD a[p0].mb0@s0 peer=7 tag=2", "BACKWARD a[p0].mb0@s0", "RECV_GRAD a[p0].mb1@s0 peer=7 tag=6",
        "BACKWARD a[p0].mb1@s0", "WAIT_SENDS", "REDUCE_GRADS a", "OPTIMIZER_STEP a"]
    assert [str(i) for i in progs[7]] == [
        "RECV_ACT a[p0].mb0@s1 peer=5 tag=0", "FORWARD a[p0].mb0@s1", "BACKWARD a[p0].mb0@s1",
        "SEND_GRAD a[p0].mb0@s1 peer=5 tag=2",
        "RECV_ACT a[p0].mb1@s1 peer=5 tag=4", "FORWARD a[p0].mb1@s1", "BACKWARD a[p0].mb1@s1",
        "SEND_GRAD a[p0].mb1@s1 peer=5 tag=6", "WAIT_SENDS", "REDUCE_GRADS a", "OPTIMIZER_STEP a"]


def test_reversed_critic_peers():
    progs = C.compile_all(Schedule.from_orders(PB, serial_1f1b(PB)), PLACE)
    critic_f0 = [str(i) for i in progs[3] if i.model == "critic" and i.mb == 0 and i.kind in C.SENDS]
    # critic stage 0 sits on rank 3 and sends its activation to rank 2
    assert critic_f0 == ["SEND_ACT critic[p0].mb0@s0 peer=2 tag=32"]


def valid_orders(pb, randoms=20):
    """Serial, greedy, two annealed and ``randoms`` random topological orders."""
    return [serial_1f1b(pb), greedy_fused(pb)] + [
        anneal_makespan(pb, greedy_fused(pb), AnnealConfig(iters=300), seed=s)[0] for s in (1, 2)] + [
        random_topological(pb, seed) for seed in range(randoms)]


@pytest.mark.parametrize("pb,place", PLACEMENTS)
def test_valid_schedules_compile_deadlock_free(pb, place):
    for o in valid_orders(pb):
        progs = C.compile_all(Schedule.from_orders(pb, o), place)
        C.check_deadlock_free(progs)  # order-matched receives, TP barriers, every send received
        assert progs[0] == C.compile_rank(Schedule.from_orders(pb, o), place, 0)
        for r, prog in progs.items():
            assert sum(i.kind in C.COMPUTE for i in prog) == sum(
                2 * m.microbatches for m in pb.models)


def test_copies_use_their_own_ranks():
    progs = C.compile_all(Schedule.from_orders(PB, serial_1f1b(PB)), PLACE_X2)
    peers = {r: {i.peer for i in prog if i.peer >= 0} for r, prog in progs.items()}
    assert peers[0] == {1} and peers[4] == {5} and peers[5] == {4, 6}


def test_cyclic_programs_detected_by_replay():
    o = serial_1f1b(Problem(2, (spec("a", 2, 1, 2, "down"),)))
    pb = Problem(2, (spec("a", 2, 1, 2, "down"),))
    place = {"a": mesh("actor_train", [0, 1], 2)}
    good = C.compile_all(Schedule.from_orders(pb, o), place)
    bad = dict(good)
    bad[1] = tuple(i for i in good[1] if i.kind != C.SEND_GRAD)
    with pytest.raises(ScheduleError, match="programs deadlock; ranks wait at {0: 'RECV_GRAD"):
        C.check_deadlock_free(bad)


def without_posts(progs):
    return {r: tuple(i for i in p if i.kind != C.POST_RECV) for r, p in progs.items()}


def test_receives_posted_in_sender_order():
    serial = C.compile_all(Schedule.from_orders(PB, serial_1f1b(PB)), PLACE)
    assert without_posts(serial) == serial  # every pair already receives in send order
    greedy = C.compile_all(Schedule.from_orders(PB, greedy_fused(PB)), PLACE)
    C.check_deadlock_free(greedy)
    # without the POST_RECVs an order-matching backend would pair the wrong messages
    with pytest.raises(ScheduleError, match=r"rank 2's receive #3 from rank 3 \(RECV_GRAD actor\[p0\].mb0@s2 "
                                              r"peer=3 tag=4\) would get rank 3's message #3 to it, tag 56"):
        C.check_deadlock_free(without_posts(greedy))


def test_posts_precede_the_receive_that_overtakes_them():
    """Single model, stage 1 runs micro-batches last-first: its first receive
    (mb1, sent second) posts mb0's first; stage 0's first gradient (mb0) is
    sent last, so mb1's is posted ahead of it."""
    pb = Problem(2, (spec("a", 2, 1, 2, "down"),))
    ids = lambda s, ops: [pb.node_id_fast(0, 0, int(x[1]), s, x[0] == "F") for x in ops]  # noqa: E731
    orders = [ids(0, ["F0", "F1", "B0", "B1"]), ids(1, ["F1", "B1", "F0", "B0"])]
    progs = C.compile_all(Schedule.from_orders(pb, orders), {"a": mesh("actor_train", [0, 1], 2)})
    assert [str(i) for i in progs[1][:3]] == [
        "POST_RECV a[p0].mb0@s1 peer=0 tag=0", "RECV_ACT a[p0].mb1@s1 peer=0 tag=4", "FORWARD a[p0].mb1@s1"]
    assert [str(i) for i in progs[0] if i.kind in (C.POST_RECV, C.RECV_GRAD)] == [
        "POST_RECV a[p0].mb1@s0 peer=1 tag=6", "RECV_GRAD a[p0].mb0@s0 peer=1 tag=2",
        "RECV_GRAD a[p0].mb1@s0 peer=1 tag=6"]
    C.check_deadlock_free(progs)


def buffers(pb, orders, place) -> dict:
    progs = C.compile_all(Schedule.from_orders(pb, orders), place)
    return {r: C.early_buffers(p) for r, p in progs.items()}


def test_early_buffers_exact():
    # serial 1F1B: every pair receives in send order, nothing arrives early
    for pb, place in PLACEMENTS:
        assert set(buffers(pb, serial_1f1b(pb), place).values()) == {0}
    # one model, stage 1 takes micro-batches last-first: rank 1's first receive overtakes
    # m - 1 activations, rank 0's first gradient (mb0) is the last rank 1 sends
    m = 4
    pb = Problem(2, (spec("a", 2, 1, m, "down"),))
    ids = lambda s, op, mbs: [pb.node_id_fast(0, 0, b, s, op == "F") for b in mbs]  # noqa: E731
    rev = [v for b in reversed(range(m)) for v in ids(1, "F", [b]) + ids(1, "B", [b])]
    assert buffers(pb, [ids(0, "F", range(m)) + ids(0, "B", range(m)), rev],
                   {"a": mesh("actor_train", [0, 1], 2)}) == {0: m - 1, 1: m - 1}
    # actor down + critic up on 2 ranks; stage 1 runs all critic work before the actor's:
    # its first critic gradient is rank 0's message #m, so all m actor activations wait
    m = 3
    pb = Problem(2, (spec("actor", 2, 1, m, "down"), spec("critic", 2, 1, m, "up")))
    a = lambda s, op, b: pb.node_id_fast(0, 0, b, s, op == "F")  # noqa: E731
    c = lambda s, op, b: pb.node_id_fast(1, 0, b, s, op == "F")  # noqa: E731
    stage0 = [a(0, "F", b) for b in range(m)] + [v for b in range(m) for v in (c(1, "F", b), c(1, "B", b))] \
        + [a(0, "B", b) for b in range(m)]
    stage1 = [c(0, "F", b) for b in range(m)] + [c(0, "B", b) for b in range(m)] \
        + [v for b in range(m) for v in (a(1, "F", b), a(1, "B", b))]
    place = {"actor": mesh("actor_train", [0, 1], 2), "critic": mesh("critic_train", [0, 1], 2, reverse=True)}
    assert buffers(pb, [stage0, stage1], place) == {0: 0, 1: m}
    # the measured cases quoted in docs/executor.md
    assert buffers(PB, greedy_fused(PB), PLACE) == {0: 0, 1: 2, 2: 1, 3: 0}


def formula_buffers(progs) -> dict:
    """Independent reference of the bound: per rank b, the max over its receives t
    of sum over peers a of (1 + max send index taken from a) - (count taken from a)."""
    send_index = {}
    for a, prog in progs.items():
        for i in prog:
            if i.kind in C.SENDS:
                order = send_index.setdefault((a, i.peer), {})
                order[i.tag] = len(order)
    out = {}
    for b, prog in progs.items():
        top, taken, best = {}, {}, 0
        for i in prog:
            if i.kind in C.RECVS:
                top[i.peer] = max(top.get(i.peer, -1), send_index[i.peer, b][i.tag])
                taken[i.peer] = taken.get(i.peer, 0) + 1
                best = max(best, sum(top[a] + 1 - taken[a] for a in top))
        out[b] = best
    return out


@pytest.mark.parametrize("pb,place", PLACEMENTS)
def test_early_buffers_equal_the_formula(pb, place):
    seen = set()
    for o in valid_orders(pb, randoms=10):
        progs = C.compile_all(Schedule.from_orders(pb, o), place)
        got = {r: C.early_buffers(p) for r, p in progs.items()}
        assert got == formula_buffers(progs)
        seen |= set(got.values())
    assert max(seen) > 0  # the random orders do overtake


def test_mixed_tp_programs_exact():
    """Actor tp2 x pp2, critic tp1 x pp4 up, one micro-batch, serial 1F1B: ranks 3
    and 2 run critic stages 0 and 1, the two parts of critic schedule stage 0."""
    pb = Problem(2, (spec("actor", 2, 1, 1, "down"), spec("critic", 2, 1, 1, "up")))
    progs = C.compile_all(Schedule.from_orders(pb, serial_1f1b(pb)), PLACE_MIXED)
    assert [str(i) for i in progs[3]] == [
        "RECV_ACT actor[p0].mb0@s1 peer=1 tag=0", "FORWARD actor[p0].mb0@s1", "BACKWARD actor[p0].mb0@s1",
        "SEND_GRAD actor[p0].mb0@s1 peer=1 tag=2",
        "FORWARD critic[p0].mb0@s0", "SEND_ACT critic[p0].mb0@s0 peer=2 tag=4",
        "RECV_GRAD critic[p0].mb0@s0 peer=2 tag=7", "BACKWARD critic[p0].mb0@s0",
        "WAIT_SENDS", "REDUCE_GRADS actor", "OPTIMIZER_STEP actor", "REDUCE_GRADS critic", "OPTIMIZER_STEP critic"]
    assert [str(i) for i in progs[2] if i.model == "critic" and i.mb == 0] == [
        "RECV_ACT critic[p0].mb0@s1 peer=3 tag=4", "FORWARD critic[p0].mb0@s1",
        "SEND_ACT critic[p0].mb0@s1 peer=1 tag=4", "RECV_GRAD critic[p0].mb0@s1 peer=1 tag=6",
        "BACKWARD critic[p0].mb0@s1", "SEND_GRAD critic[p0].mb0@s1 peer=3 tag=7"]
    groups = {(r, i.model): i.group for r, p in progs.items() for i in p if i.kind in C.COMPUTE}
    assert groups[2, "actor"] == groups[3, "actor"] == (2, 3) and groups[0, "actor"] == (0, 1)
    assert groups[2, "critic"] == ()


def test_mixed_tp_is_the_cost_models_problem():
    shapes = [ModelShape("actor", 4, 64, 128, 4, tp=2, pp=2, microbatches=4),
              ModelShape("critic", 4, 64, 128, 4, tp=1, pp=4, microbatches=4, direction="up")]
    pb = build_problem(shapes)
    assert (pb.stages, [(m.pp, m.pipelines) for m in pb.models]) == (2, [(2, 1), (2, 1)])
    sched = Schedule.from_orders(pb, greedy_fused(pb))
    assert C.merge_factors(sched, PLACE_MIXED) == {"actor": 1, "critic": 2}
    assert C.rank_slots(sched, PLACE_MIXED) == {0: C.Slot(0, 0), 1: C.Slot(0, 0), 2: C.Slot(1, 0), 3: C.Slot(1, 0)}
    C.check_deadlock_free(C.compile_all(sched, PLACE_MIXED))


def test_tp_collectives_modelled_by_replay():
    """Rank 2 moved its critic work (waiting for rank 3's critic stage 0) before its
    actor forward; rank 3 waits in that forward's TP collective for rank 2."""
    pb = Problem(2, (spec("actor", 2, 1, 1, "down"), spec("critic", 2, 1, 1, "up")))
    progs = dict(C.compile_all(Schedule.from_orders(pb, serial_1f1b(pb)), PLACE_MIXED))
    C.check_deadlock_free(progs)
    critic_first = [i for i in progs[2] if i.model == "critic"]
    progs[2] = tuple(critic_first) + tuple(i for i in progs[2] if i.model != "critic")
    with pytest.raises(ScheduleError, match=r"programs deadlock; ranks wait at .*2: 'RECV_ACT critic"
                                              r".*3: 'FORWARD actor"):
        C.check_deadlock_free(progs)


def _swap_stage(sched, s, pick_a, pick_b):
    row = list(sched.stages[s])
    a, b = row.index(next(filter(pick_a, row))), row.index(next(filter(pick_b, row)))
    row.insert(b, row.pop(a))
    return Schedule(sched.problem, sched.stages[:s] + (tuple(row),) + sched.stages[s + 1:])


def cyclic_schedule(pb):
    """Serial 1F1B with actor B0@s0 moved before F1@s0 on stage 0 and F1@s1
    before B0@s1 on stage 1: B0@s0 <- B0@s1 <- F1@s1 <- F1@s0 <- B0@s0."""
    is_ = lambda op, mb: lambda a: a.model == "actor" and a.op == op and a.mb == mb  # noqa: E731
    sched = _swap_stage(Schedule.from_orders(pb, serial_1f1b(pb)), 0, is_("B", 0), is_("F", 1))
    return _swap_stage(sched, 1, is_("F", 1), is_("B", 0))


def test_cyclic_order_refused():
    with pytest.raises(ScheduleError, match=r"\[deadlock\] stage 0: actor\[p0\].B0@s0 at position 1 "
                                              r"waits for actor\[p0\].B0@s1 on stage 1, which never runs"):
        C.compile_rank(cyclic_schedule(PB), PLACE, 0)


@pytest.mark.parametrize("pb,place,counts,message", [
    (PB, {"actor": PLACE["actor"]}, None, r"schedule models \['actor', 'critic'\] differ from the placed"),
    (PB, {**PLACE, "actor": mesh("actor_train", range(4), 2, dp=2)}, None,
     "model 'actor': schedule pp=4 but placement pp=2"),
    (PB_K2, {**PLACE_K2, "actor": mesh("actor_train", [0, 1, 2, 3], 1, dp=4)}, None,
     "schedule pp=2 but placement pp=1"),
    (PB, {**PLACE, "critic": mesh("critic_train", range(4), 4)}, None,
     r"rank 0: model 'actor' puts it on Slot\(fused=0.*critic' on Slot\(fused=3"),
    (PB_K2, {**PLACE_K2, "actor": mesh("actor_train", range(4), 2, dp=2)}, None,
     r"rank 1: model 'actor' puts it on Slot\(fused=2"),
    (PB, {**PLACE, "actor": PLACE_X2["actor"]}, None,
     r"placed on ranks \[0, 1, 2, 3\], the fused pipeline spans \[0, 1, 2, 3, 4, 5, 6, 7\]"),
    (PB, PLACE, {"actor": 4, "critic": 2}, "model 'critic': schedule has 4 micro-batches per "
                                          "pipeline but the executor was given 2"),
    (PB_2, {**PLACE_MIXED, "critic": mesh("critic_train", range(4), 2, dp=2, reverse=True)}, None,
     r"model 'critic': schedule pp=2 but placement pp=2 \(tp=1 is 1/2 of the largest tp: 2 placement "
     r"stages form one schedule stage, so pp=4 is needed\)"),
    (PB_2, {**PLACE_MIXED, "critic": mesh("critic_train", range(4), 4)}, None,
     r"rank 0: model 'actor' puts it on Slot\(fused=0, copy=0\) but model 'critic' on Slot\(fused=1, copy=0\)"),
    (PB_2, {"actor": mesh("actor_train", range(6), 2, tp=3), "critic": mesh("critic_train", range(6), 3, tp=2)},
     None, "model 'critic': tp=2 does not divide the largest tp=3"),
])
def test_mismatch_refused(pb, place, counts, message):
    with pytest.raises(ScheduleError, match=message):
        C.compile_rank(Schedule.from_orders(pb, serial_1f1b(pb)), place, 0, counts)


def test_dp_not_multiple_of_pipelines_refused():
    pb = Problem(4, (spec("actor", 2, 2, 3, "down"),))
    with pytest.raises(ScheduleError, match="runs 2 pipelines but placement dp=3"):
        C.rank_slots(Schedule.from_orders(pb, serial_1f1b(pb)), {"actor": mesh("actor_train", range(6), 2, dp=3)})


def test_rank_outside_refused():
    with pytest.raises(ScheduleError, match=r"rank 9 is not in the fused pipeline \(ranks \[0, 1, 2, 3\]\)"):
        C.compile_rank(Schedule.from_orders(PB, serial_1f1b(PB)), PLACE, 9)


def test_stage_contents_checked():
    sched = Schedule.from_orders(PB, serial_1f1b(PB))
    full = [list(r) for r in sched.stages]
    rows = [r[1:] if s == 0 else r for s, r in enumerate(full)]
    moved = full[0][0]
    cases = [
        (rows, r"\[missing\] stage 0: actor\[p0\].F0@s0 is not scheduled"),
        ([full[0], full[1] + [moved]] + full[2:], "belongs on fused stage 0, not 1"),
        ([[moved] + rows[0] + [moved]] + rows[1:], r"\[duplicate\] stage 0: actor\[p0\].F0@s0 appears again"),
        (rows[:3], "schedule has 3 stage lists, expected 4"),
    ]
    for rows_, message in cases:
        with pytest.raises(ScheduleError, match=message):
            check_schedule(Schedule(PB, tuple(tuple(r) for r in rows_)))


def test_json_roundtrip_and_file(tmp_path):
    sched = Schedule.from_orders(PB_K2, greedy_fused(PB_K2), {"makespan": 1.0})
    d = schedule_to_dict(sched)
    assert d["schedule"][2][0] == {"model": "actor", "pipeline": 1, "mb": 0, "op": "F", "model_stage": 0}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(d))
    assert load_schedule(path) == sched
    for e in d["schedule"][3]:
        e.pop("model_stage")  # optional: derived from the fused stage
    assert schedule_from_dict(d) == sched
    d["schedule"][3][0]["model_stage"] = (sched.stages[3][0].stage + 1) % 2  # not its stage
    with pytest.raises(ScheduleError, match="belongs on fused stage"):
        C.compile_rank(schedule_from_dict(d), PLACE_K2, 0)
    with pytest.raises(ScheduleError, match="malformed schedule: schedule file version 2"):
        schedule_from_dict({**d, "version": 2})
    path.write_text(json.dumps({**d, "version": 2}))
    with pytest.raises(ScheduleError, match=f"schedule file {path}: malformed schedule: .*version 2"):
        load_schedule(path)
    path.write_text("{not json")
    with pytest.raises(ScheduleError, match=f"schedule file {path}: "):
        load_schedule(path)
    with pytest.raises(ScheduleError, match="No such file"):
        load_schedule(tmp_path / "missing.json")


def test_timeline_bubbles_and_chrome_trace():
    t = Timeline(rank=0, origin=10.0)
    t.record("a F0", "FORWARD", 10.0, 11.0)
    t.record("SEND_ACT", "SEND_ACT", 11.0, 11.5)
    t.record("a B0", "BACKWARD", 12.0, 14.0)
    per_rank = [(0, t.to_list()), (1, [("a F0", "FORWARD", 1.0, 2.0)])]
    assert t.compute_busy() == 3.0 and t.compute_end() == 4.0
    assert makespan(per_rank) == 4.0
    assert bubble_fractions(per_rank) == {0: 0.25, 1: 0.75}
    trace = chrome_trace(per_rank)["traceEvents"]
    assert trace[2] == {"name": "SEND_ACT", "cat": "SEND_ACT", "ph": "X", "pid": 0, "tid": 0,
                        "ts": 1e6, "dur": 0.5e6}
    assert [e["ph"] for e in trace] == ["M", "X", "X", "X", "M", "X"]
