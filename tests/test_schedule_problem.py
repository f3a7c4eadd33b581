"""Problem model, subtask numbering and the FLOP cost model (rlhf.schedule); bad values refused by name."""
import json

import pytest

from rlhf.schedule.cost_model import CostConfig, ModelShape, build_problem, llama
from rlhf.schedule.generators import greedy_fused, serial_1f1b
from rlhf.schedule.io import load_schedule, schedule_to_dict
from rlhf.schedule.lower_bound import min_peak_memory
from rlhf.schedule.problem import Action, ModelSpec, Problem, ProblemError, stage_nodes, to_actions
from rlhf.schedule.schedule import Schedule, ScheduleError
from rlhf.schedule.simulate import stage_peak_memory
from rlhf.schedule.validate import validate


def two_models(mb_a=4, mb_c=2):
    return Problem(stages=4, models=(
        ModelSpec("actor", 4, 1, mb_a, "down", [1.0] * 4, [2.0] * 4, [1.0] * 4),
        ModelSpec("critic", 2, 2, mb_c, "up", [0.5] * 2, [1.0] * 2, [2.0] * 2)))


def test_node_ids_round_trip_and_chains():
    pb = two_models()
    assert pb.num_nodes == 4 * 8 + 2 * 2 * 4
    for v, a in enumerate(pb.actions):
        assert pb.node_id(a) == v
    # chain of actor micro-batch 1: F0..F3, B3..B0
    base = pb.node_id(Action("actor", 0, 1, "F", 0))
    assert [str(pb.action(base + k)) for k in range(8)] == [
        "actor[p0].F1@s0", "actor[p0].F1@s1", "actor[p0].F1@s2", "actor[p0].F1@s3",
        "actor[p0].B1@s3", "actor[p0].B1@s2", "actor[p0].B1@s1", "actor[p0].B1@s0"]
    assert pb.arrays.pred[base] == -1 and pb.arrays.pred[base + 5] == base + 4


def test_fused_stages_of_up_pipelines():
    pb = two_models()
    critic = pb.models[1]
    # pipeline 0 of the critic runs on fused stages 3, 2; pipeline 1 on 1, 0
    assert [critic.fused_stage(p, j, 4) for p in (0, 1) for j in (0, 1)] == [3, 2, 1, 0]
    counts = [len(x) for x in stage_nodes(pb)]
    assert counts == [8 + 4] * 4


def test_problem_rejects_bad_shapes():
    with pytest.raises(ProblemError, match="pp\\*pipelines"):
        Problem(stages=4, models=(ModelSpec("a", 2, 1, 2, "down", [1, 1], [1, 1], [1, 1]),))
    with pytest.raises(ProblemError, match="direction"):
        ModelSpec("a", 2, 1, 2, "left", [1, 1], [1, 1], [1, 1])
    with pytest.raises(ProblemError, match="fwd has 1 entries"):
        ModelSpec("a", 2, 1, 2, "down", [1], [1, 1], [1, 1])


def test_problem_json_round_trip():
    pb = two_models()
    assert Problem.from_dict(pb.to_dict()) == pb


def test_cost_model_fusion_factor_pp_8_4():
    pb = build_problem([llama("actor", "33B", 8, 8, 16, "down"), llama("critic", "13B", 8, 4, 16, "up")])
    a, c = pb.models
    assert pb.stages == 8 and (a.pipelines, c.pipelines) == (1, 2)
    assert (a.microbatches, c.microbatches) == (16, 8)   # the global batch is kept
    assert a.bwd[0] == pytest.approx(2 * a.fwd[0])
    assert len(set(a.fwd)) == 1  # same-shaped stages: uniform latencies


def test_cost_model_flops_formula():
    s = ModelShape("m", layers=2, hidden=64, ffn=256, heads=4, tp=1, pp=1, microbatches=1)
    cfg = CostConfig(tokens_per_microbatch=10, seq_len=10, gpu_flops=1e3, mfu=1.0)
    pb = build_problem([s], cfg)
    per_token_layer = 2 * (4 * 64 * 64 + 3 * 64 * 256) + 4 * 10 * 64
    assert pb.models[0].fwd[0] == pytest.approx(2 * 10 * per_token_layer / 1e3 * 1e3)


def test_cost_model_coprime_fusion_and_tp_merge():
    a = ModelShape("a", 24, 512, 2048, 8, tp=2, pp=4, microbatches=6)
    c = ModelShape("c", 24, 512, 2048, 8, tp=2, pp=6, microbatches=6, direction="up")
    pb = build_problem([a, c])
    assert pb.stages == 12 and [m.pipelines for m in pb.models] == [3, 2]
    # tp 4 x pp 8 next to tp 8 x pp 4: pairs of stages merge onto 8-GPU fused stages
    big = ModelShape("big", 32, 512, 2048, 8, tp=8, pp=4, microbatches=4)
    small = ModelShape("small", 32, 512, 2048, 8, tp=4, pp=8, microbatches=4, direction="up")
    pb = build_problem([big, small])
    assert pb.stages == 4 and pb.models[1].pp == 4 and pb.models[1].pipelines == 1
    assert pb.models[1].fwd[0] == pytest.approx(pb.models[0].fwd[0])  # same work per GPU
    with pytest.raises(ProblemError, match="divisible by its fusion factor"):
        build_problem([ModelShape("a", 8, 64, 256, 4, tp=1, pp=4, microbatches=3),
                       ModelShape("c", 8, 64, 256, 4, tp=1, pp=2, microbatches=3)])
    with pytest.raises(ProblemError, match="gpus"):
        build_problem([a, c], CostConfig(gpus=30))


