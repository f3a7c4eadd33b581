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
