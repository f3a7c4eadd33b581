"""Compiler and timeline unit tests (pure: no torch.distributed, no processes).

Exact instruction lists for a small pipeline, deadlock freedom and send/recv
pairing for many valid schedules (serial, greedy, annealed, random
topological orders) on several placements, and every refusal's message.
"""
import json
import random

import pytest

from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.pipeline import compiler as C
from rlhf.pipeline.timeline import Timeline, bubble_fractions, chrome_trace, makespan
from rlhf.schedule.anneal import AnnealConfig, anneal_makespan
from rlhf.schedule.generators import greedy_fused, serial_1f1b
from rlhf.schedule.io import load_schedule, schedule_from_dict, schedule_to_dict
from rlhf.schedule.problem import ModelSpec, Problem
from rlhf.schedule.schedule import Schedule, ScheduleError
from rlhf.schedule.validate import check_schedule


def spec(name, pp, pipelines, mbs, direction, f=1.0, b=2.0):
    return ModelSpec(name, pp, pipelines, mbs, direction, [f] * pp, [b] * pp, [1.0] * pp)


def mesh(task, ranks, pp, dp=1, reverse=False):
    return TaskMesh(task, tuple(ranks), ParallelStrategy(dp=dp, pp=pp), reverse)


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


@pytest.mark.parametrize("pb,place", [(PB, PLACE), (PB_K2, PLACE_K2), (PB, PLACE_X2)])
def test_valid_schedules_compile_deadlock_free(pb, place):
    orders = [serial_1f1b(pb), greedy_fused(pb),
              anneal_makespan(pb, greedy_fused(pb), AnnealConfig(iters=300), seed=1)[0]]
    orders += [random_topological(pb, seed) for seed in range(20)]
    for o in orders:
        progs = C.compile_all(Schedule.from_orders(pb, o), place)
        C.check_deadlock_free(progs)  # also: every send received exactly once
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


def test_pair_order_for_tagless_backends():
    C.check_pair_order(C.compile_all(Schedule.from_orders(PB, serial_1f1b(PB)), PLACE))
    with pytest.raises(ScheduleError, match=r"rank \d -> \d: message #\d+ is sent as tag \d+ but "
                                              r"received as tag \d+; this backend matches messages by order"):
        C.check_pair_order(C.compile_all(Schedule.from_orders(PB, greedy_fused(PB)), PLACE))


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
