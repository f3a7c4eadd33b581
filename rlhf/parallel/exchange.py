"""Moving small host objects (samples, per-sample outputs) between all ranks.

The trainer's batch is small next to the models, so after generation and
after inference every rank receives all of it with one object all-gather;
each task's DP replica then takes its share by index (rlhf.parallel.dealing.shares).
"""

from __future__ import annotations

import torch.distributed as dist


def gather_to_all(mine: list, group=None) -> list:
    """Every rank's ``mine`` list concatenated in rank order, on every rank (collective)."""
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    return [item for part in parts for item in part]


def first_rank(group=None) -> int:
    """The global rank of ``group``'s first rank (rank 0 of the world when None): where a group's
    one-rank work runs before a broadcast from it."""
    return dist.get_global_rank(group, 0) if group is not None else 0
