"""Contiguous part sizes of N items: how a batch is dealt to DP replicas and generation instances.

Torch-free, so that the fusion policy (and through it the planner) deals a
simulated batch exactly as ``rlhf.batch.Batch.split`` deals a real one.
"""

from __future__ import annotations

from typing import Sequence, Union


def part_sizes(n: int, sizes: Union[int, Sequence[int]]) -> list[int]:
    """Sizes of contiguous parts of ``n`` items: ``sizes`` itself (checked), or ``sizes`` near-equal
    parts (the first ``n % sizes`` parts one item longer)."""
    if isinstance(sizes, int):
        if sizes < 1:
            raise ValueError(f"Batch.split: {sizes} parts; expected a count >= 1 or a list of sizes")
        return [n // sizes + (i < n % sizes) for i in range(sizes)]
    sizes = list(sizes)
    if sum(sizes) != n or any(s < 0 for s in sizes):
        raise ValueError(f"Batch.split: sizes {sizes}; expected sizes >= 0 summing to len(batch) = {n}")
    return sizes
