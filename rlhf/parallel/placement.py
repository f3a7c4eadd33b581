"""Placement: one TaskMesh per task, parsed from a plan and validated.

A plan (JSON/YAML file or the equivalent flags) maps each task to its ranks
and degrees::

    {"actor_train":  {"ranks": "0-3", "tp": 2, "pp": 2},
     "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": true},
     "actor_gen":    {"tp": 2, "dp": 2},
     "reward_inf":   {"ranks": [0, 1]}}

Omitted ranks mean the whole world; omitted degrees are 1, except that dp
defaults to whatever fills the mesh (``len(ranks) / (pp * tp)``). Tasks left
out of the plan run on the whole world with dp only; a task whose entry is
null (``"critic_inf": null``, or the flag ``--critic-inf none``) is not placed
(e.g. the critic tasks of a run whose estimator needs no critic).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlhf.checks import is_int
from rlhf.parallel.mesh import ParallelStrategy, PlacementError, TaskMesh
from rlhf.tasks import TASK_MODEL, TASKS, TRAIN_TASK


def parse_ranks(spec, task: str, world_size: int) -> tuple[int, ...]:
    """Ranks from a list ``[0, 1]`` or a string ``"0-3"`` / ``"0,2,4-5"`` (ascending ranges only); a range
    reaching past the world is refused before it is expanded."""
    usage = "use e.g. '0-3' or '0,2,4-5' or a list of integers"
    if isinstance(spec, (list, tuple)):
        if not all(is_int(r) for r in spec):
            raise PlacementError(f"{task}: ranks {list(spec)!r} must be integers; {usage}")
        return tuple(spec)
    if not isinstance(spec, str):
        raise PlacementError(f"{task}: ranks {spec!r} is a {type(spec).__name__}; {usage}")
    ranks: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or not (hi or lo).isdigit() or int(hi or lo) < int(lo):
            raise PlacementError(f"{task}: cannot parse ranks {spec!r} ({part.strip()!r}); {usage}")
        if int(hi or lo) >= world_size:
            raise PlacementError(f"{task}: ranks {spec!r} reach rank {int(hi or lo)}, outside the world of "
                                 f"{world_size} ranks (valid: 0..{world_size - 1})")
        ranks.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(ranks)


@dataclass(frozen=True)
class Placement:
    """The mesh of every task, validated against the world size."""

    meshes: dict[str, TaskMesh]
    world_size: int

    def __post_init__(self):
        for task, mesh in self.meshes.items():
            if task not in TASKS:
                raise PlacementError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
            outside = [r for r in mesh.ranks if not 0 <= r < self.world_size]
            if outside:
                raise PlacementError(
                    f"{task}: rank(s) {outside} are outside the world of {self.world_size} ranks "
                    f"(valid: 0..{self.world_size - 1})"
                )

    def __getitem__(self, task: str) -> TaskMesh:
        if task not in self.meshes:
            raise PlacementError(f"{task} is not placed (its plan entry is null); placed: {', '.join(self.meshes)}")
        return self.meshes[task]

    @classmethod
    def from_plan(cls, plan: dict, world_size: int) -> "Placement":
        """Build from a plan dict (see module docstring); a task whose entry is None is not placed."""
        if not (is_int(world_size) and world_size >= 1):
            raise PlacementError(f"world size {world_size!r} must be a positive integer (the number of ranks)")
        if not isinstance(plan, dict):
            raise PlacementError(f"the plan must map tasks to meshes, got a {type(plan).__name__}; valid tasks: "
                                 f"{', '.join(TASKS)}")
        unknown = set(plan) - set(TASKS)
        if unknown:
            raise PlacementError(f"unknown task(s) {sorted(unknown, key=str)} in plan; "
                                 f"valid tasks: {', '.join(TASKS)}")
        meshes = {task: _mesh_from_entry(task, plan.get(task, {}), world_size)
                  for task in TASKS if plan.get(task, {}) is not None}
        return cls(meshes=meshes, world_size=world_size)

    @classmethod
    def from_file(cls, path: str | Path, world_size: int) -> "Placement":
        """Build from a JSON or YAML plan file."""
        return cls.from_plan(load_plan(path), world_size)

    def validate_models(self, model_configs: dict) -> None:
        """Check each task's strategy against the model it runs (heads, ffn, layers; any tp splits the
        vocabulary, padded: rlhf.models.vocab)."""
        for task, mesh in self.meshes.items():
            cfg = model_configs.get(TASK_MODEL[task])
            if cfg is not None:
                check_strategy_fits_model(task, mesh.strategy, cfg)


def load_plan(path: str | Path) -> dict:
    """The plan dict of a JSON or YAML placement file; errors name the file."""
    path = Path(path)
    try:
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            plan = yaml.safe_load(text)
        else:
            plan = json.loads(text)
    except (OSError, ValueError) as exc:
        raise PlacementError(f"placement file {path}: {exc}") from None
    if not isinstance(plan, dict):
        raise PlacementError(f"placement file {path}: expected a mapping of task -> mesh")
    return plan


def _mesh_from_entry(task: str, entry: dict, world_size: int) -> TaskMesh:
    if not isinstance(entry, dict):
        raise PlacementError(f"{task}: expected a mapping with ranks/dp/pp/tp/ep, got {entry!r}")
    allowed = {"ranks", "dp", "pp", "tp", "ep", "reverse_pp"}
    extra = set(entry) - allowed
    if extra:
        raise PlacementError(f"{task}: unknown key(s) {sorted(extra, key=str)}; allowed: {sorted(allowed)}")
    ranks = parse_ranks(entry["ranks"], task, world_size) if "ranks" in entry else tuple(range(world_size))
    if "ranks" in entry and not ranks:
        raise PlacementError(f"{task}: ranks {entry['ranks']!r} names no rank; give e.g. '0-3' or null to leave "
                             f"{task} unplaced")
    for key in ("dp", "pp", "tp", "ep"):
        if key in entry and not (is_int(entry[key]) and entry[key] >= 1):
            raise PlacementError(f"{task}: {key}={entry[key]!r} must be a positive integer (e.g. {key}=2)")
    if not isinstance(entry.get("reverse_pp", False), bool):
        raise PlacementError(f"{task}: reverse_pp={entry['reverse_pp']!r} must be true or false (a JSON boolean)")
    tp, pp = entry.get("tp", 1), entry.get("pp", 1)
    if "dp" in entry:
        dp = entry["dp"]
    else:
        if len(ranks) % (tp * pp):
            raise PlacementError(
                f"{task}: pp*tp = {pp}*{tp} does not divide the mesh size {len(ranks)}; "
                "choose pp and tp whose product divides the number of ranks"
            )
        dp = len(ranks) // (tp * pp)
    try:
        strategy = ParallelStrategy(dp=dp, pp=pp, tp=tp, ep=entry.get("ep", 1))
    except PlacementError as exc:
        raise PlacementError(f"{task}: {exc}") from None
    return TaskMesh(task, ranks, strategy, entry.get("reverse_pp", False))


def check_strategy_fits_model(task: str, strategy: ParallelStrategy, cfg) -> None:
    """Raise PlacementError if ``strategy`` cannot shard the model ``cfg``."""
    tp, pp = strategy.tp, strategy.pp
    rules = [
        (cfg.num_attention_heads % tp == 0,
         f"tp={tp} does not divide num_attention_heads={cfg.num_attention_heads}"),
        (cfg.num_kv_heads % tp == 0, f"tp={tp} does not divide the KV heads (num_kv_heads={cfg.num_kv_heads})"),
        (cfg.ffn_hidden_size % tp == 0, f"tp={tp} does not divide ffn_hidden_size={cfg.ffn_hidden_size}"),
        (pp <= cfg.num_layers, f"pp={pp} is larger than num_layers={cfg.num_layers}"),
        (cfg.num_layers % pp == 0, f"pp={pp} does not divide num_layers={cfg.num_layers}"),
        (strategy.ep == 1 or cfg.is_moe, f"ep={strategy.ep} needs a mixture-of-experts model (num_experts > 0); "
                                         "this one is dense"),
        (not cfg.is_moe or cfg.num_experts % strategy.ep == 0,
         f"ep={strategy.ep} does not divide num_experts={cfg.num_experts}"),
        (task != "actor_gen" or strategy.ep == 1,
         f"ep={strategy.ep}: the engine's replicas step independently and hold every expert; use ep=1 (tp shards "
         "the generation model)"),
        (not cfg.is_moe or tp == 1 or task not in TRAIN_TASK.values(),
         f"tp={tp} with a mixture of experts: megatron trains MoE layers at tp > 1 only with sequence "
         "parallelism, which this system does not run; split the experts with ep instead (tp=1)"),
    ]
    for ok, message in rules:
        if not ok:
            raise PlacementError(f"{task}: {message}")
