"""Inter-stage fusion runtime, generation side: count the unfinished samples, migrate the long tail.

Every generation instance (one actor_gen DP replica; its TP ranks run the
same engine in lockstep) steps its engine. Every ``check_every`` loop steps
all ranks of the generation mesh all-gather one int64 row each (the one
small collective)::

    [samples assigned, finished, exportable now, free KV tokens, KV tokens of the exportable]

When the batch's unfinished samples number at most `migration_limit(R, batch)`
(and every unfinished sample can be exported), every rank derives the same
plan from the same rows: the destinations (`choose_destinations`) and, after
one object all-gather of the sample ids, the moves (`assign_moves`). Each TP
rank of a source sends its shard (K/V, or tokens only for re-prefill) to the
same TP rank of the destination, in one global order (deadlock-free: sources
only send, destinations only receive). The sources are then free; the
destinations run to the end. A refused message leaves the sample with its
source, which imports it back and finishes it: no sample is lost.

The same gather hands every rank the samples finished so far
(``finished_at_migration``): the trainer (`rlhf.fusion.inter_stage`, with
``--inter-stage-fusion``) infers them on the freed ranks while the
destinations generate, and `finish_tail` hands each sample a destination
finishes on to them (`rlhf.fusion.stream`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.engine import Engine, OutOfBlocksError, Request, SampleResult
from rlhf.fusion.policy import FusionPolicyError, assign_moves, choose_destinations, migration_limit
from rlhf.fusion.transport import MigrationFormatError, MigrationRefused, recv_sequence, send_sequence
from rlhf.parallel.exchange import gather_to_all

ASSIGNED, FINISHED, EXPORTABLE, FREE_KV, HELD_KV = range(5)


@dataclass(frozen=True)
class MigrationConfig:
    """R (fraction of the batch; 0 never migrates), K/V or tokens only, steps between counts, B_sat."""

    threshold: float
    migrate_kv: bool = True
    check_every: int = 4
    b_sat: int = 32

    def __post_init__(self):
        for name, ok, valid in (("threshold", 0 <= self.threshold <= 1, "a fraction in [0, 1]"),
                                ("check_every", self.check_every >= 1, ">= 1"), ("b_sat", self.b_sat >= 1, ">= 1")):
            if not ok:
                raise FusionPolicyError(f"MigrationConfig.{name}={getattr(self, name)!r} is invalid: must be {valid}")


@dataclass
class FusedGeneration:
    """What one rank's instance generated, and what the migration did from its side.

    ``samples``: the samples that finished here (TP ranks of an instance hold the same ones).
    ``migrate_step``: the loop step of the migration (None: none); ``destinations``: DP indices.
    ``finished_at_migration``: every instance's samples finished by then (the same on every rank of
    the generation mesh), which the freed ranks can infer while the destinations generate.
    """

    samples: list[SampleResult]
    migrate_step: int | None = None
    destinations: tuple[int, ...] = ()
    finished_at_migration: list[SampleResult] = dataclasses.field(default_factory=list)
    moved_out: int = 0
    moved_in: int = 0
    bytes_sent: int = 0
    refused: int = 0
    generation_s: float = 0.0
    migration_s: float = 0.0


def fused_generate(engine: Engine, requests: list[Request], groups, cfg: MigrationConfig,
                   finish: bool = True) -> FusedGeneration:
    """Run this instance's ``requests``; migrate the batch's long tail once it is short enough (collective
    over the generation mesh ``groups.mesh_group``: every rank of it calls this).

    ``finish=False`` returns right after the migration, leaving the long tail in ``engine`` for the caller
    to run with `finish_tail` (which can hand each finished sample on as it finishes)."""
    start = time.perf_counter()
    for r in requests:
        engine.add_request(r)
    out = FusedGeneration([])
    assigned, step = sum(r.params.n for r in requests), 0
    while True:
        if step and step % cfg.check_every == 0:
            rows = _report(engine, groups, assigned, len(out.samples))
            unfinished = sum(r[ASSIGNED] - r[FINISHED] for r in rows)
            if unfinished == 0:
                break
            ready = all(r[EXPORTABLE] == r[ASSIGNED] - r[FINISHED] for r in rows)
            if ready and unfinished <= migration_limit(cfg.threshold, sum(r[ASSIGNED] for r in rows)):
                out.migrate_step = step
                moving = time.perf_counter()
                _migrate(engine, groups, rows, cfg, out)
                out.migration_s = time.perf_counter() - moving
                break
        if engine.has_unfinished():
            out.samples += engine.step()
        step += 1
    out.generation_s = time.perf_counter() - start
    if finish:
        finish_tail(engine, out)
    return out


def finish_tail(engine: Engine, out: FusedGeneration, on_finished=None, every: int = 1) -> None:
    """Run what ``engine`` still holds to the end (a destination's long tail, or a sample a source kept),
    adding to ``out``. ``on_finished(samples, last)`` is called every ``every`` steps with the samples
    finished since its last call (possibly none), and once at the end with ``last=True``."""
    start, step, fresh = time.perf_counter() - out.generation_s, 0, []
    while engine.has_unfinished():
        done = engine.step()
        out.samples += done
        fresh += done
        step += 1
        if on_finished is not None and step % every == 0 and engine.has_unfinished():
            on_finished(fresh, False)
            fresh = []
    if on_finished is not None:
        on_finished(fresh, True)
    out.generation_s = time.perf_counter() - start


def _report(engine: Engine, groups, assigned: int, finished: int) -> list[list[int]]:
    """Every instance's count row, by DP index (one all-gather over the generation mesh)."""
    samples = engine.exportable()
    free_kv = engine.kv.pool.num_free * engine.config.block_size
    mine = torch.tensor([assigned, finished, len(samples), free_kv, sum(n for _, _, n in samples)],
                        dtype=torch.int64, device=platform.device())
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(groups.mesh_group))]
    dist.all_gather(parts, mine, group=groups.mesh_group)
    mesh, rows = groups.mesh, {}
    for rank, part in zip(dist.get_process_group_ranks(groups.mesh_group), parts):
        coord = mesh.coord(rank)
        if coord.tp == 0:
            rows[coord.dp] = part.tolist()  # .tolist(): the decision is taken on the host
    return [rows[d] for d in range(mesh.strategy.dp)]


