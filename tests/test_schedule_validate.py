"""The validator rejects hand-made invalid schedules of each kind, naming the
subtask and the rule; schedule files round-trip."""
import pytest

from rlhf.schedule.generators import greedy_fused, serial_1f1b
from rlhf.schedule.io import load_schedule, save_schedule, schedule_from_dict, schedule_to_dict
from rlhf.schedule.problem import Action, ModelSpec, Problem, to_actions
from rlhf.schedule.schedule import Schedule, ScheduleError
from rlhf.schedule.validate import check_schedule, validate


def small():
    return Problem(stages=2, models=(
        ModelSpec("actor", 2, 1, 2, "down", [1.0, 1.0], [2.0, 2.0], [1.0, 1.0]),
        ModelSpec("critic", 1, 2, 1, "up", [1.0], [1.0], [3.0])))


def serial(pb):
    return [list(s) for s in to_actions(pb, serial_1f1b(pb))]


def rules(pb, sched, cap=None):
    return [(v.rule, v.stage, str(v.action)) for v in validate(pb, sched, cap)]


def test_serial_and_greedy_are_valid():
    pb = small()
    assert validate(pb, serial(pb)) == []
    assert validate(pb, to_actions(pb, greedy_fused(pb))) == []


def test_serial_order_is_exact():
    pb = small()
    assert [str(a) for a in serial(pb)[0]] == [
        "actor[p0].F0@s0", "actor[p0].F1@s0", "actor[p0].B0@s0", "actor[p0].B1@s0",
        "critic[p1].F0@s0", "critic[p1].B0@s0"]


def test_missing_and_duplicate():
    pb = small()
    s = serial(pb)
    dropped = s[1].pop(0)
    assert rules(pb, s) == [("missing", 1, str(dropped))]
    s = serial(pb)
    s[0].append(s[0][0])
    assert rules(pb, s) == [("duplicate", 0, "actor[p0].F0@s0")]


def test_wrong_stage():
    pb = small()
    s = serial(pb)
    a = s[0].pop(0)
    s[1].insert(0, a)
    got = rules(pb, s)
    assert ("placement", 1, "actor[p0].F0@s0") in got
    s = serial(pb)
    s[0][0] = Action("policy", 0, 0, "F", 0)
    assert rules(pb, s)[0][:2] == ("placement", 0)


def test_backward_before_its_forward():
    pb = small()
    s = serial(pb)
    s[1][-2], s[1][-1] = s[1][-1], s[1][-2]   # critic p0: B0 before F0 on stage 1
    assert rules(pb, s) == [("order", 1, "critic[p0].B0@s0")]


def test_deadlock_across_stages():
    pb = small()
    s = serial(pb)
    # stage 0 waits for actor B0 before it sends F1, stage 1 waits for F1 first
    s[0] = [s[0][i] for i in (0, 2, 1, 3, 4, 5)]
    s[1] = [s[1][i] for i in (0, 2, 1, 3, 4, 5)]
    assert [str(a) for a in s[0][:3]] == ["actor[p0].F0@s0", "actor[p0].B0@s0", "actor[p0].F1@s0"]
    assert [str(a) for a in s[1][:3]] == ["actor[p0].F0@s1", "actor[p0].F1@s1", "actor[p0].B0@s1"]
    got = rules(pb, s)
    assert got == [("deadlock", 0, "actor[p0].B0@s0"), ("deadlock", 1, "actor[p0].F1@s1")]
    with pytest.raises(ScheduleError, match="cyclic dependency"):
        check_schedule(Schedule(pb, tuple(tuple(row) for row in s)))


def test_memory_cap():
    pb = small()
    s = serial(pb)
    assert validate(pb, s, 3.0) == []
    # two actor micro-batches (2.0) then a critic F (3.0) on stage 0 -> 5.0 > 4.0
    s[0] = [s[0][i] for i in (0, 1, 4, 2, 3, 5)]
    assert rules(pb, s, 4.0) == [("memory", 0, "critic[p1].F0@s0")]
    assert "exceeds the cap" in str(validate(pb, s, 4.0)[0])


def test_schedule_file_round_trip(tmp_path):
    pb = small()
    sched = to_actions(pb, greedy_fused(pb))
    save_schedule(tmp_path / "s.json", Schedule(pb, sched, {"makespan": 1.0}))
    loaded = load_schedule(tmp_path / "s.json")
    assert loaded.problem == pb and loaded.stages == sched and loaded.metrics == {"makespan": 1.0}


def test_schedule_file_model_stage_is_implied_or_checked():
    pb = small()
    d = schedule_to_dict(Schedule.from_orders(pb, greedy_fused(pb)))
    for stage in d["schedule"]:
        for a in stage:
            del a["model_stage"]
    implied = schedule_from_dict(d).stages
    assert implied == to_actions(pb, greedy_fused(pb))
    d["schedule"][0][0]["model_stage"] = 1  # actor F0 of stage 0 claims model stage 1
    wrong = schedule_from_dict(d).stages
    assert rules(pb, wrong) == [("placement", 0, "actor[p0].F0@s1"),
                                ("duplicate", 1, "actor[p0].F0@s1"),
                                ("missing", 0, "actor[p0].F0@s0")]
