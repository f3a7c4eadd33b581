"""Every validation layer, fed seeded random malformed values (wrong types, NaN, Infinity, negatives, zero,
empty strings and lists, huge ints), answers with its own error type or accepts the value; it never raises
anything else and never hangs (each test has a timeout). Accepted values are checked to be sane (no NaN,
Infinity or bool where a number belongs). In-process calls; one subprocess per entry point checks the exit
status 2 and that no traceback is printed.
"""

import dataclasses
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf import config as shared_config
from rlhf.cli import UsageError
from rlhf.config import ConfigError, PlacementConfig
from rlhf.models.config import ModelConfig
from rlhf.parallel import Placement, PlacementError
from rlhf.ppo import config as ppo_config
from rlhf.ppo import layout
from rlhf.ppo.arguments import SECTIONS
from rlhf.ppo.arguments import parse_args as parse_pretrain
from rlhf.reward_model import config as reward_config
from rlhf.reward_model.arguments import REWARD_SECTIONS
from rlhf.reward_model.arguments import parse_args as parse_reward
from rlhf.schedule.generators import serial_1f1b
from rlhf.schedule.io import schedule_from_dict, schedule_to_dict
from rlhf.schedule.problem import ModelSpec, Problem, ProblemError
from rlhf.schedule.schedule import Schedule, ScheduleError
from rlhf.schedule.simulate import simulate
from rlhf.tasks import TASKS
from rlhf.testing.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 300
NAN, INF = float("nan"), float("inf")
MALFORMED = [None, True, False, 0, -1, -3, 2**63, 10**400, 0.0, -0.0, -2.5, 2.9, 1e308, NAN, INF, -INF, "", " ",
             "x", "two", "2", "-1", "nan", "0-3", [], [1], [NAN], ["a"], {}, {"a": 1}, (), object()]
"""Values no validator should take silently where they do not belong."""
TEXT_NUMBERS = ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "-1e400", "0", "-0", "-1", "-5", "0.0", "1e-320",
                "2.9", "1e300", "99999999999999999999999", "", "x", "two", "0x10", "1_000", " 3 ", "1,5", "True"]
"""Command-line spellings of numbers, good and bad."""


def malformed(rng: random.Random):
    """One random malformed value: a listed one, a random int or float of any size, or a random string."""
    kind = rng.random()
    if kind < 0.6:
        return rng.choice(MALFORMED)
    if kind < 0.75:
        return rng.choice([-1, 1]) * rng.randrange(10 ** rng.randint(1, 30))
    if kind < 0.9:
        return rng.uniform(-1, 1) * 10 ** rng.randint(-5, 300)
    return "".join(rng.choice("0123456789-,.xe ") for _ in range(rng.randint(0, 8)))


def cli_number(rng: random.Random) -> str:
    """A random command-line number spelling."""
    return rng.choice(TEXT_NUMBERS) if rng.random() < 0.7 else repr(malformed(rng))


def sane_text_number(text: str) -> bool:
    """A command-line number as sane as :func:`sane_number` says: an integer of any size (int flags parse the
    spelling exactly; ``float`` would call 10**400 infinite) or a finite float."""
    try:
        int(text)
    except ValueError:
        return math.isfinite(float(text))
    return True