def _migrate(engine: Engine, groups, rows: list[list[int]], cfg: MigrationConfig, out: FusedGeneration) -> None:
    """Move every unfinished sample off the non-destinations, in one global order."""
    mesh, me, tp = groups.mesh, groups.coord.dp, groups.coord.tp
    free_kv = [r[FREE_KV] for r in rows]
    out.destinations = choose_destinations([r[ASSIGNED] - r[FINISHED] for r in rows], free_kv,
                                           [r[HELD_KV] for r in rows], cfg.b_sat)
    mine = [(me, engine.exportable(), out.samples)] if tp == 0 else []
    gathered = gather_to_all(mine, group=groups.mesh_group)
    lists = {dp: unfinished for dp, unfinished, _ in gathered}
    out.finished_at_migration = sorted((s for _, _, finished in gathered for s in finished),
                                       key=lambda s: (s.request_id, s.sample_index))
    samples = [lists[d] for d in range(mesh.strategy.dp)]
    for src, pos, dst in assign_moves([[n for _, _, n in s] for s in samples], out.destinations, free_kv):
        if me == src:
            request_id, index, _ = samples[src][pos]
            state = engine.export_sequence(request_id, index, with_kv=cfg.migrate_kv)
            try:
                out.bytes_sent += send_sequence(state, mesh.rank(0, dst, tp))
                out.moved_out += 1
            except MigrationRefused:
                engine.import_sequence(state)  # it stays here and finishes here
                out.refused += 1
        elif me == dst:
            try:
                state = recv_sequence(mesh.rank(0, src, tp))
            except MigrationFormatError:
                continue  # the source was told and keeps the sample
            _import(engine, state)
            out.moved_in += 1


def _import(engine: Engine, state) -> None:
    """Continue ``state`` here; if its K/V do not fit now, re-prefill its tokens instead (every TP rank of
    the instance sees the same free blocks, so all take the same branch)."""
    try:
        engine.import_sequence(state)
    except OutOfBlocksError:
        engine.import_sequence(dataclasses.replace(state, kv=None, num_computed=0))
