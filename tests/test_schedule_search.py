"""Schedules, simulator, lower bound and annealing (rlhf.schedule)."""
import itertools
import random
from dataclasses import replace

import pytest

from rlhf.schedule.anneal import AnnealConfig, AnnealStats, StageMover, anneal_makespan, anneal_memory
from rlhf.schedule.cost_model import llama
from rlhf.schedule.generators import (Rule, backfill_schedule, greedy_fused, list_schedule, model_alone,
                                      rule_schedule, serial_1f1b, serial_1f1b_makespan)
from rlhf.schedule.latency_models import build, latency_model
from rlhf.schedule.lower_bound import makespan_lower_bound, serial_peak_memory
from rlhf.schedule.problem import ModelSpec, Problem, in_microbatch_order, stage_nodes, to_actions
from rlhf.schedule.search import (SearchConfig, distinct_starts, race, fine_depths, format_summary, makespan_limit,
                                  makespan_target, search, search_mpi, start_pool)
from rlhf.schedule.simulate import Walker, latest_ends, simulate, simulate_from, stage_peak_memory
from rlhf.schedule.validate import validate


def uniform(pp, m, f, b, pipelines=1, direction="down", name="m"):
    return ModelSpec(name, pp, pipelines, m, direction, [f] * pp, [b] * pp, [1.0] * pp)


