"""How N items are dealt into parts: contiguous, near-equal, the first ``N % parts`` one longer.

The one dealing rule of the project: a batch to DP replicas and micro-batches
(``rlhf.batch.Batch.split``), samples to an inference task's replicas, pairs
to a reward model's replicas. Torch-free, so that the fusion policy (and
through it the planner) deals a simulated batch exactly as a real one is dealt.
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


def shares(n: int, parts: int) -> list[list[int]]:
    """``range(n)`` cut into ``parts`` contiguous pieces (:func:`part_sizes`), as index lists."""
    out, start = [], 0
    for size in part_sizes(n, parts):
        out.append(list(range(start, start + size)))
        start += size
    return out
