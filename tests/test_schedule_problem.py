"""Problem model, subtask numbering and the FLOP cost model (rlhf.schedule)."""
import pytest

from rlhf.schedule.cost_model import CostConfig, ModelShape, build_problem, llama
from rlhf.schedule.problem import Action, ModelSpec, Problem, ProblemError, stage_nodes


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
