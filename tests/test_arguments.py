"""pretrain_rlhf.py flags -> the frozen JobConfig, and bad values refused naming their flag."""

import dataclasses
import json

import pytest

from rlhf.arguments import build_parser, parse_args
from rlhf.config import ConfigError, JobConfig, PlacementConfig, RunConfig
from rlhf.models.config import preset
from rlhf.parallel import PlacementError


def test_defaults_are_the_tiny_job():
    cfg = parse_args([])
    assert cfg == JobConfig()
    assert cfg.run == RunConfig(seq_length=32, micro_batch_size=2, iterations=2, seed=1234)
    assert cfg.models["actor"] == cfg.models["reference"] == preset("tiny")
    assert cfg.models["critic"] == cfg.models["reward"] == preset("tiny-critic")
    assert cfg.placement.plan() == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run = RunConfig()


def test_flags_fill_the_configs(tmp_path):
    shape = tmp_path / "actor.json"
    shape.write_text(json.dumps({"num_layers": 4, "vocab_size": 256}))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"actor_train": {"ranks": "0-3", "pp": 2}, "ref_inf": {"ranks": [2, 3]}}))
    cfg = parse_args(["--placement", str(plan), "--actor-train", "tp=2,pp=2,ranks=0-3",
                      "--critic-train", "dp=2,pp=2,ranks=0,1,2-3,reverse_pp", "--actor-model", str(shape),
                      "--seq-length", "16", "--micro-batch-size", "4", "--iterations", "3", "--seed", "7"])
    assert cfg.run == RunConfig(seq_length=16, micro_batch_size=4, iterations=3, seed=7)
    assert cfg.models.actor.num_layers == 4 and cfg.models["reference"].vocab_size == 256
    # a flag replaces the file's whole entry for its task; other file entries stay
    assert cfg.placement.plan() == {
        "actor_train": {"ranks": "0-3", "tp": 2, "pp": 2},
        "critic_train": {"ranks": "0,1,2-3", "dp": 2, "pp": 2, "reverse_pp": True},
        "ref_inf": {"ranks": [2, 3]},
    }


@pytest.mark.parametrize("argv,message", [
    (["--seq-length", "0"], "--seq-length: seq_length must be an integer >= 1, got 0"),
    (["--micro-batch-size", "-1"], "--micro-batch-size: micro_batch_size must be an integer >= 1, got -1"),
    (["--iterations", "0"], "--iterations: iterations must be an integer >= 1, got 0"),
    (["--seq-length", "300"], "--seq-length: seq_length 300 exceeds the actor model's context max_seq_len=256"),
    (["--actor-train", "tp=x"], "--actor-train: cannot parse 'tp=x' in 'tp=x'"),
    (["--critic-model", "nope"], "--critic-model nope: [Errno 2] No such file or directory"),
])
def test_bad_values_name_their_flag(argv, message):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert str(exc.value).startswith(message)


def test_configs_validate_without_the_parser():
    with pytest.raises(ConfigError, match="unknown task") as exc:
        PlacementConfig(overrides={"actor_training": {}})
    assert exc.value.field_name == "placement.overrides"
    with pytest.raises(ConfigError) as exc:
        RunConfig(iterations=0)
    assert exc.value.field_name == "run.iterations"
    with pytest.raises(PlacementError, match="placement file .*missing.json"):
        PlacementConfig(file="missing.json").plan()


def test_help_explains_every_flag():
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings} has no help text"
