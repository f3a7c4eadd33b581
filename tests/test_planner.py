"""The execution planner (rlhf/planner): shapes, hardware file, calibration, cost model, iteration simulator,
search and tools/plan_placement.py (reshard bytes: tests/test_planner_reshard.py).

Each piece against an independent reference: parameter counts against the
published Llama-2 / CodeLlama counts, transformers' own models and the dry
run's count; the 1F1B bubble against rlhf/schedule's simulator; calibration
against constants it must recover; the list scheduler against hand-worked
timelines; written plans against pretrain_rlhf.py's own --dry-run checks.
"""

import json
import math
import random
import re
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from rlhf.models.config import MODEL_PRESETS, ModelConfig
from rlhf.parallel import Placement
from rlhf.parallel.mesh import ParallelStrategy, TaskMesh
from rlhf.planner.calibrate import OVERHEAD_TERMS, calibrate
from rlhf.planner.cost import (BF16, FP32, Cluster, Precision, Workload, allreduce_s, decode_read_parameters,
                               decode_step_s, decode_terms, expert_alltoall_bytes, expert_alltoall_bytes_per_iteration,
                               pass_collectives, saturating_batch, task_cost, task_memory)
from rlhf.planner.errors import PlannerError
from rlhf.planner.hardware import HARDWARE_PRESETS as HW
from rlhf.planner.hardware import load_hardware, save_hardware
from rlhf.planner.reshard_bytes import received_bytes
from rlhf.planner.shapes import (LLAMA_SHAPES, active_parameter_count, forward_flops_per_token, kv_bytes_per_token,
                                 llama_shape, parameter_count, rank_parameters, schedule_shape, stage_parameters)
from rlhf.fusion import policy
from rlhf.planner import fused_generation, real_appendix
from rlhf.planner.iteration_sim import Call, Sharing, schedule_calls
from rlhf.planner.placement_search import (APP_PLACEMENTS, PlacementSearchConfig, allocations, generation_order,
                                           search_placements, set_partitions, strategies)
from rlhf.planner.plan import (FUSED_GENERATION, Plan, evaluate, memory_parts_per_rank, memory_per_rank,
                               plan_from_placement_file, stage_seconds)
from rlhf.schedule.cost_model import CostConfig, build_problem
from rlhf.schedule.generators import serial_1f1b_makespan
from rlhf.tasks import INFERENCE_TASKS, MODELS, TASKS, task_kind
from rlhf.testing.tools import load_tool

plan_placement = load_tool("plan_placement")
ROOT = Path(__file__).resolve().parents[1]
TINY = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_kv_heads=2,
                   vocab_size=256, max_seq_len=64)
QWEN3_MOE = ModelConfig(num_layers=3, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                        vocab_size=300, kv_channels=16, qk_norm=True, num_experts=6, moe_router_topk=2,
                        moe_ffn_hidden_size=40)
"""A tiny Qwen3-MoE: QK-norm, head_dim 16 apart from hidden / heads = 12, 6 experts of ffn 40, each token to 2."""

# ReaL Table 1's four LLaMA configurations: the parameter counts of the published checkpoints
# (meta-llama/Llama-2-{7,13,70}b-hf, codellama/CodeLlama-34b-hf).
TABLE1 = {"llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320, "llama-34b": 33_743_970_304,
          "llama-70b": 68_976_648_192}


# --- models ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TABLE1))
def test_table1_parameter_counts_are_exact(name):
    assert parameter_count(llama_shape(name), "lm") == TABLE1[name]


@pytest.mark.parametrize("name", ["llama-7b", "llama-34b"])
def test_counts_match_transformers_llama(name):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = llama_shape(name)
    hf = transformers.LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
                                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                                  num_key_value_heads=cfg.num_kv_heads, vocab_size=cfg.vocab_size)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(hf)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(cfg, "lm")


def test_counts_match_the_hf_tensors_per_stage_and_kind():
    """Against the HF tensors a model converts from (rlhf/checkpoint/hf.py), each on the stage that holds it."""
    from rlhf.checkpoint.hf import hf_shapes, hf_sources

    def hf_stage_counts(cfg, kind, pp):
        shapes, counts = hf_shapes(cfg), [0] * pp
        for name, sources in hf_sources(cfg, "lm_head" if kind == "lm" else "score").items():
            layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
            if layer is None:
                stage = 0 if name.startswith("embedding.") else pp - 1
            else:
                stage = layer * pp // cfg.num_layers
            counts[stage] += sum(math.prod(shapes[source]) for source in sources)
        return counts

    qwen = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                       vocab_size=300, qkv_bias=True)
    for cfg in (TINY, qwen, LLAMA_SHAPES["llama-13b"], QWEN3_MOE):
        for kind in ("lm", "value"):
            for pp in (p for p in (1, 2, 4) if cfg.num_layers % p == 0):
                assert stage_parameters(cfg, kind, pp) == hf_stage_counts(cfg, kind, pp)


def test_unknown_preset_is_one_line():
    with pytest.raises(PlannerError, match=r"^unknown model preset 'llama-8b'; presets: llama-7b, llama-13b"):
        llama_shape("llama-8b")


# --- hardware file and calibration ---------------------------------------------------------------------------------

def test_hardware_file_round_trip_and_errors(tmp_path):
    hw = HW["h100"]
    path = tmp_path / "hw.json"
    save_hardware(hw, path)
    assert load_hardware(str(path)) == hw
    path.write_text(json.dumps({**hw.to_dict(), "nvlink": 1}))
    with pytest.raises(PlannerError, match=r"^hardware file .*hw.json: unknown field\(s\) \['nvlink'\]"):
        load_hardware(str(path))
    path.write_text(json.dumps({**hw.to_dict(), "mfu": 1.5}))
    with pytest.raises(PlannerError, match=r"mfu=1.5 is invalid; give a fraction in \(0, 1\]"):
        load_hardware(str(path))
    with pytest.raises(PlannerError, match=r"^hardware file nope.json: .*give a preset: h100, a100"):
        load_hardware("nope.json")


def test_calibration_recovers_the_constants_of_a_measured_run():
    """Stage and call times made with known constants (ranks sharing 2 cores) are fitted back from the starting
    file."""
    start = replace(HW["a100"], shared_cores=2)
    truth = replace(start, mfu=0.3, layer_overhead_s=0.002, collective_latency_s=3e-4)
    plan = _flat_plan(8, train=ParallelStrategy(dp=2, pp=2, tp=2), gen=ParallelStrategy(dp=4, tp=2))
    ev = evaluate(plan, MODELS_7B, WL, truth, Cluster(1, 8))
    measured = stage_seconds(ev) | {t: ev.timeline.end[t] - ev.timeline.start[t] for t in TASKS}  # and each call's
    measured["iteration"] = ev.seconds + 0.5  # host time beyond the calls, on 8 ranks sharing 2 cores
    fitted = calibrate(start, plan, MODELS_7B, WL, Cluster(1, 8), measured)
    assert (fitted.mfu, fitted.layer_overhead_s, fitted.collective_latency_s, fitted.host_s) == pytest.approx(
        (0.3, 0.002, 3e-4, 0.5 * 2 / 8), rel=1e-6)
    assert (fitted.hbm_efficiency, fitted.call_overhead_s) == (start.hbm_efficiency, 0.0)  # at most three terms


def test_calibration_leaves_the_host_work_inside_stages_to_host_s():
    """A measured stage also holds host work between its calls (batches assembled, gathers): with the calls
    measured, the fit matches them alone, so the constants come back exact and the gaps land in host_s."""
    start = replace(HW["a100"], shared_cores=2)
    truth = replace(start, mfu=0.3, layer_overhead_s=0.002, collective_latency_s=3e-4)
    plan = _flat_plan(8, train=ParallelStrategy(dp=2, pp=2, tp=2), gen=ParallelStrategy(dp=4, tp=2))
    ev = evaluate(plan, MODELS_7B, WL, truth, Cluster(1, 8))
    measured = stage_seconds(ev) | {t: ev.timeline.end[t] - ev.timeline.start[t] for t in TASKS}
    measured["inference"] += 0.3  # gaps between the inference calls
    measured["iteration"] = ev.seconds + 0.3
    fitted = calibrate(start, plan, MODELS_7B, WL, Cluster(1, 8), measured)
    assert (fitted.mfu, fitted.layer_overhead_s, fitted.collective_latency_s, fitted.host_s) == pytest.approx(
        (0.3, 0.002, 3e-4, 0.3 * 2 / 8), rel=1e-6)
    # the stages alone (no call seconds) are matched as they are: the gaps then go to the constants
    stages_only = {k: v for k, v in measured.items() if k not in TASKS}
    assert calibrate(start, plan, MODELS_7B, WL, Cluster(1, 8), stages_only).mfu != pytest.approx(0.3, rel=1e-3)


def test_calibration_skips_a_term_the_run_does_not_exercise():
    """A run without TP, PP or DP collectives says nothing about their latency: the next term is fitted."""
    truth = replace(HW["a100"], mfu=0.2, layer_overhead_s=0.004, hbm_efficiency=0.3)
    plan = Plan("one rank", {t: _mesh(t, ParallelStrategy()) for t in TASKS})
    measured = stage_seconds(evaluate(plan, MODELS_7B, WL, truth, Cluster(1, 8)))
    terms = ("mfu", "layer_overhead_s", "collective_latency_s", "hbm_efficiency")
    fitted = calibrate(HW["a100"], plan, MODELS_7B, WL, Cluster(1, 8), measured, terms)
    assert (fitted.mfu, fitted.layer_overhead_s, fitted.hbm_efficiency) == pytest.approx((0.2, 0.004, 0.3), rel=1e-6)
    assert fitted.collective_latency_s == 0.0
    with pytest.raises(PlannerError, match=r"^measured time\(s\) \['decode'\] unknown; give stages \(reshard"):
        calibrate(HW["a100"], plan, MODELS_7B, WL, Cluster(1, 8), {"decode": 1.0})


# --- cost model ----------------------------------------------------------------------------------------------------

