"""Inter-stage fusion runtime, generation side, on 4 gloo ranks (one launch; see scenario_fusion.py).

The same long-tailed requests run unfused (each instance's engine alone) and fused, with 4 instances and
with 2 TP2 instances, migrating K/V or tokens only: every sample is counted once and ends with the same
tokens and log-probs; R=0 never migrates and equals unfused bit for bit; R=1 migrates at the first check.
"""

import pytest

from rlhf.fusion.policy import FusionPolicyError
from rlhf.fusion.runtime import MigrationConfig
from rlhf.testing.distributed import launch
from scenario_fusion import CHECK_EVERY, PLANS, RUNS

CASES = [(plan, name) for plan in PLANS for name, _, _ in RUNS]


@pytest.fixture(scope="module")
def results():
    return launch(4, "scenario_fusion:runtime_run", timeout_s=300)[0]


def by_key(samples):
    return {(rid, index): (tokens, logprobs) for rid, index, tokens, logprobs in samples}


@pytest.mark.parametrize("plan, name", CASES)
def test_every_sample_once_with_the_unfused_tokens_and_logprobs(results, plan, name):
    unfused, (fused, _) = by_key(results[plan]["unfused"][0]), results[plan][name]
    assert len(unfused) == 16
    assert len(fused) == len(by_key(fused)) == 16  # none duplicated
    assert by_key(fused).keys() == unfused.keys()  # none lost
    for key, (tokens, logprobs) in by_key(fused).items():
        assert tokens == unfused[key][0], key
        assert max(abs(a - b) for a, b in zip(logprobs, unfused[key][1])) <= 1e-6, key


@pytest.mark.parametrize("plan", PLANS)
def test_r_zero_never_migrates_and_equals_unfused_exactly(results, plan):
    fused, stats = results[plan]["R=0"]
    assert by_key(fused) == by_key(results[plan]["unfused"][0])
    assert all(s.migrate_step is None and s.moved_out == s.moved_in == 0 for s in stats)


@pytest.mark.parametrize("plan, name", [c for c in CASES if c[1] != "R=0"])
def test_migrations_move_what_the_plan_says(results, plan, name):
    stats = results[plan][name][1]
    assert len({(s.migrate_step, s.destinations) for s in stats}) == 1  # one plan, the same on every rank
    step, dests = stats[0].migrate_step, stats[0].destinations
    assert step == CHECK_EVERY if name.startswith("R=1") else step > CHECK_EVERY  # R=1: at the first check
    assert len(dests) == 1  # 16 samples or fewer left, B_sat = 16
    assert sum(s.moved_out for s in stats) == sum(s.moved_in for s in stats) > 0
    assert all(s.refused == 0 for s in stats)


@pytest.mark.parametrize("plan", PLANS)
def test_kv_migration_ships_more_bytes_than_tokens_only(results, plan):
    for r in ("R=0.3", "R=1"):
        kv, tokens = (sum(s.bytes_sent for s in results[plan][f"{r} {how}"][1]) for how in ("kv", "tokens"))
        assert kv > tokens > 0


def test_fusion_config_names_a_bad_field():
    with pytest.raises(FusionPolicyError, match=r"MigrationConfig.threshold=1.5 is invalid: must be a fraction"):
        MigrationConfig(1.5)
    with pytest.raises(FusionPolicyError, match="check_every=0"):
        MigrationConfig(0.2, check_every=0)
