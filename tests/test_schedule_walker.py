"""The schedule search's walker: the compiled one (rlhf/schedule/csrc/walker.c) against the Python original
(rlhf.schedule.simulate.Walker) and the full simulation, bit for bit, and a search that gives the same
schedule with either."""
import random
import shutil
import sysconfig

import pytest

import rlhf.schedule.native as native
from rlhf.schedule.generators import greedy_fused
from rlhf.schedule.problem import ModelSpec, Problem
from rlhf.schedule.search import SearchConfig, search
from rlhf.schedule.simulate import INF, Walker, order_peak, simulate
from rlhf.schedule.simulate import walker as make_walker


def random_problem(rng):
    stages = rng.choice([2, 4])
    models = []
    for i, direction in enumerate(("down", "up")):
        pp = rng.choice([p for p in (1, 2, stages) if stages % p == 0])
        models.append(ModelSpec(f"m{i}", pp, stages // pp, rng.randint(1, 5), direction,
                                [rng.uniform(0.5, 4) for _ in range(pp)], [rng.uniform(0.5, 6) for _ in range(pp)],
                                [rng.uniform(0.5, 3) for _ in range(pp)]))
    return Problem(stages=stages, models=tuple(models), comm=rng.choice([0.0, 0.3]))


def compiled(pb, orders):
    arr = pb.arrays
    return native.compiled_walker()(arr.pred, arr.lag, arr.dur, arr.mem, arr.stage, arr.queue, arr.partner,
                                    [list(o) for o in orders])


def test_the_compiled_walker_builds_where_there_is_a_c_compiler():
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    assert shutil.which(cc) is not None, f"no C compiler {cc!r} on this machine"
    assert native.compiled_walker() is not None


def test_compiled_and_python_walkers_agree_to_the_bit():
    rng = random.Random(0)
    trials = accepted = deadlocks = 0
    for _ in range(60):
        pb = random_problem(rng)
        orders = [list(o) for o in greedy_fused(pb)]
        py, c = Walker(pb, orders), compiled(pb, orders)
        assert (py.ok, py.makespan) == (c.ok, c.makespan) and list(py.end) == [c.end[v] for v in range(pb.num_nodes)]
        dur = pb.arrays.dur
        for _ in range(60):
            s = rng.randrange(pb.stages)
            if len(orders[s]) < 2:
                continue
            i, k = sorted(rng.sample(range(len(orders[s])), 2))
            new = orders[s][:]
            new[i], new[k] = new[k], new[i]  # any edit, deadlocks included
            assert py.peak(new) == c.peak(new) == order_peak(new, pb.arrays.mem)
            cut = py.end[orders[s][i]] - dur[orders[s][i]]
            got = py.trial(s, new, cut)
            assert got == c.trial(s, new, cut)
            trials += 1
            if got[0] == INF:
                deadlocks += 1
                continue
            full = simulate(pb, [new if t == s else o for t, o in enumerate(orders)])
            assert full.makespan == got[0]
            if rng.random() < 0.5:
                py.accept()
                c.accept()
                orders[s] = new
                accepted += 1
                assert list(py.end) == full.end == [c.end[v] for v in range(pb.num_nodes)]
                seed = rng.getrandbits(64)
                assert py.critical_edges(seed) == c.critical_edges(seed)
    assert trials > 2000 and accepted > 500 and deadlocks > 50


def test_a_search_gives_the_same_schedule_with_either_walker(monkeypatch):
    pb = Problem(stages=4, models=(
        ModelSpec("actor", 4, 1, 8, "down", [1.0, 1.3, 0.9, 1.1], [2.0, 2.4, 1.9, 2.2], [1.0] * 4),
        ModelSpec("critic", 2, 2, 4, "up", [0.6, 0.5], [1.2, 1.1], [0.8, 0.8])))
    cfg = SearchConfig(budget_s=0.3, memory_budget_s=0.2, seed=3)
    fast = search(pb, cfg)
    monkeypatch.setattr(native, "compiled_walker", lambda: None)
    assert isinstance(make_walker(pb, greedy_fused(pb)), Walker)
    slow = search(pb, cfg)
    assert (fast.orders, fast.makespan, fast.evaluations) == (slow.orders, slow.makespan, slow.evaluations)


@pytest.mark.parametrize("mangle, message", [
    (lambda a: a.update(pred=a["pred"][:-1]), "must be a list of 1?[0-9]+ integers"),
    (lambda a: a["orders"][0].append(a["orders"][0][0]), "hold more subtasks than the problem"),
    (lambda a: a["orders"][0].__setitem__(0, 10**6), "not a subtask"),
    (lambda a: a.update(orders=[a["orders"][1], a["orders"][0]]), "not its own"),
])
def test_the_compiled_walker_refuses_inconsistent_input(mangle, message):
    pb = random_problem(random.Random(2))
    while pb.stages < 2 or not all(greedy_fused(pb)):
        pb = random_problem(random.Random(pb.num_nodes))
    arr = pb.arrays
    args = {"pred": list(arr.pred), "orders": [list(o) for o in greedy_fused(pb)]}
    mangle(args)
    with pytest.raises(ValueError, match=message):
        native.compiled_walker()(args["pred"], arr.lag, arr.dur, arr.mem, arr.stage, arr.queue, arr.partner,
                                 args["orders"])


def test_without_a_compiler_the_search_says_so_once_and_runs_the_python_walker(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: "no-such-cc" if name == "CC" else None)
    assert native.compiled_walker.__wrapped__() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the search runs the Python one" in err
    assert list(tmp_path.iterdir()) == []  # no half-written build left behind
    monkeypatch.setenv(native.PURE_ENV, "1")
    assert native.compiled_walker.__wrapped__() is None and capsys.readouterr().err == ""


def test_a_trial_of_another_stage_s_subtasks_is_refused():
    pb = random_problem(random.Random(5))
    orders = [list(o) for o in greedy_fused(pb)]
    w = compiled(pb, orders)
    with pytest.raises(ValueError, match="does not run on stage 0"):
        w.trial(0, orders[1][:len(orders[0])] + orders[0][len(orders[1]):], 0.0)
    with pytest.raises(RuntimeError, match="no finished trial"):
        w.accept()
