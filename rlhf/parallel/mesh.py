"""A task's device mesh: which ranks run it and how (dp, pp, tp) maps onto them.

Rank layout inside a mesh (megatron's order, tp fastest, then dp, then pp)::

    mesh position i = tp_idx + tp * (dp_idx + dp * pp_slot)

    ranks [0 1 2 3 4 5 6 7], tp=2, dp=2, pp=2:
        pp slot 0: dp0 -> (0, 1)   dp1 -> (2, 3)
        pp slot 1: dp0 -> (4, 5)   dp1 -> (6, 7)

A pipeline with ``reverse_pp`` runs its stages in reverse slot order (logical
stage s lives in slot pp-1-s), so two models on the same ranks can pipeline in
opposite directions (bidirectional fusion: actor stage 0 shares ranks with the
critic's last stage).
"""

from __future__ import annotations

from dataclasses import dataclass


class PlacementError(ValueError):
    """An invalid placement; the message names the task and the broken rule."""


@dataclass(frozen=True)
class ParallelStrategy:
    """Data, pipeline and tensor parallel degrees of one task, and the expert-parallel degree ``ep`` carved
    out of the data-parallel ranks (megatron's way: ``ep`` consecutive DP replicas split a mixture of
    experts' experts between them, each holding num_experts / ep whole experts; the replicas holding the
    same experts are the expert-data-parallel group). ``ep`` must divide ``dp``."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name in ("dp", "pp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PlacementError(f"{name} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            raise PlacementError(f"ep={self.ep} does not divide dp={self.dp}; expert parallelism splits the "
                                 "experts over ep of the data-parallel replicas, so choose ep dividing dp")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def __str__(self) -> str:
        return f"dp{self.dp}xpp{self.pp}xtp{self.tp}" + (f"xep{self.ep}" if self.ep > 1 else "")


@dataclass(frozen=True)
class Coord:
    """Position of one rank inside a task mesh (pp is the logical stage)."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class TaskMesh:
    """The ranks of one task and its parallel strategy."""

    task: str
    ranks: tuple[int, ...]
    strategy: ParallelStrategy
    reverse_pp: bool = False

    def __post_init__(self):
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if len(set(self.ranks)) != len(self.ranks):
            dup = sorted({r for r in self.ranks if self.ranks.count(r) > 1})
            raise PlacementError(f"{self.task}: rank(s) {dup} appear twice in the mesh {list(self.ranks)}")
        if self.strategy.size != len(self.ranks):
            raise PlacementError(
                f"{self.task}: dp*pp*tp = {self.strategy.dp}*{self.strategy.pp}*{self.strategy.tp} = "
                f"{self.strategy.size} but the mesh has {len(self.ranks)} ranks {list(self.ranks)}; "
                "choose degrees whose product is the mesh size"
            )
        tp = self.strategy.tp
        for start in range(0, len(self.ranks), tp):
            block = list(self.ranks[start:start + tp])
            if block != sorted(block):
                raise PlacementError(
                    f"{self.task}: TP group {block} must list its ranks in ascending order "
                    "(megatron indexes TP shards by sorted rank); use reverse_pp to reverse a pipeline"
                )

    def _slot(self, pp: int) -> int:
        return self.strategy.pp - 1 - pp if self.reverse_pp else pp

    def rank(self, pp: int, dp: int, tp: int) -> int:
        """Global rank at logical pipeline stage ``pp``, data replica ``dp``, TP index ``tp``."""
        s = self.strategy
        return self.ranks[tp + s.tp * (dp + s.dp * self._slot(pp))]

    def coord(self, rank: int) -> Coord | None:
        """This rank's (pp, dp, tp) in the mesh, or None if it is not in it."""
        if rank not in self.ranks:
            return None
        i = self.ranks.index(rank)
        s = self.strategy
        tp, rest = i % s.tp, i // s.tp
        dp, slot = rest % s.dp, rest // s.dp
        return Coord(pp=self._slot(slot), dp=dp, tp=tp)

    def tp_ranks(self, pp: int, dp: int) -> list[int]:
        return [self.rank(pp, dp, t) for t in range(self.strategy.tp)]

    def dp_ranks(self, pp: int, tp: int) -> list[int]:
        return [self.rank(pp, d, tp) for d in range(self.strategy.dp)]

    def pp_ranks(self, dp: int, tp: int) -> list[int]:
        """Ranks of one pipeline, in logical stage order."""
        return [self.rank(p, dp, tp) for p in range(self.strategy.pp)]

    def ep_ranks(self, pp: int, dp: int, tp: int) -> list[int]:
        """The expert-parallel group of replica ``dp``: the ``ep`` consecutive replicas that split the experts,
        in expert-parallel rank order."""
        first = dp - dp % self.strategy.ep
        return [self.rank(pp, first + e, tp) for e in range(self.strategy.ep)]

    def ep_index(self, pp: int, dp: int, tp: int) -> int:
        """The expert-parallel rank of position (pp, dp, tp): its index in its sorted EP group, as megatron
        numbers it (it holds experts ep_index * E / ep .. (ep_index + 1) * E / ep - 1 of E)."""
        return sorted(self.ep_ranks(pp, dp, tp)).index(self.rank(pp, dp, tp))

    def expert_dp_ranks(self, pp: int, dp: int, tp: int) -> list[int]:
        """The replicas holding the same experts as replica ``dp`` (its expert-data-parallel group)."""
        s = self.strategy
        return [self.rank(pp, dp % s.ep + k * s.ep, tp) for k in range(s.dp // s.ep)]

    def mp_ranks(self, dp: int) -> list[int]:
        """The tp x pp ranks holding one full copy of the model."""
        return [self.rank(p, dp, t) for p in range(self.strategy.pp) for t in range(self.strategy.tp)]


def sharing_ranks(meshes: dict, task: str) -> dict[str, list[int]]:
    """The other tasks of ``meshes`` ({task: TaskMesh}) that hold a rank of ``task``'s, with those ranks, in
    ``meshes`` order (an asynchronous run needs none for actor_gen)."""
    own = set(meshes[task].ranks)
    shared = {t: sorted(own & set(m.ranks)) for t, m in meshes.items() if t != task}
    return {t: ranks for t, ranks in shared.items() if ranks}
