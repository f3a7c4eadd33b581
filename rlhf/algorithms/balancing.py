"""Token-balanced mini-batches for data parallelism (owns the partitioning of a
PPO mini-batch across DP ranks).

Each epoch shuffles the samples once, cuts them into mini-batches, and splits
every mini-batch across the DP ranks so that token counts are balanced:
every sample is used exactly once per epoch, and with ``equal_size`` every rank
gets the same number of samples (needed when ranks must run the same number of
micro-batches). Partitioning is host-side integer work on lengths.

Methods: Karmarkar-Karp largest differencing ("kk", k-way: repeatedly merge the
two partial solutions with the largest spread, pairing heaviest with lightest)
and longest-processing-time first ("lpt", greedy: heaviest sample to the
lightest rank). Both finish with swap refinement: while swapping one sample of
the heaviest rank with one of the lightest lowers the heavier of the two, do the
best such swap (sample counts stay as they are).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from typing import Callable, Dict, List, Sequence

import torch

Partition = List[List[int]]


def _as_list(lengths) -> List[int]:
    # Host-side scheduling: lengths are read once per epoch.
    return lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)


def _check(weights: Sequence[int], k: int, equal_size: bool) -> None:
    if k < 1:
        raise ValueError(f"number of partitions k={k} must be >= 1")
    if len(weights) < k:
        raise ValueError(f"{len(weights)} samples cannot fill k={k} partitions; use at least k samples")
    if equal_size and len(weights) % k:
        raise ValueError(f"equal_size needs the sample count ({len(weights)}) divisible by k={k}")
    if any(w < 0 for w in weights):
        raise ValueError("sample lengths must be >= 0")


def karmarkar_karp(weights: Sequence[int], k: int, equal_size: bool = False) -> Partition:
    """k-way largest differencing method.

    Args:
        weights: per-sample token counts (length N).
        k: number of partitions (DP ranks).
        equal_size: every partition gets N / k samples (N divisible by k).
    Returns:
        k lists of sample indices (each sorted), covering 0..N-1 exactly once.
    """
    weights = _as_list(weights)
    _check(weights, k, equal_size)
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    # A partial solution: k (sum, indices) parts sorted by sum, heaviest first.
    # equal_size starts from k-tuples of similar samples, one per part, so that
    # every merge keeps part sizes equal; otherwise from single samples.
    step = k if equal_size else 1
    counter = itertools.count()
    heap = []
    for start in range(0, len(order), step):
        parts = [(weights[i], [i]) for i in order[start : start + step]] + [(0, [])] * (k - step)
        parts.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), next(counter), parts))
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))]
        merged.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(counter), merged))
    return _refine_by_swaps(weights, [indices for _, indices in heap[0][2]])


def _best_swap(weights: List[int], heavy: List[int], light: List[int], gap: int):
    """(i, j) in heavy x light whose swap shrinks ``gap`` the most, or None.
    Moving d = w_i - w_j with 0 < d < gap leaves the pair |gap - 2d| apart."""
    light_sorted = sorted(light, key=lambda j: weights[j])
    light_weights = [weights[j] for j in light_sorted]
    best, best_gap = None, gap
    for i in heavy:
        target = weights[i] - gap / 2  # ideal w_j
        pos = bisect.bisect_left(light_weights, target)
        for q in (pos - 1, pos):
            if 0 <= q < len(light_sorted):
                d = weights[i] - light_weights[q]
                if 0 < d < gap and abs(gap - 2 * d) < best_gap:
                    best, best_gap = (i, light_sorted[q]), abs(gap - 2 * d)
    return best


def _refine_by_swaps(weights: List[int], parts: Partition, max_rounds: int = 1000) -> Partition:
    """Swap samples between the heaviest and the lightest part while that
    strictly lowers their spread; returns parts with sorted indices."""
    parts = [list(part) for part in parts]
    loads = [sum(weights[i] for i in part) for part in parts]
    for _ in range(max_rounds):
        hi = max(range(len(parts)), key=loads.__getitem__)
        lo = min(range(len(parts)), key=loads.__getitem__)
        swap = _best_swap(weights, parts[hi], parts[lo], loads[hi] - loads[lo])
        if swap is None:
            break
        i, j = swap
        parts[hi][parts[hi].index(i)], parts[lo][parts[lo].index(j)] = j, i
        loads[hi] += weights[j] - weights[i]
        loads[lo] += weights[i] - weights[j]
    return [sorted(part) for part in parts]


def lpt_partition(weights: Sequence[int], k: int, equal_size: bool = False) -> Partition:
    """Greedy LPT: heaviest sample first, to the lightest partition that still
    has room (room = N / k when ``equal_size``). Same contract as ``karmarkar_karp``."""
    weights = _as_list(weights)
    _check(weights, k, equal_size)
    capacity = len(weights) // k if equal_size else len(weights)
    heap = [(0, rank) for rank in range(k)]  # (load, rank) of ranks with room
    parts: Partition = [[] for _ in range(k)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, rank = heapq.heappop(heap)
        parts[rank].append(i)
        if len(parts[rank]) < capacity:
            heapq.heappush(heap, (load + weights[i], rank))
    return _refine_by_swaps(weights, parts)


PARTITIONERS: Dict[str, Callable[[Sequence[int], int, bool], Partition]] = {
    "kk": karmarkar_karp,
    "lpt": lpt_partition,
}


def partition_loads(lengths: Sequence[int], parts: Partition) -> List[int]:
    """Token load of each partition."""
    lengths = _as_list(lengths)
    return [sum(lengths[i] for i in part) for part in parts]


def balanced_minibatches(
    lengths: Sequence[int],
    num_minibatches: int,
    dp_size: int,
    equal_size: bool = True,
    method: str = "kk",
    generator: torch.Generator | None = None,
) -> List[Partition]:
    """One epoch of token-balanced DP mini-batches.

    Args:
        lengths: [N] tokens per sample (prompt + response: the compute it costs).
        num_minibatches: PPO mini-batches per epoch; N must be divisible by it.
        dp_size: data-parallel ranks.
        equal_size: equal sample count per rank (N / num_minibatches divisible by dp_size).
        method: "kk" or "lpt".
        generator: seeds the per-epoch shuffle; None keeps the input order.
    Returns:
        result[m][r] = sample indices (into ``lengths``) for mini-batch m on rank r.
        Every index appears exactly once.
    """
    lengths = _as_list(lengths)
    if method not in PARTITIONERS:
        raise KeyError(f"unknown balancing method {method!r}; known: {sorted(PARTITIONERS)}")
    if num_minibatches < 1 or len(lengths) % num_minibatches:
        raise ValueError(
            f"num_minibatches={num_minibatches} must be >= 1 and divide the sample count {len(lengths)}"
        )
    if generator is None:
        order = list(range(len(lengths)))
    else:
        order = torch.randperm(len(lengths), generator=generator).tolist()
    size = len(lengths) // num_minibatches
    epoch = []
    for start in range(0, len(order), size):
        members = order[start : start + size]
        parts = PARTITIONERS[method]([lengths[i] for i in members], dp_size, equal_size)
        epoch.append([[members[j] for j in part] for part in parts])
    return epoch
