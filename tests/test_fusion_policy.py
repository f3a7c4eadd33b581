"""Inter-stage fusion policy (pure): simulator against hand-computed timelines and an independent
step-by-step reference, the m and destination rules, and the chosen R against the sweep's best."""

import heapq
import math
import random

import pytest

from rlhf.fusion.policy import (SWEEP, FusionPolicyError, GenerationCost, LengthDistribution, assign_moves,
                                choose_destinations, choose_threshold, destination_count, long_tailed_lengths,
                                simulate, split_batch, sweep)

UNIT = GenerationCost(instances=2, step_s=1.0, b_sat=2, infer_s=1.0, migrate_s=0.5)


def test_the_long_tailed_workload_has_its_p999_above_ten_times_the_median():
    lengths = sorted(long_tailed_lengths(100_000, random.Random(0)))
    median, p999 = lengths[len(lengths) // 2], lengths[int(0.999 * len(lengths))]
    assert median == pytest.approx(128, rel=0.02) and p999 > 10 * median


def test_step_time_is_flat_up_to_saturation_then_linear():
    cost = GenerationCost(instances=1, step_s=0.03, b_sat=32, infer_s=0.1)
    assert [cost.step_time(b) for b in (1, 16, 32)] == [0.03] * 3
    assert cost.step_time(64) == pytest.approx(0.06)


def test_hand_computed_timeline_without_moves():
    # instance 0: lengths [1, 4] -> ends 1, 4; instance 1: [2, 2] -> ends 2, 2; unfused: 4 + 4 samples * 1 s / 2
    assert simulate([1, 4, 2, 2], UNIT, 0.0).total_s == 6.0
    # R = 1/4: at t=2 one sample is left, on instance 0 (m=1, nothing moves); instance 1 infers the 3 finished
    # ones from t=2 to 5; the one that ends generation (t=4) waits for that, then both infer it: 5 + 1/2
    fused = simulate([1, 4, 2, 2], UNIT, 0.25)
    assert (fused.total_s, fused.generation_s, fused.migrate_at_s, fused.m, fused.migrated) == (5.5, 4.0, 2.0, 1, 0)


def test_hand_computed_timeline_with_a_move():
    # [3, 1] and [3, 1]: at t=1 two samples are left, one each; m = ceil(2/2) = 1, instance 0 (tie: lower index)
    # receives one (0.5 s), runs both from 1.5 to 3.5; instance 1, free once the move is done, infers the two
    # finished ones from t=1.5 to 3.5; the two that end generation at 3.5: both instances, 3.5 + 2/2
    fused = simulate([3, 1, 3, 1], UNIT, 0.5)
    assert (fused.total_s, fused.generation_s, fused.migrate_at_s, fused.m, fused.migrated) == (4.5, 3.5, 1.0, 1, 1)
    assert simulate([3, 1, 3, 1], UNIT, 0.0).total_s == 5.0


def reference(lengths, cost, threshold, dt=1e-3):
    """One event per decode step (KV unlimited), then the inference queue served in ticks of ``dt``."""
    remaining = split_batch(lengths, cost.instances)
    limit = math.floor(threshold * len(lengths) + 1e-9)
    finished, frees = [], None

    def migrate(t, events):
        nonlocal remaining
        dests = choose_destinations([len(r) for r in remaining], [math.inf] * len(remaining),
                                    [0] * len(remaining), cost.b_sat)
        kept = [list(r) if j in dests else [] for j, r in enumerate(remaining)]
        delays = {}
        moves = assign_moves([[0] * len(r) for r in remaining], dests, [math.inf] * len(remaining))
        for src, pos, dst in moves:
            kept[dst].append(remaining[src][pos])
            delays[dst] = delays.get(dst, 0.0) + cost.migrate_s
        remaining = kept
        # receivers pause for the transfer and drop a partial step; other destinations go on
        events = [(te, j) for te, j in events if j in dests and j not in delays]
        events += [(t + delay + cost.step_time(len(remaining[j])), j) for j, delay in delays.items()]
        heapq.heapify(events)
        # the moves go one after another: a source is free when the last is done
        return events, {j: t + cost.migrate_s * len(moves) for j in range(cost.instances) if j not in dests}

    events = [(cost.step_time(len(r)), j) for j, r in enumerate(remaining) if r]
    heapq.heapify(events)
    if limit >= len(lengths):
        events, frees = migrate(0.0, events)
    while events:
        t, i = heapq.heappop(events)
        remaining[i] = [n - 1 for n in remaining[i]]
        finished += [t] * remaining[i].count(0)
        remaining[i] = [n for n in remaining[i] if n > 0]
        if remaining[i]:
            heapq.heappush(events, (t + cost.step_time(len(remaining[i])), i))
        unfinished = len(lengths) - len(finished)
        if frees is None and unfinished <= limit and events and events[0][0] > t + 1e-9:
            events, frees = migrate(t, events)
    gen_end = max(finished)
    # the freed instances serve what finished before generation ended; what ends it waits for all N
    streamed = sorted(t for t in finished if t < gen_end - 1e-9) if frees else []
    starts = list(frees.values()) if frees else []
    arrived, served, tick = 0, 0.0, 0
    while served < len(streamed) - 1e-9:
        now = tick * dt
        while arrived < len(streamed) and streamed[arrived] <= now + 1e-12:
            arrived += 1
        served = min(arrived, served + dt * sum(s <= now + 1e-12 for s in starts) / cost.infer_s)
        tick += 1
    drained = tick * dt if streamed else min(starts, default=0.0)
    return max(drained, gen_end) + (len(lengths) - len(streamed)) * cost.infer_s / cost.instances


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulator_matches_a_step_by_step_reference(seed):
    rng = random.Random(seed)
    lengths = long_tailed_lengths(24, rng, median=6, sigma=0.9, cap=60)
    cost = GenerationCost(instances=4, step_s=0.05, b_sat=4, infer_s=0.07, migrate_s=0.05)
    for r in (0.0, 0.1, 0.3, 0.6, 1.0):  # moves 0-2 samples (a move costs 0.05 s); ticks of 1 ms
        assert simulate(lengths, cost, r).total_s == pytest.approx(reference(lengths, cost, r), abs=2e-3)


def test_r_zero_is_unfused_and_r_one_migrates_at_the_start():
    lengths = long_tailed_lengths(64, random.Random(3))
    cost = GenerationCost(instances=8, step_s=0.03, b_sat=4, infer_s=0.2)
    assert simulate(lengths, cost, 0.0).migrate_at_s is None
    full = simulate(lengths, cost, 1.0)
    assert (full.migrate_at_s, full.m, full.migrated) == (0.0, 8, 0)  # 64 samples need all 8 at B_sat=4


def test_destination_count_takes_the_larger_of_batch_and_kv_needs():
    assert destination_count(70, 32, [1e9] * 8, [0] * 8) == 3  # ceil(70 / 32)
    assert destination_count(0, 32, [1e9] * 8, [0] * 8) == 0
    # the others ship 100 + 100 + 100 KV tokens; 60 free each: 3 candidates hold 180 < 200 shipped, 4 hold 240 >= 100
    assert destination_count(8, 32, [60] * 5, [100] * 5) == 4
    assert destination_count(8, 32, [10] * 3, [100] * 3) == 3  # never more than the instances


def test_destinations_are_the_instances_holding_the_most_unfinished_samples():
    assert choose_destinations([3, 9, 0, 9, 5], [1e9] * 5, [0] * 5, b_sat=16) == (1, 3)  # 26 samples: m=2
    assert choose_destinations([3, 9, 0, 9, 5], [1e9] * 5, [0] * 5, b_sat=8) == (0, 1, 3, 4)  # m=4
    with pytest.raises(FusionPolicyError, match="one entry per instance"):
        choose_destinations([1, 2], [1.0], [1.0, 2.0], b_sat=4)


def test_moves_fill_the_destination_holding_the_fewest_that_has_room():
    samples = [[5, 5, 5], [1], [7], [2, 2]]
    moves = assign_moves(samples, destinations=(0, 3), free_kv=[100, 0, 0, 100])
    assert moves == [(1, 0, 3), (2, 0, 0)]  # 3 holds 2 < 3; then 3 vs 3 samples: the lower index
    moves = assign_moves(samples, destinations=(0, 3), free_kv=[5, 0, 0, 100])
    assert moves == [(1, 0, 3), (2, 0, 3)]  # 7 KV tokens do not fit destination 0's 5 free


def test_length_distribution_reads_a_file_and_keeps_a_window(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# response lengths\n12\n\n40  # long\n7\n")
    dist = LengthDistribution.from_file(path, window=4)
    assert dist.lengths == [12, 40, 7]
    dist.observe([1, 2])
    assert dist.lengths == [40, 7, 1, 2]
    path.write_text("12\nabc\n")
    with pytest.raises(FusionPolicyError, match=r"lengths.txt:2: 'abc' is not a response length"):
        LengthDistribution.from_file(path)
    with pytest.raises(FusionPolicyError, match="no response lengths yet"):
        LengthDistribution().draw(4, random.Random(0))


BENCH_COST = GenerationCost(instances=8, step_s=0.03, b_sat=32, infer_s=0.2, migrate_s=0.1)


def _best_on_fresh_batches(draw, count=32):
    rng = random.Random(1234)
    points = sweep([draw(rng) for _ in range(count)], BENCH_COST)
    return min(points, key=lambda p: p[1]), points


def test_policy_threshold_is_within_one_step_of_the_best_on_a_long_tailed_workload():
    history = LengthDistribution(long_tailed_lengths(4 * 512, random.Random(7)))  # four earlier iterations
    choice = choose_threshold(history, BENCH_COST, batch_size=512)
    (best_r, best_s), points = _best_on_fresh_batches(lambda rng: long_tailed_lengths(512, rng))
    assert abs(choice.threshold - best_r) <= 0.05 + 1e-9, points
    assert choice.speedup > 1.15  # the long tail leaves the freed instances time to infer


def test_policy_threshold_is_within_one_step_of_the_best_on_a_uniform_workload():
    uniform = lambda rng, n=512: [rng.randint(96, 160) for _ in range(n)]  # noqa: E731
    history = LengthDistribution(uniform(random.Random(7), 4 * 512))
    choice = choose_threshold(history, BENCH_COST, batch_size=512)
    (best_r, best_s), points = _best_on_fresh_batches(uniform)
    assert abs(choice.threshold - best_r) <= 0.05 + 1e-9, points
    assert choice.speedup < 1.05  # everything ends together: little to overlap


def test_sweep_is_five_to_ninety_five_percent():
    assert SWEEP[0] == 0.05 and SWEEP[-1] == 0.95 and len(SWEEP) == 19