# --- bad values: refused by name, never coerced -------------------------------------------------

def spec(**change):
    """ModelSpec fields of a valid 2-stage model, with ``change`` applied."""
    fields = dict(name="a", pp=2, pipelines=1, microbatches=2, direction="down", fwd=[1.0, 1.0], bwd=[2.0, 2.0],
                  act_mem=[1.0, 0.0])
    return {**fields, **change}


@pytest.mark.parametrize("change, message", [
    ({"fwd": [1.0, float("nan")]}, "model 'a': fwd[1]=nan must be a finite number > 0"),
    ({"bwd": [float("inf"), 1.0]}, "model 'a': bwd[0]=inf must be a finite number > 0"),
    ({"act_mem": [float("-inf"), 0.0]}, "model 'a': act_mem[0]=-inf must be a finite number >= 0"),
    ({"fwd": [1.0, 0.0]}, "model 'a': fwd[1]=0.0 must be a finite number > 0"),
    ({"fwd": ["1", 1.0]}, "model 'a': fwd[0]='1' must be a finite number > 0"),
    ({"bwd": [True, 1.0]}, "model 'a': bwd[0]=True must be a finite number > 0"),
    ({"act_mem": [10**400, 0]}, "model 'a': act_mem[0]=" + str(10**400) + " must be a finite number >= 0"),
    ({"fwd": "11"}, "model 'a': fwd='11' must be a list of numbers, one per model stage (pp=2)"),
    ({"fwd": None}, "model 'a': fwd=None must be a list of numbers"),
    ({"pp": 2.0}, "model 'a': pp=2.0 must be a positive integer"),
    ({"microbatches": True}, "model 'a': microbatches=True must be a positive integer"),
    ({"pipelines": 0}, "model 'a': pipelines=0 must be a positive integer"),
    ({"name": ""}, "model name='' must be a non-empty string"),
    ({"name": 3}, "model name=3 must be a non-empty string"),
    ({"direction": ["down"]}, "model 'a': direction=['down'] must be one of ('down', 'up')"),
])
def test_model_spec_refuses_bad_values_by_name(change, message):
    with pytest.raises(ProblemError) as exc:
        ModelSpec(**spec(**change))
    assert str(exc.value).startswith(message)


def test_problem_refuses_bad_values_by_name():
    model = ModelSpec(**spec())
    for kwargs, message in [({"comm": float("nan")}, "comm=nan must be a finite number >= 0"),
                            ({"comm": -1}, "comm=-1 must be a finite number >= 0"),
                            ({"mem_cap": float("inf")}, "mem_cap=inf must be a finite number > 0, or absent"),
                            ({"mem_cap": 0}, "mem_cap=0 must be a finite number > 0"),
                            ({"mem_cap": "2"}, "mem_cap='2' must be a finite number > 0"),
                            ({"stages": 2.0}, "stages=2.0 must be a positive integer"),
                            ({"models": [model.to_dict()]}, "models=[{'name': 'a'"),
                            ({"time_unit": None}, "time_unit=None must be a string")]:
        with pytest.raises(ProblemError) as exc:
            Problem(**{"stages": 2, "models": (model,), **kwargs})
        assert str(exc.value).startswith(message)
    huge = ModelSpec(**spec(microbatches=10**12))  # valid alone; a problem this big would never finish
    with pytest.raises(ProblemError, match=r"4000000000000 subtasks .* more than the 1000000 supported"):
        Problem(stages=2, models=(huge,))
    pb = Problem(stages=2, models=(model,), comm=1, mem_cap=3)
    assert (pb.comm, pb.mem_cap) == (1.0, 3.0) and isinstance(pb.comm, float)


def test_problem_json_is_checked_not_coerced():
    good = two_models().to_dict()

    def refused(change, message):
        d = json.loads(json.dumps(good))
        change(d)
        with pytest.raises(ProblemError) as exc:
            Problem.from_dict(d)
        assert str(exc.value).startswith(message), str(exc.value)

    refused(lambda d: d["models"][0].update(pp="4"), "model 'actor': pp='4' must be a positive integer")
    refused(lambda d: d["models"][1]["fwd"].__setitem__(1, float("nan")), "model 'critic': fwd[1]=nan must be")
    refused(lambda d: d.update(stages=4.0), "stages=4.0 must be a positive integer")
    refused(lambda d: d.update(models={}), "models={} must be a list of model entries")
    refused(lambda d: d["models"].__setitem__(0, ["actor"]), "model entry ['actor'] must be an object")
    refused(lambda d: d.update(comm="0"), "comm='0' must be a finite number >= 0")
    with pytest.raises(ProblemError, match="a problem is a JSON object with 'stages' and 'models', not a list"):
        Problem.from_dict([good])
    d = json.loads(json.dumps(good))
    del d["models"][0]["act_mem"]  # optional: zeros
    assert Problem.from_dict(d).models[0].act_mem == (0.0,) * 4


