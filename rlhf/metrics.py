"""Per-iteration metrics: stage timing, cross-rank reduction, and the outputs on rank 0.

What the trainer calls, once per iteration::

    timer.start_iteration(it)                 StageTimer: wall seconds per named stage,
    with timer.stage("generation"): ...         and this rank's Timeline on a traced iteration
    local = {**timer.metrics(), ...}          floats or 0-dim tensors, any keys per rank
    metrics = with_rates(reduce_metrics(local))   collective: one dict, equal on every rank
    writer.log(it, metrics)                   MetricsWriter: progress bar, JSON Lines, TensorBoard,
                                                W&B, MLflow (rank 0 only)
    writer.print_text(sample)                 a block of text above the bar (rank 0)
    if timer.timeline is not None: write_trace(path, timer.timeline)   collective: one trace

and the writer, closed after the last iteration, prints the run's summary line
(:class:`RunSummary`). docs/logging.md describes every output.

Reduction rule (:func:`reduce_op`): a key's name says how it is reduced over
the ranks that reported it, so every rank agrees without a shared table and a
reader of the metrics file knows what each number is:

    time_*            max   the slowest rank: what the iteration waited for
    *_max             max
    *_sum, *_count    sum   report from ONE rank per distinct share (e.g. TP rank 0
                            of each DP replica): TP/PP copies would be counted twice
    anything else     mean  unweighted over the reporting ranks (exact when their
                            shares are equal; copies of one value do not change it). A std
                            is no mean of stds: compute it where all samples are, report
                            it from one rank (a key with one reporter passes unchanged)
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Mapping
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from rlhf import platform
from rlhf.config import CheckpointConfig, LoggingConfig
from rlhf.pipeline.timeline import Event, Timeline, gather, write_chrome_trace

logger = logging.getLogger(__name__)

STAGE_KIND = "STAGE"
"""Category of stage spans in the Chrome trace (executor instructions use FORWARD/BACKWARD/...)."""

POSTFIX = (("reward", "reward_mean"), ("gold", "gold_reward_mean"), ("kl", "kl_mean"),
           ("len", "response_length_mean"), ("samples/s", "samples_per_s"))
"""(label, metric key) shown in the progress bar's postfix when the key is present (PPO's)."""

SUMMARY_KEYS = {"ppo": ("reward_mean", "gold_reward_mean"), "reward": ("loss", "accuracy", "eval_accuracy")}
"""Per program (the writer's ``desc``): the metrics whose first and last windows the end-of-run line averages."""

SUMMARY_WINDOW = 10
"""Iterations averaged at the start and the end of a run (tools/plot_metrics.py's default window too)."""

RUNS_FILE = "logging_runs.json"
"""Kept in the checkpoint root (``--save``): the W&B and MLflow runs that a run resumed from it continues."""


class StageTimer:
    """Owns this rank's wall seconds per stage for the current iteration, and its traced Timeline.

    Stages may nest (``"inference"`` around ``"ref_inf"``): each name adds its
    own full span, so an outer stage's seconds include its inner stages'.
    A name may not be entered while it is already open (it would count twice);
    a name entered twice in sequence adds both spans. Every stage boundary
    calls ``sync`` (default :func:`rlhf.platform.synchronize`) so queued device
    work is charged to the stage that queued it: a deliberate host sync per
    boundary, not per step. ``clock`` returns seconds (default perf_counter,
    the executor's clock, so :meth:`include` can rebase its Timeline).
    """

    def __init__(self, trace_iteration: int | None = None, group=None,
                 clock: Callable[[], float] = time.perf_counter,
                 sync: Callable[[], None] = platform.synchronize):
        self.trace_iteration = trace_iteration
        self.group = group
        self.clock = clock
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self.timeline: Timeline | None = None
        self._open: list[str] = []
        self._start = clock()

    def start_iteration(self, iteration: int) -> None:
        """Forget the last iteration's seconds; on the traced iteration (collective over ``group``)
        barrier and start a Timeline whose origin all ranks share to within the barrier's skew."""
        if self._open:
            raise RuntimeError(f"start_iteration({iteration}) inside open stage(s) {self._open}")
        self.seconds = {}
        self.timeline = None
        if iteration == self.trace_iteration:
            dist.barrier(group=self.group)
            self.timeline = Timeline(dist.get_rank(), origin=self.clock())
        self._start = self.clock()

    @contextmanager
    def stage(self, name: str):
        """Time the body as stage ``name``: adds its wall seconds to ``seconds[name]``."""
        if name in self._open:
            raise ValueError(f"stage {name!r} is already open ({' > '.join(self._open)}); "
                             "a stage cannot nest inside itself")
        self.sync()
        start = self.clock()
        self._open.append(name)
        try:
            yield
        finally:
            self.sync()
            end = self.clock()
            self._open.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + (end - start)
            if self.timeline is not None:
                self.timeline.record(name, STAGE_KIND, start, end)

    def include(self, other: Timeline) -> None:
        """Add ``other``'s events (e.g. an executor step's ``StepResult.timeline``) to the traced
        Timeline, rebased onto its origin; no-op when this iteration is not traced. Both
        timelines must use the same clock."""
        if self.timeline is None:
            return
        shift = other.origin - self.timeline.origin
        self.timeline.events.extend(Event(e.label, e.kind, e.start + shift, e.end + shift) for e in other.events)

    def elapsed(self) -> float:
        """Seconds since :meth:`start_iteration`."""
        return self.clock() - self._start

    def metrics(self) -> dict[str, float]:
        """``{"time_<stage>_s": seconds}`` for each stage run, and ``time_iteration_s``:
        seconds since :meth:`start_iteration`."""
        out = {f"time_{name}_s": s for name, s in self.seconds.items()}
        out["time_iteration_s"] = self.elapsed()
        return out


def reduce_op(key: str) -> str:
    """How ``key`` is reduced over the ranks that report it: ``"max"``, ``"sum"`` or ``"mean"``
    (the rule in the module docstring)."""
    if key.startswith("time_") or key.endswith("_max"):
        return "max"
    if key.endswith(("_sum", "_count")):
        return "sum"
    return "mean"


def reduce_metrics(local: Mapping[str, float | torch.Tensor], group=None) -> dict[str, float]:
    """Every key any rank of ``group`` reported, reduced by :func:`reduce_op` over the ranks
    that reported it. Collective over ``group``; the result (sorted keys) is equal on all ranks.

    ``local``: floats or one-element tensors (any device; detached here). Costs one
    object all-gather of the key names and two all-reduces (sum, max) of float64 vectors.
    """
    keys = _union_keys(local, group)
    if not keys:
        return {}
    summed = [k for k in keys if reduce_op(k) != "max"]
    maxed = [k for k in keys if reduce_op(k) == "max"]
    device = platform.device()
    sums = torch.stack([_vector([local.get(k, 0.0) for k in summed], device),    # values, 0 if absent
                        _vector([float(k in local) for k in summed], device)])   # reporting ranks
    peaks = _vector([local.get(k, -math.inf) for k in maxed], device)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=group)
    # The iteration's one deliberate host sync: metrics stay on the device until here.
    values, n = torch.cat([sums.flatten(), peaks]).tolist(), len(summed)
    totals, counts, peak_values = values[:n], values[n:2 * n], values[2 * n:]
    out = {k: t / c if reduce_op(k) == "mean" else t for k, t, c in zip(summed, totals, counts)}
    out.update(zip(maxed, peak_values))
    return dict(sorted(out.items()))


