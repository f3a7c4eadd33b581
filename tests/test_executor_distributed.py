"""Executor acceptance (4 gloo ranks): actor and critic fused on ranks 0-3,
one PPO mini-batch step each, in named configurations:

* ``pp4``: actor pp4 "down", critic pp4 "up" (reverse_pp) - the main case;
* ``tp2_pp2``: both tp2 x pp2, the critic reversed (TP peers, vocab-parallel loss);
* ``pp2_dp2``: both pp2 x dp2: two copies of the fused pipeline, DP all-reduce;
* ``k2``: actor pp2 with 2 pipelines (its dp2 replicas) fused with critic pp4 up;
* ``mixed_tp``: actor tp2 x pp2 with critic tp1 x pp4 up (RLHFuse 5.2: critic
  stages 0, 1 form one fused stage on the ranks of actor stage 1).

Each runs the serial 1F1B, greedy and annealed fused schedules with every
message between two ranks under one tag ("per_pair": gloo then pairs them by
order, as NCCL does), ``pp4`` and ``mixed_tp`` also with a tag per message;
all give the parameters of unsharded single-process training and of the
serial run (1e-5).  Schedules that do not match the placement, and a cyclic
one, are refused with no communication.
"""
import json

import pytest

from rlhf.schedule.generators import greedy_fused, serial_1f1b
from rlhf.schedule.io import schedule_to_dict
from rlhf.schedule.problem import ModelSpec, Problem
from rlhf.schedule.schedule import Schedule
from rlhf.schedule.search import SearchConfig, search
from rlhf.testing.distributed import launch
from test_executor_compiler import cyclic_schedule

TOL = 1e-5


def problem(microbatches=4, pp=4, critic_direction="up", actor_pipelines=1, critic_pp=None):
    def spec(name, pp, k, direction, f, b):
        return ModelSpec(name, pp, k, microbatches // k, direction, [f] * pp, [b] * pp, [1.0] * pp)
    critic_pp = critic_pp or pp
    return Problem(critic_pp, (spec("actor", pp, actor_pipelines, "down", 1.0, 2.0),
                               spec("critic", critic_pp, 1, critic_direction, 0.7, 1.4)))


def plan(actor: dict, critic: dict) -> dict:
    return {"actor_train": {"ranks": "0-3", **actor}, "critic_train": {"ranks": "0-3", **critic}}


ONE_TAG = ("serial/per_pair", "fused/per_pair", "greedy/per_pair")  # the first run is the baseline
CONFIGS = {  # name: (placement plan, problem, runs "schedule/tags")
    "pp4": (plan({"pp": 4}, {"pp": 4, "reverse_pp": True}), problem(),
            ONE_TAG + ("serial/per_message", "fused/per_message", "greedy/per_message")),
    "tp2_pp2": (plan({"tp": 2, "pp": 2}, {"tp": 2, "pp": 2, "reverse_pp": True}), problem(pp=2), ONE_TAG),
    "pp2_dp2": (plan({"pp": 2}, {"pp": 2, "reverse_pp": True}), problem(2, pp=2), ONE_TAG),
    "k2": (plan({"ranks": [0, 2, 1, 3], "pp": 2}, {"pp": 4, "reverse_pp": True}),
           problem(pp=2, actor_pipelines=2, critic_pp=4), ONE_TAG),
    "mixed_tp": (plan({"tp": 2, "pp": 2}, {"pp": 4, "reverse_pp": True}), problem(pp=2),
                 ONE_TAG + ("fused/per_message",)),
}


def annealed(pb):
    return search(pb, SearchConfig(budget_s=0.1, memory_budget_s=0.02)).orders


SCHEDULES = {
    "serial": lambda pb: Schedule.from_orders(pb, serial_1f1b(pb)),
    "fused": lambda pb: Schedule.from_orders(pb, annealed(pb)),
    "greedy": lambda pb: Schedule.from_orders(pb, greedy_fused(pb)),
}
REFUSED = {
    "microbatches": lambda: Schedule.from_orders(problem(8), serial_1f1b(problem(8))),
    "pp": lambda: Schedule.from_orders(problem(pp=2), serial_1f1b(problem(pp=2))),
    "direction": lambda: Schedule.from_orders(problem(critic_direction="down"),
                                                serial_1f1b(problem(critic_direction="down"))),
    "cyclic": lambda: cyclic_schedule(problem()),
}
EXPECTED_MESSAGE = {
    "microbatches": "schedule has 8 micro-batches per pipeline but the executor was given 4",
    "pp": "schedule pp=2 but placement pp=4",
    "direction": "check 'direction' in the schedule against reverse_pp",
    "cyclic": "which never runs (cyclic dependency)",
}


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return tmp_path_factory.mktemp("executor") / "fused_trace.json"


@pytest.fixture(scope="module")
def results(trace_path):
    configs = {}
    for name, (plan_, pb, labels) in CONFIGS.items():
        schedules = {k: schedule_to_dict(SCHEDULES[k](pb)) for k in SCHEDULES}
        assert schedules["fused"]["schedule"] != schedules["serial"]["schedule"]
        runs = {label: (schedules[label.split("/")[0]], label.split("/")[1]) for label in labels}
        configs[name] = {"plan": plan_, "runs": runs}
    refused = {k: schedule_to_dict(f()) for k, f in REFUSED.items()}
    return launch(4, "scenario_executor:run", configs=configs, refused=refused,
                  trace_path=str(trace_path))


RUNS = [(cfg, label) for cfg, (_, _, labels) in CONFIGS.items() for label in labels]


@pytest.mark.parametrize("cfg,label", RUNS)
@pytest.mark.parametrize("model", ["actor", "critic"])
def test_parameters_match_unsharded_training(results, cfg, label, model):
    for r in results:
        assert r["moved"][cfg, label, model] > 1e-3  # the step changed the weights
        assert r["err"][cfg, label, model] < TOL
        assert r["vs_serial"][cfg, label, model] < TOL


@pytest.mark.parametrize("label", CONFIGS["pp4"][2])
def test_losses_on_last_stages_match_reference(results, label):
    # actor's last stage is rank 3; the reversed critic's is rank 0
    for rank, model in ((3, "actor"), (0, "critic")):
        r = results[rank]
        assert abs(r["losses"]["pp4", label][model] - r["ref_losses"][model]) < TOL
    assert results[1]["losses"]["pp4", label] == {}


@pytest.mark.parametrize("label", list(REFUSED))
def test_mismatched_or_cyclic_schedule_refused_before_communication(results, label):
    for r in results:
        refusal = r["refused"][label]
        assert refusal["message"] is not None and EXPECTED_MESSAGE[label] in refusal["message"]
        assert refusal["comm_calls"] == 0


def test_chrome_trace_written(results, trace_path):
    trace = json.loads(trace_path.read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert len(spans) == sum(r["events"]["pp4"] for r in results)
    computes = [e for e in spans if e["cat"] in ("FORWARD", "BACKWARD")]
    assert len(computes) == 2 * 2 * 4 * 4  # models x (F, B) x micro-batches x stages
    assert all(e["dur"] >= 0 for e in spans)
