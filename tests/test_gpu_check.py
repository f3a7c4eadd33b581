"""benchmarks/gpu_check.py in its CPU mode (--dry): every part runs on tiny shapes and the summary line says
what it computed (docs/gpu.md). The same script, without --dry, is what a lent GPU runs."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dry_mode_runs_every_part_and_prints_the_summary(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("gpu_check: device=cpu gpu_tests=skipped smollm2_weights=random ")
    fields = dict(item.split("=", 1) for item in line.split()[1:])
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
