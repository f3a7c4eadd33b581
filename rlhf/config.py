"""What both programs' configurations share: the error they raise and the sections both hold.

Configs are frozen dataclasses holding plain values that validate themselves
(``__post_init__``); live objects (process groups, models) are built from
them elsewhere. One error protocol: a section raises ``ConfigError(message,
field)`` naming its own field; a config that holds it names the field from
its own level with :meth:`ConfigError.renamed` (``lr`` -> ``ppo.lr``), so an
entry point reports the flag that set it. The sections here (run, logging,
checkpoint, placement) serve ``pretrain_rlhf.py`` (rlhf/ppo/config/) and
``train_reward.py`` (rlhf/reward_model/config.py) alike. A leaf: it imports
no runtime package (only the torch-free task table, value checks and plan
files).
"""

from __future__ import annotations

import copy
import functools
import os
import types
import typing
from dataclasses import dataclass, field, fields
from importlib.util import find_spec
from types import MappingProxyType
from typing import Mapping

from rlhf.checks import finite_float, is_int
from rlhf.models.config import RECOMPUTE_GRANULARITIES
from rlhf.parallel.placement import load_plan
from rlhf.tasks import TASKS


class ConfigError(ValueError):
    """An invalid configuration value; ``field_name`` is the field, dotted from the config that reports
    it (``seq_length`` in its section, ``run.seq_length`` from the job)."""

    def __init__(self, message: str, field_name: str):
        super().__init__(message)
        self.field_name = field_name

    def renamed(self, field_name: str) -> ConfigError:
        """The same error, its field named ``field_name`` (how an enclosing config names it)."""
        return ConfigError(str(self), field_name)


def check_positive_ints(section: str, config, names) -> None:
    """Raise a ConfigError naming ``<section>.<name>`` unless each named field is an integer >= 1."""
    for name in names:
        value = getattr(config, name)
        if not is_int(value) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}", f"{section}.{name}")


def check_field_types(section: str, config) -> None:
    """Raise a ConfigError naming ``<section>.<field>`` for a field whose value does not have its annotated
    type: types are checked, never coerced. An int is not a bool, a float is finite (NaN and Infinity are
    refused), a str is not empty; None only where the annotation allows it. Fields annotated otherwise
    (``Mapping[str, str]``) are left to the config's own checks."""
    for name, (classes, optional) in _field_types(type(config)).items():
        value = getattr(config, name)
        if (value is None and optional) or any(_has_type(value, cls) for cls in classes):
            continue
        wanted = " or ".join([_TYPE_WORDS.get(cls, f"a {cls.__name__}") for cls in classes] + ["None"] * optional)
        raise ConfigError(f"{name} must be {wanted}, got {value!r}", f"{section}.{name}")


_TYPE_WORDS = {bool: "True or False", int: "an integer", float: "a finite number", str: "a non-empty string"}