def fused(pp_a=4, pp_c=2, mb=4, fa=2.0, fc=1.0):
    s = max(pp_a, pp_c)
    return Problem(stages=s, models=(
        uniform(pp_a, mb // (s // pp_a), fa, 2 * fa, s // pp_a, "down", "actor"),
        uniform(pp_c, mb // (s // pp_c), fc, 2 * fc, s // pp_c, "up", "critic")))


def random_problem(rng, stages=2, max_mb=2, comm=0.0):
    models = []
    for i, direction in enumerate(("down", "up")):
        pp = rng.choice([p for p in (1, 2, stages) if stages % p == 0])
        models.append(ModelSpec(f"m{i}", pp, stages // pp, rng.randint(1, max_mb), direction,
                                [rng.randint(1, 4) for _ in range(pp)],
                                [rng.randint(1, 6) for _ in range(pp)],
                                [rng.randint(1, 3) for _ in range(pp)]))
    return Problem(stages=stages, models=tuple(models), comm=comm)


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
        pb = random_problem(rng, comm=rng.choice([0.0, 0.0, 0.5]))
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


def subset_formula(pb):
    """RLHFuse section 7.3's bound, the reference the preemptive bound must never fall below: per fused
    stage and subset of its model pipelines, min arrival + work + min tail; and one micro-batch's chain."""
    best = 0.0
    for s in range(pb.stages):
        row = []
        for m in pb.models:
            for p in range(m.pipelines):
                for j in range(m.pp):
                    if m.fused_stage(p, j, pb.stages) == s:
                        row.append((sum(m.fwd[:j]) + j * pb.comm, m.microbatches * (m.fwd[j] + m.bwd[j]),
                                    sum(m.bwd[:j]) + j * pb.comm))
        for r in range(1, len(row) + 1):
            for sub in itertools.combinations(row, r):
                best = max(best, min(x[0] for x in sub) + sum(x[1] for x in sub) + min(x[2] for x in sub))
    return max([best] + [sum(m.fwd) + sum(m.bwd) + 2 * (m.pp - 1) * pb.comm for m in pb.models])


def test_lower_bound_never_below_the_subset_formula():
    rng = random.Random(5)
    higher = 0
    for _ in range(200):
        pb = random_problem(rng, stages=rng.choice([2, 4]), max_mb=6, comm=rng.choice([0.0, 0.5]))
        lb, ref = makespan_lower_bound(pb), subset_formula(pb)
        assert lb >= ref - 1e-9
        higher += lb > ref + 1e-9
    assert higher > 10  # uneven stages space the forwards: the preemptive bound is often higher (18 of 200)


def test_lower_bound_below_every_schedule_of_larger_problems():
    """Beyond brute force: no list schedule (random priorities) nor hot annealing result of random problems
    with up to 6 micro-batches a model beats the bound."""
    rng = random.Random(9)
    for trial in range(40):
        pb = random_problem(rng, stages=rng.choice([2, 4]), max_mb=6, comm=rng.choice([0.0, 0.5]))
        lb = makespan_lower_bound(pb)
        for _ in range(30):
            keys = [rng.random() for _ in range(pb.num_nodes)]
            orders = list_schedule(pb, key=keys.__getitem__)
            assert simulate(pb, orders).makespan >= lb - 1e-9
        orders, _ = anneal_makespan(pb, greedy_fused(pb), AnnealConfig(iters=300, t0_scale=1.0), trial)
        assert simulate(pb, orders).makespan >= lb - 1e-9


def queues_in_order(pb, orders):
    """Whether every stage runs each (model, pipeline, op) in micro-batch order."""
    acts = pb.actions
    for order in orders:
        last = {}
        for v in order:
            a = acts[v]
            key = (a.model, a.pipeline, a.op)
            if last.get(key, -1) > a.mb:
                return False
            last[key] = a.mb
    return True


def scrambled(pb, orders, rng, swaps=40):
    """``orders`` with subtasks of one queue swapped on random stages (kept where still deadlock-free)."""
    queue = pb.arrays.queue
    orders = [list(o) for o in orders]
    for _ in range(swaps):
        s = rng.randrange(pb.stages)
        i, k = rng.randrange(len(orders[s])), rng.randrange(len(orders[s]))
        if i == k or queue[orders[s][i]] != queue[orders[s][k]]:
            continue
        new = [list(o) for o in orders]
        new[s][i], new[s][k] = new[s][k], new[s][i]
        if simulate(pb, new).ok and validate(pb, to_actions(pb, new)) == []:
            orders = new
    return orders


def test_microbatch_order_is_never_slower_and_holds_the_same_memory():
    rng = random.Random(4)
    scrambles = 0
    for trial in range(30):
        pb = random_problem(rng, stages=rng.choice([2, 4]), max_mb=5, comm=rng.choice([0.0, 0.5]))
        orders = scrambled(pb, greedy_fused(pb), rng)
        fixed = in_microbatch_order(pb, orders)
        assert queues_in_order(pb, fixed) and validate(pb, to_actions(pb, fixed)) == []
        assert simulate(pb, fixed).makespan <= simulate(pb, orders).makespan + 1e-9
        assert stage_peak_memory(pb, fixed) == stage_peak_memory(pb, orders)
        assert in_microbatch_order(pb, fixed) == fixed
        scrambles += not queues_in_order(pb, orders)
    assert scrambles > 15


def test_microbatch_order_relabels_crossed_chains():
    # actor micro-batch 1 overtakes 0 on stage 1: relabelled, stage 1 runs "0" first and the chains follow
    pb = Problem(stages=2, models=(uniform(2, 2, 1.0, 1.0),))
    f = lambda b, j: pb.node_id_fast(0, 0, b, j, True)
    b_ = lambda b, j: pb.node_id_fast(0, 0, b, j, False)
    orders = [[f(0, 0), f(1, 0), b_(1, 0), b_(0, 0)], [f(1, 1), b_(1, 1), f(0, 1), b_(0, 1)]]
    fixed = in_microbatch_order(pb, orders)
    assert fixed == [[f(0, 0), f(1, 0), b_(0, 0), b_(1, 0)], [f(0, 1), b_(0, 1), f(1, 1), b_(1, 1)]]
    assert simulate(pb, fixed).makespan <= simulate(pb, orders).makespan


def test_moves_keep_microbatch_order():
    rng = random.Random(2)
    for trial in range(6):
        pb = random_problem(rng, stages=rng.choice([2, 4]), max_mb=5)
        start = in_microbatch_order(pb, greedy_fused(pb))
        orders, _ = anneal_makespan(pb, start, AnnealConfig(iters=2000, t0_scale=1.0), trial)
        assert queues_in_order(pb, orders)
        limit = simulate(pb, orders).makespan * 1.05
        lean, _ = anneal_memory(pb, orders, AnnealConfig(iters=2000, t0_scale=1.0), trial, makespan_limit=limit)
        assert queues_in_order(pb, lean) and simulate(pb, lean).makespan <= limit + 1e-9


def test_critical_edges_are_ones_a_move_can_break():
    rng = random.Random(8)
    for trial in range(10):
        pb = random_problem(rng, stages=rng.choice([2, 4]), max_mb=5)
        orders = in_microbatch_order(pb, greedy_fused(pb))
        end = simulate(pb, orders).end
        mover = StageMover(pb, AnnealConfig(), rng)
        for s, i in Walker(pb, orders).critical_edges(trial):
            u, v = orders[s][i - 1], orders[s][i]
            assert pb.arrays.queue[u] != pb.arrays.queue[v] and pb.arrays.partner[u] != v
            assert end[v] - pb.arrays.dur[v] == pytest.approx(end[u])  # u delayed v
            assert mover.reach_earlier(orders[s], i, end) + mover.reach_later(orders[s], i - 1, end) > 0


def test_lower_bound_sees_a_slow_upstream_stage():
    # one pipeline, F latencies 3 and 1, B 1 and 1, 2 micro-batches: the second forward reaches stage 1 at 6,
    # so its B there ends at 8 at the earliest and B(0) follows: 9, the optimum. The subset formula says 8.
    pb = Problem(stages=2, models=(ModelSpec("m", 2, 1, 2, "down", [3.0, 1.0], [1.0, 1.0], [1.0, 1.0]),))
    assert subset_formula(pb) == 8.0
    assert makespan_lower_bound(pb) == 9.0 == brute_force_optimum(pb)


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


# --- memory phase: cap ladder and memory pass (issue 12) ------------------------------------------------------

def makespan_and_peak(pb, schedule, cap=None):
    """Makespan and peak of a schedule recomputed from its actions, after validation (the reference)."""
    assert validate(pb, schedule, cap) == []
    ids = [[pb.node_id(a) for a in stage] for stage in schedule]
    return simulate(pb, ids).makespan, max(stage_peak_memory(pb, ids))


@pytest.mark.parametrize("shape, seed", [((4, 4, 8), 0), ((4, 2, 8), 1), ((8, 8, 8), 2), ((4, 2, 16), 3)])
def test_memory_phase_keeps_the_makespan_and_never_raises_the_peak(shape, seed):
    pb = fused(pp_a=shape[0], pp_c=shape[1], mb=shape[2])
    cfg = SearchConfig(budget_s=0.3, memory_budget_s=0.3, seed=seed)
    res = search(pb, cfg)
    ms, peak = makespan_and_peak(pb, res.schedule.stages)
    assert ms == pytest.approx(res.makespan) and peak == pytest.approx(max(res.peak_mem))
    # within the limit of the makespan phase's best, and never more memory than it held
    assert ms <= makespan_limit(res.best_makespan, res.lower_bound, cfg.makespan_slack) + 1e-9
    assert res.best_makespan > res.lower_bound * 1.01 or ms <= res.lower_bound * 1.01 + 1e-9
    assert peak <= res.best_peak + 1e-9


def test_cap_ladder_lowers_the_peak_at_the_same_makespan():
    # the fastest schedule the makespan phase finds holds over 1.5x the serial peak (2x, the ceiling); the
    # ladder finds one within 1.5x at the lower bound
    pb = fused(pp_a=4, pp_c=4, mb=8)
    res = search(pb, SearchConfig(budget_s=0.3, memory_budget_s=0.3, seed=0))
    serial = max(serial_peak_memory(pb))
    assert res.best_makespan == pytest.approx(makespan_lower_bound(pb))
    assert res.best_peak > 1.5 * serial
    ms, peak = makespan_and_peak(pb, res.schedule.stages, cap=1.5 * serial)
    assert ms == pytest.approx(makespan_lower_bound(pb))
    assert "within cap 1.5x" in res.start_name
    # the summary's phases say which part reached which point, in the order they ran
    names = [p.name for p in res.phases]
    assert names[:3] == ["start pool", "makespan", "cap 1.5x"] and names[-2:] == ["memory pass", "speed pass"]
    start, fast, rung, final = res.phases[0], res.phases[1], res.phases[2], res.phases[-1]
    assert final.peak <= res.phases[-2].peak and final.makespan <= res.phases[-2].makespan
    assert (fast.makespan, fast.peak) == (res.best_makespan, res.best_peak)
    assert rung.kept and rung.makespan == pytest.approx(ms) and rung.peak <= 1.5 * serial + 1e-9
    assert (final.makespan, final.peak) == (res.makespan, max(res.peak_mem)) and start.makespan >= fast.makespan
    assert "cap 1.5x" in format_summary(res) and res.metrics()["phases"][2]["name"] == "cap 1.5x"


@pytest.mark.parametrize("cap_x", [1.0, 1.25])
def test_mem_cap_is_honoured_by_every_phase(cap_x):
    pb = fused(pp_a=4, pp_c=4, mb=8)
    cap = cap_x * max(serial_peak_memory(pb))
    res = search(pb, SearchConfig(budget_s=0.3, memory_budget_s=0.3, seed=1, mem_cap=cap))
    ms, peak = makespan_and_peak(pb, res.schedule.stages, cap=cap)
    assert peak <= cap + 1e-9 and res.best_peak <= cap + 1e-9
    assert ms <= serial_1f1b_makespan(pb) + 1e-9


@pytest.mark.parametrize("ceiling", [1.25, 2.0])
def test_mem_ceiling_bounds_every_phase_without_a_cap(ceiling):
    pb = fused(pp_a=4, pp_c=4, mb=8)
    serial = max(serial_peak_memory(pb))
    free = search(pb, SearchConfig(budget_s=0.3, memory_budget_s=0.3, seed=0, mem_ceiling=None))
    assert free.best_peak > ceiling * serial  # without a ceiling the fastest schedule holds more (2.25x)
    res = search(pb, SearchConfig(budget_s=0.3, memory_budget_s=0.3, seed=0, mem_ceiling=ceiling))
    _, peak = makespan_and_peak(pb, res.schedule.stages, cap=ceiling * serial)
    assert all(p.peak <= ceiling * serial + 1e-9 for p in res.phases) and res.best_peak <= ceiling * serial + 1e-9
    assert res.makespan <= serial_1f1b_makespan(pb)
    with pytest.raises(ValueError, match="mem_ceiling"):
        SearchConfig(mem_ceiling=0.5)


def test_anneal_memory_keeps_the_limit_and_stops_at_the_floor():
    pb = fused(pp_a=4, pp_c=4, mb=8)
    start = rule_schedule(pb, Rule((None, None), (0, 1)))  # deep warm-up: much memory
    limit = simulate(pb, start).makespan * 1.02
    peak0 = max(stage_peak_memory(pb, start))
    best, stats = anneal_memory(pb, start, AnnealConfig(iters=4000, t0_scale=1e-3), seed=0, makespan_limit=limit)
    ms, peak = makespan_and_peak(pb, to_actions(pb, best))
    assert ms <= limit + 1e-9 and peak < peak0 and stats.proposals == 4000
    _, stats = anneal_memory(pb, start, AnnealConfig(iters=4000), seed=0, makespan_limit=limit, floor=peak0)
    assert stats.proposals == 0  # already at the floor


def test_makespan_limit_never_leaves_one_percent_of_the_bound_unless_the_best_does():
    assert makespan_limit(100.0, 100.0, 0.005) == pytest.approx(101.0)  # a best at the bound counts as the target
    assert makespan_limit(100.8, 100.0, 0.005) == pytest.approx(101.0)  # 1% of the bound caps the slack
    assert makespan_limit(103.0, 100.0, 0.005) == pytest.approx(103.515)  # the best misses anyway: all the slack
    assert makespan_limit(100.0, 100.0, 0.0) == pytest.approx(100.0)


def test_makespan_target_is_where_a_faster_schedule_no_longer_widens_the_limit():
    target = makespan_target(100.0, 0.009)
    assert target == pytest.approx(101.0 / 1.009) and makespan_limit(target, 100.0, 0.009) == pytest.approx(101.0)
    assert makespan_limit(target * 0.999, 100.0, 0.009) == pytest.approx(101.0)  # an overshoot keeps it
    assert makespan_limit(target * 1.001, 100.0, 0.009) == pytest.approx(101.0)  # 1% of the bound caps it
    assert makespan_target(100.0, 0.0) == 100.0 and makespan_target(100.0, 0.05) == 100.0


def test_a_race_ends_no_slower_than_its_fastest_start_and_stops_at_the_target():
    pb = build([llama("actor", "33B", 8, 4, 16, "down"), llama("critic", "13B", 8, 4, 16, "up")], latency_model(3))
    cap = 1.5 * max(serial_peak_memory(pb))
    pool = start_pool(pb, cap)
    starts = distinct_starts([(x.makespan, x.orders, x.name) for x in pool], 8)
    assert len(starts) == 8 and len({tuple(map(tuple, s[1])) for s in starts}) == 8
    assert [s[0] for s in starts] == sorted(s[0] for s in starts)
    acfg = AnnealConfig(t0_scale=1e-3, mem_cap=cap)
    stats = AnnealStats()
    orders, name, used = race(pb, starts, acfg, 40000, 0, makespan_lower_bound(pb), stats)
    assert simulate(pb, orders).makespan <= min(s[0] for s in starts) + 1e-9
    assert max(stage_peak_memory(pb, orders)) <= cap + 1e-9 and used == stats.proposals <= 40000
    assert name in {s[2] for s in starts}
    # a target every start meets: the first start annealed stops at once
    orders, name, used = race(pb, starts, acfg, 40000, 0, max(s[0] for s in starts), AnnealStats())
    assert (name, used) == (starts[0][2], 0)


def test_fine_depths_are_fractions_of_the_pipeline():
    assert fine_depths(16) == (0, 1, 2, 4, 8, 12, 16, None) and fine_depths(1) == (0, 1, 2, None)


@pytest.mark.parametrize("seed", [1, 3, 6])
def test_memory_phase_holds_under_other_latency_models(seed):
    """Issue 34's small robustness case: 33B/13B on 4 stages (16 micro-batches) under three drawn latency
    models reaches within 1% of the bound at <= 1.5x the serial 1F1B peak in a short search. The memory
    phase before the reheated rungs, finer starts and 0.9% slack held 2.17x under model 1."""
    pb = build([llama("actor", "33B", 8, 4, 16, "down"), llama("critic", "13B", 8, 4, 16, "up")],
               latency_model(seed))
    res = search(pb, SearchConfig(budget_s=1.0, memory_budget_s=1.0))
    ms, peak = makespan_and_peak(pb, res.schedule.stages)
    assert ms <= makespan_lower_bound(pb) * 1.01 * (1 + 1e-9)
    assert peak <= 1.5 * max(serial_peak_memory(pb)) + 1e-9


def test_safe_earlier_jumps_never_deadlock():
    """Every jump that reach_earlier allows is deadlock-free (checked by simulation on random states)."""
    rng = random.Random(7)
    checked = 0
    for trial in range(6):
        pb = random_problem(rng, stages=rng.choice([2, 4]), max_mb=4)
        orders, _ = anneal_makespan(pb, greedy_fused(pb), AnnealConfig(iters=200, t0_scale=0.5), trial)
        end = simulate(pb, orders).end
        mover = StageMover(pb, AnnealConfig(window=96), rng)
        for s, order in enumerate(orders):
            for i in range(len(order)):
                for k in range(1, mover.reach_earlier(order, i, end) + 1):
                    new = [list(o) for o in orders]
                    new[s] = order[:i - k] + [order[i]] + order[i - k:i] + order[i + 1:]
                    assert simulate(pb, new).ok
                    checked += 1
    assert checked > 100


def test_balanced_rule_interleaves_the_models_by_progress():
    # one stage: actor 4 micro-batches, critic 2; keys are the place in each model's own
    # F,B,F,B,... sequence as a fraction of it, the critic 0.02 behind
    pb = Problem(stages=1, models=(uniform(1, 4, 1.0, 2.0, name="actor"),
                                    uniform(1, 2, 1.0, 2.0, direction="up", name="critic")))
    orders = rule_schedule(pb, Rule((None, None), (0, 1), balance=0.02))
    got = [f"{a.model[0]}{a.op}{a.mb}" for a in to_actions(pb, orders)[0]]
    assert got == ["aF0", "cF0", "aB0", "aF1", "cB0", "aB1", "aF2", "cF1", "aB2", "aF3", "cB1", "aB3"]


class _TwoRanks:
    """A stand-in for an MPI communicator: this process is rank 0, ``other`` rank 1's result."""

    def __init__(self, other):
        self.other = other

    def Get_rank(self):
        return 0

    def allgather(self, value):
        if isinstance(value, tuple):  # the selection keys
            o = self.other
            return [value, (o.makespan, max(o.peak_mem), 1, o.best_makespan)]
        return [value, value]

    def bcast(self, value, root):
        return value if root == 0 else self.other


def test_search_mpi_keeps_the_leanest_result_within_the_limit():
    pb = fused(pp_a=4, pp_c=4, mb=8)
    cfg = SearchConfig(budget_s=0.3, memory_budget_s=0.3, seed=0)
    mine, other = search(pb, cfg), search(pb, replace(cfg, seed=1))
    got = search_mpi(pb, cfg, comm=_TwoRanks(other))
    fastest, tolerated = min(mine.best_makespan, other.best_makespan), mine.lower_bound * 1.01
    limit = tolerated if fastest <= tolerated else fastest * 1.009  # makespan_limit's rule, written out
    within = [r for r in (mine, other) if r.makespan <= limit + 1e-9]
    want = min(within or (mine, other), key=lambda r: (max(r.peak_mem), r.makespan, r.seed))
    assert (got.makespan, max(got.peak_mem), got.seed) == (want.makespan, max(want.peak_mem), want.seed)


def longest_tail(pb, orders):
    """Reference for latest_ends: per subtask, its duration plus the longest path after it
    (stage and chain successors), by plain memoised recursion."""
    nxt = {}
    for order in orders:
        for a, b in zip(order, order[1:]):
            nxt[a] = b
    arr = pb.arrays
    memo = {}

    def tail(v):
        if v not in memo:
            after = [0.0]
            if v in nxt:
                after.append(tail(nxt[v]))
            if v + 1 < pb.num_nodes and arr.pred[v + 1] == v:
                after.append(arr.lag[v + 1] + tail(v + 1))
            memo[v] = arr.dur[v] + max(after)
        return memo[v]
    return tail


def test_latest_ends_match_longest_paths_to_the_end():
    rng = random.Random(11)
    for _ in range(5):
        pb = random_problem(rng, stages=rng.choice([2, 4]), max_mb=4)
        orders = greedy_fused(pb)
        res = simulate(pb, orders)
        tail = longest_tail(pb, orders)
        late = latest_ends(pb, orders, res)
        assert late == pytest.approx([res.makespan - tail(v) + pb.arrays.dur[v] for v in range(pb.num_nodes)])


@pytest.mark.parametrize("first", [0, 1])
def test_lazy_backfill_is_valid_and_never_delays_the_first_model(first):
    pb = fused(pp_a=4, pp_c=2, mb=8)
    orders = backfill_schedule(pb, first, 0, 2, lazy=True)
    assert validate(pb, to_actions(pb, orders)) == []
    sub = model_alone(pb, first)
    alone = simulate(sub, serial_1f1b(sub)).makespan
    end = simulate(pb, orders).end
    base = pb.node_id_fast(first, 0, 0, 0, True)
    assert max(end[base:base + sub.num_nodes]) <= alone + 1e-9
