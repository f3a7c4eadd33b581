"""tools/search_schedule.py end to end: problem file in, schedule file, table
and Gantt chart out; mpiexec runs one search per rank and keeps the best."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf.schedule.search as schedule_search
from rlhf.schedule.io import load_schedule
from rlhf.schedule.lower_bound import serial_peak_memory
from rlhf.schedule.problem import ModelSpec, Problem
from rlhf.schedule.search import SearchConfig, search
from rlhf.schedule.validate import validate
from rlhf.testing.tools import load_tool

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


@pytest.mark.skipif(not (Path(sys.executable).parent / "mpiexec").exists(),
                    reason="mpiexec not installed next to this python")
def test_mpi_two_ranks_keep_the_best_seed(tmp_path):
    pb, path = problem_file(tmp_path)
    out = tmp_path / "s.json"
    r = run(["--problem", str(path), "--budget", "0.2", "--memory-budget", "0.1", "--seed", "3",
             "--out", str(out)], mpi=2)
    assert r.returncode == 0, r.stderr
    metrics = load_schedule(out).metrics
    # rank 0 races each rung's starts, rank 1 anneals the fastest alone (search_mpi's portfolio)
    singles = [search(pb, SearchConfig(budget_s=0.2, memory_budget_s=0.1, seed=s, rung_starts=n))
               for s, n in ((3, 8), (4, 1))]
    # the least memory among the ranks' results within the limit of the best makespan any rank found (1%
    # over the bound when that best is within it: a best under the target counts as the target; else 0.9%
    # over it), then the smallest makespan
    fastest, tolerated = min(x.best_makespan for x in singles), singles[0].lower_bound * 1.01
    limit = tolerated if fastest <= tolerated else fastest * 1.009
    within = [x for x in singles if x.makespan <= limit + 1e-9] or singles
    best = min(within, key=lambda x: (max(x.peak_mem), x.makespan, x.seed))
    assert metrics["makespan"] == pytest.approx(best.makespan)
    assert metrics["seed"] == best.seed


# --- bad input: refused before the search starts, one line naming the flag or file, exit status 2 -------------

search_schedule = load_tool("search_schedule")
MPIEXEC = Path(sys.executable).parent / "mpiexec"


@pytest.fixture
def refusal(tmp_path, capsys, monkeypatch):
    """refusal(argv) -> the one stderr line of search_schedule.main(argv), which must exit 2 without searching."""
    def start_search(*_):
        raise AssertionError("the search started")

    monkeypatch.setattr(schedule_search, "search_mpi", start_search)

    def run_main(argv):
        assert search_schedule.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("search_schedule.py: "), err
        return err[len("search_schedule.py: "):-1]
    return run_main


@pytest.mark.parametrize("flags, message", [
    (["--budget", "nan"], "--budget: nan is not a finite number; give a number in [0, 1e+06] nominal seconds"),
    (["--budget", "1e300"], "--budget: 1e+300 is out of range; give a number in [0, 1e+06] nominal seconds"),
    (["--memory-budget", "-1"], "--memory-budget: -1 is out of range; give a number in [0, 1e+06] nominal seconds"),
    (["--t0-scale", "0"], "--t0-scale: 0 is out of range; give a number > 0"),
    (["--t0-scale", "inf"], "--t0-scale: inf is not a finite number; give a number > 0"),
    (["--mem-cap", "nan"], "--mem-cap: nan is not a finite number; give a number > 0 GiB"),
    (["--mem-cap", "-5"], "--mem-cap: -5 is out of range; give a number > 0 GiB"),
    (["--mem-cap=-1.5x"], "--mem-cap: -1.5 is out of range; give a number > 0 (times the serial 1F1B peak, "
                          "e.g. 1.25x)"),
    (["--mem-cap", "lots"], "--mem-cap: 'lots' is not a number; give a number (GiB) or a multiple of the serial "
                            "1F1B peak such as 1.25x"),
    (["--mem-ceiling", "0.5x"], "--mem-ceiling: 0.5 is out of range; give a number >= 1 (times the serial 1F1B "
                                "peak, e.g. 2x)"),
    (["--mem-ceiling", "lots"], "--mem-ceiling: 'lots' is not a number; give a multiple of the serial 1F1B peak "
                                "such as 2x (at least 1x), or none"),
    # the largest activation on a stage is the critic's 1.5 GiB: no schedule fits in less
    (["--mem-cap", "0.5"], "--mem-cap: 0.5 GiB is below the feasible minimum 1.5 GiB (the largest activation of "
                           "one micro-batch on one stage); give at least 1.5 (serial 1F1B needs 4, 1x)"),
    (["--mem-cap", "2"], "--mem-cap: the search finds no start schedule within 2 GiB (the feasible minimum is "
                         "1.5); give a larger cap, at most the serial 1F1B peak 4 (1x), which always works"),
])
def test_bad_numbers_name_the_flag_and_the_valid_range(tmp_path, refusal, flags, message):
    _, path = problem_file(tmp_path)
    assert refusal(["--problem", str(path), *flags]) == message


def test_unwritable_outputs_are_refused_before_the_search(tmp_path, refusal):
    _, path = problem_file(tmp_path)
    missing = tmp_path / "missing" / "s.json"
    assert refusal(["--problem", str(path), "--out", str(missing)]) == (
        f"--out {missing}: cannot write there; the folder {missing.parent} must exist and be writable, and --out "
        "must name a file")
    assert refusal(["--problem", str(path), "--plot", str(tmp_path)]).startswith(f"--plot {tmp_path}: cannot write")
    assert refusal(["--problem", str(path), "--out", "/proc/s.json"]).startswith("--out /proc/s.json: cannot write "
                                                                                "there (No such file or directory)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["problem.json"]  # nothing left behind


def test_bad_problem_files_name_the_file_and_the_field(tmp_path, refusal):
    pb, path = problem_file(tmp_path)
    for change, message in [
            (("fwd", 1, float("nan")), "model 'actor': fwd[1]=nan must be a finite number > 0"),
            (("bwd", 0, float("inf")), "model 'actor': bwd[0]=inf must be a finite number > 0"),
            (("act_mem", 2, -1.0), "model 'actor': act_mem[2]=-1.0 must be a finite number >= 0"),
            (("fwd", 3, "2.0"), "model 'actor': fwd[3]='2.0' must be a finite number > 0"),
            (("pp", None, 4.0), "model 'actor': pp=4.0 must be a positive integer")]:
        d = pb.to_dict()
        field, index, value = change
        if index is None:
            d["models"][0][field] = value
        else:
            d["models"][0][field][index] = value
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(d))  # NaN and Infinity as Python's json writes them
        assert refusal(["--problem", str(bad)]) == f"--problem: problem file {bad}: {message}"
    bad.write_text('{"stages": 4, "models": [')
    assert refusal(["--problem", str(bad)]).startswith(f"--problem: problem file {bad}: Expecting value")
    assert refusal(["--problem", str(tmp_path / "missing.json")]) == (
        f"--problem: problem file {tmp_path / 'missing.json'}: [Errno 2] No such file or directory: "
        f"'{tmp_path / 'missing.json'}'")
    d = pb.to_dict()
    d["mem_cap"] = 1.0
    bad.write_text(json.dumps(d))
    assert refusal(["--problem", str(bad)]).startswith(f"--problem {bad}: mem_cap: 1 GiB is below the feasible "
                                                       "minimum 1.5 GiB")
    d = pb.to_dict()
    d["stages"] = 3
    bad.write_text(json.dumps(d))
    assert "pp*pipelines = 4*1 = 4 must equal stages=3" in refusal(["--problem", str(bad)])


def test_cost_model_flags_name_the_flag(refusal):
    shape = "name=a,size=7B,tp=1,pp=2,mb=2,direction=down"
    assert refusal(["--model", shape, "--mfu", "0"]) == (
        "--mfu: CostConfig.mfu=0.0 must lie in (0, 1] (model FLOPs utilisation)")
    assert refusal(["--model", shape, "--gpu-tflops", "nan"]) == (
        "--gpu-tflops: CostConfig.gpu_flops=nan must be a finite number > 0")
    assert refusal(["--model", shape, "--gpus", "3"]).startswith("--gpus: gpus=3 must be a multiple of fused stages")
    assert refusal(["--model", shape.replace("down", "left")]) == (
        "--model: model 'a': direction='left' must be one of ('down', 'up')")
    assert refusal(["--model", shape.replace("tp=1", "tp=x")]) == "--model: tp='x' must be an integer"
    assert refusal(["--model", shape + ",hidden=99999999999"]) == (
        f"--model: '{shape},hidden=99999999999': model 'a': hidden=99999999999 must be an integer in "
        "[1, 2147483647]; keys: name, size or layers/hidden/ffn/heads[/kv_heads], tp, pp, mb, direction")
    assert refusal(["--model", "name=a,size=7B,tp=1,pp=2,mb=2,direction=down,colour=red"]).startswith(
        "--model: 'name=a,size=7B,tp=1,pp=2,mb=2,direction=down,colour=red': ModelShape.__init__() got an "
        "unexpected keyword argument 'colour'")


def test_nan_latency_exits_2_at_once_without_traceback(tmp_path):
    pb, _ = problem_file(tmp_path)
    d = pb.to_dict()
    d["models"][1]["fwd"][0] = float("nan")  # used to hang list scheduling
    bad = tmp_path / "nan.json"
    bad.write_text(json.dumps(d))
    r = run(["--problem", str(bad)])
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"search_schedule.py: --problem: problem file {bad}: model 'critic': fwd[0]=nan must be a " \
                       "finite number > 0\n"


@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed next to this python")
def test_mpi_bad_input_prints_once_and_every_rank_exits_2(tmp_path):
    _, path = problem_file(tmp_path)
    r = run(["--problem", str(path), "--budget", "nan", "--out", str(tmp_path / "s.json")], mpi=2)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr == ("search_schedule.py: --budget: nan is not a finite number; give a number in [0, 1e+06] "
                        "nominal seconds\n")
    r = run(["--problem", str(path), "--budget", "abc"], mpi=2)  # argparse's own error, also on rank 0 only
    assert r.returncode == 2 and r.stderr.count("invalid float value: 'abc'") == 1


def test_makespan_slack_flag_bounds_the_memory_phase(tmp_path, refusal):
    pb, path = problem_file(tmp_path)
    out = tmp_path / "s.json"
    r = run(["--problem", str(path), "--budget", "0.2", "--memory-budget", "0.2", "--makespan-slack", "0",
             "--out", str(out)])
    assert r.returncode == 0, r.stderr
    metrics = load_schedule(out).metrics
    # no slack: the fastest makespan found is kept, only its memory may fall
    assert metrics["makespan"] == pytest.approx(metrics["best_makespan"])
    assert max(metrics["peak_act_mem"]) <= metrics["best_peak_act_mem"] + 1e-9
    assert refusal(["--problem", str(path), "--makespan-slack", "-0.1"]) == (
        "--makespan-slack: -0.1 is out of range; give a number in [0, 1]")
