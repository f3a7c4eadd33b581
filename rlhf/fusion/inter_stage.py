"""Inter-stage fusion inside the trainer: fused generation, inference on the freed ranks, metrics.

One iteration with ``--inter-stage-fusion`` (docs/fusion.md)::

    every generation instance      fused_generate (rlhf.fusion.runtime): count every k steps;
                                   at <= R x batch unfinished, migrate them to m destinations
    destinations                   generate the long tail, streaming the samples they finish to
                                   the freed ranks every k steps (rlhf.fusion.stream)
    ranks freed by the migration   infer the samples finished by then, then each streamed batch:
                                   each inference task's DP replicas whose ranks are all free
                                   take the samples in turns
    every rank                     one object all-gather: the samples and what was inferred early;
                                   then the trainer infers the rest (the batch that ended
                                   generation, and tasks with no freed replica) on all replicas

A sample's reference log-probs, score and values do not depend on which
replica or micro-batch computes them, so the outputs equal the unfused run's
(up to float rounding of other batch shapes).

R is ``fusion.migration_threshold``, or auto: `FIRST_THRESHOLD` in the first
iteration, then the policy's choice (`choose_threshold`) for the response
lengths seen so far and the step and inference times the last iteration
measured. ``migrate_kv`` auto ships K/V unless the last migration measured
that re-prefilling the tokens costs less.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch.distributed as dist

from rlhf.fusion.policy import GenerationCost, LengthDistribution, choose_threshold
from rlhf.fusion.runtime import FusedGeneration, MigrationConfig, finish_tail, fused_generate
from rlhf.fusion.stream import StreamSender, receive
from rlhf.parallel.exchange import gather_to_all
from rlhf.pipeline.inference import InferenceRunner

FIRST_THRESHOLD = 0.2
"""R of the first iteration under ``migration_threshold auto``: RLHFuse's measured best (its Figure 9)."""


@dataclass
class EarlyInference:
    """What the freed ranks inferred during generation.

    ``done``: {task: batch indices its early replicas inferred} (the same on every rank after `gather`);
    ``outputs``: the output batches this rank computed (last stage, TP rank 0: rlhf.pipeline.inference).
    """

    done: dict = field(default_factory=dict)
    outputs: list = field(default_factory=list)


@dataclass
class FusionOutcome:
    """What fused generation hands to inference on this rank: its fused generation (None off
    actor_gen), for the metrics, and what the freed ranks inferred meanwhile."""

    fused: FusedGeneration | None
    early: EarlyInference


class Stream(NamedTuple):
    """The long tail's stream: the freed ranks that infer (``receivers``) and the ranks of the
    destinations that send them the samples they finish (``senders``)."""

    receivers: list
    senders: list


class GenerationReport(NamedTuple):
    """One rank's timing of the iteration's generation, gathered to every rank (None: did not run there):
    its generation and migration seconds, its early-inference window (start, end) in seconds since
    generation began, and its instance's engine steps."""

    generation_s: float | None
    migration_s: float | None
    window: tuple | None
    steps: int | None


def early_replicas(mesh, freed: set) -> list[int]:
    """DP indices of ``mesh``'s replicas whose every rank is in ``freed``."""
    return [d for d in range(mesh.strategy.dp) if set(mesh.mp_ranks(d)) <= freed]


def batch_index(request_id: str, sample_index: int, n: int) -> int:
    """A sample's row in the iteration's batch: prompt ``request_id``'s ``n`` samples sit together."""
    return int(request_id) * n + sample_index


