"""Inter-stage fusion in the trainer (4 gloo ranks, one launch; see scenario_inter_stage.py).

The unfused run is the reference: with the long tail migrated (K/V or tokens
only) and the finished samples inferred early on the freed ranks, every
sample, its engine log-probs and its reference log-probs, score and values
must equal the unfused run's; R=0 never migrates and equals it exactly;
R=1 migrates at the first count.
"""

import numpy as np
import pytest

from rlhf.testing.distributed import launch

from scenario_inter_stage import CHECK_EVERY, FIELDS, PLANS, RUNS

BATCH = 16  # 8 prompts x 2 samples


@pytest.fixture(scope="module")
def runs():
    return launch(4, "scenario_inter_stage:run", timeout_s=600)[0]


def _diff(a, b) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("run", [name for name, _, _ in RUNS])
def test_fused_samples_and_inference_equal_unfused(runs, plan, run):
    unfused, fused = runs[plan]["unfused"], runs[plan][run]
    assert sorted(fused["samples"]) == sorted(set(fused["samples"])) and len(fused["samples"]) == BATCH
    assert fused["samples"] == unfused["samples"]  # none lost, none duplicated, same order
    assert fused["finish_reasons"] == unfused["finish_reasons"]
    assert np.array_equal(fused["fields"]["tokens"], unfused["fields"]["tokens"])
    for field in FIELDS[1:]:
        assert _diff(fused["fields"][field], unfused["fields"][field]) <= 1e-6, field


@pytest.mark.parametrize("plan", PLANS)
def test_the_long_tail_migrates_and_the_freed_ranks_infer_early(runs, plan):
    lengths = runs[plan]["unfused"]["fields"]["old_logprobs"]
    streams = []
    for name in ("R=0.5 kv", "R=0.5 tokens"):
        run = runs[plan][name]
        stats = run["stats"]
        assert all(step is not None for _, step, *_ in stats)
        moved_out, moved_in = sum(s[2] for s in stats), sum(s[3] for s in stats)
        assert moved_out == moved_in > 0 and all(s[4] == 0 for s in stats)  # nothing refused
        streamed = max(s[6] for s in stats)  # the freed ranks that infer all received the same batches
        assert run["early_done"] and all(n == stats[0][5] + streamed for n in run["early_done"].values())
        assert run["early_rows"] == sum(run["early_done"].values())  # each early output computed once
        streams.append(streamed)
    assert max(streams) > 0  # some long-tail samples were inferred while others still generated
    assert len(set((lengths != 0).sum(1).tolist())) > 3  # the workload is long-tailed: lengths differ


@pytest.mark.parametrize("plan", PLANS)
def test_r0_never_migrates_and_equals_unfused_exactly(runs, plan):
    unfused, never = runs[plan]["unfused"], runs[plan]["R=0"]
    assert all(step is None for _, step, *_ in never["stats"]) and never["early_done"] == {}
    for field in FIELDS:
        assert np.array_equal(never["fields"][field], unfused["fields"][field]), field


@pytest.mark.parametrize("plan", PLANS)
def test_r1_migrates_at_the_first_count(runs, plan):
    assert {step for _, step, *_ in runs[plan]["R=1"]["stats"]} == {CHECK_EVERY}
