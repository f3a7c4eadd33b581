"""Decode steps run ahead of the host (rlhf/engine/engine.py, `Engine.step`; one 1-rank launch, see
scenario_engine_pipelined.py): a pure decode step of the last step's sequences is launched with that step's
tokens still on the device, and they are read on the host only afterwards, once per step. Samples are found
finished up to a step late, the token computed for them meanwhile dropped: every sample equals the engine
that reads every step's tokens at its end (the engine before), under admission limits, preemption, prefix
sharing and static decode steps."""

import pytest

from rlhf.testing.distributed import launch
from scenario_engine_pipelined import CONFIGS

# A finished sample found a step late was computed in one more row of that step: other rows' matmuls run at
# another batch size, which may round differently on the CPU (as in test_engine_fuzz.py).
LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module")
def runs():
    return launch(1, "scenario_engine_pipelined:run", timeout_s=300)[0]


def test_each_decode_step_is_launched_before_the_last_ones_tokens_are_read(runs):
    """3 x 2 samples of 8 tokens, no stop id: the prefill step (L0), then each decode step launched before the
    tokens of the one before it are read (one read per step); the last is read before anything more is
    launched (its tokens end every sample by length). The same results as reading every step."""
    plain = runs["plain"]
    assert plain["order"] == ["L0"] + [x for k in range(1, 8) for x in (f"L{k}", f"R{k - 1}")] + ["R7"]
    assert plain["equal"]


@pytest.mark.parametrize("name", CONFIGS)
def test_every_sample_equals_reading_every_step(runs, name):
    r = runs[name]
    assert len(r["got"]) == len(r["want"]) == 19
    for got, want in zip(r["got"], r["want"]):
        assert got[:4] + got[5:] == want[:4] + want[5:], got[:2]  # ids, prompt, tokens, finish reason
        assert max(abs(a - b) for a, b in zip(got[4], want[4])) < LOGPROB_TOL, got[:2]
    assert {g[5] for g in r["got"]} == {"stop", "length"}
    assert r["reads"] == r["launches"] and r["ahead"] >= 3  # every step read once, some after the next launch
    assert r["free"] == r["blocks"] and not r["unfinished"]


def test_stops_were_found_late_and_the_tiny_pool_preempted(runs):
    assert all(runs[name]["dropped"] > 0 for name in CONFIGS)  # rows computed for samples that had stopped
    assert runs["tiny pool"]["preemptions"] > 0
