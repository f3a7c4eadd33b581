"""All command-line flags of pretrain_rlhf.py, grouped, parsed into a frozen JobConfig."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlhf.config import ConfigError, JobConfig, ModelsConfig, PlacementConfig, RunConfig
from rlhf.models.config import PRESETS, ModelConfig, ModelConfigError, preset
from rlhf.tasks import TASKS

RUN_FLAGS = {"seq_length": "--seq-length", "micro_batch_size": "--micro-batch-size",
             "iterations": "--iterations", "seed": "--seed"}
"""RunConfig field -> the flag that sets it."""


def _task_flag(task: str) -> str:
    return "--" + task.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_rlhf.py",
        description="PPO-based RLHF on Megatron-Core. Launch with torchrun; every task (actor "
        "generation, reference/reward/critic inference, actor/critic training) runs on its own "
        "device mesh with its own (dp, pp, tp).",
    )
    place = parser.add_argument_group("placement (device mesh and parallel strategy per task)")
    place.add_argument("--placement", metavar="FILE",
                       help="JSON/YAML plan mapping each task to {ranks, dp, pp, tp, reverse_pp}; "
                            "see examples/placement_4ranks.json. Per-task flags below override it.")
    for task in TASKS:
        place.add_argument(_task_flag(task), metavar="SPEC", default=None,
                           help=f"mesh of {task}, e.g. 'tp=2,pp=2,ranks=0-3[,reverse_pp]' "
                                "(default: all ranks, data parallel only)")

    model = parser.add_argument_group("models")
    model.add_argument("--actor-model", default="tiny", metavar="PRESET_OR_JSON",
                       help=f"actor/reference shape: a preset ({', '.join(sorted(PRESETS))}) or a JSON "
                            "file of ModelConfig fields (default: tiny)")
    model.add_argument("--critic-model", default="tiny-critic", metavar="PRESET_OR_JSON",
                       help="critic/reward shape, same forms (default: tiny-critic)")

    run = parser.add_argument_group("run")
    defaults = RunConfig()
    run.add_argument("--seq-length", type=int, default=defaults.seq_length,
                     help=f"tokens per sample (default: {defaults.seq_length})")
    run.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size,
                     help=f"samples per micro-batch (default: {defaults.micro_batch_size})")
    run.add_argument("--iterations", type=int, default=defaults.iterations,
                     help=f"iterations to run (default: {defaults.iterations})")
    run.add_argument("--seed", type=int, default=defaults.seed, help=f"random seed (default: {defaults.seed})")
    return parser


def parse_task_spec(task: str, spec: str) -> dict:
    """'tp=2,pp=2,ranks=0-3,reverse_pp' -> plan entry; errors name the flag."""
    entry: dict = {}
    ranks: list[str] = []
    for item in spec.split(","):
        key, eq, value = item.strip().partition("=")
        if key == "reverse_pp" and not eq:
            entry["reverse_pp"] = True
        elif key in ("dp", "pp", "tp") and value.isdigit():
            entry[key] = int(value)
        elif key == "ranks" and value:
            ranks.append(value)
        elif not eq and key and ranks:  # continuation of a rank list: ranks=0,2,4-5
            ranks.append(key)
        else:
            raise SystemExit(f"{_task_flag(task)}: cannot parse {item!r} in {spec!r}; "
                             "expected e.g. 'tp=2,pp=2,ranks=0-3,reverse_pp'")
    if ranks:
        entry["ranks"] = ",".join(ranks)
    return entry


def load_model_config(value: str, flag: str) -> ModelConfig:
    """A preset name or a JSON file of ModelConfig fields."""
    try:
        if value in PRESETS:
            return preset(value)
        return ModelConfig.from_dict(json.loads(Path(value).read_text()))
    except (OSError, ValueError, ModelConfigError) as exc:
        raise SystemExit(f"{flag} {value}: {exc} (give a preset: {', '.join(sorted(PRESETS))}, "
                         "or a JSON file of model fields)") from None


def config_from_args(args: argparse.Namespace) -> JobConfig:
    """The JobConfig of parsed flags; a bad value exits naming its flag."""
    overrides = {t: parse_task_spec(t, getattr(args, t)) for t in TASKS if getattr(args, t)}
    models = ModelsConfig(actor=load_model_config(args.actor_model, "--actor-model"),
                          critic=load_model_config(args.critic_model, "--critic-model"))
    try:
        run = RunConfig(**{name: getattr(args, name) for name in RUN_FLAGS})
        return JobConfig(placement=PlacementConfig(args.placement, overrides), models=models, run=run)
    except ConfigError as exc:
        flag = RUN_FLAGS.get(exc.field_name.removeprefix("run."), exc.field_name)
        raise SystemExit(f"{flag}: {exc}") from None


def parse_args(argv=None) -> JobConfig:
    return config_from_args(build_parser().parse_args(argv))
