"""The seeded latency-model generator (rlhf.schedule.latency_models): the same seed gives the same problems,
each choice changes the latencies as its FLOP count says, and the cost model's own count is a model too."""
import pytest

from rlhf.schedule.cost_model import CostConfig, ModelShape, build_problem, llama
from rlhf.schedule.latency_models import COST_MODEL, LatencyModel, build, kv_heads, latency_model
from rlhf.schedule.problem import ProblemError


def shapes(mb=16):
    return [llama("actor", "33B", 8, 8, mb, "down"), llama("critic", "13B", 8, 4, mb, "up")]


def test_the_same_seed_gives_the_same_models_and_problems():
    drawn = [latency_model(seed) for seed in range(12)]
    assert drawn == [latency_model(seed) for seed in range(12)]
    assert [build(shapes(), m) for m in drawn] == [build(shapes(), m) for m in drawn]
    assert len({m.describe() for m in drawn}) >= 10  # the seeds draw different models
    # pinned: a change to the draw changes every documented robustness table
    assert [m.describe() for m in drawn[:5]] == [
        "mlp3,no-attn,gqa,b/f=1.76,t+-0.2,m+-0.2", "mlp2,no-attn,mha,b/f=1.56,t+-0,m+-0.2",
        "mlp2,attn,gqa,b/f=1.67,t+-0.2,m+-0.2", "mlp2,no-attn,gqa,b/f=2.42,t+-0.1,m+-0",
        "mlp2,attn,mha,b/f=1.98,t+-0,m+-0"]
    first = build(shapes(), drawn[0]).models[0]
    assert first.fwd[0] == pytest.approx(28.409565, rel=1e-7) and first.act_mem[0] == pytest.approx(0.690579, rel=1e-6)


def test_the_cost_models_own_count_is_the_default_model():
    assert build(shapes(), COST_MODEL) == build_problem(shapes())


def test_each_choice_changes_the_flops_as_counted():
    s, seq = ModelShape("m", layers=8, hidden=1024, ffn=4096, heads=16, tp=1, pp=2, microbatches=4), 2048
    h = 1024
    full = 2 * (2 * h * h + 2 * h * h + 3 * h * 4096) + 4 * seq * h
    assert LatencyModel().flops(s, seq) == full == s.flops_per_token_layer(seq)
    assert LatencyModel(mlp_matrices=2).flops(s, seq) == full - 2 * h * 4096
    assert LatencyModel(attention=False).flops(s, seq) == full - 4 * seq * h
    assert LatencyModel(gqa=True).flops(s, seq) == full - 2 * 2 * h * (h - h * 2 // 16)  # 2 KV heads of 16
    assert [kv_heads(n) for n in (64, 52, 40, 16, 4)] == [8, 4, 5, 2, 1]


def test_ratio_and_jitters_stay_within_their_ranges():
    for seed in range(40):
        model = latency_model(seed)
        assert 1.5 <= model.bwd_over_fwd <= 2.5 and model.mlp_matrices in (2, 3)
        plain = build(shapes(), LatencyModel(model.mlp_matrices, model.attention, model.gqa, model.bwd_over_fwd))
        for jit, ref in zip(build(shapes(), model).models, plain.models):
            for got, want in ((jit.fwd, ref.fwd), (jit.bwd, ref.bwd)):
                assert all(abs(g / w - 1) <= model.time_jitter + 1e-12 for g, w in zip(got, want))
            assert all(abs(g / w - 1) <= model.mem_jitter + 1e-12 for g, w in zip(jit.act_mem, ref.act_mem))
            assert all(b / f == pytest.approx(model.bwd_over_fwd) for f, b in zip(jit.fwd, jit.bwd))
        if model.time_jitter:  # the stages of one model then differ
            assert len(set(build(shapes(), model).models[0].fwd)) == 8


def test_bad_models_are_refused_by_field():
    for kwargs, field in ((dict(mlp_matrices=4), "mlp_matrices"), (dict(bwd_over_fwd=3.0), "bwd_over_fwd"),
                          (dict(time_jitter=0.3), "time_jitter"), (dict(mem_jitter=-0.1), "mem_jitter")):
        with pytest.raises(ProblemError, match=field):
            LatencyModel(**kwargs)
    with pytest.raises(ProblemError, match="microbatches"):  # build keeps the cost model's checks
        build(shapes(mb=3), latency_model(1), CostConfig())
