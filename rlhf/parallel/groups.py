"""Per-task process groups: a megatron ProcessGroupCollection for every task.

`build_task_groups` is collective: every rank calls it with the same
placement and creates every group in the same order (``new_group`` is
collective), cached by rank set so tasks with identical sub-meshes share
communicators. A rank outside a task's mesh gets ``None`` for that task.

Reversed pipelines: ``new_group`` orders members by global rank, so
``group.rank()`` is the sorted index. megatron derives a stage's layers from
``pg_collection.pp.rank()/size()`` only, so the collection gets a thin view
reporting the logical stage; our own p2p code uses the mesh's peer ranks.

Experts: megatron's expert groups are ``ep`` (the replicas splitting the
experts), ``expt_tp`` (one rank: experts are not tensor-parallel) and
``expt_dp`` (the replicas holding the same experts); its ``tp_ep`` is the
expert-tensor x expert group, so with ``expt_tp`` of one rank it is ``ep``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from rlhf.models.gpt import PipelineStage
from rlhf.parallel.collectives import name_group, new_group
from rlhf.parallel.mesh import Coord, ParallelStrategy, TaskMesh
from rlhf.parallel.placement import Placement
from rlhf.tasks import TASKS


class LogicalStageGroup:
    """A pipeline group whose rank() is the logical stage of a reversed pipeline."""

    def __init__(self, group: dist.ProcessGroup, stage: int):
        self.process_group = group  # the communicator itself (what collectives.describe_group names)
        self._stage = stage

    def rank(self) -> int:
        return self._stage

    def size(self) -> int:
        return self.process_group.size()

    def __getattr__(self, name):
        return getattr(self.process_group, name)


@dataclass
class TaskGroups:
    """What one rank needs to run one task: its mesh, coordinate and groups."""

    mesh: TaskMesh
    coord: Coord
    pg_collection: object  # megatron ProcessGroupCollection
    tp: dist.ProcessGroup
    dp: dist.ProcessGroup
    pp: dist.ProcessGroup
    mp: dist.ProcessGroup
    mesh_group: dist.ProcessGroup
    expert_mp: dist.ProcessGroup  # the ranks holding one copy of every expert (mp with its ep group)

    @property
    def stage(self) -> PipelineStage:
        """This rank's logical pipeline stage, as ``build_model`` takes it."""
        return PipelineStage(self.coord.pp, self.mesh.strategy.pp)

    @property
    def is_first_stage(self) -> bool:
        return self.stage.is_first

    @property
    def is_last_stage(self) -> bool:
        return self.stage.is_last

    @property
    def tp_rank(self) -> int:
        """The TP shard index megatron uses (the rank within the sorted TP group)."""
        return self.tp.rank()

    def peer(self, stage_offset: int) -> int:
        """Global rank of the same (dp, tp) position ``stage_offset`` stages away."""
        return self.mesh.rank(self.coord.pp + stage_offset, self.coord.dp, self.coord.tp)


class _GroupCache:
    """Process-wide communicators, one per rank set (creation is collective)."""

    def __init__(self):
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def get(self, ranks, create: bool = True, user: str = "one rank") -> dist.ProcessGroup:
        """The group of ``ranks``, made when missing (collective), remembered as used by ``user``."""
        key = tuple(sorted(ranks))
        if key not in self._groups:
            if not create:
                raise RuntimeError(f"no process group for ranks {list(key)}; call build_task_groups first")
            self._groups[key] = new_group(key, user)
        else:
            name_group(self._groups[key], list(key), user)
        return self._groups[key]


_CACHE = _GroupCache()


def _rank_sets(mesh: TaskMesh) -> dict[str, list[list[int]]]:
    s = mesh.strategy
    return {
        "tp": [mesh.tp_ranks(p, d) for p in range(s.pp) for d in range(s.dp)],
        "dp": [mesh.dp_ranks(p, t) for p in range(s.pp) for t in range(s.tp)],
        "pp": [mesh.pp_ranks(d, t) for d in range(s.dp) for t in range(s.tp)],
        "mp": [mesh.mp_ranks(d) for d in range(s.dp)],
        "tp_dp": [[mesh.rank(p, d, t) for d in range(s.dp) for t in range(s.tp)] for p in range(s.pp)],
        "expert_mp": [[r for p in range(s.pp) for t in range(s.tp) for r in mesh.ep_ranks(p, d, t)]
                      for d in range(0, s.dp, s.ep)],
        "ep": [mesh.ep_ranks(p, d, t) for p in range(s.pp) for d in range(0, s.dp, s.ep) for t in range(s.tp)],
        "expert_dp": [mesh.expert_dp_ranks(p, e, t) for p in range(s.pp) for e in range(s.ep) for t in range(s.tp)],
        "mesh": [list(mesh.ranks)],
    }


def build_task_groups(placement: Placement, rank: int | None = None) -> dict[str, TaskGroups | None]:
    """Create all groups (collective) and return this rank's TaskGroups per task."""
    rank = dist.get_rank() if rank is None else rank
    cache = _CACHE
    singletons = [cache.get([r]) for r in range(placement.world_size)]
    result: dict[str, TaskGroups | None] = {}
    for task in TASKS:
        if task not in placement.meshes:
            result[task] = None
            continue
        mesh = placement[task]
        mine: dict[str, dist.ProcessGroup] = {}
        for kind, sets in _rank_sets(mesh).items():
            for ranks in sets:
                group = cache.get(ranks, user=f"{task} {kind}")
                if rank in ranks:
                    mine[kind] = group
        coord = mesh.coord(rank)
        result[task] = None if coord is None else _task_groups(mesh, coord, mine, singletons[rank])
    return result


def local_groups(task: str = "local") -> TaskGroups:
    """Groups for an unsharded model on this rank alone (a one-rank mesh).

    Uses the one-rank communicator made by `build_task_groups`, so no
    collective call happens here.
    """
    rank = dist.get_rank()
    mesh = TaskMesh(task, (rank,), ParallelStrategy())
    single = _CACHE.get([rank], create=False)
    mine = {kind: single for kind in ("tp", "dp", "pp", "mp", "tp_dp", "ep", "expert_dp", "expert_mp", "mesh")}
    return _task_groups(mesh, Coord(0, 0, 0), mine, single)


def _task_groups(mesh: TaskMesh, coord: Coord, mine: dict, single) -> TaskGroups:
    from megatron.core.process_groups_config import ProcessGroupCollection

    pp_view = LogicalStageGroup(mine["pp"], coord.pp) if mesh.reverse_pp else mine["pp"]
    pgc = ProcessGroupCollection(
        tp=mine["tp"], pp=pp_view, cp=single, tp_cp=mine["tp"], hcp=None,
        embd=None, pos_embd=None, mp=mine["mp"], dp=mine["dp"], dp_cp=mine["dp"],
        tp_dp_cp=mine["tp_dp"], intra_dp_cp=mine["dp"], ep=mine["ep"], expt_tp=single,
        tp_ep=mine["ep"], tp_ep_pp=None, expt_dp=mine["expert_dp"], intra_expt_dp=mine["expert_dp"],
        intra_dist_opt=mine["mesh"],
    )
    return TaskGroups(
        mesh=mesh, coord=coord, pg_collection=pgc, tp=mine["tp"], dp=mine["dp"],
        pp=mine["pp"], mp=mine["mp"], mesh_group=mine["mesh"], expert_mp=mine["expert_mp"],
    )
