"""benchmarks/gpu_check.py in its CPU mode (--dry): every part runs on tiny shapes and the summary line says
what it computed (docs/gpu.md); --parts runs only the parts named. The same script, without --dry, is what a
lent GPU runs."""

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_FIELDS = {"engine_sequences", "enginerlhf_prompts", "sync1b_ms", "sync135m_ms",
                 *(f"{workload}_{what}" for workload in ("engine1b", "enginerlhf", "engine135m")
                   for what in ("tokens_per_s", "tokens"))}


def _gpu_check(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *flags],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


def _summary(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("gpu_check: device=cpu ")
    return dict(item.split("=", 1) for item in line.split()[1:])


def _check_engine(fields: dict, sequences: int, prompts: int) -> None:
    """Each engine workload generated exactly the output tokens drawn for it (tiny lengths: nano-vllm's in
    [4, 12] per sequence, the RLHF workload's at most 12 per sample, 2 samples per prompt)."""
    assert (fields["engine_sequences"], fields["enginerlhf_prompts"]) == (str(sequences), str(prompts))
    for workload, most in (("engine1b", 12 * sequences), ("engine135m", 12 * sequences), ("enginerlhf", 24 * prompts)):
        generated, drawn = map(int, fields[f"{workload}_tokens"].split("/"))
        assert generated == drawn <= most and float(fields[f"{workload}_tokens_per_s"]) > 0
    assert int(fields["engine1b_tokens"].split("/")[1]) >= 4 * sequences
    assert float(fields["sync1b_ms"]) > 0 and float(fields["sync135m_ms"]) > 0


def test_dry_mode_runs_every_part_and_prints_the_summary(tmp_path):
    fields = _summary(_gpu_check("--dry", "--out", str(tmp_path)))
    assert list(fields)[:3] == ["device", "gpu_tests", "smollm2_weights"] and list(fields)[-1] == "seconds"
    assert fields["gpu_tests"] == "skipped" and fields["smollm2_weights"] == "random"
    for job in ("smollm2", "llama1b"):  # both bf16 PPO jobs ran their iterations and logged them
        assert float(fields[f"{job}_iter_s"]) > 0 and fields[f"{job}_mfu"] == "n/a"  # no peak FLOPs for a CPU
        assert (tmp_path / f"{job}.jsonl").read_text().count("\n") == 2
    assert fields["peak_gib"] == "n/a" and float(fields["predicted_gib"]) > 0
    assert float(fields["engine_tokens_per_s"]) > 0 and float(fields["hf_tokens_per_s"]) > 0
    equal, prompts = map(int, fields["greedy_equal"].split("/"))
    near, parted = map(int, fields["near_tie_partings"].split("/"))
    assert prompts == 3 and parted == prompts - equal and near == parted  # every parting at a bf16 near-tie
    # part 5 on the CPU: the padded static decode steps (no graphs recorded) give the eager engine's tokens
    assert fields["graphs_greedy_equal"] == "3/3"
    assert float(fields["eager_sampled_tokens_per_s"]) > 0 and float(fields["graphs_sampled_tokens_per_s"]) > 0
    # part 6: a warm-up and a timed GRPO iteration, 4 prompts x 2 samples, the prompt file's 12-token prompts
    records = [json.loads(line) for line in (tmp_path / "grpo1b.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["samples_count"], r["prompt_length_mean"]) for r in records] == [(1, 8, 12), (2, 8, 12)]
    assert all(float(fields[f"grpo1b_{stage}_s"]) > 0 for stage in ("step", "gen", "infer", "train"))
    assert fields["grpo1b_train_mfu"] == fields["grpo1b_infer_mfu"] == fields["grpo1b_peak_gib"] == "n/a"
    mismatch = float(fields["grpo1b_mismatch_kl"])
    assert math.isfinite(mismatch) and mismatch >= 0
    _check_engine(fields, sequences=4, prompts=2)  # part 7


def test_parts_runs_only_the_parts_named(tmp_path):
    fields = _summary(_gpu_check("--dry", "--parts", "engine", "--engine-sequences", "3", "--rlhf-prompts", "1",
                                 "--out", str(tmp_path)))
    assert set(fields) == {"device", "seconds", *ENGINE_FIELDS}
    _check_engine(fields, sequences=3, prompts=1)
    assert not list(tmp_path.iterdir())  # no model directory, no job: the engine's models are built in place


def test_an_unknown_part_is_a_usage_error_naming_the_parts():
    out = _gpu_check("--dry", "--parts", "engine,decoder")
    assert out.returncode == 2 and out.stdout == ""
    assert "--parts: unknown part decoder; the parts are tests, ppo, decode, graphs, grpo1b, engine" in out.stderr
