"""bf16 and fp16 mixed precision (--bf16, --fp16) against fp32 on 4 gloo ranks, and the tiny default in bf16.

One iteration on fixed samples from the same weights: every batch field and loss within the tolerances
docs/precision.md states (bf16 keeps 8 bits of mantissa: about 3 significant digits); fp16 at Megatron-LM's
initial loss scale skips the overflowing steps; resume is exact in bf16 (metrics, and the saved fp32 main
weights bitwise); the weights and KV cache held in training are half fp32's. See tests/scenario_precision.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf import platform
from rlhf.cli import UsageError
from rlhf.ppo.arguments import parse_args
from rlhf.testing.distributed import launch
from rlhf.testing.learning import rise_in_standard_errors

ROOT = Path(__file__).resolve().parents[1]
# largest |low precision - fp32| allowed, per batch field and metric (docs/precision.md, "Tolerances")
FIELD_TOL = {"bf16": {"ref_logprobs": 0.02, "scores": 0.005, "values": 0.005, "advantages": 0.05, "returns": 0.005},
             "fp16": {"ref_logprobs": 0.002, "scores": 5e-4, "values": 5e-4, "advantages": 0.01, "returns": 5e-4}}
METRIC_TOL = {"bf16": {"policy_loss": 0.005, "value_loss": 5e-4, "kl_mean": 0.005, "approx_kl": 5e-4,
                       "entropy_mean": 0.01, "advantage_mean": 1e-6, "return_mean": 0.002},
              "fp16": {"policy_loss": 5e-4, "value_loss": 5e-5, "kl_mean": 5e-4, "approx_kl": 5e-5,
                       "entropy_mean": 0.001, "advantage_mean": 1e-6, "return_mean": 2e-4}}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(4, "scenario_precision:run", root=str(tmp_path_factory.mktemp("precision")))[0]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_first_iteration_is_within_tolerance_of_fp32(results, precision):
    r = results[precision]
    assert r["field_dtypes"] == ["torch.float32"]  # log-probs, values and advantages stay fp32
    for field, diff in r["fields"].items():
        assert diff <= FIELD_TOL[precision][field], (field, diff)
    for metric, diff in r["metrics"].items():
        assert abs(diff) <= METRIC_TOL[precision][metric], (metric, diff, results["fp32_metrics"][metric])
    assert r["fields"]["ref_logprobs"] > 0  # it did run in low precision


def test_fp16_scales_the_loss_and_skips_overflowing_steps(results):
    assert results["fp16"]["loss_scale"] == 2.0 ** 12 and results["fp16"]["skipped"] == 0
    overflow = results["overflow"]  # Megatron-LM's initial scale 2**32: the gradients overflow fp16
    assert overflow["metrics"] == {"actor_loss_scale": 2.0 ** 32, "actor_skipped_steps": 2.0,
                                   "critic_loss_scale": 2.0 ** 32, "critic_skipped_steps": 2.0,
                                   # the loss scale backs off from them: not counted towards --max-skipped-steps
                                   "actor_consecutive_skipped_steps": 0.0, "critic_consecutive_skipped_steps": 0.0}
    assert overflow["moved"] == 0.0  # a skipped step leaves the weights as they were


@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
def test_bf16_resume_is_exact(results, optimizer):
    r = results[f"resume_{optimizer}"]
    for straight, resumed in zip(r["straight"], r["resumed"], strict=True):
        for key, value in straight.items():
            if not key.startswith("time_") and not key.endswith("_per_s") and key != "training_bubble_fraction":
                assert resumed[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert r["saved_dtypes"] == ["torch.float32"]  # a trained bf16 model's checkpoint holds its fp32 main weights
    assert r["main_moved"] > 1e-3 and r["main_weights_equal"]
    assert r["model_is_main_rounded"]  # the bf16 model after loading is the main weights rounded


def test_bf16_halves_the_bytes_held_in_training(results):
    held = results["training_bytes"]
    assert held["bf16"] <= 0.65 * held["fp32"]
    assert held["bf16"] == pytest.approx(held["fp32"] / 2, rel=0.01)  # weights and KV cache: 2 bytes, not 4


@pytest.mark.parametrize("flags, message", [
    (["--bf16", "--fp16"], "--fp16: bf16 and fp16 exclude each other"),
    (["--loss-scale", "128"], "--loss-scale: loss_scale=128.0 scales fp16 losses only"),
    (["--fp16", "--loss-scale-window", "0"], "--loss-scale-window: loss_scale_window=0 must be >= 1"),
])
def test_bad_precision_flags_are_refused_naming_the_flag(flags, message):
    with pytest.raises(UsageError, match=message):
        parse_args(flags)


def test_tiny_default_learns_in_bf16(tmp_path):
    """The main job as a user runs it with --bf16: 14 iterations; the gold reward of the last 7 is above
    the first 7's by more than 3 standard errors of the difference (4.5 measured; 6.9 over 20 iterations)."""
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           str(ROOT / "pretrain_rlhf.py"), "--bf16", "--iterations", "14", "--no-progress",
           "--metrics-file", str(metrics)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    # the start-up warning where bf16 products are slow (this AVX2-only CI host: yes)
    assert ("warning: --bf16 on this CPU" in out.stdout) == platform.slow_half_precision(torch.bfloat16)
    gold = [json.loads(line)["gold_reward_mean"] for line in metrics.read_text().splitlines()]
    assert rise_in_standard_errors(gold, window=7) > 3, gold
