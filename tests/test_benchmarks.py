"""The benchmarks the README names, each in a quick mode: it runs and prints its summary line (benchmarks
measure; tests do not time). benchmarks/gpu_check.py --dry is tests/test_gpu_check.py's."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _benchmark(name: str, *flags: str) -> str:
    """The last line ``python benchmarks/<name> <flags>`` prints (it must exit 0)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / name), *flags], capture_output=True, text=True,
                         timeout=600, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_inter_stage_runs_the_simulation_and_the_sleep_calibrated_ranks():
    """One fresh batch per R and one timed round of (b)'s 4 sleep-calibrated ranks, which drive the real fusion
    runtime (InterStageFusion takes the inference tasks by name); (c)'s real models left out."""
    line = _benchmark("inter_stage.py", "--batches", "1", "--repeats", "1", "--skip-real")
    assert line.startswith("inter-stage: R=") and "measured/predicted=" in line


def test_e2e_breaks_down_one_iteration_of_a_small_job():
    """One timed iteration, no warm-up, of a smaller tiny job on the 4 gloo ranks: 8 prompts x 2 samples of at
    most 8 tokens, one mini-batch, the gold rule as the reward (no reward model trained at start-up)."""
    line = _benchmark("e2e.py", "--iterations", "1", "--warmup", "0", "--", "--reward-fn",
                      "rlhf.data.synthetic:gold_reward", "--rollout-batch-size", "8", "--n-samples-per-prompt", "2",
                      "--ppo-mini-batch-size", "16", "--max-response-len", "8")
    assert line.startswith("e2e: iteration ") and "(gen " in line and line.endswith(" tokens/s")


def test_generation_compares_hf_and_the_engine_on_a_small_workload():
    """8 samples (the long tail at 16 new tokens), batches of 4, one run per system; the KV memory part as is."""
    line = _benchmark("generation.py", "--samples", "8", "--batch", "4", "--long", "16", "--repeats", "1")
    assert line.startswith("generation: tokens_per_s=") and "vs_hf=" in line and "kv_sharing=" in line


def test_gae_compares_loop_and_matrix_form_quick():
    """--quick: T in {256, 1024}, 2 timing rounds each; --sweep-blocks with 3 repeats per block size."""
    line = _benchmark("gae.py", "--quick", "--sweep-blocks")
    assert line.startswith("gae: T=256 ratio=") and "T=1024 ratio=" in line and "max_rel_err=" in line


def test_table3_searches_one_setting_on_one_process():
    """One process (no mpiexec): the first setting alone (33B/13B PP 8/4, 8 micro-batches) with 0.2 + 0.1
    nominal s of search; Figure 10 and the --mem-cap curve left out."""
    line = _benchmark("table3.py", "--only", "0", "--budget", "0.2", "--memory-budget", "0.1", "--no-fig10",
                      "--no-caps")
    assert line.startswith("table3: within 1% of bound in ") and "/1, both in " in line


def test_planner_reproduces_the_papers_quick():
    """--quick: (a), (b) with the planner's search for 7B+7B only, (c), and (e) searched with one option per
    task; no CPU runs (d)."""
    line = _benchmark("planner.py", "--quick")
    assert line.startswith("planner: table1=") and "hybridflow=" in line and "cpu_rank_agreement=n/a" in line


def test_async_published_simulates_verls_setting():
    """The default run: a planner simulation only, about a second."""
    line = _benchmark("async_published.py")
    assert line.startswith("async_published: verl_sync_s=") and "published_speedup=" in line


def test_memory_compares_measured_and_predicted_quick():
    """--quick: the three tiny placements (4, 2 and 1 ranks, 1 iteration each) with 4 prompts x 2 samples and
    the gold rule as the reward (no reward model trained at start-up)."""
    line = _benchmark("memory.py", "--quick")
    assert line.startswith("memory: predicted / measured total per rank ") and line.endswith(" over 3 placements")


def test_fused_pipeline_runs_sleep_and_real_modes():
    """Sleep mode at 5 ms per time unit and the real tiny models, one timed run per schedule after the warm-up."""
    line = _benchmark("fused_pipeline.py", "--unit-ms", "5", "--repeats", "1")
    assert line.startswith("fused_pipeline: sleep_speedup=") and "real_bubbles=" in line
