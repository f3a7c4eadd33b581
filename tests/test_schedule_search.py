"""Schedules, simulator, lower bound and annealing (rlhf.schedule)."""
import itertools
import random

import pytest

from rlhf.schedule.anneal import AnnealConfig, anneal_makespan
from rlhf.schedule.generators import (backfill_schedule, greedy_fused, serial_1f1b,
                                      serial_1f1b_makespan)
from rlhf.schedule.lower_bound import makespan_lower_bound, serial_peak_memory
from rlhf.schedule.problem import ModelSpec, Problem, stage_nodes, to_actions
from rlhf.schedule.search import SearchConfig, search
from rlhf.schedule.simulate import simulate, simulate_from, stage_peak_memory
from rlhf.schedule.validate import validate


def uniform(pp, m, f, b, pipelines=1, direction="down", name="m"):
    return ModelSpec(name, pp, pipelines, m, direction, [f] * pp, [b] * pp, [1.0] * pp)


def fused(pp_a=4, pp_c=2, mb=4, fa=2.0, fc=1.0):
    s = max(pp_a, pp_c)
    return Problem(stages=s, models=(
        uniform(pp_a, mb // (s // pp_a), fa, 2 * fa, s // pp_a, "down", "actor"),
        uniform(pp_c, mb // (s // pp_c), fc, 2 * fc, s // pp_c, "up", "critic")))


def random_problem(rng, stages=2, max_mb=2):
    models = []
    for i, direction in enumerate(("down", "up")):
        pp = rng.choice([p for p in (1, 2, stages) if stages % p == 0])
        models.append(ModelSpec(f"m{i}", pp, stages // pp, rng.randint(1, max_mb), direction,
                                [rng.randint(1, 4) for _ in range(pp)],
                                [rng.randint(1, 6) for _ in range(pp)],
                                [rng.randint(1, 3) for _ in range(pp)]))
    return Problem(stages=stages, models=tuple(models))


@pytest.mark.parametrize("pp,m,f,b", [(4, 8, 1.0, 2.0), (8, 3, 1.5, 2.5), (1, 5, 1.0, 1.0), (6, 6, 0.5, 1.0)])
def test_serial_1f1b_makespan_formula(pp, m, f, b):
    pb = Problem(stages=pp, models=(uniform(pp, m, f, b),))
    assert serial_1f1b_makespan(pb) == pytest.approx((m + pp - 1) * (f + b))
    assert simulate(pb, serial_1f1b(pb)).makespan == pytest.approx((m + pp - 1) * (f + b))
    # for one uniform pipeline the lower bound is that makespan (1F1B is optimal)
    assert makespan_lower_bound(pb) == pytest.approx((m + pp - 1) * (f + b))


def test_serial_of_two_models_is_the_sum_and_peak_is_1f1b():
    pb = fused()
    assert serial_1f1b_makespan(pb) == pytest.approx((4 + 3) * 6.0 + (2 + 1) * 3.0)
    # actor stage 0 holds pp=4 micro-batches; critic stage 0 of each pipeline holds 2
    assert serial_peak_memory(pb) == [4.0, 3.0, 2.0, 2.0]


def test_1f1b_order_exact():
    pb = Problem(stages=4, models=(uniform(4, 4, 1.0, 2.0),))
    got = [[f"{a.op}{a.mb}" for a in st] for st in to_actions(pb, serial_1f1b(pb))]
    assert got[0] == ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert got[2] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert got[3] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]


def test_greedy_fused_beats_serial_and_is_valid():
    pb = fused(mb=8)
    g = greedy_fused(pb)
    assert validate(pb, to_actions(pb, g)) == []
    assert simulate(pb, g).makespan < serial_1f1b_makespan(pb)


def test_simulate_from_matches_full_simulation():
    rng = random.Random(3)
    pb = fused(pp_a=4, pp_c=4, mb=6)
    cur = greedy_fused(pb)
    base = simulate(pb, cur)
    dur = pb.arrays.dur
    checked = 0
    for _ in range(300):
        s = rng.randrange(pb.stages)
        i = rng.randrange(len(cur[s]) - 1)
        new = [list(o) for o in cur]
        new[s][i], new[s][i + 1] = new[s][i + 1], new[s][i]
        full = simulate(pb, new)
        cut = base.end[cur[s][i]] - dur[cur[s][i]]
        inc = simulate_from(pb, new, base.end, lambda v: base.end[v] - dur[v], cut)
        assert inc.makespan == full.makespan
        if full.ok:
            assert inc.end == full.end
            checked += 1
    assert checked > 50


def brute_force_optimum(pb):
    """Minimum makespan over every per-stage order with F before its B."""
    per_stage = []
    for nodes in stage_nodes(pb):
        orders = []
        for perm in itertools.permutations(nodes):
            pos = {v: k for k, v in enumerate(perm)}
            acts = [pb.action(v) for v in perm]
            if all(a.op == "F" or pos[pb.node_id(a.__class__(a.model, a.pipeline, a.mb, "F", a.stage))]
                   < pos[v] for v, a in zip(perm, acts)):
                orders.append(list(perm))
        per_stage.append(orders)
    best = float("inf")
    for combo in itertools.product(*per_stage):
        best = min(best, simulate(pb, list(combo)).makespan)
    return best


def test_lower_bound_below_brute_force_optimum():
    rng = random.Random(0)
    tried = 0
    while tried < 12:
        pb = random_problem(rng)
        sizes = [len(x) for x in stage_nodes(pb)]
        if max(sizes) > 6:
            continue
        tried += 1
        opt = brute_force_optimum(pb)
        lb = makespan_lower_bound(pb)
        assert lb <= opt + 1e-9
        res = search(pb, SearchConfig(budget_s=0.02, memory_budget_s=0.01, seed=tried))
        assert opt - 1e-9 <= res.makespan
        assert lb <= res.makespan + 1e-9


@pytest.mark.parametrize("seed", range(6))
def test_annealing_valid_not_worse_than_greedy_within_cap(seed):
    rng = random.Random(seed)
    pb = random_problem(rng, stages=rng.choice([2, 4]), max_mb=4)
    cap = None
    if seed % 2:
        cap = 1.25 * max(serial_peak_memory(pb))
    res = search(pb, SearchConfig(budget_s=0.05, memory_budget_s=0.02, seed=seed, mem_cap=cap))
    assert validate(pb, res.schedule.stages, cap) == []
    assert res.makespan >= makespan_lower_bound(pb) - 1e-9
    if cap is None:
        assert res.makespan <= res.greedy_makespan + 1e-9
    else:
        assert max(res.peak_mem) <= cap + 1e-9
        assert res.makespan <= simulate(pb, serial_1f1b(pb)).makespan + 1e-9


def test_anneal_never_worse_than_start_and_respects_cap():
    pb = fused(pp_a=4, pp_c=4, mb=8)
    start = greedy_fused(pb)
    cap = max(stage_peak_memory(pb, start))
    ms0 = simulate(pb, start).makespan
    for seed in range(3):
        best, stats = anneal_makespan(pb, start, AnnealConfig(iters=3000, t0_scale=1.0, mem_cap=cap), seed)
        assert validate(pb, to_actions(pb, best), cap) == []
        assert simulate(pb, best).makespan <= ms0
        assert stats.evaluations > 0


def test_backfill_keeps_first_model_on_its_1f1b_times():
    pb = fused(pp_a=4, pp_c=2, mb=4)
    orders = backfill_schedule(pb, 0, 0)
    assert validate(pb, to_actions(pb, orders)) == []
    assert simulate(pb, orders).makespan <= simulate(pb, greedy_fused(pb)).makespan + 1e-9


def test_search_is_deterministic_per_seed():
    pb = fused(pp_a=4, pp_c=4, mb=8)
    a = search(pb, SearchConfig(budget_s=0.1, memory_budget_s=0.05, seed=5))
    b = search(pb, SearchConfig(budget_s=0.1, memory_budget_s=0.05, seed=5))
    assert a.orders == b.orders and a.makespan == b.makespan


@pytest.mark.parametrize("kwargs, field", [
    ({"move_weights": (1.0, -1.0, 1.0, 1.0)}, "move_weights"),
    ({"move_weights": (1.0, 1.0, 1.0)}, "move_weights"),
    ({"t0_scale": 0.0}, "t0_scale"),
    ({"t0": -1.0}, "t0"),
    ({"window": 0}, "window"),
])
def test_anneal_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AnnealConfig(**kwargs)