WL = Workload(samples=256, prompt_len=256, response_len=256, minibatches=4, micro_batch_size=4)
MODELS_7B = {m: llama_shape("llama-7b") for m in MODELS}


def _mesh(task, strategy, start=0):
    return TaskMesh(task, tuple(range(start, start + strategy.size)), strategy)


def _flat_plan(n, train, gen, infer=None):
    infer = infer or ParallelStrategy(dp=n)
    meshes = {t: _mesh(t, gen if t == "actor_gen" else train if t.endswith("train") else infer) for t in TASKS}
    return Plan("flat", meshes)


def test_generation_is_memory_bound_below_the_saturating_batch():
    cfg, hw = llama_shape("llama-7b"), HW["h100"]
    mesh = _mesh("actor_gen", ParallelStrategy(tp=2))
    cluster = Cluster(1, 8)
    b_sat = saturating_batch(cfg, mesh, 512, hw)
    comm = lambda b: 2 * cfg.num_layers * allreduce_s(b * cfg.hidden_size * 2, [0, 1], cluster, hw)  # noqa: E731
    for batch in (1, b_sat // 2):
        read = (parameter_count(cfg, "lm") * 2 + batch * 512 * kv_bytes_per_token(cfg)) / (2 * 3.35e12 * 0.6)
        assert decode_step_s(cfg, mesh, batch, 512, hw, cluster) == pytest.approx(read + comm(batch))
    # far past B_sat (and with a short context: little KV to read) the step is compute-bound
    read, compute, _ = decode_terms(cfg, mesh, 8 * b_sat, 1, hw, cluster)
    assert compute > read
    assert decode_terms(cfg, mesh, 16 * b_sat, 1, hw, cluster)[1] == pytest.approx(2 * compute)


def test_collectives_per_pass_hand_counted():
    """Counted off rlhf/models (megatron's row/column-parallel layers, logprobs.py) for the 2-layer tiny model."""
    lm, value = MODEL_PRESETS["tiny"], MODEL_PRESETS["tiny-critic"]
    mesh = lambda **k: _mesh("t", ParallelStrategy(**k))  # noqa: E731
    # layers, embedding, the log-probs and entropy (the maxima, then the three sums)
    assert pass_collectives(lm, "lm", mesh(tp=2), "inference") == 2 * 2 + 1 + 2
    assert pass_collectives(lm, "lm", mesh(tp=2), "training") == 2 * 2 + 1 + 2
    assert pass_collectives(lm, "lm", mesh(tp=2), "training", backward=True) == 2 * 2 + 1
    assert pass_collectives(value, "value", mesh(tp=2), "inference") == 2 * 2 + 1  # the value head is replicated
    assert pass_collectives(lm, "lm", mesh(tp=2, pp=2), "inference") == 2 + 2 + 1  # last stage, one message
    assert pass_collectives(lm, "lm", mesh(dp=2, pp=2), "training", backward=True) == 1
    assert pass_collectives(lm, "lm", mesh(dp=4), "inference") == 0
    hw = replace(HW["a100"], collective_latency_s=1e-3)
    gen = task_cost("actor_gen", lm, "lm", mesh(dp=2, tp=2), WL, hw, Cluster(1, 4))
    assert gen.collectives == WL.response_len * (2 * 2 + 2)  # per engine step: embedding, layers, logits
    assert gen.parts["latency"] == pytest.approx(gen.collectives * 1e-3)


def test_training_bubble_matches_the_schedule_simulator():
    """(m + pp - 1) / m: the planner's 1F1B time against rlhf.schedule's serial 1F1B makespan."""
    cfg, hw, cluster = llama_shape("llama-13b"), HW["a100"], Cluster(1, 8)
    mesh = _mesh("actor_train", ParallelStrategy(dp=1, pp=4, tp=2))
    c = task_cost("actor_train", cfg, "lm", mesh, WL, hw, cluster)
    m = WL.samples // WL.minibatches // WL.micro_batch_size
    pb = build_problem([schedule_shape(cfg, "actor", 2, 4, m)], CostConfig())
    f_b = pb.models[0].fwd[0] + pb.models[0].bwd[0]
    assert (c.parts["compute"] + c.parts["bubble"]) / c.parts["compute"] == pytest.approx(
        serial_1f1b_makespan(pb) / (m * f_b))
    tokens = WL.samples * WL.seq * WL.ppo_epochs
    assert c.parts["compute"] == pytest.approx(3 * forward_flops_per_token(cfg, "lm", WL.seq) * tokens
                                               / (8 * hw.gpu_flops * hw.mfu))
    assert c.static_bytes == 18 * max(stage_parameters(cfg, "lm", 4)) / 2


def test_memory_parts_take_their_element_sizes_from_the_precision():
    cfg = llama_shape("llama-13b")
    stage = max(stage_parameters(cfg, "lm", 4)) / 2  # pp 4, tp 2: the largest stage's share
    train = _mesh("actor_train", ParallelStrategy(dp=1, pp=4, tp=2))
    bf16, fp32 = (task_memory("actor_train", cfg, "lm", train, WL, precision=p) for p in (BF16, FP32))
    # bf16 weights, fp32 gradients (accumulated as Megatron-LM does for bf16), fp32 main params and Adam moments
    assert (bf16["parameters"], bf16["gradients"], bf16["optimizer"]) == (2 * stage, 4 * stage, 12 * stage)
    assert (fp32["parameters"], fp32["gradients"], fp32["optimizer"]) == (4 * stage, 4 * stage, 8 * stage)
    logits = WL.micro_batch_size * WL.seq * cfg.vocab_size * 4 / 2  # fp32 logits of one micro-batch
    assert fp32["activations"] - logits == pytest.approx(2 * (bf16["activations"] - logits))
    gen = _mesh("actor_gen", ParallelStrategy(dp=2, tp=4))
    kv16, kv32 = (task_memory("actor_gen", cfg, "lm", gen, WL, precision=p)["kv"] for p in (BF16, FP32))
    assert kv16 == WL.samples / 2 * WL.seq * kv_bytes_per_token(cfg) / 4 and kv32 == 2 * kv16
    ref = task_memory("ref_inf", cfg, "lm", _mesh("ref_inf", ParallelStrategy(dp=8)), WL, precision=FP32)
    assert ref["parameters"] == 4 * parameter_count(cfg, "lm") and ref["gradients"] == ref["optimizer"] == 0
    cost = task_cost("actor_train", cfg, "lm", train, WL, HW["a100"], Cluster(1, 8), precision=FP32)
    assert cost.memory == fp32 and cost.static_bytes == 16 * stage
    with pytest.raises(PlannerError, match="grad=-1 must be bytes per element >= 0"):
        Precision("odd", weight=2, grad=-1, main=0, optimizer=8)
    # full recompute keeps one hidden state per chunk of layers per micro-batch in flight, and one chunk's
    # activations again while its backward runs; selective is what the 34-byte constant already assumes
    tokens, layers = WL.micro_batch_size * WL.seq, cfg.num_layers // 4
    full = task_memory("actor_train", cfg, "lm", train, WL, precision=FP32, recompute=("full", 2))
    assert full["activations"] == pytest.approx(4 * layers / 2 * tokens * cfg.hidden_size * 4  # chunk inputs
                                                + max(logits, 2 * tokens * cfg.hidden_size * 34 * 2 / 2))
    assert task_memory("actor_train", cfg, "lm", train, WL, precision=FP32, recompute=("selective", None)) == fp32


def test_memory_parts_per_rank_add_up_to_the_memory_per_rank():
    plan = _flat_plan(8, train=ParallelStrategy(dp=1, pp=4, tp=2), gen=ParallelStrategy(dp=4, tp=2))
    critic = plan.meshes["critic_train"]
    fused = Plan("fused", {**plan.meshes, "critic_train": TaskMesh("critic_train", critic.ranks, critic.strategy,
                                                                   reverse_pp=True)}, fuse_training=True)
    for p in (plan, fused):
        ev = evaluate(p, MODELS_7B, WL, HW["h100"], Cluster(1, 8), precision=FP32)
        parts = memory_parts_per_rank(p, {t: c.memory for t, c in ev.costs.items()})
        assert set(parts) == set(ev.memory) == set(memory_per_rank(p, ev.costs))
        for rank, total in ev.memory.items():
            assert sum(parts[rank].values()) == pytest.approx(total, rel=1e-12)
    fp32 = evaluate(plan, MODELS_7B, WL, HW["h100"], Cluster(1, 8), precision=FP32)
    assert evaluate(plan, MODELS_7B, WL, HW["h100"], Cluster(1, 8)).peak_memory < fp32.peak_memory
    memory = {t: c.memory for t, c in fp32.costs.items()}
    resident = memory_parts_per_rank(plan, memory, resident_kv=True)  # the KV cache kept between generations
    for rank in plan.meshes["actor_gen"].ranks:
        others = max(memory[t]["activations"] for t, mesh in plan.meshes.items() if rank in mesh.ranks)
        static = sum(memory[t][p] for t, mesh in plan.meshes.items() if rank in mesh.ranks
                     for p in ("parameters", "gradients", "optimizer", "kv"))
        assert resident[rank]["kv"] == memory["actor_gen"]["kv"] > 0
        assert sum(resident[rank].values()) == pytest.approx(static + others, rel=1e-12)


def test_fused_training_is_no_slower_than_serial():
    plan = _flat_plan(8, train=ParallelStrategy(dp=1, pp=4, tp=2), gen=ParallelStrategy(dp=4, tp=2))
    critic = plan.meshes["critic_train"]
    fused = Plan("fused", {**plan.meshes, "critic_train": TaskMesh("critic_train", critic.ranks, critic.strategy,
                                                                   reverse_pp=True)}, fuse_training=True)
    serial = evaluate(plan, MODELS_7B, WL, HW["h100"], Cluster(1, 8))
    together = evaluate(fused, MODELS_7B, WL, HW["h100"], Cluster(1, 8))
    train = serial.timeline.end["critic_train"] - serial.timeline.start["actor_train"]
    span = together.timeline.end["actor_train+critic_train"] - together.timeline.start["actor_train+critic_train"]
    assert span < train
    assert together.peak_memory > serial.peak_memory  # both models' activations are live at once


def test_given_micro_batch_counts_split_the_batch_like_a_micro_batch_size():
    """A call given m micro-batches per DP replica costs what micro-batches of samples / (dp m) cost."""
    cfg, hw, cluster = llama_shape("llama-7b"), HW["h100"], Cluster(1, 8)
    for task, strategy, samples in (("actor_train", ParallelStrategy(dp=2, pp=2, tp=2), WL.samples // WL.minibatches),
                                    ("ref_inf", ParallelStrategy(dp=4, pp=2), WL.samples)):
        mesh = _mesh(task, strategy)
        for m in (1, 2, 8):
            size = samples // (strategy.dp * m)
            assert task_cost(task, cfg, "lm", mesh, WL, hw, cluster, m) == task_cost(
                task, cfg, "lm", mesh, replace(WL, micro_batch_size=size), hw, cluster)
    with pytest.raises(PlannerError, match=r"^ref_inf: micro-batches=0 must be a positive integer"):
        task_cost("ref_inf", cfg, "lm", _mesh("ref_inf", ParallelStrategy()), WL, hw, cluster, 0)


def test_generation_in_micro_batches_runs_them_in_turn_or_pipelined():
    """m micro-batches on one stage decode in turn (m steps of b / m samples per token); over pp stages a token
    takes max(m, pp) passes of a micro-batch through one stage (pp stages, m = 1: the whole model's read)."""
    cfg, hw, cluster = llama_shape("llama-7b"), HW["h100"], Cluster(1, 8)
    context, steps = WL.prompt_len + WL.response_len / 2, WL.response_len
    cost = lambda s, m=None: task_cost("actor_gen", cfg, "lm", _mesh("actor_gen", s), WL, hw, cluster, m)  # noqa: E731

    def step(s, batch):  # one decode step of the whole model on one DP replica
        return max(decode_terms(cfg, _mesh("actor_gen", s), batch, context, hw, cluster)[:2])

    one, batch = ParallelStrategy(tp=2), WL.samples
    assert cost(one, 4).parts["decode"] == pytest.approx((steps - 1) * 4 * step(one, batch / 4))
    assert cost(one, 4).parts["prefill"] == pytest.approx(cost(one).parts["prefill"])  # the same FLOPs in turn
    piped = ParallelStrategy(pp=2, tp=2)
    assert cost(piped, 1).parts["decode"] == pytest.approx((steps - 1) * step(piped, batch))
    assert cost(piped, 2).parts["decode"] == pytest.approx((steps - 1) * step(piped, batch / 2))
    assert cost(piped, 8).parts["decode"] == pytest.approx((steps - 1) * 4 * step(piped, batch / 8))
    assert cost(piped, 2).parts["prefill"] == pytest.approx(cost(one).parts["prefill"] * 3 / 4)  # (m + pp - 1) / m pp


def test_the_planner_does_not_import_torch():
    """The planner (the fusion policy it borrows included) runs where torch is not installed."""
    import subprocess
    import sys

    code = ("import sys, rlhf.planner.placement_search, rlhf.planner.calibrate, rlhf.planner.fused_generation, "
            "rlhf.planner.real_appendix; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- inter-stage fusion ---------------------------------------------------------------------------------------------

LONG_TAIL = replace(WL, samples=1024, response_len=1024, long_tail_median=128)  # 256 per instance > B_sat


def _gen_and_inference_span(ev) -> float:
    t = ev.timeline
    return max(t.end[c] for c in INFERENCE_TASKS) - t.start["actor_gen"]


def test_inter_stage_time_model_reproduces_the_unfused_plan():
    """The fusion policy's model, set from the cost model, gives the unfused plan's generation + inference
    time when every sample runs to full length (the planner's own assumption)."""
    plan = _flat_plan(8, train=ParallelStrategy(dp=2, pp=2, tp=2), gen=ParallelStrategy(dp=4, tp=2))
    unfused = evaluate(plan, MODELS_7B, LONG_TAIL, HW["h100"], Cluster(1, 8))
    gen_s = unfused.costs["actor_gen"].seconds
    span = _gen_and_inference_span(unfused)
    cost = fused_generation.generation_cost(MODELS_7B["actor"], plan.meshes["actor_gen"], LONG_TAIL, HW["h100"],
                                       Cluster(1, 8), gen_s, span - gen_s)
    full = policy.simulate([LONG_TAIL.response_len] * LONG_TAIL.samples, cost, 0.0)
    assert full.generation_s == pytest.approx(gen_s)
    assert full.total_s == pytest.approx(span)


def test_inter_stage_fusion_shortens_a_long_tail_by_the_policys_speedup():
    plan = _flat_plan(8, train=ParallelStrategy(dp=2, pp=2, tp=2), gen=ParallelStrategy(dp=4, tp=2))
    hw, cluster = HW["h100"], Cluster(1, 8)
    unfused = evaluate(plan, MODELS_7B, LONG_TAIL, hw, cluster)
    fused = evaluate(replace(plan, fuse_generation=True), MODELS_7B, LONG_TAIL, hw, cluster)
    span = _gen_and_inference_span(unfused)
    cost = fused_generation.generation_cost(MODELS_7B["actor"], plan.meshes["actor_gen"], LONG_TAIL, hw, cluster,
                                       unfused.costs["actor_gen"].seconds, span - unfused.costs["actor_gen"].seconds)
    lengths = policy.LengthDistribution(policy.long_tailed_lengths(4096, random.Random(0), 128, cap=1024))
    choice = policy.choose_threshold(lengths, cost, LONG_TAIL.samples, trials=8)
    call = fused.timeline.end[FUSED_GENERATION] - fused.timeline.start[FUSED_GENERATION]
    assert call == pytest.approx(span / choice.speedup)
    assert fused.migration_threshold == choice.threshold and choice.speedup > 1.1
    # everything after inference moves up by what fusion saves
    assert unfused.seconds - fused.seconds == pytest.approx(span - call)
    assert stage_seconds(fused)["generation"] == pytest.approx(call) and stage_seconds(fused)["inference"] == 0
    # a given R: the policy's own R gives the same time; R = 0 never migrates (the unfused time)
    def at(r):
        return evaluate(replace(plan, fuse_generation=True, migration_threshold=r), MODELS_7B, LONG_TAIL, hw, cluster)

    assert at(choice.threshold).seconds == pytest.approx(fused.seconds, rel=1e-12)
    assert at(0.0).seconds == pytest.approx(unfused.seconds, rel=1e-12)
    assert at(0.95).seconds > fused.seconds


def test_inter_stage_fusion_gains_nothing_without_a_tail_and_is_not_proposed():
    plan = _flat_plan(8, train=ParallelStrategy(dp=2, pp=2, tp=2), gen=ParallelStrategy(dp=4, tp=2))
    hw, cluster = HW["h100"], Cluster(1, 8)
    uniform = replace(LONG_TAIL, long_tail_median=0)
    fused = evaluate(replace(plan, fuse_generation=True), MODELS_7B, uniform, hw, cluster)
    assert fused.seconds == pytest.approx(evaluate(plan, MODELS_7B, uniform, hw, cluster).seconds, rel=1e-12)
    nodes = Cluster(2, 8)  # a batch this long fits one node only with every model's memory spread thin
    small = PlacementSearchConfig(options=2, keep=3, fuse_generation=True)
    assert not any(ev.plan.fuse_generation for ev in search_placements(MODELS_7B, uniform, hw, nodes, small).ranked)
    tailed = search_placements(MODELS_7B, LONG_TAIL, hw, nodes, small)
    plain = search_placements(MODELS_7B, LONG_TAIL, hw, nodes, replace(small, fuse_generation=False))
    assert tailed.best.plan.fuse_generation and tailed.best.seconds < plain.best.seconds


@pytest.mark.parametrize("gen, inference_start, message", [
    (ParallelStrategy(tp=8), 0, r"needs actor_gen dp >= 2"),
    (ParallelStrategy(dp=2, tp=4), 8, r"needs the inference tasks on actor_gen's ranks; ref_inf, reward_inf, "
                                      r"critic_inf are not"),
])
def test_inter_stage_fusion_refuses_plans_without_freed_ranks(gen, inference_start, message):
    train, infer = ParallelStrategy(dp=2, pp=2, tp=2), ParallelStrategy(dp=8)
    meshes = {t: _mesh(t, gen if t == "actor_gen" else infer if t in INFERENCE_TASKS else train,
                       inference_start if t in INFERENCE_TASKS else 0) for t in TASKS}
    with pytest.raises(PlannerError, match=message):
        evaluate(Plan("p", meshes, fuse_generation=True), MODELS_7B, LONG_TAIL, HW["h100"], Cluster(2, 8))
    plan = _flat_plan(8, train=ParallelStrategy(dp=2, pp=2, tp=2), gen=ParallelStrategy(dp=4, tp=2))
    with pytest.raises(PlannerError, match=r"not modelled on cpu-gloo, whose ranks share cores"):
        evaluate(replace(plan, fuse_generation=True), MODELS_7B, LONG_TAIL, replace(HW["cpu"], shared_cores=2),
                 Cluster(1, 8))


# --- iteration simulator -------------------------------------------------------------------------------------------

def test_list_scheduling_hand_worked():
    calls = [Call("A", {0, 1}, 2.0), Call("B", {2}, 1.0), Call("C", {0}, 1.0, [("A", 0.5)]),
             Call("D", {1, 2}, 1.0, [("B", 0.0)])]
    t = schedule_calls(calls)
    # A and B start at 0; D waits for rank 1 (A ends at 2), not for B alone; C for A's data (2 + 0.5)
    assert t.start == {"A": 0.0, "B": 0.0, "D": 2.0, "C": 2.5}
    assert t.seconds == 3.5
    with pytest.raises(PlannerError, match="wait on each other"):
        schedule_calls([Call("X", {0}, 1.0, [("Y", 0)]), Call("Y", {0}, 1.0, [("X", 0)])])
    with pytest.raises(PlannerError, match=r"call 'X': unknown input\(s\) \['Z'\]"):
        schedule_calls([Call("X", {0}, 1.0, [("Z", 0)])])


def test_shared_cores_hand_worked():
    """4 ranks on 2 cores: two calls on two ranks each run at half speed until one ends."""
    calls = [Call("A", {0, 1}, 1.0), Call("B", {2, 3}, 2.0), Call("C", {0, 1, 2, 3}, 1.0, [("A", 0.0), ("B", 0.0)])]
    t = schedule_calls(calls, Sharing(ranks_per_node=4, cores=2))
    # A, B at speed 1/2 until A's work of 1 s is done at 2; B alone at full speed ends at 3; C on 4 ranks at 1/2
    assert (t.end["A"], t.end["B"], t.start["C"], t.end["C"]) == pytest.approx((2.0, 3.0, 3.0, 5.0))
    two_nodes = Sharing(ranks_per_node=2, cores=2)  # no sharing
    assert schedule_calls(calls, two_nodes).seconds == pytest.approx(3.0)


def test_event_walk_at_full_speed_is_the_list_walk():
    """Random call graphs: with a core per rank, the event-by-event walk gives the list scheduler's timeline."""
    rng = random.Random(0)
    for _ in range(200):
        calls = []
        for i in range(rng.randint(1, 8)):
            ranks = set(rng.sample(range(4), rng.randint(1, 4)))
            inputs = [(f"c{j}", rng.choice([0.0, rng.random()])) for j in range(i) if rng.random() < 0.3]
            calls.append(Call(f"c{i}", ranks, rng.choice([0.0, rng.random()]), inputs))
        listed, events = schedule_calls(calls), schedule_calls(calls, Sharing(ranks_per_node=1, cores=1))
        assert events.start == pytest.approx(listed.start) and events.end == pytest.approx(listed.end)


def test_iteration_from_given_call_times_overlaps_disjoint_meshes():
    """With per-call times given (as ReaL's Tables 2-5 give them), disjoint meshes run side by side."""
    s = ParallelStrategy(dp=4)
    meshes = {"actor_gen": _mesh("actor_gen", s), "actor_train": _mesh("actor_train", s),
              "ref_inf": _mesh("ref_inf", s, 4), "reward_inf": _mesh("reward_inf", s, 4),
              "critic_inf": _mesh("critic_inf", s, 4),
              "critic_train": _mesh("critic_train", ParallelStrategy(dp=2, tp=2), 4)}
    times = {"actor_gen": 10.0, "ref_inf": 2.0, "reward_inf": 1.0, "critic_inf": 3.0, "actor_train": 5.0,
             "critic_train": 4.0}
    ev = evaluate(Plan("split", meshes), MODELS_7B, WL, replace(HW["h100"], inter_node_bandwidth=1e30,
                                                                 intra_node_bandwidth=1e30), Cluster(1, 8), times)
    # inference 10..16 (ref and reward one after the other on ranks 4-7, critic too); both trainings
    # 16..21 side by side; the critic's reshard into critic_inf after its training (ranks 4-7 only)
    assert ev.timeline.start["ref_inf"] == pytest.approx(10.0)
    assert ev.timeline.start["actor_train"] == ev.timeline.start["critic_train"] == pytest.approx(16.0)
    assert ev.timeline.end["actor_train"] == pytest.approx(21.0)
    assert ev.timeline.start["reshard critic"] == pytest.approx(20.0)
    assert "reshard actor" not in ev.timeline.start  # actor_train and actor_gen share a layout: nothing moves


@pytest.mark.parametrize("generation_s", [4.0, 30.0])
def test_asynchronous_iteration_is_the_slower_side_plus_the_meeting(generation_s):
    """Generation apart (ranks 0-3) and ahead: it runs beside inference and training of the batch before
    (ranks 4-7); the actor's move into actor_gen waits for both, and the iteration ends with it. The same
    plan synchronous runs generation first."""
    s = ParallelStrategy(dp=4)
    meshes = {"actor_gen": _mesh("actor_gen", s), "actor_train": _mesh("actor_train", s, 4),
              "ref_inf": _mesh("ref_inf", s, 4), "reward_inf": _mesh("reward_inf", s, 4),
              "critic_inf": _mesh("critic_inf", s, 4), "critic_train": _mesh("critic_train", s, 4)}
    times = {"actor_gen": generation_s, "ref_inf": 2.0, "reward_inf": 1.0, "critic_inf": 3.0, "actor_train": 5.0,
             "critic_train": 4.0}
    hw = replace(HW["h100"], inter_node_bandwidth=1e30, intra_node_bandwidth=1e30, host_s=0.5)
    ev = evaluate(Plan("apart", meshes, asynchronous=True), MODELS_7B, WL, hw, Cluster(1, 8), times)
    sync = evaluate(Plan("apart", meshes), MODELS_7B, WL, hw, Cluster(1, 8), times)
    t = ev.timeline
    learning = 2.0 + 1.0 + 3.0 + 0.5 + 5.0 + 4.0  # every call of the learners in turn on ranks 4-7
    assert t.start["actor_gen"] == t.start["ref_inf"] == 0.0
    assert t.start["reshard actor"] == pytest.approx(max(generation_s, learning))
    assert ev.seconds == pytest.approx(t.end["reshard actor"])
    meeting = t.end["reshard actor"] - t.start["reshard actor"]
    assert sync.seconds == pytest.approx(meeting + generation_s + learning)
    assert t.start["advantage"] == pytest.approx(6.0)  # on the learners only: it does not wait for generation


@pytest.mark.parametrize("k", [2, 16])
def test_partial_rollouts_decode_a_batch_for_its_mean_length(k):
    """Free-running generation keeps the engine's batch full: a batch's decode steps are its mean response
    length, not its longest. On uniform lengths that changes nothing; on the long-tailed lognormal (median
    1/8 of the cap) actor_gen lasts prefill + call overhead + the rest x mean/max of the same lengths the
    trainer draws, but no less than 1/K of the lockstep batch (K iterations for its longest sample: the
    bound that acts at K = 2; at 16, mean/max does)."""
    import random

    from rlhf.fusion.policy import long_tailed_lengths

    s = ParallelStrategy(dp=4)
    meshes = {"actor_gen": _mesh("actor_gen", s), "actor_train": _mesh("actor_train", s, 4),
              **{t: _mesh(t, s, 4) for t in ("ref_inf", "reward_inf", "critic_inf", "critic_train")}}
    hw, cluster = HW["h100"], Cluster(1, 8)
    for wl in (WL, replace(WL, long_tail_median=WL.response_len // 8)):
        lockstep = evaluate(Plan("apart", meshes, asynchronous=True), MODELS_7B, wl, hw, cluster)
        partial = evaluate(Plan("apart", meshes, asynchronous=True, partial_rollouts=True, max_staleness=k),
                           MODELS_7B, wl, hw, cluster)
        span = {name: ev.timeline.end["actor_gen"] - ev.timeline.start["actor_gen"]
                for name, ev in (("lockstep", lockstep), ("partial", partial))}
        lengths = long_tailed_lengths(4096, random.Random(0), median=wl.long_tail_median, cap=wl.response_len) \
            if wl.long_tail_median else [wl.response_len]
        fixed = lockstep.costs["actor_gen"].parts["prefill"] + hw.call_overhead_s
        ratio = sum(lengths) / len(lengths) / wl.response_len
        full = fixed + (span["lockstep"] - fixed) * ratio
        assert span["partial"] == pytest.approx(max(full, span["lockstep"] / k))
        if wl.long_tail_median:
            assert span["partial"] == pytest.approx(span["lockstep"] / 2 if k == 2 else full)
        else:
            assert ratio == 1 and span["partial"] == pytest.approx(span["lockstep"])
    with pytest.raises(PlannerError, match=r"partial rollouts run asynchronous generation free; the plan is not"):
        Plan("apart", meshes, partial_rollouts=True)


def test_absent_tasks_at_zero_seconds_leave_generation_and_training():
    """A critic-, reward- and reference-free algorithm (DAPO, GRPO) as benchmarks/async_published.py gives
    it: the absent models tiny, their calls 0 s. Synchronous, the iteration is generation plus training;
    asynchronous with partial rollouts (K = 2: free-running), the slower of the two, generation timed as
    without given seconds."""
    absent = ("ref_inf", "reward_inf", "critic_inf", "critic_train")
    s = ParallelStrategy(dp=4)
    meshes = {"actor_gen": _mesh("actor_gen", s), "actor_train": _mesh("actor_train", s, 4),
              **{t: _mesh(t, s, 4) for t in absent}}
    models = {"actor": llama_shape("llama-7b"), "reference": MODEL_PRESETS["tiny"],
              "critic": MODEL_PRESETS["tiny-critic"], "reward": MODEL_PRESETS["tiny-critic"]}
    wl = replace(WL, long_tail_median=WL.response_len // 8)
    hw, cluster = replace(HW["h100"], inter_node_bandwidth=1e30, intra_node_bandwidth=1e30), Cluster(1, 8)
    zero = dict.fromkeys(absent, 0.0)
    sync = evaluate(Plan("apart", meshes), models, wl, hw, cluster, zero)
    partial, alone = (evaluate(Plan("apart", meshes, asynchronous=True, partial_rollouts=True, max_staleness=2),
                               models, wl, hw, cluster, given) for given in (zero, None))
    gen, train = sync.costs["actor_gen"].seconds, sync.costs["actor_train"].seconds
    assert sync.seconds == pytest.approx(gen + train)
    span = {name: ev.timeline.end["actor_gen"] - ev.timeline.start["actor_gen"]
            for name, ev in (("partial", partial), ("alone", alone))}
    assert span["partial"] == pytest.approx(span["alone"]) and span["partial"] < 0.75 * gen
    assert partial.seconds == pytest.approx(max(span["partial"], train))


def test_asynchronous_plans_need_generation_apart():
    with pytest.raises(PlannerError, match=r"asynchronous generation needs ranks of its own, but ref_inf"):
        Plan("flat", _flat_plan(8, ParallelStrategy(dp=8), ParallelStrategy(dp=8)).meshes, asynchronous=True)


TINY_MODELS = {"actor": MODEL_PRESETS["tiny"], "reference": MODEL_PRESETS["tiny"],
               "critic": MODEL_PRESETS["tiny-critic"], "reward": MODEL_PRESETS["tiny-critic"]}
"""The job's built-in tiny default."""


def test_weights_return_after_each_call_as_reals_runtime_moves_them():
    """With weights_return the actor's weights come back into training right after generation (before the
    inference calls), the critic's move into inference after that and back before advantage; nothing moves
    after training."""
    s = ParallelStrategy(dp=4)
    meshes = {"actor_gen": _mesh("actor_gen", ParallelStrategy(dp=4, tp=2)), "actor_train": _mesh("actor_train", s),
              "ref_inf": _mesh("ref_inf", s, 4), "reward_inf": _mesh("reward_inf", s),
              "critic_inf": _mesh("critic_inf", ParallelStrategy(dp=4, tp=2)), "critic_train": _mesh("critic_train", s, 4)}
    times = {"actor_gen": 10.0, "ref_inf": 2.0, "reward_inf": 1.0, "critic_inf": 3.0, "actor_train": 5.0,
             "critic_train": 4.0}
    ev = evaluate(Plan("real", meshes, weights_return=True), MODELS_7B, WL, HW["h100"], Cluster(1, 8), times)
    t, moved = ev.timeline, ev.reshard_bytes
    assert set(moved) == {"reshard actor", "return actor", "reshard critic", "return critic"} and all(moved.values())
    span = {n: t.end[n] - t.start[n] for n in moved}
    assert t.start["actor_gen"] == pytest.approx(span["reshard actor"])
    assert t.start["return actor"] == pytest.approx(t.end["actor_gen"])
    assert t.start["reshard critic"] == pytest.approx(t.end["return actor"])  # first in list order, all ranks
    assert t.start["ref_inf"] == t.start["reward_inf"] == pytest.approx(t.end["reshard critic"])
    assert t.start["critic_inf"] == pytest.approx(t.end["ref_inf"])  # its ranks hold ref_inf and reward_inf
    assert t.start["advantage"] == pytest.approx(t.end["return critic"] + 0.25 * WL.samples * WL.seq * 16 / 450e9)
    assert ev.seconds == pytest.approx(t.end["actor_train"])  # no reshard after training
    with pytest.raises(PlannerError, match=r"fused generation keeps the actor's copy"):
        Plan("p", meshes, fuse_generation=True, weights_return=True)


# --- predicted against measured on 4 CPU ranks -----------------------------------------------------------------------

PROFILING = {"ref_inf": {"tp": 2}, "critic_train": {"pp": 2}}
PROFILED = {"actor_gen": 0.042, "actor_train": 0.093, "advantage": 0.001, "critic_inf": 0.011, "critic_train": 0.094,
            "generation": 0.062, "inference": 0.222, "iteration": 0.503, "ref_inf": 0.163, "reshard": 0.01,
            "reward_inf": 0.017, "training": 0.196}
PREDICTED = {
    "built-in default": {"plan": None, "iteration": 0.929},
    "dp4 everywhere": {"plan": {}, "iteration": 0.375},
    "tp2 everywhere": {"plan": {t: {"tp": 2} for t in TASKS}, "iteration": 1.321},
    "actor | critic+ref+reward": {"plan": {t: {"ranks": "0-1" if t.startswith("actor") else "2-3"} for t in TASKS},
                                  "iteration": 0.281},
    "pp2 training, tp2 generation": {"plan": {"actor_train": {"pp": 2}, "critic_train": {"pp": 2},
                                              "actor_gen": {"tp": 2}}, "iteration": 0.595},
}
"""Measured 2026-11-23 05:58 UTC on the 2-core VM by ``python benchmarks/planner.py --cpu-runs --record FILE`` (the
tiny default on 4 gloo ranks; per placement the median of 3 interleaved rounds, each the median of 5 iterations
after 2 warm-up, the slowest rank per stage, a call from its last rank's start to its last rank's end): the
profiling run's stage and call seconds, the other placements' iterations (docs/planner.md's table; None: the
job's built-in plan)."""


def test_four_cpu_ranks_predicted_from_one_profiling_run():
    """Calibrated on the profiling run's times alone, the planner predicts the other placements' iterations
    within 25%, in the measured order."""
    from rlhf.ppo.layout import DEFAULT_PLANS

    models = TINY_MODELS
    wl = Workload(samples=16 * 4, prompt_len=16, response_len=16, minibatches=2, micro_batch_size=4)  # the job's
    cluster = Cluster(1, 4)
    plan = lambda p: Plan("p", dict(Placement.from_plan(DEFAULT_PLANS[4] if p is None else p, 4).meshes))  # noqa: E731
    hw = calibrate(replace(HW["cpu"], shared_cores=2), plan(PROFILING), models, wl, cluster, PROFILED, OVERHEAD_TERMS)
    predicted = {name: evaluate(plan(run["plan"]), models, wl, hw, cluster).seconds for name, run in PREDICTED.items()}
    measured = {name: run["iteration"] for name, run in PREDICTED.items()}
    errors = {name: abs(predicted[name] / measured[name] - 1) for name in PREDICTED}
    assert max(errors.values()) <= 0.25, errors
    assert sorted(PREDICTED, key=predicted.get) == sorted(PREDICTED, key=measured.get)


# --- search --------------------------------------------------------------------------------------------------------

def test_search_space_enumeration_and_pruning():
    assert len(set_partitions(MODELS)) == 15  # Bell number B4
    assert allocations(3, Cluster(1, 8)) == [(2, 2, 4), (4, 2, 2)]  # aligned blocks, none straddles a node
    assert allocations(2, Cluster(2, 8)) == [(8, 8)]
    assert APP_PLACEMENTS["flatten"] in set_partitions(MODELS) and APP_PLACEMENTS["separate"] in set_partitions(MODELS)
    cfg = llama_shape("llama-7b")
    ok, why = strategies("actor_train", cfg, tuple(range(16)), WL, Cluster(2, 8))
    assert ParallelStrategy(dp=2, pp=1, tp=8) in ok
    assert why == ["actor_train dp1xpp1xtp16: tp=16: a TP group leaves its node"]
    _, why = strategies("actor_gen", TINY, tuple(range(8)), WL, Cluster(1, 8))
    assert "actor_gen dp2xpp1xtp4: tp=4 does not divide the heads/KV heads/ffn" in why  # 2 KV heads
    assert "actor_gen dp4xpp2xtp1: generation decodes a whole model (pp=1)" in why
    _, why = strategies("critic_train", cfg, tuple(range(8)), Workload(48, 8, 8, 2, 4), Cluster(1, 8))
    assert "critic_train dp8xpp1xtp1: dp=8 x micro-batch 4 does not divide the mini-batch of 24 samples" in why


def test_asynchronous_search_keeps_both_modes_and_places_generation_apart():
    """With asynchronous on, the search tries each placement with actor_gen on a block of its own both ways;
    the best asynchronous plans are searched even where synchronous ones score better first, and their
    time is the plan's own prediction."""
    from rlhf.ppo.layout import check_generation_apart

    hw, cluster, wl = HW["h100"], Cluster(1, 8), replace(WL, samples=128, minibatches=2)
    res = search_placements(MODELS_7B, wl, hw, cluster, PlacementSearchConfig(options=2, keep=2, asynchronous=True))
    ahead = [ev for ev in res.ranked if ev.plan.asynchronous]
    assert ahead and any(not ev.plan.asynchronous for ev in res.ranked)
    for ev in ahead[:5]:
        gen = set(ev.plan.meshes["actor_gen"].ranks)
        assert ev.plan.name.startswith("gen | ") and gen == set(range(len(gen)))  # the first block
        assert all(not gen & set(m.ranks) for t, m in ev.plan.meshes.items() if t != "actor_gen")
        assert ev.seconds == pytest.approx(evaluate(ev.plan, MODELS_7B, wl, hw, cluster).seconds)
        _job_accepts(ev.plan.placement(), MODELS_7B, 8, wl)
        check_generation_apart(Placement.from_plan(ev.plan.placement(), 8), 1)  # the job's --max-staleness check
    default = search_placements(MODELS_7B, wl, hw, cluster, PlacementSearchConfig(options=2, keep=2))
    assert not any(ev.plan.asynchronous or ev.plan.name.startswith("gen | ") for ev in default.ranked)


def test_inference_tasks_may_take_half_a_set_and_then_run_side_by_side():
    hw, cluster, wl = HW["h100"], Cluster(2, 8), replace(WL, samples=512)
    res = search_placements(MODELS_7B, wl, hw, cluster, PlacementSearchConfig(options=2, keep=2))
    halves = [ev for ev in res.ranked if ev.plan.name.startswith("flatten")
              and {ev.plan.meshes["ref_inf"].ranks, ev.plan.meshes["reward_inf"].ranks} == {tuple(range(8)),
                                                                                           tuple(range(8, 16))}]
    assert halves, "no flatten plan with ref_inf and reward_inf on the two halves"
    t = halves[0].timeline
    assert t.start["ref_inf"] == pytest.approx(t.start["reward_inf"])  # disjoint ranks: side by side
    # each on its half costs what the cost model says of that half alone
    for task in ("ref_inf", "reward_inf"):
        mesh = halves[0].plan.meshes[task]
        alone = task_cost(task, MODELS_7B["actor"], task_kind(task), mesh, wl, hw, cluster)
        assert t.end[task] - t.start[task] == pytest.approx(alone.seconds)
    for ev in halves[:3]:
        _job_accepts(ev.plan.placement(), MODELS_7B, 16, wl)


def test_generation_mesh_takes_hybridflow_order_when_it_moves_fewer_bytes():
    train = _mesh("actor_train", ParallelStrategy(dp=2, tp=4))
    meshes = {"actor_train": train, "actor_gen": _mesh("actor_gen", ParallelStrategy(dp=4, tp=2))}
    assert generation_order(meshes, MODELS_7B)["actor_gen"].ranks == (0, 2, 1, 3, 4, 6, 5, 7)
    same = {**meshes, "actor_gen": _mesh("actor_gen", ParallelStrategy(dp=2, tp=4))}
    assert generation_order(same, MODELS_7B)["actor_gen"].ranks == tuple(range(8))  # nothing moves either way


def _job_accepts(placement: dict, models: dict, world: int, wl: Workload) -> None:
    """The checks pretrain_rlhf.py makes: Placement validation, model shapes, whole micro-batches."""
    p = Placement.from_plan(placement, world)
    p.validate_models(models)
    for task in ("actor_train", "critic_train"):
        assert (wl.samples // wl.minibatches) % (p[task].strategy.dp * wl.micro_batch_size) == 0


@pytest.mark.parametrize("actor, critic, nodes", [("llama-7b", "llama-7b", 2), ("llama-70b", "llama-7b", 16)])
def test_search_plans_pass_placement_validation(actor, critic, nodes):
    a, c = llama_shape(actor), llama_shape(critic)
    models = {"actor": a, "reference": a, "critic": c, "reward": c}
    hw, cluster = HW["h100"], Cluster(nodes, 8)
    res = search_placements(models, WL, hw, cluster, PlacementSearchConfig(fuse_training=True))
    assert [e.seconds for e in res.ranked] == sorted(e.seconds for e in res.ranked)
    assert res.pruned and all(e.peak_memory <= hw.gpu_memory * hw.memory_headroom for e in res.ranked)
    for ev in res.ranked[:3]:
        _job_accepts(ev.plan.placement(), models, cluster.gpus, WL)
    assert res.best.seconds == min(e.seconds for e in res.ranked)


# --- ReaL's appendix tables (the shared seed facts) ------------------------------------------------------------------

REAL_TABLES = Path(__file__).parent / "data" / "real_appendix_tables.json"
"""A copy of ../shared/seed-facts/real_appendix_tables.json (ReaL's appendix, as printed), so the suite runs
where the shared folder is not beside the checkout; the benchmark reads the shared file itself."""


@pytest.fixture(scope="module")
def real():
    return real_appendix.load_appendix(REAL_TABLES)


def test_real_table1_counts_are_exact(real):
    for col, cfg in real.shapes.items():
        total, without_head = real.counts[col]
        assert parameter_count(cfg, "lm") == total
        assert total - cfg.vocab_size * cfg.hidden_size == without_head


def test_real_plans_read_as_reals_runtime_runs_them(real):
    """Meshes from node names; with pp > 1 ReaL pipelines pp (2 pp in training) micro-batches per one it
    names; the 70B plans on 128 GPUs at the weak-scaling batch of 4096."""
    plans = {p.name: p for p in real.plans}
    assert list(plans) == ["7B+7B searched (Table 4)", "7B+7B heuristic (Table 5)", "70B+7B searched (Table 2)",
                           "70B+7B heuristic (Table 3)"]
    searched = plans["7B+7B searched (Table 4)"]
    meshes, plan = searched.plan.meshes, searched.plan
    assert (meshes["reward_inf"].ranks, meshes["ref_inf"].ranks) == (tuple(range(8)), tuple(range(8, 16)))
    assert meshes["actor_gen"].strategy == ParallelStrategy(dp=4, pp=2, tp=2) and plan.weights_return
    assert plan.microbatches == {"actor_gen": 2, "reward_inf": 16, "ref_inf": 32, "critic_inf": 16,
                                 "critic_train": 8, "actor_train": 16}
    assert searched.measured["critic_train"] == 28.1 and searched.end_to_end_s == 64.0
    assert (searched.cluster, searched.workload) == (Cluster(2, 8), Workload(512, 1024, 1024, 8))
    big = plans["70B+7B searched (Table 2)"]
    assert (big.cluster.gpus, big.workload.samples, big.models["actor"].num_layers) == (128, 4096, 80)
    assert big.models["critic"] == real.shapes["7B"]


def test_real_table6_from_the_measured_calls_and_the_modelled_moves(real):
    """Each end-to-end time within 10% of Table 6, nothing fitted: the heuristic plans run every call on one
    layout (no weights move, the calls run one after another); the 7B searched plan's critical path is
    ActorGen, RefInf, CriticInf and CriticTrain plus its four weight moves (ReaL's there and back); the batch's
    transfers take milliseconds."""
    simulated = real_appendix.simulate_table6(real)
    for p in real.plans:
        assert abs(simulated[p.name].seconds / p.end_to_end_s - 1) <= 0.1, p.name
    for name in ("7B+7B heuristic (Table 5)", "70B+7B heuristic (Table 3)"):
        p = next(p for p in real.plans if p.name == name)
        assert not any(simulated[name].reshard_bytes.values())
        assert simulated[name].seconds == pytest.approx(sum(p.measured.values()), abs=0.01)  # and the batch's moves
    ev = simulated["7B+7B searched (Table 4)"]
    moves = sum(ev.timeline.end[n] - ev.timeline.start[n] for n in ev.reshard_bytes)
    assert len(ev.reshard_bytes) == 4 and ev.seconds == pytest.approx(16.3 + 8.0 + 4.7 + 28.1 + moves, abs=0.01)
    assert [round(simulated[p.name].seconds, 2) for p in real.plans] == [57.75, 114.9, 361.37, 529.51]


def test_real_held_out_prediction(real):
    """Calibrated on one plan's calls (and iteration, for host_s), the cost model predicts the other three plans'
    18 calls; the median and largest errors per calibration plan, as docs/planner.md reports them."""
    fits = real_appendix.held_out(real)
    assert [h.calibrated_on for h in fits] == [p.name for p in real.plans]
    for h in fits:
        assert len(h.errors()) == 18 and len(h.calls) == 24
        fit = next(p for p in real.plans if p.name == h.calibrated_on)
        ev = evaluate(fit.plan, fit.models, fit.workload, h.hardware, fit.cluster)
        assert h.iterations[fit.name][0] == pytest.approx(ev.seconds)
        assert ev.seconds == pytest.approx(fit.end_to_end_s) or h.hardware.host_s == 0  # host_s takes the rest
    assert [(round(h.median_error, 3), round(h.largest_error, 3)) for h in fits] == [
        (0.247, 0.464), (0.266, 0.897), (0.189, 0.441), (0.206, 1.001)]
    assert round(statistics.median(abs(e) for h in fits for e in h.errors()), 3) == 0.233


def test_planner_search_no_slower_than_reals_searched_plan_7b(real):
    """7B+7B on 16 GPUs (the 70B+7B search takes minutes: benchmarks/planner.py runs it)."""
    fits = real_appendix.held_out(real)
    (found,) = real_appendix.search_beside_real(real, fits, micro_batch_sizes=(1,), settings=("7B+7B",))
    assert found.calibrated_on == "7B+7B heuristic (Table 5)"
    assert found.best.seconds <= found.real["7B+7B searched (Table 4)"] < found.real["7B+7B heuristic (Table 5)"]
    _job_accepts(found.best.plan.placement(), real.plans[0].models, 16, replace(real.plans[0].workload,
                                                                              micro_batch_size=1))


# --- tools/plan_placement.py ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("actor, critic, nodes, fusion", [
    ("llama-7b", "llama-7b", 2, ["--intra-stage-fusion", "--inter-stage-fusion", "--long-tail-median", "64"]),
    ("llama-70b", "llama-7b", 16, ["--intra-stage-fusion"])])
def test_tool_writes_a_plan_the_job_accepts(tmp_path, capsys, actor, critic, nodes, fusion):
    """The written plan, with the job flags the tool names (fusion included), passes pretrain_rlhf.py's own
    pre-start checks (its --dry-run)."""
    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.dry_run import dry_run

    out = tmp_path / "plan.json"
    batch = ["--rollout-batch-size", "64", "--n-samples-per-prompt", "4", "--ppo-mini-batch-size", "64",
             "--micro-batch-size", "4", "--max-prompt-len", "512", "--max-response-len", "512"]
    assert plan_placement.main(["--actor", actor, "--critic", critic, "--nodes", str(nodes), "--gpus-per-node", "8",
                                *fusion, "--out", str(out), "--top", "3", *batch]) == 0
    text = capsys.readouterr().out
    assert "iter s" in text and "GiB/GPU" in text and "pruned:" in text and f"written to {out}" in text
    shapes = {}
    for model, preset in (("actor", actor), ("critic", critic)):
        shapes[model] = tmp_path / f"{model}.json"
        shapes[model].write_text(json.dumps(LLAMA_SHAPES[preset].to_dict()))
    fused = re.fullmatch(rf"best plan written to {out} \(pretrain_rlhf.py --placement {out}(.*)\)",
                         text.splitlines()[-1]).group(1).split()
    if "--long-tail-median" in fusion:
        assert "--inter-stage-fusion" in fused and "--migration-threshold" in fused  # the long tail pays
    config = parse_args(["--actor-model", str(shapes["actor"]), "--critic-model", str(shapes["critic"]),
                         "--placement", str(out), *batch, *fused])
    assert dry_run(config, nodes * 8).startswith(f"dry run: {nodes * 8} ranks;")
    # the written plan predicted on its own gives the table's first row
    assert plan_placement.main(["--actor", actor, "--critic", critic, "--nodes", str(nodes), "--placement", str(out),
                                *batch, *fused]) == 0
    assert text.splitlines()[2].split()[1] == capsys.readouterr().out.splitlines()[2].split()[1]


def test_tool_predicts_a_placement_synchronous_and_asynchronous(tmp_path, capsys):
    """--max-staleness with a placement whose generation is apart: both iterations, the faster first, the ratio,
    and the job flags of the winner."""
    plan, out = tmp_path / "apart.json", tmp_path / "best.json"
    plan.write_text(json.dumps({"actor_gen": {"ranks": "0-1", "dp": 2}, "actor_train": {"ranks": "2-3", "pp": 2},
                                "critic_train": {"ranks": "2-3", "pp": 2, "reverse_pp": True},
                                **{t: {"ranks": "2-3"} for t in INFERENCE_TASKS}}))
    assert plan_placement.main(["--actor", "tiny", "--critic", "tiny-critic", "--nodes", "1", "--gpus-per-node", "4",
                                "--hardware", "a100", "--placement", str(plan), "--max-staleness", "2",
                                "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    fast, slow = (float(line.split()[1]) for line in lines[2:4])
    assert "apart.json async:" in lines[2] and "+async" in lines[2] and "apart.json:" in lines[3]
    assert lines[4] == f"asynchronous wins: {slow / fast:.2f}x the best synchronous plan's iteration (steady state)"
    assert lines[-1].endswith(f"--placement {out} --max-staleness 2)")
    assert plan_placement.main(["--actor", "tiny", "--critic", "tiny-critic", "--nodes", "1", "--gpus-per-node", "4",
                                "--hardware", "a100", "--placement", str(plan), "--max-staleness", "2",
                                "--partial-rollouts", "--long-tail-median", "64", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "+async +partial" in lines[2] and lines[4].startswith("asynchronous wins")
    assert lines[-1].endswith(f"--placement {out} --max-staleness 2 --partial-rollouts --long-tail-median 64)")


def test_tool_calibrates_from_measured_stages(tmp_path, capsys):
    """Stage times made with known constants (a slow 'GPU' with large overheads) are fitted back."""
    measured, hw_out = tmp_path / "stages.json", tmp_path / "cpu.json"
    placement = ROOT / "examples" / "placement_4ranks.json"
    truth = replace(HW["a100"], mfu=0.001, layer_overhead_s=0.005, collective_latency_s=0.001)
    models = TINY_MODELS
    plan = plan_from_placement_file(placement, Cluster(1, 4))
    measured.write_text(json.dumps(stage_seconds(evaluate(plan, models, Workload(512, 512, 512, 4, 4), truth,
                                                          Cluster(1, 4)))))
    args = ["--actor", "tiny", "--critic", "tiny-critic", "--nodes", "1", "--gpus-per-node", "4", "--hardware", "a100",
            "--placement", str(placement), "--measured", str(measured), "--write-hardware", str(hw_out)]
    assert plan_placement.main(args) == 0
    assert "calibrated: mfu" in capsys.readouterr().out
    fitted = load_hardware(str(hw_out))
    assert (fitted.mfu, fitted.layer_overhead_s, fitted.collective_latency_s) == pytest.approx((0.001, 0.005, 0.001),
                                                                                            rel=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--actor", "llama-8b", "--critic", "llama-7b"], r"^plan_placement.py: --actor llama-8b: unknown model; give a "
                                                      r"preset \(llama-7b"),
    (["--actor", "llama-70b", "--critic", "llama-7b", "--nodes", "1"],
     r"^plan_placement.py: no plan fits in memory on 1 x 8 GPUs \(e.g. .*GiB"),
    (["--actor", "tiny", "--critic", "tiny", "--gpus-per-node", "3", "--ppo-mini-batch-size", "6",
      "--rollout-batch-size", "6", "--n-samples-per-prompt", "1", "--micro-batch-size", "4"],
     r"^plan_placement.py: the 3 GPUs \(1 x 3\) cannot be divided among the tasks"),
    (["--actor", "tiny", "--critic", "tiny", "--gpus-per-node", "4", "--placement", "BAD"],
     r"^plan_placement.py: --placement BAD: actor_gen: pp\*tp = 1\*3 does not divide the mesh size 4"),
    (["--actor", "tiny", "--critic", "tiny", "--hardware", "nope.json"], r"^plan_placement.py: --hardware: hardware "
                                                                        r"file nope.json"),
    (["--actor", "tiny", "--critic", "tiny", "--gpus-per-node", "4", "--placement",
      str(ROOT / "examples" / "placement_4ranks.json"), "--measured", "BAD", "--fit", "mfu,speed"],
     r"^plan_placement.py: --fit: cannot fit speed; give some of mfu, layer_overhead_s"),
    (["--actor", "tiny", "--critic", "tiny", "--long-tail-median", "600"],
     r"^plan_placement.py: --long-tail-median: 600 must be in \[0, --max-response-len 512\]"),
    (["--actor", "tiny", "--critic", "tiny", "--migration-threshold", "0.3"],
     r"^plan_placement.py: --migration-threshold: needs --placement and --inter-stage-fusion"),
    (["--actor", "tiny", "--critic", "tiny", "--ppo-mini-batch-size", "100"],
     r"^plan_placement.py: --ppo-mini-batch-size: 100 does not divide the 512 samples"),
    (["--actor", "tiny", "--critic", "tiny", "--max-staleness", "-1"],
     r"^plan_placement.py: --max-staleness: -1 must be >= 0"),
    (["--actor", "tiny", "--critic", "tiny", "--max-staleness", "1", "--partial-rollouts"],
     r"^plan_placement.py: --partial-rollouts: needs --max-staleness >= 2 \(got 1\)"),
    (["--actor", "tiny", "--critic", "tiny", "--gpus-per-node", "4", "--max-staleness", "1", "--placement",
      str(ROOT / "examples" / "placement_4ranks.json")],
     r"^plan_placement.py: plan 'placement_4ranks.json async': asynchronous generation needs ranks of its own"),
])
def test_tool_bad_input_is_one_line(tmp_path, capsys, args, message):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"actor_gen": {"tp": 3}}))
    assert plan_placement.main([str(bad) if a == "BAD" else a for a in args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.match(message, err.replace(str(bad), "BAD")), err


def test_the_dry_run_prints_the_predicted_memory_per_rank():
    """The tiny default on its built-in 4-rank plan, fp32 (every model today): each rank's static parts
    summed by hand from its tasks (a task's largest stage / tp)."""
    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.dry_run import dry_run, short_bytes
    from rlhf.ppo.layout import build_placement
    from rlhf.ppo.memory_plan import predicted_memory

    config = parse_args([])
    actor, critic = config.models["actor"], config.models["critic"]

    def share(cfg, kind, pp, tp):
        return max(stage_parameters(cfg, kind, pp)) / tp

    trained = share(actor, "lm", 2, 2) + share(critic, "value", 2, 1)  # actor_train TP2xPP2, critic_train PP2xDP2
    frozen = {0: share(critic, "value", 1, 1), 2: share(actor, "lm", 1, 1)}  # reward_inf on 0-1, ref_inf on 2-3
    predicted = predicted_memory(config, build_placement(config, 4))
    out = dry_run(config, 4)
    for rank in range(4):
        weights = trained + share(actor, "lm", 1, 2) + share(critic, "value", 1, 2) + frozen[rank // 2 * 2]
        parts = predicted[rank]
        assert (parts["parameters"], parts["gradients"], parts["optimizer"]) == (4 * weights, 4 * trained,
                                                                                8 * trained)
        assert f"  rank {rank}: parameters {short_bytes(4 * weights)}, gradients {short_bytes(4 * trained)}" in out
        assert f"; total {short_bytes(sum(parts.values()))}" in out
        # the engine's cache, resident: per replica (16 prompts / dp 2 + 1) x 4 samples x (32 // 16 + 2) blocks
        # of 16 tokens, K and V of 2 layers x 2 KV heads x 16 dims, fp32, this TP rank's half of the heads
        assert parts["kv"] == (16 // 2 + 1) * 4 * (32 // 16 + 2) * 16 * 2 * 2 * 2 * 16 * 4 / 2


# --- mixtures of experts -------------------------------------------------------------------------------------------

def test_moe_counts_match_transformers_qwen3_moe():
    """Every expert, the router and QK-norm counted as transformers builds Qwen3-MoE (and dense Qwen3) with a
    head_dim apart from hidden / heads."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cfg = QWEN3_MOE
    common = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_kv_heads,
                  head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, tie_word_embeddings=False, attention_bias=False)
    with torch.device("meta"):
        moe = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, num_experts=cfg.num_experts, num_experts_per_tok=cfg.moe_router_topk,
            moe_intermediate_size=cfg.expert_ffn_hidden_size, decoder_sparse_step=1, mlp_only_layers=[]))
        dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    assert sum(p.numel() for p in moe.parameters()) == parameter_count(cfg, "lm")
    assert sum(p.numel() for p in dense.parameters()) == parameter_count(replace(cfg, num_experts=0), "lm")


def test_moe_active_parameters_and_flops():
    cfg, h, q = QWEN3_MOE, QWEN3_MOE.hidden_size, 4 * 16
    total, active = parameter_count(cfg, "lm"), active_parameter_count(cfg, "lm")
    assert active == total - 3 * (6 - 2) * 3 * h * 40 and active < total  # 3 layers, 4 idle experts of 3 h f_e
    dense = replace(cfg, num_experts=0)
    assert active_parameter_count(dense, "lm") == parameter_count(dense, "lm")
    # FLOPs: 2 x every active matmul weight (all but the embedding and the norms), attention at q = heads x head_dim
    norms = 3 * (2 * h + 2 * 16) + h
    assert forward_flops_per_token(cfg, "lm", 0) == 2 * (active - cfg.vocab_size * h - norms)
    assert forward_flops_per_token(cfg, "lm", 10) - forward_flops_per_token(cfg, "lm", 0) == 3 * 4 * 10 * q
    # Qwen3-30B-A3B's shape: the model card's "30.5B in total and 3.3B activated" (3.35B, cut to one decimal)
    a3b = ModelConfig(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32, num_kv_heads=4,
                      kv_channels=128, vocab_size=151936, qk_norm=True, num_experts=128, moe_router_topk=8,
                      moe_ffn_hidden_size=768)
    total, active = parameter_count(a3b, "lm"), active_parameter_count(a3b, "lm")
    assert (round(total / 1e9, 1), math.floor(active / 1e8) / 10) == (30.5, 3.3)
    assert (total, active) == (30_532_122_624, 3_353_032_704)


def test_moe_memory_per_rank_falls_with_ep():
    """A rank holds its stage's dense parameters / tp and its experts / ep; gradients and Adam state alike."""
    cfg = QWEN3_MOE
    experts = 3 * 6 * 3 * cfg.hidden_size * 40
    dense = parameter_count(cfg, "lm") - experts
    previous = math.inf
    for ep in (1, 2, 3, 6):
        mesh = _mesh("actor_train", ParallelStrategy(dp=6, ep=ep))
        mem = task_memory("actor_train", cfg, "lm", mesh, WL)
        held = dense + experts / ep
        assert rank_parameters(cfg, "lm", mesh.strategy) == held
        assert (mem["parameters"], mem["gradients"], mem["optimizer"]) == (2 * held, 4 * held, 12 * held)
        assert mem["parameters"] < previous
        previous = mem["parameters"]
    # tp splits the dense parameters only: experts are whole on every TP rank
    assert rank_parameters(cfg, "lm", ParallelStrategy(dp=2, tp=2, ep=2)) == dense / 2 + experts / 2
    dense_cfg = replace(cfg, num_experts=0)
    assert rank_parameters(dense_cfg, "lm", ParallelStrategy(tp=2, pp=3)) == max(stage_parameters(dense_cfg, "lm", 3)) / 2


def test_expert_alltoall_is_zero_at_ep1_and_grows_with_ep():
    """tokens x h x 2 bytes x k x (ep-1)/ep per all-to-all, a dispatch and a combine per layer each way, on the
    1F1B critical path of every update; none for ep = 1 or a dense model."""
    cfg, hw, cluster = replace(QWEN3_MOE, num_experts=8), HW["h100"], Cluster(1, 8)
    tokens, m = WL.micro_batch_size * WL.seq, WL.samples // WL.minibatches // (8 * WL.micro_batch_size)
    seconds = []
    for ep in (1, 2, 4, 8):
        mesh = _mesh("actor_train", ParallelStrategy(dp=8, ep=ep))
        nbytes = tokens * cfg.hidden_size * 2 * 2 * (ep - 1) / ep
        assert expert_alltoall_bytes(cfg, tokens, ep) == nbytes
        per_iteration = WL.minibatches * m * 2 * 2 * 3 * nbytes  # updates x passes x (fwd, bwd) x 2 x layers
        assert expert_alltoall_bytes_per_iteration("actor_train", cfg, mesh, WL) == per_iteration
        c = task_cost("actor_train", cfg, "lm", mesh, WL, hw, cluster)
        assert c.parts["ep_comm"] == pytest.approx(per_iteration / hw.intra_node_bandwidth)
        assert pass_collectives(cfg, "lm", mesh, "training", backward=True) == (2 * 3 if ep > 1 else 0)
        seconds.append(c.parts["ep_comm"])
    assert seconds[0] == 0 and seconds == sorted(seconds) and len(set(seconds)) == 4
    dense = task_cost("actor_train", replace(cfg, num_experts=0), "lm", _mesh("t", ParallelStrategy(dp=8)), WL, hw,
                      cluster)
    assert dense.parts["ep_comm"] == 0
    # an EP group across nodes takes the network; inference pays the forward's all-to-alls only
    wide = _mesh("ref_inf", ParallelStrategy(dp=16, ep=8), 4)  # EP group ranks 4-11 straddles nodes 0 and 1
    inf = task_cost("ref_inf", cfg, "lm", wide, WL, hw, Cluster(2, 8))
    m_inf = WL.samples // (16 * WL.micro_batch_size)
    assert inf.parts["ep_comm"] == pytest.approx(m_inf * 2 * 3 * expert_alltoall_bytes(cfg, tokens, 8)
                                                 / hw.inter_node_bandwidth)


def test_moe_decode_reads_the_experts_its_batch_reaches():
    cfg, s = QWEN3_MOE, ParallelStrategy()
    assert decode_read_parameters(cfg, s, 1) == pytest.approx(active_parameter_count(cfg, "lm"))  # k of E
    assert decode_read_parameters(cfg, s, 1000) == pytest.approx(parameter_count(cfg, "lm"))  # every expert
    dense = replace(cfg, num_experts=0)
    assert decode_read_parameters(dense, s, 1) == parameter_count(dense, "lm")
    hw, mesh = HW["h100"], _mesh("actor_gen", s)
    b = saturating_batch(cfg, mesh, 64, hw)  # the smallest batch whose FLOPs take as long as its reads
    weights = lambda batch: decode_read_parameters(cfg, s, batch) * 2 / (hw.hbm_bandwidth * hw.hbm_efficiency)  # noqa: E731
    flops = forward_flops_per_token(cfg, "lm", 64) / (hw.gpu_flops * hw.mfu)
    assert b > 1 and b * flops >= weights(b) and (b - 1) * flops < weights(b - 1)
    read, compute, _ = decode_terms(cfg, mesh, b, 0, hw, Cluster(1, 1))
    assert read == pytest.approx(weights(b)) and compute == pytest.approx(b * forward_flops_per_token(cfg, "lm", 0)
                                                                          / (hw.gpu_flops * hw.mfu))


def test_reshard_bytes_send_each_expert_to_its_holders():
    """ep 1 -> ep 2 on the same ranks: each rank already holds its experts, nothing moves; back, each rank
    receives the half of every layer's experts it lacks (whole tensors, bf16)."""
    cfg = QWEN3_MOE
    one, two = _mesh("actor_train", ParallelStrategy(dp=2)), _mesh("ref_inf", ParallelStrategy(dp=2, ep=2))
    assert received_bytes(cfg, "lm", one, two) == {0: 0, 1: 0}
    missing = 3 * 3 * 3 * cfg.hidden_size * 40 * 2  # layers x experts of the other rank x 3 h f_e x 2 bytes
    assert received_bytes(cfg, "lm", two, one) == {0: missing, 1: missing}
    wide = _mesh("ref_inf", ParallelStrategy(dp=2, tp=2, ep=2))  # every TP rank of a replica holds its experts
    assert set(received_bytes(cfg, "lm", wide, _mesh("actor_train", ParallelStrategy(dp=2, tp=2))).values()) == {
        missing}


def test_search_gives_moe_tasks_ep_and_the_job_accepts_its_plans(tmp_path):
    """Strategies: ep dividing dp and the experts for every task but generation, no MoE training at tp > 1;
    the placement file carries ep and reads back; the search's best plans pass the job's checks."""
    cfg = replace(QWEN3_MOE, vocab_size=32000, num_layers=4)
    ok, why = strategies("actor_train", cfg, tuple(range(8)), WL, Cluster(1, 8))
    assert {s.ep for s in ok if s.dp == 8} == {1, 2}  # the divisors of 8 that divide 6 experts
    assert all(s.tp == 1 for s in ok)
    assert ("actor_train dp4xpp1xtp2: tp=2: megatron trains MoE layers at tp > 1 only with sequence parallelism "
            "(split the experts with ep)") in why
    assert all(s.ep == 1 for s in strategies("actor_gen", cfg, tuple(range(8)), WL, Cluster(1, 8))[0])
    assert ParallelStrategy(dp=4, tp=2, ep=2) in strategies("ref_inf", cfg, tuple(range(8)), WL, Cluster(1, 8))[0]
    models = {m: cfg for m in MODELS}
    plan = _flat_plan(8, train=ParallelStrategy(dp=8, ep=2), gen=ParallelStrategy(dp=4, tp=2))
    assert plan.placement()["actor_train"]["ep"] == 2 and "ep" not in plan.placement()["actor_gen"]
    path = tmp_path / "moe.json"
    path.write_text(json.dumps(plan.placement()))
    assert plan_from_placement_file(path, Cluster(1, 8)).meshes["critic_train"].strategy.ep == 2
    _job_accepts(plan.placement(), models, 8, WL)
    res = search_placements(models, WL, HW["h100"], Cluster(1, 8), PlacementSearchConfig(options=2, keep=2))
    assert any(ev.plan.meshes[t].strategy.ep > 1 for ev in res.ranked for t in TASKS)
    for ev in res.ranked[:3]:
        _job_accepts(ev.plan.placement(), models, 8, WL)


def test_the_dry_run_prints_moe_parameters_and_the_expert_alltoall():
    """The tiny MoE presets on the built-in 4-rank plan (fp32): each model's total and active parameters, each
    task with ep its experts per rank and all-to-all bytes, worked by hand for ref_inf and actor_train."""
    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.dry_run import dry_run, short_count

    config = parse_args(["--actor-model", "tiny-moe", "--critic-model", "tiny-moe-critic"])
    out = dry_run(config, 4)
    for model, kind in (("actor", "lm"), ("critic", "value")):
        cfg = config.models[model]
        assert (f"mixture of experts: 4 experts (ffn {cfg.expert_ffn_hidden_size}), each token to 2: "
                f"{short_count(parameter_count(cfg, kind))} parameters in all, "
                f"{short_count(active_parameter_count(cfg, kind))} active per token") in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "ranks [" in line}
    assert "ep " not in lines["actor_gen"].split(";", 1)[1]  # the engine holds every expert
    # ref_inf: 64 samples over 2 replicas in 8 micro-batches of 4 x 32 tokens; per layer (2) a dispatch and a
    # combine of tokens x h 64 x 4 bytes x k 2 x 1/2: 8 x 2 x 2 x 128 x 64 x 4 = 1 MiB. actor_train: 2
    # mini-batches of 4 micro-batches, forward and backward, through the 1 layer of its stage: the same
    assert "ep 2: 2 experts per rank, expert all-to-all 1.00 MiB sent per rank per iteration (predicted)" in lines[
        "ref_inf"]
    assert "ep 2: 2 experts per rank, expert all-to-all 1.00 MiB sent per rank" in lines["actor_train"]
    actor = config.models["actor"]
    assert f"; {short_count(rank_parameters(actor, 'lm', ParallelStrategy(dp=2, pp=2, ep=2)))}/rank" in lines[
        "actor_train"]