def sane_number(value) -> bool:
    """A real number that is finite and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (
        isinstance(value, int) or math.isfinite(value))


# --- placement plans ---------------------------------------------------------------------------

def random_ranks(rng: random.Random):
    if rng.random() < 0.5:
        return malformed(rng)
    parts = [f"{rng.randrange(10 ** rng.randint(1, 15))}-{rng.randrange(10 ** rng.randint(1, 15))}"
             if rng.random() < 0.5 else str(rng.randint(-2, 9)) for _ in range(rng.randint(1, 3))]
    return ",".join(parts)


@pytest.mark.timeout(60)
def test_placement_plans_answer_with_placement_errors():
    rng = random.Random(1601)
    good = {"actor_train": {"ranks": "0-3", "tp": 2, "pp": 2}, "critic_train": {"dp": 2, "pp": 2, "reverse_pp": True}}
    model = ModelConfig(num_layers=4, num_attention_heads=4, num_kv_heads=2, hidden_size=64, vocab_size=256)
    refused = 0
    for _ in range(TRIALS):
        plan = json.loads(json.dumps(good))
        task = rng.choice(TASKS + ("no_such_task",))
        entry = plan.setdefault(task, {})
        for _ in range(rng.randint(1, 3)):
            key = rng.choice(["ranks", "dp", "pp", "tp", "reverse_pp", "tpp"])
            entry[key] = random_ranks(rng) if key == "ranks" else malformed(rng)
        if rng.random() < 0.1:
            plan[task] = malformed(rng)
        if rng.random() < 0.05:
            plan = malformed(rng)
        world = rng.choice([1, 2, 4, 4, 4, 8])
        try:
            placement = Placement.from_plan(plan, world)
            placement.validate_models({"actor": model, "critic": model, "reference": model, "reward": model})
        except PlacementError:
            refused += 1
            continue
        for mesh in placement.meshes.values():  # accepted: true integers, every rank in the world
            assert all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < world for r in mesh.ranks)
            assert all(type(d) is int for d in (mesh.strategy.dp, mesh.strategy.pp, mesh.strategy.tp))
            assert type(mesh.reverse_pp) is bool
    assert refused > TRIALS // 2


@pytest.mark.timeout(60)
def test_placement_overrides_answer_with_config_or_placement_errors():
    rng = random.Random(1602)
    for _ in range(TRIALS // 2):
        overrides = {rng.choice(TASKS): {rng.choice(["ranks", "tp", "dp"]): malformed(rng)}}
        if rng.random() < 0.2:
            overrides = malformed(rng)
        try:
            layout.build_placement(ppo_config.JobConfig(placement=PlacementConfig(overrides=overrides)), 4)
        except (ConfigError, PlacementError):
            pass


# --- schedule problems and files ---------------------------------------------------------------

def good_problem() -> Problem:
    return Problem(stages=4, models=(
        ModelSpec("actor", 4, 1, 4, "down", [2.0] * 4, [4.0] * 4, [1.0] * 4),
        ModelSpec("critic", 2, 2, 2, "up", [1.0] * 2, [2.0] * 2, [1.5] * 2)))


def mutate(rng: random.Random, d: dict) -> None:
    """Set one random place of a problem / schedule dict (possibly mutated before) to a malformed value."""
    models = [m for m in d.get("models", ()) if isinstance(m, dict)] if isinstance(d.get("models"), list) else []
    stages = [s for s in d.get("schedule", ()) if isinstance(s, list) and s] if isinstance(d.get("schedule"), list) \
        else []
    where = rng.random()
    if where < 0.5 and models:
        model = rng.choice(models)
        key = rng.choice(["name", "pp", "pipelines", "microbatches", "direction", "fwd", "bwd", "act_mem"])
        values = model.get(key)
        if isinstance(values, list) and values and rng.random() < 0.7:
            values[rng.randrange(len(values))] = malformed(rng)
        else:
            model[key] = malformed(rng)
    elif where < 0.8 and stages:
        action = rng.choice(rng.choice(stages))
        if isinstance(action, dict):
            action[rng.choice(["model", "pipeline", "mb", "op", "model_stage"])] = malformed(rng)
    elif where < 0.9 and models:
        d["models"][rng.randrange(len(d["models"]))] = malformed(rng)
    else:
        d[rng.choice(["stages", "comm", "mem_cap", "time_unit", "models", "version", "metrics", "schedule"])] = \
            malformed(rng)


@pytest.mark.timeout(60)
def test_problems_answer_with_problem_errors():
    rng = random.Random(1603)
    good = good_problem().to_dict()
    refused = 0
    for _ in range(TRIALS):
        d = json.loads(json.dumps(good))
        for _ in range(rng.randint(1, 2)):
            mutate(rng, d)
        try:
            pb = Problem.from_dict(d)
        except ProblemError:
            refused += 1
            continue
        for m in pb.models:
            assert all(sane_number(x) and x > 0 for x in m.fwd + m.bwd), m
            assert all(sane_number(x) and x >= 0 for x in m.act_mem), m
        assert sane_number(pb.comm) and (pb.mem_cap is None or sane_number(pb.mem_cap))
        if pb.num_nodes <= 10_000:  # an accepted problem has a finite serial makespan
            assert math.isfinite(simulate(pb, serial_1f1b(pb)).makespan)
    assert refused > TRIALS // 2


@pytest.mark.timeout(60)
def test_schedule_files_answer_with_schedule_errors():
    rng = random.Random(1604)
    pb = good_problem()
    good = schedule_to_dict(Schedule.from_orders(pb, serial_1f1b(pb)))
    for _ in range(TRIALS):
        d = json.loads(json.dumps(good))
        mutate(rng, d)
        try:
            schedule_from_dict(d)
        except ScheduleError:
            pass


# --- command-line numbers ----------------------------------------------------------------------

def parse_outcome(parse, argv, errors):
    """None if accepted; the error type name if refused cleanly (argparse's exit 2 counts as clean)."""
    try:
        parse(argv)
    except errors as exc:
        return type(exc).__name__
    except SystemExit as exc:
        assert exc.code == 2, argv
        return "SystemExit"
    return None


class Accepted(Exception):
    """Raised by :func:`accept`, the stub of the work a tool starts once its input passed every check."""


def accept(*_):
    raise Accepted


def main_outcome(main, argv):
    """None if the tool's ``main(argv)`` accepted its input (it reached the stubbed work); else how it refused:
    exit status 2, argparse's included."""
    try:
        status = main(argv)
    except Accepted:
        return None
    except SystemExit as exc:
        assert exc.code == 2, argv
        return "SystemExit"
    assert status == 2, argv
    return "exit 2"


@pytest.mark.timeout(120)
def test_search_schedule_numbers(tmp_path, capsys, monkeypatch):
    import rlhf.schedule.search as schedule_search

    tool = load_tool("search_schedule")
    monkeypatch.setattr(schedule_search, "search_mpi", accept)
    path = tmp_path / "problem.json"
    path.write_text(json.dumps(good_problem().to_dict()))
    rng = random.Random(1605)
    flags = ["--budget", "--memory-budget", "--t0-scale", "--mem-cap", "--mem-ceiling", "--seed"]
    for _ in range(TRIALS // 2):
        flag, text = rng.choice(flags), cli_number(rng)
        text = text + "x" if flag in ("--mem-cap", "--mem-ceiling") and rng.random() < 0.3 else text
        outcome = main_outcome(tool.main, ["--problem", str(path), f"{flag}={text}"])
        if outcome is None and flag != "--seed":
            value = float(text.rstrip("x"))
            assert math.isfinite(value) and value >= (1 if flag == "--mem-ceiling" else 0), (flag, text)
    cost_flags = ["--tokens", "--seq-len", "--gpus", "--gpu-tflops", "--mfu", "--comm"]
    for _ in range(TRIALS // 3):
        flag, text = rng.choice(cost_flags), cli_number(rng)
        argv = ["--model", "name=a,size=7B,tp=1,pp=2,mb=2,direction=down", f"{flag}={text}", "--budget=0"]
        outcome = main_outcome(tool.main, argv)
        assert outcome is not None or math.isfinite(float(text)), (flag, text)
    for _ in range(TRIALS // 3):  # --model key=value pairs
        key = rng.choice(["layers", "hidden", "ffn", "heads", "kv_heads", "tp", "pp", "mb", "direction", "name"])
        argv = ["--model", f"name=a,size=7B,tp=1,pp=2,mb=2,direction=down,{key}={cli_number(rng)}", "--budget=0"]
        main_outcome(tool.main, argv)
    capsys.readouterr()


@pytest.mark.timeout(60)
def test_generate_numbers(tmp_path, capsys, monkeypatch):
    from rlhf.engine import completions

    tool = load_tool("generate")
    monkeypatch.setattr(completions, "load_unsharded_lm", accept)
    rng = random.Random(1606)
    flags = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--kv-blocks", "--seed"]
    base = ["--load", "m", "--prompts", "p.jsonl", "--out", str(tmp_path / "o.jsonl")]
    for _ in range(TRIALS):
        flag, text = rng.choice(flags), cli_number(rng)
        outcome = main_outcome(tool.main, base + [f"{flag}={text}"])
        if outcome is None:
            assert math.isfinite(float(text)) and float(text) >= 0, (flag, text)
    capsys.readouterr()


def numeric_flags(sections: dict) -> list:
    return ["--" + name.replace("_", "-") for _, _, fields in sections.values()
            for name, kind, _ in fields if kind is not bool and kind is not str]


@pytest.mark.timeout(120)
def test_pretrain_and_reward_numbers(tmp_path, capsys):
    rng = random.Random(1607)
    for _ in range(TRIALS // 2):
        flag, text = rng.choice(numeric_flags(SECTIONS)), cli_number(rng)
        if parse_outcome(parse_pretrain, [f"{flag}={text}"], UsageError) is None:
            assert sane_text_number(text), (flag, text)
    data = tmp_path / "pairs.jsonl"
    data.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    for _ in range(TRIALS // 2):
        flag, text = rng.choice(numeric_flags(REWARD_SECTIONS)), cli_number(rng)
        if parse_outcome(parse_reward, ["--train-data", str(data), f"{flag}={text}"], UsageError) is None:
            assert sane_text_number(text), (flag, text)
    capsys.readouterr()


# --- config dataclasses ------------------------------------------------------------------------

CONFIGS = [shared_config.RunConfig, ppo_config.GenerationConfig, ppo_config.PPOConfig, ppo_config.ModelsConfig,
           ppo_config.DataConfig, ppo_config.RewardConfig, shared_config.PlacementConfig, shared_config.LoggingConfig,
           ppo_config.FusionConfig, shared_config.CheckpointConfig, ppo_config.JobConfig,
           reward_config.RewardTrainingConfig, reward_config.RewardOptimizerConfig, reward_config.RewardDataConfig]


@pytest.mark.timeout(120)
def test_config_dataclasses_answer_with_config_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # strings that happen to be valid paths name nothing that exists
    rng = random.Random(1608)
    for cls in CONFIGS:
        fields = [f for f in dataclasses.fields(cls) if f.init]
        for _ in range(TRIALS // 4):
            f = rng.choice(fields)
            value = malformed(rng)
            try:
                cls(**{f.name: value})
            except ConfigError as exc:
                assert exc.field_name, (cls.__name__, f.name, value)
                continue
            wanted = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            if value is None and wanted.endswith(" | None"):
                continue
            wanted = wanted.split(" | ")[0]
            assert not (isinstance(value, float) and not math.isfinite(value)), (cls.__name__, f.name, value)
            if wanted in ("int", "float"):
                assert sane_number(value) and (wanted == "float" or isinstance(value, int)), (cls.__name__, f.name)
            if wanted == "bool":
                assert isinstance(value, bool), (cls.__name__, f.name, value)


# --- entry points: exit status 2, one line, no traceback ---------------------------------------

@pytest.mark.timeout(240)
def test_entry_points_exit_2_without_traceback(tmp_path):
    runs = {
        "pretrain_rlhf.py": ([str(ROOT / "pretrain_rlhf.py"), "--kl-coef", "nan"],
                             "pretrain_rlhf.py: --kl-coef: kl_coef must be a finite number, got nan\n"),
        "train_reward.py": ([str(ROOT / "train_reward.py"), "--train-data", str(tmp_path / "none.jsonl")],
                            f"train_reward.py: --train-data: train_data='{tmp_path / 'none.jsonl'}' is not a file"),
        "generate.py": ([str(ROOT / "tools" / "generate.py"), "--load", "m", "--prompts", "p", "--out", "o",
                         "--temperature", "inf"],
                        "generate.py: --temperature: temperature=inf is invalid: must be a finite number >= 0"),
        "search_schedule.py": ([str(ROOT / "tools" / "search_schedule.py"), "--model",
                                "name=a,size=7B,tp=1,pp=2,mb=2,direction=down", "--mem-cap", "nan"],
                               "search_schedule.py: --mem-cap: nan is not a finite number; give a number > 0 GiB\n"),
    }
    procs = {name: subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, cwd=tmp_path) for name, (argv, _) in runs.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=200)
        assert proc.returncode == 2, (name, err)
        assert "Traceback" not in err and err.startswith(runs[name][1]), (name, err)
