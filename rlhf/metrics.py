"""Per-iteration metrics: stage timing, cross-rank reduction, and the outputs on rank 0.

What the trainer calls, once per iteration::

    timer.start_iteration(it)                 StageTimer: wall seconds per named stage,
    with timer.stage("generation"): ...         and this rank's Timeline on a traced iteration
    local = {**timer.metrics(), ...}          floats or 0-dim tensors, any keys per rank
    metrics = with_rates(reduce_metrics(local))   collective: one dict, equal on every rank
    writer.log(it, metrics)                   MetricsWriter: progress bar, JSON Lines,
                                                TensorBoard (rank 0 only)
    if timer.timeline is not None: write_trace(path, timer.timeline)   collective: one trace

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
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from rlhf import platform
from rlhf.config import LoggingConfig
from rlhf.pipeline.timeline import Event, Timeline, gather, write_chrome_trace

logger = logging.getLogger(__name__)

STAGE_KIND = "STAGE"
"""Category of stage spans in the Chrome trace (executor instructions use FORWARD/BACKWARD/...)."""

POSTFIX = (("reward", "reward_mean"), ("kl", "kl_mean"), ("len", "response_length_mean"),
           ("samples/s", "samples_per_s"))
"""(label, metric key) shown in the progress bar's postfix when the key is present."""


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

    def metrics(self) -> dict[str, float]:
        """``{"time_<stage>_s": seconds}`` for each stage run, and ``time_iteration_s``:
        seconds since :meth:`start_iteration`."""
        out = {f"time_{name}_s": s for name, s in self.seconds.items()}
        out["time_iteration_s"] = self.clock() - self._start
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
    """Owns the run's outputs: a progress bar, the JSON Lines file and TensorBoard events.

    Built on every rank; only ``rank == 0`` writes. ``start_iteration`` is the
    number of iterations already done (a resumed checkpoint's iteration; 0 for a
    fresh run), so the first :meth:`log` is iteration ``start_iteration + 1``.
    ``desc`` names the progress bar and ``postfix`` lists the (label, metric
    key) pairs shown after it (default: PPO's).

    Resume rule: the outputs describe the run that is writing them. Lines of
    ``metrics_file`` with ``iteration > start_iteration`` (an abandoned future
    this run recomputes, or a fresh run's predecessor) and unreadable lines (a
    partial line from a killed run) are dropped before appending; TensorBoard
    events from step ``start_iteration + 1`` on are hidden through
    ``SummaryWriter(purge_step=...)``.
    """

    def __init__(self, config: LoggingConfig, total_iterations: int, rank: int, start_iteration: int = 0,
                 desc: str = "ppo", postfix: tuple = POSTFIX):
        self.active = rank == 0
        self.last_iteration = start_iteration
        self.postfix = postfix
        self._file = self._tb = None
        self._bar = tqdm(total=total_iterations, initial=start_iteration, desc=desc, unit="it",
                         dynamic_ncols=True, disable=not (self.active and config.progress))
        if not self.active:
            return
        if config.metrics_file is not None:
            _drop_lines_after(Path(config.metrics_file), start_iteration)
            self._file = open(config.metrics_file, "a", encoding="utf-8")
        if config.tensorboard_dir is not None:
            self._tb = SummaryWriter(config.tensorboard_dir, purge_step=start_iteration + 1)

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """Record iteration ``iteration``'s reduced metrics (floats) everywhere configured."""
        if iteration <= self.last_iteration:
            raise ValueError(f"iteration {iteration} logged after iteration {self.last_iteration}; "
                             "iterations must increase")
        self.last_iteration = iteration
        if not self.active:
            return
        if self._file is not None:
            record = {k: v if math.isfinite(v) else None for k, v in metrics.items()}  # strict JSON: no NaN/inf
            self._file.write(json.dumps({"iteration": iteration, **record}, sort_keys=True) + "\n")
            self._file.flush()  # a killed run keeps every finished iteration
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, value, global_step=iteration)
            self._tb.flush()
        self._bar.set_postfix({label: f"{metrics[key]:.4g}" for label, key in self.postfix if key in metrics},
                              refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        """Close the bar, the file and the TensorBoard writer (idempotent)."""
        self._bar.close()
        for handle in (self._file, self._tb):
            if handle is not None:
                handle.close()
        self._file = self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _drop_lines_after(path: Path, last_kept: int) -> None:
    """Rewrite ``path`` (atomically) keeping only readable lines with ``iteration <= last_kept``."""
    if not path.exists():
        return
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        if _line_iteration(line) <= last_kept:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        logger.warning("%s: dropped %d line(s) after iteration %d (resume rule)", path, dropped, last_kept)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def _line_iteration(line: str) -> float:
    """The ``iteration`` of a metrics line; +inf for a line that is not a complete record."""
    try:
        iteration = json.loads(line)["iteration"]
    except (ValueError, KeyError, TypeError):
        return math.inf
    return iteration if isinstance(iteration, int) else math.inf
