"""tools/search_schedule.py end to end: problem file in, schedule file, table
and Gantt chart out; mpiexec runs one search per rank and keeps the best."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.schedule.io import load_schedule
from rlhf.schedule.lower_bound import serial_peak_memory
from rlhf.schedule.problem import ModelSpec, Problem
from rlhf.schedule.search import SearchConfig, search
from rlhf.schedule.validate import validate

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "search_schedule.py"


def problem_file(tmp_path):
    pb = Problem(stages=4, models=(
        ModelSpec("actor", 4, 1, 4, "down", [2.0] * 4, [4.0] * 4, [1.0] * 4),
        ModelSpec("critic", 2, 2, 2, "up", [1.0] * 2, [2.0] * 2, [1.5] * 2)))
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(pb.to_dict()))
    return pb, path


def run(args, mpi=0):
    cmd = [sys.executable, str(TOOL), *args]
    if mpi:
        cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(mpi), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_cli_problem_file_out_and_plot(tmp_path):
    pb, path = problem_file(tmp_path)
    out, png = tmp_path / "s.json", tmp_path / "g.png"
    r = run(["--problem", str(path), "--budget", "0.2", "--memory-budget", "0.1",
             "--mem-cap", "1.25x", "--out", str(out), "--plot", str(png)])
    assert r.returncode == 0, r.stderr
    for row in ("serial 1F1B", "greedy fused", "annealed", "lower bound", "evaluations"):
        assert row in r.stdout
    sched = load_schedule(out)
    pb2, metrics = sched.problem, sched.metrics
    assert validate(pb2, sched.stages) == []
    assert pb2.mem_cap == pytest.approx(1.25 * max(serial_peak_memory(pb)))  # "1.25x" resolved
    assert metrics["lower_bound"] <= metrics["makespan"] <= metrics["greedy"] * 1.25 + 1e-9
    assert png.stat().st_size > 1000


def test_cli_reports_bad_problem(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"stages": 3, "models": [
        {"name": "a", "pp": 2, "pipelines": 1, "microbatches": 2, "direction": "down",
         "fwd": [1, 1], "bwd": [1, 1]}]}))
    r = run(["--problem", str(path)])
    assert r.returncode == 2 and "pp*pipelines" in r.stderr


@pytest.mark.skipif(not (Path(sys.executable).parent / "mpiexec").exists(),
                    reason="mpiexec not installed next to this python")
def test_mpi_two_ranks_keep_the_best_seed(tmp_path):
    pb, path = problem_file(tmp_path)
    out = tmp_path / "s.json"
    r = run(["--problem", str(path), "--budget", "0.2", "--memory-budget", "0.1", "--seed", "3",
             "--out", str(out)], mpi=2)
    assert r.returncode == 0, r.stderr
    metrics = load_schedule(out).metrics
    singles = [search(pb, SearchConfig(budget_s=0.2, memory_budget_s=0.1, seed=s)) for s in (3, 4)]
    best = min(singles, key=lambda x: (x.makespan, max(x.peak_mem)))
    assert metrics["makespan"] == pytest.approx(best.makespan)
    assert metrics["seed"] == best.seed


def test_cli_cap_below_any_schedule(tmp_path):
    _, path = problem_file(tmp_path)
    r = run(["--problem", str(path), "--mem-cap", "0.5", "--budget", "0.1"])
    assert r.returncode == 2 and "memory cap" in r.stderr


def test_cli_bad_flag_values_name_the_flag(tmp_path):
    _, path = problem_file(tmp_path)
    r = run(["--problem", str(path), "--mem-cap", "lots"])
    assert r.returncode == 2 and "--mem-cap 'lots'" in r.stderr and "1.25x" in r.stderr
    r = run(["--problem", str(path), "--t0-scale", "0"])
    assert r.returncode == 2 and "--t0-scale" in r.stderr
    r = run(["--problem", str(tmp_path / "missing.json")])
    assert r.returncode == 2 and "--problem" in r.stderr and "missing.json" in r.stderr
    r = run(["--model", "name=a,size=7B,tp=x,pp=2,mb=2,direction=down"])
    assert r.returncode == 2 and "tp='x' must be an integer" in r.stderr
    r = run(["--model", "name=a,size=7B,tp=1,pp=2,mb=2,direction=down", "--mfu", "0"])
    assert r.returncode == 2 and "--mfu: CostConfig.mfu=0.0 must lie in (0, 1]" in r.stderr