def _union_keys(local: Mapping, group) -> list[str]:
    """Sorted union of every rank's keys (collective), checking this rank's values are scalars."""
    for key, value in local.items():
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise ValueError(f"metric {key!r} must be a float or a one-element tensor, "
                             f"got shape {tuple(value.shape)}")
    per_rank = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, sorted(local), group=group)
    return sorted(set().union(*per_rank))


def _vector(values: list, device: torch.device) -> torch.Tensor:
    """float64 vector ``[len(values)]`` on ``device`` from floats and one-element tensors."""
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).detach().reshape(())
                        for v in values])


def with_rates(metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` plus ``samples_per_s`` and ``tokens_per_s`` (reduced ``samples_count`` /
    ``tokens_count`` over the slowest rank's ``time_iteration_s``) where those keys exist."""
    out = dict(metrics)
    seconds = metrics.get("time_iteration_s", 0.0)
    for unit in ("samples", "tokens"):
        if f"{unit}_count" in metrics and seconds > 0:
            out[f"{unit}_per_s"] = metrics[f"{unit}_count"] / seconds
    return dict(sorted(out.items()))


def write_trace(path: str | Path, timeline: Timeline, group=None) -> None:
    """Gather every rank's events (collective over ``group``) and write one Chrome trace from
    the group's rank 0: one process per rank; open in https://ui.perfetto.dev."""
    per_rank = gather(timeline, group)
    if dist.get_rank(group) == 0:
        write_chrome_trace(path, per_rank)


class MetricsWriter:
    """Owns the run's outputs: a progress bar, the JSON Lines file, TensorBoard events, the optional
    Weights & Biases and MLflow runs (docs/logging.md), and the line that ends a run.

    Built on every rank; only ``rank == 0`` writes. ``start_iteration`` is the
    number of iterations already done (a resumed checkpoint's iteration; 0 for a
    fresh run), so the first :meth:`log` is iteration ``start_iteration + 1``.
    ``desc`` names the progress bar and the program (whose keys the end line
    averages, :data:`SUMMARY_KEYS`), ``postfix`` lists the (label, metric
    key) pairs shown after the bar (default: PPO's). ``checkpoint``
    (the job's checkpoint section) is where the W&B and MLflow run ids are kept
    so a resumed run continues the same runs (:data:`RUNS_FILE`).

    Resume rule: the outputs describe the run that is writing them. Lines of
    ``metrics_file`` with ``iteration > start_iteration`` (an abandoned future
    this run recomputes, or a fresh run's predecessor) and unreadable lines (a
    partial line from a killed run) are dropped before appending; TensorBoard
    events from step ``start_iteration + 1`` on are hidden through
    ``SummaryWriter(purge_step=...)``. W&B and MLflow keep what they were sent:
    there a recomputed iteration is dropped (W&B: steps only increase) or
    logged a second time at its step (MLflow).
    """

    def __init__(self, config: LoggingConfig, total_iterations: int, rank: int, start_iteration: int = 0,
                 desc: str = "ppo", postfix: tuple = POSTFIX, checkpoint: CheckpointConfig | None = None):
        self.active = rank == 0
        self.desc, self.total_iterations = desc, total_iterations
        self.last_iteration = start_iteration
        self.postfix = postfix
        self.summary = RunSummary(SUMMARY_KEYS.get(desc, ()))
        self.metrics_file = config.metrics_file
        self._sinks: list | None = (_open_sinks(config, start_iteration, checkpoint, desc, self.summary)
                                    if self.active else [])
        self._bar = tqdm(total=total_iterations, initial=start_iteration, desc=desc, unit="it",
                         dynamic_ncols=True, disable=not (self.active and config.progress))

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """Record iteration ``iteration``'s reduced metrics (floats) everywhere configured."""
        if iteration <= self.last_iteration:
            raise ValueError(f"iteration {iteration} logged after iteration {self.last_iteration}; "
                             "iterations must increase")
        self.last_iteration = iteration
        if not self.active:
            return
        for sink in self._sinks:
            sink.log(iteration, metrics)
        self.summary.add(iteration, metrics)
        self._bar.set_postfix({label: f"{metrics[key]:.4g}" for label, key in self.postfix if key in metrics},
                              refresh=False)
        self._bar.update(1)

    def print_text(self, text: str) -> None:
        """Print ``text`` (any lines: a decoded sample, its reward) on rank 0 above the progress bar,
        which is cleared and drawn again below it."""
        if self.active:
            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()  # shows up in a redirected log as it happens

    def close(self, failed: bool = False) -> None:
        """Close the bar and every output (idempotent); W&B and MLflow record ``failed``. A run that
        reached its last iteration ends with the summary line (:meth:`RunSummary.line`) on rank 0."""
        self._bar.close()
        if self._sinks is None:
            return
        for sink in self._sinks:
            sink.close(failed)
        if self.active and not failed and self.last_iteration == self.total_iterations:
            self.print_text(self.summary.line(self.desc, [s.where for s in self._sinks], self.metrics_file))
        self._sinks = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(failed=exc_type is not None)


def _open_sinks(config: LoggingConfig, start_iteration: int, checkpoint: CheckpointConfig | None, desc: str,
                summary: RunSummary) -> list:
    """Rank 0's outputs, each with ``log(iteration, metrics)``, ``close(failed)`` and ``where``; the W&B
    and MLflow runs continue those kept under ``checkpoint.load`` when resuming, and are kept under
    ``checkpoint.save``."""
    sinks: list = []
    if config.metrics_file is not None:
        sinks.append(JsonLinesSink(config.metrics_file, start_iteration, summary))
    if config.tensorboard_dir is not None:
        sinks.append(TensorBoardSink(config.tensorboard_dir, start_iteration))
    resumed = start_iteration > 0 and checkpoint is not None and checkpoint.load is not None
    kept = _read_runs(Path(checkpoint.load) / RUNS_FILE) if resumed else {}
    runs = [sink(config, kept.get(sink.name), desc) for switch, sink in
            ((config.wandb_project, WandbSink), (config.mlflow_tracking_uri, MlflowSink)) if switch is not None]
    if runs and checkpoint is not None and checkpoint.save is not None:
        _write_runs(Path(checkpoint.save) / RUNS_FILE, {run.name: run.kept for run in runs})
    return sinks + runs


class JsonLinesSink:
    """The metrics file: one JSON object per iteration, keys sorted, NaN and infinity as null (strict
    JSON), flushed per line. Opening it applies the resume rule; the lines it keeps go to ``summary``."""

    def __init__(self, path: str, start_iteration: int, summary: RunSummary):
        _drop_lines_after(Path(path), start_iteration, summary)
        self._file = open(path, "a", encoding="utf-8")
        self.where = f"metrics: {path}"

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        record = {k: v if math.isfinite(v) else None for k, v in metrics.items()}
        self._file.write(json.dumps({"iteration": iteration, **record}, sort_keys=True) + "\n")
        self._file.flush()  # a killed run keeps every finished iteration

    def close(self, failed: bool) -> None:
        self._file.close()


class TensorBoardSink:
    """TensorBoard scalars, one tag per key at step = iteration; steps after ``start_iteration`` are purged."""

    def __init__(self, log_dir: str, start_iteration: int):
        self._writer = SummaryWriter(log_dir, purge_step=start_iteration + 1)
        self.where = f"TensorBoard: {log_dir} (tensorboard --logdir {log_dir})"

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=iteration)
        self._writer.flush()

    def close(self, failed: bool) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run: every key at step = iteration (history ``_step``). A resumed run continues
    the ``kept`` run of the same project (``resume="allow"``; offline, W&B writes a second local folder
    with the same run id, which ``wandb sync`` appends). Where it goes: WANDB_MODE, WANDB_DIR."""

    name = "wandb"

    def __init__(self, config: LoggingConfig, kept: Mapping | None, desc: str):
        import wandb

        project = config.wandb_project
        run_id = kept["id"] if kept and kept.get("project") == project else None  # None: a new run
        self._run = wandb.init(project=project, name=config.wandb_run_name, id=run_id,
                               resume="allow" if run_id else None, job_type=desc)
        self.kept = {"project": project, "id": self._run.id}
        local = Path(self._run.dir).parent
        self.where = (f"W&B: offline run {local} (wandb sync {local} uploads it)" if self._run.offline
                      else f"W&B: {self._run.url or 'disabled (WANDB_MODE)'}")

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=iteration)

    def close(self, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class MlflowSink:
    """An MLflow run: every key at step = iteration. A resumed run continues the ``kept`` run of the same
    tracking URI and experiment (set RUNNING again) while the store still has it; otherwise a new run. A
    local URI (``file:DIR`` or a path) is the file store, which mlflow 3 opens only with
    MLFLOW_ALLOW_FILE_STORE=true: the URI asked for it, so that is set (unless already set) in this process."""

    name = "mlflow"

    def __init__(self, config: LoggingConfig, kept: Mapping | None, desc: str):
        uri = config.mlflow_tracking_uri
        if urlparse(uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        experiment_id = self._experiment_id(config.mlflow_experiment)
        same = kept and kept.get("tracking_uri") == uri and kept.get("experiment_id") == experiment_id
        self._run_id = self._continued(kept["run_id"]) if same else None
        if self._run_id is None:
            self._run_id = self._client.create_run(experiment_id, tags={"rlhf.program": desc}).info.run_id
        self.kept = {"tracking_uri": uri, "experiment_id": experiment_id, "run_id": self._run_id}
        self.where = f"MLflow: {uri} experiment {config.mlflow_experiment or 'Default'} run {self._run_id}"

    def _continued(self, run_id: str) -> str | None:
        """``run_id``, set RUNNING again; None (a warning) when the store has no such run any more."""
        from mlflow.exceptions import MlflowException

        try:
            self._client.update_run(run_id, status="RUNNING")
        except MlflowException as exc:
            logger.warning("MLflow run %s cannot be continued (%s); starting a new run", run_id, exc)
            return None
        return run_id

    def _experiment_id(self, name: str | None) -> str:
        """The id of experiment ``name``, created when missing; None: MLflow's Default experiment ("0")."""
        if name is None:
            return "0"
        experiment = self._client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else self._client.create_experiment(name)

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, now, iteration) for k, v in metrics.items()])

    def close(self, failed: bool) -> None:
        self._client.set_terminated(self._run_id, "FAILED" if failed else "FINISHED")


def _read_runs(path: Path) -> dict:
    """The backend runs kept in ``path`` ({} when there is none: saved before a backend was on)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def _write_runs(path: Path, runs: Mapping) -> None:
    """Keep ``runs`` ({backend: its run}) in ``path`` (atomically; the folder is made when missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class RunSummary:
    """Owns what the line that ends a run says: the first and the last ``window`` values of each of
    ``keys`` (a value logged as NaN, or null in the file, counts as NaN; a run shorter than two windows
    compares its two halves, so they never overlap), the span of iterations seen and the mean
    ``time_iteration_s``."""

    def __init__(self, keys: tuple, window: int = SUMMARY_WINDOW):
        self.keys, self.window = tuple(keys), window
        self.first: dict[str, list] = {k: [] for k in self.keys}
        self.last: dict[str, deque] = {k: deque(maxlen=window) for k in self.keys}
        self.counts: dict[str, int] = dict.fromkeys(self.keys, 0)
        self.span: tuple[int, int] | None = None
        self.seconds, self.timed = 0.0, 0

    def add(self, iteration: int, record: Mapping) -> None:
        """Count iteration ``iteration``'s metrics (floats, or None for a null of the file)."""
        for key in self.keys:
            if key in record:
                pair = (iteration, math.nan if record[key] is None else record[key])
                if len(self.first[key]) < self.window:
                    self.first[key].append(pair)
                self.last[key].append(pair)
                self.counts[key] += 1
        if record.get("time_iteration_s") is not None:
            self.seconds += record["time_iteration_s"]
            self.timed += 1
        self.span = (iteration if self.span is None else self.span[0], iteration)

    def line(self, desc: str, places: list[str], metrics_file: str | None) -> str:
        """``<desc> done: iterations A-B, S s/iteration; <key> <first mean> (A-..) -> <last mean> (..-B); ...;
        <where each output went>; plot: <command>``; ``places``: where each output went."""
        if self.span is None:
            return f"{desc} done: no iteration logged; " + "; ".join(places)
        head = f"{desc} done: iterations {self.span[0]}-{self.span[1]}"
        parts = [head + (f", {self.seconds / self.timed:.3g} s/iteration" if self.timed else "")]
        present = [k for k in self.keys if self.first[k]]
        for k in present:
            n = min(self.window, max(1, self.counts[k] // 2))
            parts.append(f"{k} {_window_mean(self.first[k][:n])} -> {_window_mean(list(self.last[k])[-n:])}")
        parts += places
        if metrics_file is None:
            parts.append("no metrics file (--metrics-file FILE keeps one to plot)")
        elif present:
            png = Path(metrics_file).with_suffix(".png")
            parts.append(f"plot: python tools/plot_metrics.py --metrics {metrics_file} --out {png} "
                         f"--keys {' '.join(present)}")
        return "; ".join(parts)


def _window_mean(pairs) -> str:
    """``0.1234 (1-10)``: the mean of (iteration, value) pairs and the iterations they span."""
    values = [v for _, v in pairs]
    return f"{sum(values) / len(values):.4g} ({pairs[0][0]}-{pairs[-1][0]})"


def _drop_lines_after(path: Path, last_kept: int, summary: RunSummary) -> None:
    """Rewrite ``path`` (atomically) keeping only readable lines with ``iteration <= last_kept``;
    each kept record is added to ``summary``."""
    if not path.exists():
        return
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        record = _line_record(line)
        if record is not None and record["iteration"] <= last_kept:
            kept.append(line + "\n")
            summary.add(record["iteration"], record)
        else:
            dropped += 1
    if dropped:
        logger.warning("%s: dropped %d line(s) after iteration %d (resume rule)", path, dropped, last_kept)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def _line_record(line: str) -> dict | None:
    """A metrics line's record; None for a line that is not a complete record with an int ``iteration``."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(record, dict) and isinstance(record.get("iteration"), int)
    return record if ok else None
