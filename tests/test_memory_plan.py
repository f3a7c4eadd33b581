"""rlhf/ppo/memory_plan.py: ``--max-tokens-per-microbatch auto`` (the default) packs micro-batches on a GPU to
the largest budget the planner's memory prediction fits in the card, and keeps them padded on the CPU, with a
fused schedule and with ``0``; the job and ``--dry-run`` say what was chosen."""

from dataclasses import replace

import pytest

from rlhf import platform
from rlhf.ppo.arguments import parse_args
from rlhf.ppo.dry_run import dry_run
from rlhf.ppo.layout import build_placement
from rlhf.ppo.memory_plan import (BUDGET_STEP, MEMORY_MARGIN, auto_budget, describe_choice, peak_bytes,
                                  resolve_micro_batches, token_budget)

GIB = 2 ** 30
LONG = ["--max-prompt-len", "64", "--max-response-len", "192", "--rollout-batch-size", "16",
        "--n-samples-per-prompt", "8", "--ppo-mini-batch-size", "64"]


@pytest.fixture(scope="module")
def job():
    config = parse_args(LONG)
    return config, build_placement(config, 4)


def _with_budget(config, budget):
    return replace(config, ppo=replace(config.ppo, max_tokens_per_microbatch=budget))


def test_the_flag_reads_auto_a_budget_and_zero():
    assert parse_args([]).ppo.max_tokens_per_microbatch is None  # auto by default
    assert parse_args(["--max-tokens-per-microbatch", "auto"]).ppo.max_tokens_per_microbatch is None
    padded = parse_args(["--max-tokens-per-microbatch", "0"]).ppo
    assert padded.max_tokens_per_microbatch == 0 and padded.packing_budget is None
    assert parse_args(["--max-tokens-per-microbatch", "64"]).ppo.packing_budget == 64


def test_the_chosen_budget_is_the_largest_step_that_fits(job):
    config, placement = job
    longest = 64 + 192
    floor = peak_bytes(_with_budget(config, longest), placement)
    for room in (1.5, 3.0, 6.0):  # devices a little, more and much larger than the smallest packed peak
        device = room * floor / MEMORY_MARGIN
        budget = token_budget(config, placement, device)
        assert budget >= longest and (budget == longest or budget % BUDGET_STEP == 0)
        assert peak_bytes(_with_budget(config, budget), placement) <= MEMORY_MARGIN * device
        cap = 64 * longest  # a whole mini-batch of longest samples: more would change nothing
        if budget + BUDGET_STEP <= cap:
            assert peak_bytes(_with_budget(config, budget + BUDGET_STEP), placement) > MEMORY_MARGIN * device
    budgets = [token_budget(config, placement, gib * GIB) for gib in (0.001, 80, 141)]
    assert budgets[0] == longest and budgets[0] < budgets[1] <= budgets[2]  # too small a card: one sample


def test_auto_packs_on_a_gpu_and_stays_padded_on_the_cpu_with_fusion_or_zero(job, monkeypatch):
    config, placement = job
    assert platform.device_memory_bytes() is None  # the suite's CPU mode
    assert resolve_micro_batches(config, placement) is config and config.ppo.packing_budget is None
    monkeypatch.setattr(platform, "device_memory_bytes", lambda: 80 * GIB)
    chosen = resolve_micro_batches(config, placement)
    assert chosen.ppo.packing_budget == token_budget(config, placement, 80 * GIB)
    assert "packed, up to" in describe_choice(chosen, placement) and "0 restores padded" in describe_choice(
        chosen, placement)
    fixed = _with_budget(config, 0)
    assert resolve_micro_batches(fixed, placement) is fixed and fixed.ppo.packing_budget is None
    fused = replace(config, fusion=replace(config.fusion, intra_stage_fusion=True))
    assert auto_budget(fused, placement, 80 * GIB) == 0


def test_dry_run_shows_the_budget_per_card_and_nothing_for_a_given_one(job):
    config, placement = job
    text = dry_run(config, 4)
    line = next(line for line in text.splitlines() if line.startswith("micro-batches (--max-tokens-per-microbatch"))
    for name, gib in (("H100", 80), ("H200", 141)):
        assert f"up to {auto_budget(config, placement, gib * GIB)} tokens on an {name}" in line
    assert "padded micro-batches of 4 samples" in line and "0 keeps them padded" in line
    assert "micro-batches (--max-tokens-per-microbatch" not in dry_run(_with_budget(config, 0), 4)