@functools.cache
def _field_types(cls) -> dict:
    """{field: (classes, None allowed)} of the dataclass fields of ``cls`` annotated with classes."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        args = typing.get_args(hint) if union else (hint,)
        classes = tuple(a for a in args if a is not type(None))
        if all(isinstance(a, type) for a in classes):
            out[f.name] = (classes, len(classes) < len(args))
    return out


def _has_type(value, cls) -> bool:
    if cls is int:
        return is_int(value)
    if cls is float:
        return finite_float(value) is not None
    if cls is str:
        return isinstance(value, str) and value != ""
    return isinstance(value, cls)


def import_named(spec: str, field_name: str, what: str):
    """The object ``MODULE:NAME`` names (NAME may be dotted), imported: a user's reward function,
    environment or agent. A ConfigError naming ``field_name`` says what is missing (``what``: the form,
    e.g. ``MODULE:FUNCTION``)."""
    import importlib

    module_name, _, attribute = spec.partition(":")
    try:
        target = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 -- importing user code can raise anything
        raise ConfigError(f"{spec}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); give "
                          f"{what} of a module on the Python path", field_name) from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{spec}: {getattr(target, '__name__', target)!r} has no attribute {part!r}",
                              field_name)
        target = getattr(target, part)
    return target


def check_range(section: str, name: str, value, low: float, high: float, what: str) -> None:
    """Raise a ConfigError naming ``<section>.<name>`` unless ``low <= value <= high`` (``what`` says so)."""
    if not low <= value <= high:
        raise ConfigError(f"{name}={value!r} must be {what}", f"{section}.{name}")


def check_recompute(section: str, granularity: str | None, num_layers: int | None) -> None:
    """Megatron-LM's ``--recompute-granularity`` (None, "full", "selective") and ``--recompute-num-layers``
    (layers per chunk of full recompute, >= 1): a ConfigError naming ``<section>.<field>`` otherwise."""
    if granularity not in (None, *RECOMPUTE_GRANULARITIES):
        raise ConfigError(f"recompute_granularity {granularity!r} is not one of "
                          f"{', '.join(RECOMPUTE_GRANULARITIES)} (or none)", f"{section}.recompute_granularity")
    if num_layers is not None:
        if granularity != "full":
            raise ConfigError(f"recompute_num_layers {num_layers} sets the layers per chunk of "
                              f"--recompute-granularity full (got {granularity or 'none'}); use full or drop it",
                              f"{section}.recompute_num_layers")
        check_range(section, "recompute_num_layers", num_layers, 1, float("inf"), ">= 1 layers per recomputed chunk")


def check_recompute_stage(section: str, task: str, granularity: str | None, num_layers: int | None,
                          stage_layers: int) -> None:
    """ConfigError unless a full recompute's chunk (default 1) divides the ``stage_layers`` layers of each
    pipeline stage of ``task`` (megatron's uniform method recomputes whole chunks)."""
    chunk = num_layers or 1
    if granularity == "full" and stage_layers % chunk:
        raise ConfigError(f"recompute_num_layers {chunk} must divide the {stage_layers} layers of each of {task}'s "
                          f"pipeline stages (megatron recomputes chunks of that many layers); give a divisor of "
                          f"{stage_layers}", f"{section}.recompute_num_layers")


MAX_SEED = 2**28 - 1
"""Largest run seed (the documented range of --seed; requests and samples get 64-bit seeds mixed from it,
rlhf.engine.sampler.mixed_seed)."""


DEFAULT_TIMEOUT_MINUTES = 30.0
"""``--distributed-timeout-minutes``' default: ranks idle in one stage wait inside a collective for the others
(the inference ranks while a long generation runs), so it leaves room for a long stage; Megatron-LM's 10 minutes
suits training alone."""


@dataclass(frozen=True)
class RunConfig:
    """How long: total iterations (a resumed run continues to it), the seed, and how long a collective may
    wait for a peer before the run ends (rlhf/parallel/collectives.py)."""

    iterations: int = 30
    seed: int = 1234
    distributed_timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES

    def __post_init__(self):
        check_field_types("run", self)
        check_positive_ints("run", self, ("iterations",))
        check_range("run", "seed", self.seed, 0, MAX_SEED, f"in [0, {MAX_SEED}]")
        if not self.distributed_timeout_minutes > 0:
            raise ConfigError(f"distributed_timeout_minutes={self.distributed_timeout_minutes!r} must be a number "
                              "of minutes > 0", "run.distributed_timeout_minutes")


@dataclass(frozen=True)
class PlacementConfig:
    """Where tasks run: a plan file (JSON/YAML; else the program's built-in plan) and per-task entries
    merged into it."""

    file: str | None = None
    overrides: Mapping[str, Mapping] = field(default_factory=dict)

    def __post_init__(self):
        check_field_types("placement", self)
        if not isinstance(self.overrides, Mapping) or not all(
                e is None or isinstance(e, Mapping) for e in self.overrides.values()):
            raise ConfigError(f"overrides={self.overrides!r} must map tasks to plan entries (mappings) or None",
                              "placement.overrides")
        unknown = sorted(set(self.overrides) - set(TASKS), key=str)
        if unknown:
            raise ConfigError(f"unknown task(s) {unknown}; valid tasks: {', '.join(TASKS)}", "placement.overrides")
        object.__setattr__(self, "overrides", MappingProxyType(
            {t: None if e is None else dict(e) for t, e in self.overrides.items()}))

    def plan(self, default: Mapping | None = None) -> dict:
        """The plan dict: the file's entries (else a copy of the program's ``default`` plan) with each
        override merged field by field into its task's entry (``None`` leaves the task unplaced).

        Raises rlhf.parallel.PlacementError for an unreadable or malformed file.
        """
        plan = load_plan(self.file) if self.file else copy.deepcopy(dict(default or {}))
        for task, entry in self.overrides.items():  # field by field into the file's entry ('none': unplaced)
            base = plan.get(task) or {}
            plan[task] = None if entry is None else {**base, **entry}
        return plan


@dataclass(frozen=True)
class LoggingConfig:
    """Where metrics go. Fields map to flags ``--metrics-file``, ``--tensorboard-dir``,
    ``--trace-iteration`` (1-based; traced into ``trace_file``), ``--no-progress``, and the optional
    backends (docs/logging.md): Weights & Biases when ``wandb_project`` is set (``wandb_run_name`` names
    the run), MLflow when ``mlflow_tracking_uri`` is set (``mlflow_experiment``: None is MLflow's
    Default). A backend whose package is missing is refused here, on every rank alike, before any work.
    ``log_samples``: every this many iterations the PPO program prints one decoded prompt and response
    with its reward (0: never; train_reward.py has no such flag)."""

    metrics_file: str | None = None
    tensorboard_dir: str | None = None
    trace_iteration: int | None = None
    progress: bool = True
    trace_file: str = "trace.json"
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_experiment: str | None = None
    log_samples: int = 10

    def __post_init__(self):
        check_field_types("logging", self)
        if self.metrics_file is not None:
            _check_path(self.metrics_file, "metrics_file", "file")
        if self.tensorboard_dir is not None:
            _check_path(self.tensorboard_dir, "tensorboard_dir", "directory")
        _check_path(self.trace_file, "trace_file", "file")
        it = self.trace_iteration
        if it is not None and it < 1:
            raise ConfigError(f"trace_iteration must be None or an integer >= 1 (iterations count from 1), "
                              f"got {it!r}", "logging.trace_iteration")
        check_range("logging", "log_samples", self.log_samples, 0, float("inf"), ">= 0 iterations (0: never)")
        self._check_backends()

    def _check_backends(self) -> None:
        """A backend's options need its switch, and its switch needs its package (found, not imported)."""
        for option, switch in (("wandb_run_name", "wandb_project"), ("mlflow_experiment", "mlflow_tracking_uri")):
            if getattr(self, option) is not None and getattr(self, switch) is None:
                raise ConfigError(f"{option} names part of a backend that is off; give {switch} too",
                                  f"logging.{option}")
        for switch, (module, package) in BACKEND_PACKAGES.items():
            if getattr(self, switch) is not None and find_spec(module) is None:
                raise ConfigError(f"{switch} needs the {module} package, which is not installed: pip install "
                                  f"{package} (or this project's logging extra: pip install -e '.[logging]')",
                                  f"logging.{switch}")
        uri = self.mlflow_tracking_uri
        scheme = (uri or "").partition(":")[0].partition("+")[0]
        if scheme in SQL_SCHEMES and find_spec("sqlalchemy") is None:
            raise ConfigError(f"mlflow_tracking_uri {uri!r} is a SQL store, which needs the full mlflow package "
                              "(pip install mlflow); mlflow-skinny opens a file: store or an http(s):// server",
                              "logging.mlflow_tracking_uri")

    def check_traced_iteration(self, run: RunConfig) -> None:
        """Refuse a ``trace_iteration`` past the run's last iteration (a job config calls it with its run)."""
        trace = self.trace_iteration
        if trace is not None and trace > run.iterations:
            raise ConfigError(f"trace_iteration {trace} is past the last iteration {run.iterations}",
                              "logging.trace_iteration")


BACKEND_PACKAGES = {"wandb_project": ("wandb", "wandb"), "mlflow_tracking_uri": ("mlflow", "mlflow-skinny")}
"""{the field that turns a logging backend on: (the module it imports, the package that provides it)}."""

SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
"""MLflow tracking URI schemes of its SQL stores (``postgresql+psycopg2://`` counts as postgresql)."""


def _check_path(value: str, name: str, kind: str) -> None:
    """Raise a ConfigError naming ``logging.<name>`` if the path ``value`` is an existing entry of the
    other kind (``kind``: "file" or "directory")."""
    other, clashes = ("directory", os.path.isdir) if kind == "file" else ("file", os.path.isfile)
    if clashes(value):
        raise ConfigError(f"{name}={value!r} is an existing {other}; give a {kind} path", f"logging.{name}")


SAVE_FORMATS = ("ours", "torch_dist")
"""Checkpoint formats the trainer writes: ours always; torch_dist adds the actor as Megatron-LM's."""


@dataclass(frozen=True)
class CheckpointConfig:
    """``save``: checkpoint root written every ``save_interval`` iterations and after the last one;
    ``keep_last``: how many of its newest checkpoints to keep (older ones are deleted once a newer one
    is complete; None: all); ``load``: checkpoint root to resume from (its latest complete checkpoint);
    ``save_format``:
    "torch_dist" also writes the actor of each checkpoint as a Megatron-LM checkpoint in
    ``<save>/megatron`` (docs/megatron_checkpoints.md)."""

    save: str | None = None
    save_interval: int | None = None
    keep_last: int | None = None
    load: str | None = None
    save_format: str = "ours"

    def __post_init__(self):
        check_field_types("checkpoint", self)
        if self.save_format not in SAVE_FORMATS:
            raise ConfigError(f"save_format {self.save_format!r} is not one of {SAVE_FORMATS}",
                              "checkpoint.save_format")
        if self.save_interval is not None:
            if self.save is None:
                raise ConfigError("save_interval needs a checkpoint root to save to (save)", "checkpoint.save_interval")
            check_positive_ints("checkpoint", self, ("save_interval",))
        if self.keep_last is not None:
            if self.save is None:
                raise ConfigError("keep_last needs a checkpoint root to save to (save)", "checkpoint.keep_last")
            check_positive_ints("checkpoint", self, ("keep_last",))
        if self.load is not None and not os.path.isdir(self.load) and not self.loads_own_saves:
            raise ConfigError(f"load={self.load!r} is not a directory; give the root a run saved into "
                              "(it holds iter_* directories and 'latest'), or the same root as save to "
                              "start fresh until the first save", "checkpoint.load")
        if self.save is not None and os.path.isfile(self.save):
            raise ConfigError(f"save={self.save!r} is a file; give a directory (created if missing)", "checkpoint.save")

    @property
    def loads_own_saves(self) -> bool:
        """``load`` and ``save`` name one root (Megatron-LM's ``--save DIR --load DIR``): a run relaunched with
        the same command continues from its own newest checkpoint, or starts fresh before the first."""
        return self.load is not None and self.save is not None and \
            os.path.realpath(self.load) == os.path.realpath(self.save)
