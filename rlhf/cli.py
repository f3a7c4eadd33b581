"""What every command-line entry point shares: one kind of usage error, reported once, exit status 2.

A ``UsageError`` message starts with the flag or the ``file[:line]`` at fault
and says what would be valid; :func:`report` prints it as
``<program>: <message>`` on the first rank only (under torchrun or mpiexec
every rank checks the same input and would print the same line) and returns 2.
The checks every entry point needs live here too: numbers in range
(:func:`check_range`), output paths writable before the work starts
(:func:`check_out_path`), and the job's own config and placement errors
turned into usage errors naming the flag (:func:`usage_errors`). So does the
flag-table mechanism of both programs (:func:`add_section_flags`,
:func:`section_configs`, :func:`section_flag`; tables in
rlhf/ppo/arguments.py and rlhf/reward_model/arguments.py), and their shared
flag parsers (a task's mesh, a model shape, the logging flags).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable, NoReturn

from rlhf.checks import finite_float
from rlhf.config import ConfigError, LoggingConfig
from rlhf.models.config import MODEL_PRESETS, ModelConfig, ModelConfigError, preset
from rlhf.models.precision import PrecisionConfig
from rlhf.parallel import PlacementError


class UsageError(Exception):
    """Bad input from the command line or a file it names (the message names the flag or file)."""


RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
"""Where a process learns its rank: torchrun, MPICH / Intel MPI, Open MPI (the first one set counts)."""


def is_first_rank() -> bool:
    """Rank 0 under torchrun or mpiexec, or a plain process."""
    rank = next((os.environ[v] for v in RANK_VARIABLES if v in os.environ), "0")
    return rank == "0"


FIRST_RANK_GRACE_S = 10.0
"""How long another rank waits before it exits with a usage error: a launcher (torchrun,
mpiexec) stops every worker once one fails, so a rank that fails first would have the
first rank killed before it prints the message. The first rank exits first; the
launcher then stops the waiting ranks at once."""


def wait_for_first_rank_report() -> None:
    """On ranks other than 0, wait (bounded) before exiting on bad input (FIRST_RANK_GRACE_S)."""
    if not is_first_rank():
        time.sleep(FIRST_RANK_GRACE_S)


def report(program: str, error: Exception) -> int:
    """Print ``<program>: <error>`` to stderr on the first rank; the exit status of bad input."""
    if is_first_rank():
        print(f"{program}: {error}", file=sys.stderr, flush=True)
    return 2


@contextlib.contextmanager
def quiet_unless_first_rank():
    """Silence stdout and stderr on ranks other than 0 (argparse's own errors and --help print there);
    an argparse error there waits for the first rank's message (wait_for_first_rank_report)."""
    if is_first_rank():
        yield
        return
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    except SystemExit as exc:
        if exc.code:
            wait_for_first_rank_report()
        raise


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` that keeps the description's layout and shows every flag's default
    (a help text that explains its default itself keeps its own words)."""

    def _get_help_string(self, action):
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def check_range(flag: str, value, low: float, high: float = math.inf, *, low_open: bool = False,
                unit: str = ""):
    """``value`` if it is a finite number in [low, high] ((low, high] with ``low_open``), else a
    UsageError ``<flag>: <value> <what is wrong>; give a number in <range> [unit]``."""
    if high == math.inf:
        valid = f"{'>' if low_open else '>='} {_show(low)}"
    else:
        valid = f"in {'(' if low_open else '['}{_show(low)}, {_show(high)}]"
    valid = f"give a number {valid}{' ' + unit if unit else ''}"
    if finite_float(value) is None:
        raise UsageError(f"{flag}: {value!r} is not a finite number; {valid}")
    if value < low or value > high or (low_open and value == low):
        raise UsageError(f"{flag}: {_show(value)} is out of range; {valid}")
    return value


def _show(number) -> str:
    return f"{number:g}" if isinstance(number, float) else str(number)


def check_out_path(flag: str, path) -> None:
    """An output file must be writable before any work is done: its folder exists and a file can be
    created there (tried, and removed again if it was not there before); UsageError naming ``flag``."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    valid = f"the folder {folder} must exist and be writable, and {flag} must name a file"
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: cannot write there; {valid}")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write there ({exc.strerror}); {valid}") from None
    if not existed:
        with contextlib.suppress(FileNotFoundError):  # another rank may have tried it at the same time
            os.remove(path)


def built_and_resumed(checkpoint, build, resume):
    """``build()`` a trainer, then ``resume(built)`` from ``checkpoint.load`` (``--load``) when given, said
    in one line on rank 0. A root without a complete checkpoint is refused (UsageError) before anything is
    built, unless it is also ``checkpoint.save``: a run relaunched with the same command (Megatron-LM's
    ``--save DIR --load DIR``, or torchrun restarting it) before its first save starts from its initial
    weights. Collective."""
    import torch.distributed as dist

    from rlhf.checkpoint import CheckpointError, resolve_checkpoint
    from rlhf.checkpoint.storage import holds_no_checkpoint

    load = checkpoint.load
    fresh = checkpoint.loads_own_saves and holds_no_checkpoint(load)
    try:
        iteration = resolve_checkpoint(load, group=dist.group.WORLD) if load and not fresh else None
        built = build()
        if iteration is not None:
            resume(built)
    except CheckpointError as exc:
        raise UsageError(f"--load {load}: {exc}") from None
    if dist.get_rank() == 0 and load:
        print(f"--load {load}: " + ("no checkpoint there yet (it is also --save); starting from the initial "
                                    "weights" if fresh else f"resuming from the checkpoint of iteration {iteration}"),
              flush=True)
    return built


def run_program(program: str, parse, run, argv=None) -> int:
    """An entry point's life: ``parse(argv)`` into a config (its output and errors on the first rank
    only; None means the work is done without a process group, as a dry run), then the process
    group and ``run(config)``. A UsageError from either prints ``<program>: ...`` and gives exit status 2."""
    try:
        with quiet_unless_first_rank():
            config = parse(argv)
    except UsageError as exc:
        status = report(program, exc)
        wait_for_first_rank_report()  # no process group yet to wait on
        return status
    if config is None:
        return 0
    import torch.distributed as dist

    from rlhf import platform
    from rlhf.parallel import collectives

    global _ran_distributed
    platform.flush_denormals()  # before the first parallel CPU op, so that torch's thread pool inherits it
    platform.init_distributed(collectives.set_timeout(config.run.distributed_timeout_minutes).total_seconds())
    _ran_distributed = True
    try:
        run(config)
        status = 0
    except UsageError as exc:
        status = report(program, exc)
    except BaseException as exc:
        failure = collectives.describe_failure(exc, dist.get_rank())
        if failure is None:
            dist.destroy_process_group()
            raise
        print(f"{program}: {failure}", file=sys.stderr, flush=True)
        return 1  # the groups are broken: no barrier and no teardown, exit_process ends the process
    dist.barrier()  # every rank has printed what it had to before any of them exits (exit_process)
    dist.destroy_process_group()
    return status


_ran_distributed = False
"""Whether this process ran a process group (run_program): then exit_process skips finalization."""


def exit_process(status: int) -> NoReturn:
    """End an entry point with ``status``; after a process group (`run_program`), skip finalization.

    A gloo worker thread can still be freeing the last collective's work after
    the program returns; those tensors were made in Python, so it needs the
    GIL, and during finalization a thread that asks for the GIL is stopped:
    the C++ runtime then aborts the process ("terminate called without an
    active exception", exit -6) although every result is written. Everything
    the program opened is closed by then, so the streams are flushed and the
    process ends at once. Without a process group (a refused flag, a dry
    run) the process exits normally.
    """
    if not _ran_distributed:
        sys.exit(status)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@contextlib.contextmanager
def usage_errors(flag_of):
    """Turn a job's own input errors into UsageErrors: a PlacementError as ``invalid placement: ...``, a
    ConfigError as ``<flag>: ...`` with ``flag_of(error.field_name)`` the flag that set the field."""
    try:
        yield
    except PlacementError as exc:
        raise UsageError(f"invalid placement: {exc}") from None
    except ConfigError as exc:  # flags, a model directory, tokenizer, a data file or a reward function
        raise UsageError(f"{flag_of(exc.field_name)}: {exc}") from None


# ---- the flag-table mechanism both programs use ----------------------------------------------
# A program lists each config section's flags once, as a table
#     {section: (config class, argument-group title, [(field, type, help), ...])}
# The flag is the field's name with dashes (``ppo.clip_eps`` -> ``--clip-eps``), its default the
# dataclass default, and a ConfigError naming ``<section>.<field>`` is reported against that flag.


def flag_name(field_name: str) -> str:
    """``clip_eps`` -> ``--clip-eps``."""
    return "--" + field_name.replace("_", "-")


def section_flag(field_name: str, sections: dict) -> str:
    """The flag that sets a dotted field of a section in the table ``sections`` (``ppo.clip_eps`` ->
    ``--clip-eps``); other fields are returned as they are."""
    section, _, name = field_name.partition(".")
    return flag_name(name) if section in sections else field_name


def fraction_or_auto(text: str):
    """'auto' -> None (chosen at run time), else a float."""
    return None if text.lower() == "auto" else float(text)


def int_or_auto(text: str):
    """'auto' -> None (chosen at run time), else an int."""
    return None if text.lower() == "auto" else int(text)


def add_section_flags(parser: argparse.ArgumentParser, sections: dict) -> None:
    """One argument group per config section of the flag table ``sections``, one flag per listed field,
    defaulting to the dataclass's default."""
    for cls, title, fields in sections.values():
        group = parser.add_argument_group(title)
        for name, kind, text in fields:
            default = next(f.default for f in dataclasses.fields(cls) if f.name == name)
            if kind is bool and default:
                group.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_false",
                                   help=f"do not: {text} (default: do)")
            elif kind is bool:
                group.add_argument(flag_name(name), action="store_true", help=f"{text} (default: off)")
            else:
                group.add_argument(flag_name(name), type=kind, default=default,
                                   help=f"{text} (default: {default})")


def section_configs(args: argparse.Namespace, sections: dict) -> dict:
    """{section: its config} from parsed flags (a bad value raises ConfigError naming its field)."""
    return {key: cls(**{name: getattr(args, name) for name, _, _ in fields})
            for key, (cls, _, fields) in sections.items()}


def parse_task_spec(task: str, spec: str) -> dict | None:
    """'tp=2,pp=2,ranks=0-3,reverse_pp' (and 'ep=2', expert parallelism) -> plan entry ('none': the task is
    not placed); errors name the flag."""
    if spec.strip().lower() == "none":
        return None
    entry: dict = {}
    ranks: list[str] = []
    for item in spec.split(","):
        key, eq, value = item.strip().partition("=")
        if key == "reverse_pp" and not eq:
            entry["reverse_pp"] = True
        elif key in ("dp", "pp", "tp", "ep") and value.isdigit():
            entry[key] = int(value)
        elif key == "ranks" and value:
            ranks.append(value)
        elif not eq and key and ranks:  # continuation of a rank list: ranks=0,2,4-5
            ranks.append(key)
        else:
            raise UsageError(f"{flag_name(task)}: cannot parse {item!r} in {spec!r}; "
                             "expected e.g. 'tp=2,pp=2,ranks=0-3,reverse_pp'")
    if ranks:
        entry["ranks"] = ",".join(ranks)
    return entry


def load_model_config(value: str, flag: str, tokenizer_ids: Callable[[], int]) -> ModelConfig:
    """A preset name, its vocab_size the job tokenizer's ``tokenizer_ids()`` (called for a preset only), or a
    JSON file of ModelConfig fields (its own vocab_size)."""
    if value in MODEL_PRESETS:
        return preset(value, tokenizer_ids())
    try:
        return ModelConfig.from_dict(json.loads(Path(value).read_text()))
    except (OSError, ValueError, ModelConfigError) as exc:
        raise UsageError(f"{flag} {value}: {exc} (give a preset: {', '.join(sorted(MODEL_PRESETS))}, "
                         "a JSON file of model fields, an HF model directory or our checkpoint root)") from None


TIMEOUT_FLAG = ("distributed_timeout_minutes", float,
                "how long any collective waits for a peer rank: a rank that died or stopped answering ends the "
                "job within this time, with a line naming the collective, its ranks and tasks, and the code that "
                "called it (Megatron-LM's flag; long enough for the longest stage that other ranks wait out)")
"""The run section's collective timeout flag, the same in both programs."""


LOGGING_FLAGS = (LoggingConfig, "logging", [
    ("metrics_file", str, "append one JSON object of metrics per iteration to this file"),
    ("tensorboard_dir", str, "write TensorBoard event files here"),
    ("trace_iteration", int, "write a Perfetto (Chrome trace) file of every rank for this iteration "
                             "(counting from 1)"),
    ("trace_file", str, "where --trace-iteration writes its trace"),
    ("progress", bool, "show the progress bar on rank 0"),
    ("wandb_project", str, "also log to this Weights & Biases project (the wandb package; WANDB_MODE=offline "
                           "writes it locally; docs/logging.md)"),
    ("wandb_run_name", str, "the W&B run's display name, with --wandb-project (None: W&B picks one)"),
    ("mlflow_tracking_uri", str, "also log to MLflow at this tracking URI: file:DIR (a local store), "
                                 "http(s)://HOST (a server) or a SQL store (the full mlflow package)"),
    ("mlflow_experiment", str, "the MLflow experiment, created when missing, with --mlflow-tracking-uri "
                               "(None: MLflow's Default)"),
])
"""The logging section's flags, the same in both programs."""


def optional_float(text: str):
    """A float, or 'none' / 'off' for None."""
    return None if text.lower() in ("none", "off") else float(text)


PRECISION_FLAGS = (PrecisionConfig, "precision (Megatron-LM's flags; docs/precision.md)", [
    ("bf16", bool, "bf16 mixed precision: every model in bfloat16 (weights, activations, the engine's KV cache), "
                   "fp32 main weights, gradients and Adam moments in the optimizer; log-probs in fp32"),
    ("fp16", bool, "fp16 mixed precision as --bf16, with loss scaling (dynamic unless --loss-scale)"),
    ("loss_scale", optional_float, "a constant fp16 loss scale ('none': dynamic)"),
    ("initial_loss_scale", float, "the dynamic fp16 loss scale's start"),
    ("min_loss_scale", float, "the dynamic fp16 loss scale's floor"),
    ("loss_scale_window", int, "clean steps after which the dynamic fp16 loss scale doubles"),
    ("hysteresis", int, "overflowing steps (each skipped) before the dynamic fp16 loss scale halves"),
    ("accumulate_allreduce_grads_in_fp32", bool, "accumulate and all-reduce fp16 gradients in fp32 (always so "
                                                 "with --bf16, as Megatron-LM)"),
])
"""The precision section's flags, the same in both programs."""


def markdown_reference(parser: argparse.ArgumentParser) -> str:
    """``parser``'s flags as Markdown (docs/flags.md, tools/flag_reference.py): its description, then one
    table per argument group with each flag, its value and the help text ``--help`` prints for it."""
    formatter = parser._get_formatter()
    lines = [f"## {parser.prog}", "", _markdown_text(parser.description or ""), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help != argparse.SUPPRESS and a.dest != "help"]
        if not actions:
            continue
        lines += [f"### {group.title}", "", "| flag | what it does |", "|---|---|"]
        for action in actions:
            value = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
            flags = ", ".join(f"`{option}{value}`" for option in action.option_strings).replace("|", "\\|")
            lines.append(f"| {flags} | {_markdown_text(formatter._expand_help(action))} |")
        lines.append("")
    return "\n".join(lines)


def _markdown_text(text: str) -> str:
    """Help text on one Markdown table line: whitespace joined, ``| * < >`` escaped."""
    text = " ".join(text.split())
    for char, escaped in (("|", "\\|"), ("*", "\\*"), ("<", "&lt;"), (">", "&gt;")):
        text = text.replace(char, escaped)
    return text