def test_schedule_file_is_checked_not_coerced(tmp_path):
    pb = two_models()
    good = schedule_to_dict(Schedule.from_orders(pb, serial_1f1b(pb)))
    path = tmp_path / "s.json"
    for change, message in [
            (lambda d: d["schedule"][0][0].update(mb=0.0), "mb=0.0 must be an integer"),
            (lambda d: d["schedule"][0][0].update(pipeline="0"), "pipeline='0' must be an integer"),
            (lambda d: d["schedule"][0][0].update(model_stage=True), "model_stage=True must be an integer"),
            (lambda d: d["schedule"][0][0].update(op="f"), "op='f' must be one of ('F', 'B')"),
            (lambda d: d["schedule"][0][0].update(model=["actor"]), "names an unknown model; known: ['actor', "),
            (lambda d: d["schedule"][0].__setitem__(0, "F0"), "stage 0: action 'F0' must be an object"),
            (lambda d: d.update(schedule={"0": []}), "schedule file lacks 'schedule', one list of actions per"),
            (lambda d: d.update(version="1"), "schedule file version '1' is not supported"),
            (lambda d: d.update(metrics=[1]), "metrics=[1] must be an object"),
            (lambda d: d["models"][0]["bwd"].__setitem__(0, float("inf")), "model 'actor': bwd[0]=inf must be")]:
        d = json.loads(json.dumps(good))
        change(d)
        path.write_text(json.dumps(d))
        with pytest.raises(ScheduleError) as exc:
            load_schedule(path)
        assert str(exc.value).startswith(f"schedule file {path}: malformed schedule: "), str(exc.value)
        assert message in str(exc.value)
    path.write_text(json.dumps(good))
    assert load_schedule(path).stages == Schedule.from_orders(pb, serial_1f1b(pb)).stages


def test_cost_model_refuses_non_finite_and_huge_values():
    for kwargs, message in [({"gpu_flops": float("nan")}, "CostConfig.gpu_flops=nan must be a finite number > 0"),
                            ({"mfu": float("nan")}, "CostConfig.mfu=nan must lie in (0, 1]"),
                            ({"comm": float("inf")}, "CostConfig.comm=inf must be a finite number >= 0"),
                            ({"seq_len": 2.5}, "CostConfig.seq_len=2.5 must be an integer in [1, 2147483647]"),
                            ({"gpus": True}, "CostConfig.gpus=True must be a positive GPU count")]:
        with pytest.raises(ProblemError) as exc:
            CostConfig(**kwargs)
        assert str(exc.value).startswith(message)
    with pytest.raises(ProblemError, match=r"hidden=\d+ must be an integer in \[1, 2147483647\]"):
        ModelShape("m", layers=2, hidden=10**400, ffn=256, heads=4, tp=1, pp=1, microbatches=1)
    with pytest.raises(ProblemError, match="kv_heads=3 must be a positive integer dividing heads=4"):
        ModelShape("m", layers=2, hidden=64, ffn=256, heads=4, tp=1, pp=1, microbatches=1, kv_heads=3)


def test_min_peak_memory_is_met_by_one_micro_batch_at_a_time():
    """The feasible minimum of a memory cap: no schedule goes below it (1F1B, greedy), and running the
    chains one after another, each to its end, is a valid schedule that meets it exactly."""
    pb = Problem(stages=4, models=(
        ModelSpec("actor", 4, 1, 3, "down", [1.0] * 4, [2.0] * 4, [1.0, 3.0, 0.5, 2.0]),
        ModelSpec("critic", 2, 2, 2, "up", [0.5] * 2, [1.0] * 2, [2.5, 1.5])))
    floor = min_peak_memory(pb)
    # the critic runs up: pipeline 1 on fused stages 1, 0 and pipeline 0 on 3, 2 (model stage 0 first), so
    # fused stages hold actor (1.0, 3.0, 0.5, 2.0) and critic (1.5, 2.5, 1.5, 2.5) activations
    assert floor == [1.5, 3.0, 1.5, 2.5]
    sequential = [[] for _ in range(pb.stages)]
    for v in range(pb.num_nodes):  # ids run chain by chain, each chain in dependency order
        sequential[pb.arrays.stage[v]].append(v)
    assert validate(pb, to_actions(pb, sequential), mem_cap=max(floor)) == []
    assert stage_peak_memory(pb, sequential) == floor
    for orders in (serial_1f1b(pb), greedy_fused(pb)):
        assert all(p >= f for p, f in zip(stage_peak_memory(pb, orders), floor))