class InterStageFusion:
    """The trainer's inter-stage fusion (collective methods: every rank calls them in the same order).

    ``inference``: the inference tasks the trainer runs, in its order.
    """

    def __init__(self, config, placement, inference: list[str], b_sat: int):
        self.cfg, self.placement, self.inference, self.b_sat = config.fusion, placement, inference, b_sat
        self.n, self.micro_batch_size = config.ppo.n_samples_per_prompt, config.ppo.micro_batch_size
        self.batch_size = config.ppo.rollout_batch_size * self.n
        self.seed = config.run.seed
        self.lengths = LengthDistribution()
        self.threshold = FIRST_THRESHOLD if self.cfg.migration_threshold is None else self.cfg.migration_threshold
        self.migrate_kv = self.cfg.migrate_kv != "no"
        self._step_s = None  # the last iteration's seconds per engine step (slowest instance)
        self._last, self._gen_steps = {}, 0  # this iteration's figures for metrics() and observe()
        self.start_iteration()

    # ---- one iteration ---------------------------------------------------------------

    def start_iteration(self) -> None:
        """Mark the start of generation on this rank (every rank, before `generate`)."""
        self._start, self._steps, self._window = time.perf_counter(), None, None
        self.streamed = 0  # samples this freed rank received from the destinations while they generated

    def generate(self, engine, requests, groups) -> FusedGeneration:
        """This instance's ``requests`` with the long tail migrated at R (collective over actor_gen); a
        destination streams the samples it finishes to the freed ranks (`rlhf.fusion.stream`)."""
        steps = engine.stats.steps
        fused = fused_generate(engine, requests, groups, MigrationConfig(
            self.threshold, self.migrate_kv, self.cfg.migration_check_every, b_sat=self.b_sat), finish=False)
        stream = self._stream(fused)
        if stream is not None and groups.coord.dp in fused.destinations and groups.tp_rank == 0:
            sender = StreamSender(stream.receivers)
            finish_tail(engine, fused, sender.send, every=self.cfg.migration_check_every)
            sender.close()
        else:
            finish_tail(engine, fused)
        self._steps = engine.stats.steps - steps
        return fused

    def _freed(self, fused: FusedGeneration) -> set:
        """The ranks of the instances the migration freed (every rank of actor_gen derives the same set)."""
        gen = self.placement["actor_gen"]
        return {r for d in range(gen.strategy.dp) if d not in fused.destinations for r in gen.mp_ranks(d)}

    def _stream(self, fused: FusedGeneration | None) -> Stream | None:
        """Who streams the long tail to whom, or None: no migration, or no inference task has a replica
        within the freed ranks."""
        if fused is None or fused.migrate_step is None:
            return None
        freed = self._freed(fused)
        meshes = [self.placement[task] for task in self.inference]
        inferring = sorted({r for mesh in meshes for d in early_replicas(mesh, freed) for r in mesh.mp_ranks(d)})
        gen = self.placement["actor_gen"]
        return Stream(inferring, [gen.rank(0, d, 0) for d in fused.destinations]) if inferring else None

    def infer_early(self, fused: FusedGeneration | None, make_batch: Callable,
                    runner: InferenceRunner) -> EarlyInference:
        """On a rank the migration freed: the samples finished by then, then each batch the destinations
        stream (``make_batch(samples) -> Batch``), shared by each inference task's replicas that lie within
        the freed ranks (``runner.infer(task, part)``). Elsewhere (destinations, ranks outside actor_gen, no
        migration): nothing."""
        early, stream = EarlyInference(), self._stream(fused)
        if stream is None or dist.get_rank() not in stream.receivers:
            return early
        start, freed = time.perf_counter(), self._freed(fused)
        dealt = {}  # task -> samples dealt so far: batch after batch, the replicas take turns

        def infer(samples: list) -> None:
            samples = sorted(samples, key=lambda s: batch_index(s.request_id, s.sample_index, self.n))
            index = [batch_index(s.request_id, s.sample_index, self.n) for s in samples]
            batch = make_batch(samples)
            for task in self.inference:
                mesh = self.placement[task]
                replicas = early_replicas(mesh, freed)
                if not replicas:
                    continue
                early.done.setdefault(task, set()).update(index)
                coord = mesh.coord(dist.get_rank())
                first = dealt.get(task, 0)
                dealt[task] = first + len(samples)
                mine = replicas.index(coord.dp) if coord is not None and coord.dp in replicas else None
                part = [k for k in range(len(samples)) if (first + k) % len(replicas) == mine]
                if part:  # a batch smaller than the replica count leaves some replicas (all their ranks) idle
                    out = runner.infer(task, batch.select(part))
                    if out is not None:
                        early.outputs.append(out)

        pending = []  # streamed samples wait for a micro-batch's worth: fewer, fuller forward passes

        def infer_streamed(samples: list) -> None:
            pending.extend(samples)
            if len(pending) >= self.micro_batch_size:
                self.streamed += len(pending)
                infer(pending)
                pending.clear()

        if fused.finished_at_migration:
            infer(fused.finished_at_migration)
        receive(stream.senders, infer_streamed)  # what is left pending goes to the last phase, on every replica
        self._window = (start - self._start, time.perf_counter() - self._start)
        return early

    def gather(self, mine: list, early: EarlyInference, fused: FusedGeneration | None) -> tuple[list, EarlyInference]:
        """Every rank's finished samples, and the early plan made known to every rank (collective)."""
        report = GenerationReport(None if fused is None else fused.generation_s,
                                  None if fused is None else fused.migration_s, self._window, self._steps)
        parts = gather_to_all([(mine, early.done, report)])
        for _, done, _ in parts:
            for task, index in done.items():
                early.done.setdefault(task, set()).update(index)
        self._record([report for _, _, report in parts])
        return [s for part in parts for s in part[0]], early

    def _record(self, reports: list) -> None:
        """The iteration's timing: generation ends when the slowest instance does; a freed rank's
        early inference overlaps generation up to then."""
        gen_s = max((r.generation_s for r in reports if r.generation_s is not None), default=0.0)
        windows = [r.window for r in reports if r.window is not None]
        migration_s = max((r.migration_s for r in reports if r.migration_s is not None), default=0.0)
        self._last = {"time_fusion_generation_s": gen_s, "time_fusion_migration_s": migration_s,
                      "time_fusion_early_inference_s": max((b - a for a, b in windows), default=0.0),
                      "time_fusion_overlap_s": max((max(0.0, min(b, gen_s) - a) for a, b in windows), default=0.0)}
        self._gen_steps = max((r.steps for r in reports if r.steps), default=0)

    def metrics(self, fused: FusedGeneration | None, tp_rank: int | None) -> dict:
        """This rank's fusion metrics (R, m, migrated samples and bytes, seconds of generation, early
        inference and their overlap); reduced over the ranks by their names (rlhf.metrics)."""
        out = dict(self._last, fusion_threshold=self.threshold, fusion_migrate_kv=float(self.migrate_kv))
        if fused is not None:
            out["fusion_bytes_sum"] = float(fused.bytes_sent)
            if tp_rank == 0:
                out["fusion_migrated_count"] = float(fused.moved_out)
                out["fusion_destinations"] = float(len(fused.destinations))
            if dist.get_rank() == 0:
                out["fusion_early_samples_count"] = float(len(fused.finished_at_migration))
        stream = self._stream(fused)
        if stream is not None and dist.get_rank() == stream.receivers[0]:  # one of the freed ranks that infer
            out["fusion_streamed_count"] = float(self.streamed)
        return out

    # ---- between iterations: the auto choices ----------------------------------------

    def observe(self, response_lengths: list, metrics: dict, instances: int) -> None:
        """Refine the auto choices from a finished iteration (``metrics``: reduced, the same on every rank)."""
        self.lengths.observe([max(1, n) for n in response_lengths])
        gen_s = metrics.get("time_fusion_generation_s", 0.0)
        if self._gen_steps and gen_s > 0:
            self._step_s = gen_s / self._gen_steps
        if self.cfg.migrate_kv == "auto" and metrics.get("fusion_migrated_count"):
            self.migrate_kv = self._kv_cheaper(metrics)
        if self.cfg.migration_threshold is None and self._step_s:
            infer_s = metrics.get("time_inference_s", 0.0) + metrics.get("time_fusion_early_inference_s", 0.0)
            cost = GenerationCost(instances, self._step_s, self.b_sat, infer_s * instances / self.batch_size)
            self.threshold = choose_threshold(self.lengths, cost, self.batch_size, trials=8, seed=self.seed).threshold

    def _kv_cheaper(self, metrics: dict) -> bool:
        """Whether shipping K/V beat re-prefilling, as last measured: the migration's bytes over the
        generation's step time (a re-prefill costs about one engine step per migrated sample)."""
        moved = metrics["fusion_migrated_count"]
        reprefill_s = (self._step_s or math.inf) * moved
        transfer_s = metrics.get("time_fusion_migration_s", 0.0)
        return transfer_s <= reprefill_s
