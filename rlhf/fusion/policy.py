"""Inter-stage fusion policy (pure: no torch.distributed): when, how many, where.

RLHFuse section 4.2. Generation instances run until the batch's unfinished
samples fall to ``R`` (a fraction of the batch); then the long tail migrates
to ``m`` destination instances and the freed instances start reference,
reward and critic inference on the finished samples, which each long-tail
sample joins when it finishes.

- **When** (`choose_threshold`): R is the value of the sweep 5..95% whose
  simulated generation + inference time (`simulate`, averaged over batches
  drawn from a `LengthDistribution`) is smallest.
- **How many** (`destination_count`): m = max(ceil(remaining / B_sat), the
  number of instances whose free KV holds the remaining samples).
- **Where** (`choose_destinations`, `assign_moves`): the m instances that
  already hold the most unfinished samples; each moved sample goes to the
  destination holding the fewest samples at that moment.

The simulator's time model, per instance (one DP replica of generation)::

    decode step (s) = step_s * max(1, running / b_sat)    # flat up to B_sat
    inference (s)   = infer_s per sample on one instance's ranks (ref+reward+critic)
    migration (s)   = migrate_s per sample a destination receives

Samples start together (sample k of a batch of B on instance k // (B / N), as
`Batch.split` deals them) and a sample of length L finishes after L steps.
Inference, as the runtime runs it (rlhf.fusion.inter_stage): the instances
freed by the migration, once every move is done (the moves go in one global
order), serve the samples finished before generation ends as a fluid queue
(1 / infer_s samples per second each); the samples that end generation are
inferred by all N instances after that queue is empty (unfused: all samples,
all instances, after generation).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from rlhf.parallel.dealing import part_sizes

SWEEP = tuple(p / 100 for p in range(5, 100, 5))
"""The thresholds R tried by `choose_threshold`: 5%, 10%, ..., 95% of the batch."""


class FusionPolicyError(ValueError):
    """Invalid input to the fusion policy; the message names the field or file and what is valid."""


@dataclass(frozen=True)
class GenerationCost:
    """Time model of N generation instances and the inference that follows (seconds).

    ``b_sat``: running batch that saturates one instance (measured, or from
    the cost model). ``kv_tokens``: KV capacity of one instance in tokens
    (None: unlimited); ``prompt_len`` counts toward each sample's KV.
    """

    instances: int
    step_s: float
    b_sat: int
    infer_s: float
    migrate_s: float = 0.0
    kv_tokens: int | None = None
    prompt_len: int = 0

    def __post_init__(self):
        for name, ok, valid in (("instances", self.instances >= 1, ">= 1"), ("step_s", self.step_s > 0, "> 0"),
                                ("b_sat", self.b_sat >= 1, ">= 1"), ("infer_s", self.infer_s >= 0, ">= 0"),
                                ("migrate_s", self.migrate_s >= 0, ">= 0"),
                                ("kv_tokens", self.kv_tokens is None or self.kv_tokens >= 1, ">= 1 or None"),
                                ("prompt_len", self.prompt_len >= 0, ">= 0")):
            if not ok:
                raise FusionPolicyError(f"GenerationCost.{name}={getattr(self, name)!r} is invalid: must be {valid}")

    def step_time(self, running: int) -> float:
        """Seconds of one decode step with ``running`` samples in the batch."""
        return self.step_s * max(1.0, running / self.b_sat)


@dataclass(frozen=True)
class SimResult:
    """One simulated batch: ``total_s`` = end of inference; ``generation_s`` = last sample finished.

    ``migrate_at_s`` is None when nothing migrated (R too small); ``m`` is the
    destination count and ``migrated`` the number of samples moved.
    """

    total_s: float
    generation_s: float
    migrate_at_s: float | None
    m: int
    migrated: int


# --- where: destination count, destinations, moves -------------------------------------------------------------


def destination_count(remaining: int, b_sat: int, free_kv: Sequence[float], need_kv: Sequence[float]) -> int:
    """m = max(ceil(remaining / b_sat), fewest candidates whose free KV holds what the others ship).

    free_kv[k], need_kv[k]: the k-th candidate's free KV tokens and the KV
    tokens its own unfinished samples hold, in the order candidates are taken
    (`choose_destinations`). m is at most the number of candidates.
    """
    if remaining <= 0:
        return 0
    by_batch, total = math.ceil(remaining / b_sat), sum(need_kv)
    held = kept = 0.0
    for m in range(1, len(free_kv) + 1):
        held, kept = held + free_kv[m - 1], kept + need_kv[m - 1]
        if m >= by_batch and held >= total - kept:
            return m
    return len(free_kv)


def choose_destinations(unfinished: Sequence[int], free_kv: Sequence[float], need_kv: Sequence[float],
                        b_sat: int) -> tuple[int, ...]:
    """The instances that receive the long tail: the m holding the most unfinished samples (ties: lower index).

    unfinished[i], free_kv[i], need_kv[i]: instance i's unfinished samples,
    its free KV tokens, and the KV tokens its unfinished samples occupy.
    """
    if not len(unfinished) == len(free_kv) == len(need_kv):
        raise FusionPolicyError(f"unfinished, free_kv and need_kv must have one entry per instance; got lengths "
                                f"{len(unfinished)}, {len(free_kv)}, {len(need_kv)}")
    order = sorted(range(len(unfinished)), key=lambda i: (-unfinished[i], i))
    m = destination_count(sum(unfinished), b_sat, [free_kv[i] for i in order], [need_kv[i] for i in order])
    return tuple(sorted(order[:m]))


def assign_moves(samples: Sequence[Sequence[float]], destinations: Sequence[int],
                 free_kv: Sequence[float]) -> list[tuple[int, int, int]]:
    """Moves ``(source, position, destination)`` of every unfinished sample off a non-destination.

    samples[i] lists the KV tokens of each unfinished sample on instance i.
    Each goes to the destination holding the fewest samples (ties: lower
    index) whose free KV still fits it, or to the one with the most free KV.
    """
    count = {d: len(samples[d]) for d in destinations}
    free = {d: float(free_kv[d]) for d in destinations}
    moves = []
    for src, kvs in enumerate(samples):
        if src in count:
            continue
        for pos, need in enumerate(kvs):
            fits = [d for d in destinations if free[d] >= need]
            dst = min(fits, key=lambda d: (count[d], d)) if fits else max(destinations, key=lambda d: (free[d], -d))
            count[dst] += 1
            free[dst] -= need
            moves.append((src, pos, dst))
    return moves


# --- the simulator ------------------------------------------------------------------------------------------------


def _run(remaining: Sequence[int], start: float, cost: GenerationCost) -> list[float]:
    """Finish times of samples with ``remaining`` steps on one instance that starts at ``start``."""
    ends = [0.0] * len(remaining)
    t, done = start, 0
    order = sorted(range(len(remaining)), key=lambda k: remaining[k])
    for pos, k in enumerate(order):
        t += (remaining[k] - done) * cost.step_time(len(order) - pos)
        done = remaining[k]
        ends[k] = t
    return ends


def _steps_done(lengths: Sequence[int], at: float, cost: GenerationCost) -> int:
    """Decode steps one instance (all samples started at 0) has completed by time ``at``."""
    t, done = 0.0, 0
    ordered = sorted(lengths)
    for pos, length in enumerate(ordered):
        dt = cost.step_time(len(ordered) - pos)
        if t + (length - done) * dt >= at - 1e-9 * max(1.0, at):
            return done + min(length - done, int((at - t) / dt + 1e-9))
        t += (length - done) * dt
        done = length
    return done


def _drain(arrivals: Sequence[float], frees: Sequence[float], infer_s: float) -> float:
    """When a fluid inference queue is empty: samples arrive at ``arrivals``, instances join at ``frees``."""
    if infer_s == 0:
        return max(arrivals)
    events = sorted([(t, 0) for t in arrivals] + [(t, 1) for t in frees])
    backlog, rate, t, done_at = 0.0, 0.0, 0.0, 0.0
    for te, kind in events:
        if backlog > 0 and rate > 0:
            if backlog <= rate * (te - t):
                done_at = t + backlog / rate
                backlog = 0.0
            else:
                backlog -= rate * (te - t)
        t = te
        if kind == 0:
            backlog += 1.0
        else:
            rate += 1.0 / infer_s
    return t + backlog / rate if backlog > 0 else done_at


def split_batch(lengths: Sequence[int], instances: int) -> list[list[int]]:
    """Deal a batch to instances as `Batch.split(instances)` does (contiguous, its part sizes)."""
    out, at = [], 0
    for size in part_sizes(len(lengths), instances):
        out.append(list(lengths[at:at + size]))
        at += size
    return out


def migration_limit(threshold: float, batch: int) -> int:
    """The most unfinished samples at which the long tail migrates: floor(R x batch); 0 never migrates."""
    return math.floor(threshold * batch + 1e-9)


def simulate(lengths: Sequence[int], cost: GenerationCost, threshold: float) -> SimResult:
    """Generation + inference of one batch whose samples have ``lengths`` (decode steps), fused at ``threshold``.

    threshold: R as a fraction of the batch; migration happens when the
    unfinished samples first number at most R x batch (R = 1: at the start;
    R x batch < 1: never, which is the unfused run).
    """
    if not 0 <= threshold <= 1:
        raise FusionPolicyError(f"threshold={threshold!r} is invalid: must be a fraction in [0, 1]")
    if not lengths or min(lengths) < 1:
        raise FusionPolicyError("lengths must be a non-empty list of response lengths >= 1")
    per = split_batch(lengths, cost.instances)
    ends = [_run(ls, 0.0, cost) for ls in per]
    gen_end = max(max(e, default=0.0) for e in ends)
    limit = migration_limit(threshold, len(lengths))
    if limit < 1:
        return SimResult(gen_end + len(lengths) * cost.infer_s / cost.instances, gen_end, None, 0, 0)
    finish = sorted(t for e in ends for t in e)
    at = 0.0 if limit >= len(lengths) else finish[len(lengths) - limit - 1]
    return _fused(per, ends, at, cost)


def _fused(per: list[list[int]], ends: list[list[float]], at: float, cost: GenerationCost) -> SimResult:
    """The rest of `simulate` once the threshold is reached at time ``at``: migrate, finish, infer."""
    steps = [_steps_done(ls, at, cost) for ls in per]
    rest = [[length - s for length in ls if length > s] for ls, s in zip(per, steps)]
    kv = [[cost.prompt_len + s] * len(r) for r, s in zip(rest, steps)]
    cap = math.inf if cost.kv_tokens is None else cost.kv_tokens
    free_kv = [cap - sum(k) for k in kv]
    dests = choose_destinations([len(r) for r in rest], free_kv, [sum(k) for k in kv], cost.b_sat)
    moves = assign_moves(kv, dests, free_kv)
    received = {d: [] for d in dests}
    for src, pos, dst in moves:
        received[dst].append(rest[src][pos])
    arrivals = [t for e, s, ls in zip(ends, steps, per) for t, length in zip(e, ls) if length <= s]
    for d in dests:  # a receiver pauses for the transfer (dropping its partial step); the others go on
        if received[d]:
            arrivals += _run(rest[d] + received[d], at + cost.migrate_s * len(received[d]), cost)
        else:
            arrivals += [t for t, length in zip(ends[d], per[d]) if length > steps[d]]
    gen_end = max(arrivals)
    moved = at + cost.migrate_s * len(moves)  # one global order of moves: a source is free once all are done
    freed = cost.instances - len(dests)
    streamed = [t for t in arrivals if t < gen_end - 1e-9] if freed else []
    drained = _drain(streamed, [moved] * freed, cost.infer_s) if streamed else moved
    last = len(arrivals) - len(streamed)  # what ends generation: every instance infers it, after the stream
    return SimResult(max(drained, gen_end) + last * cost.infer_s / cost.instances, gen_end, at, len(dests),
                     len(moves))


# --- when: the length distribution and the threshold ---------------------------------------------------------------


def long_tailed_lengths(count: int, rng: random.Random, median: float = 128, sigma: float = 0.8,
                        cap: int = 2048) -> list[int]:
    """The long-tailed measurement workload: lognormal response lengths in [1, cap].

    p99.9 = median x exp(3.09 sigma): 11.8x the median at sigma 0.8 (the
    issue asks for more than 10x).
    """
    return [max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


class LengthDistribution:
    """Response lengths seen so far (an offline sample, then each iteration's), the most recent ``window`` kept."""

    def __init__(self, lengths: Sequence[int] = (), window: int = 8192):
        if window < 1:
            raise FusionPolicyError(f"window={window!r} is invalid: must be >= 1")
        self.window = window
        self.lengths: list[int] = []
        self.observe(lengths)

    @classmethod
    def from_file(cls, path: str | Path, window: int = 8192) -> "LengthDistribution":
        """Read a sample file: one response length (integer >= 1) per line; blank lines and ``#`` comments skipped."""
        lengths = []
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise FusionPolicyError(f"{path}: cannot read the response-length file ({e.strerror})") from e
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if not line.isdigit() or int(line) < 1:
                raise FusionPolicyError(f"{path}:{number}: {line!r} is not a response length; "
                                        "want one integer >= 1 per line")
            lengths.append(int(line))
        if not lengths:
            raise FusionPolicyError(f"{path}: no response lengths; want one integer >= 1 per line")
        return cls(lengths, window)

    def observe(self, lengths: Sequence[int]) -> None:
        """Add one iteration's response lengths (online refinement); the oldest drop out past ``window``."""
        bad = [n for n in lengths if int(n) != n or n < 1]
        if bad:
            raise FusionPolicyError(f"response lengths must be integers >= 1; got {bad[:3]}")
        self.lengths = (self.lengths + [int(n) for n in lengths])[-self.window:]

    def draw(self, count: int, rng: random.Random) -> list[int]:
        """``count`` lengths drawn with replacement (one simulated batch)."""
        if not self.lengths:
            raise FusionPolicyError("no response lengths yet: give a sample file or observe an iteration first")
        return rng.choices(self.lengths, k=count)


@dataclass(frozen=True)
class ThresholdChoice:
    """The chosen R, the sweep behind it ([(R, mean simulated seconds)]) and the unfused mean."""

    threshold: float
    sweep: tuple[tuple[float, float], ...]
    unfused_s: float

    @property
    def speedup(self) -> float:
        """Unfused over fused simulated time at the chosen R."""
        return self.unfused_s / dict(self.sweep)[self.threshold]


def sweep(batches: Sequence[Sequence[int]], cost: GenerationCost,
          thresholds: Sequence[float] = SWEEP) -> list[tuple[float, float]]:
    """[(R, mean simulated generation + inference seconds over ``batches``)] for each R."""
    return [(r, sum(simulate(b, cost, r).total_s for b in batches) / len(batches)) for r in thresholds]


def choose_threshold(lengths: LengthDistribution, cost: GenerationCost, batch_size: int, trials: int = 32,
                     seed: int = 0) -> ThresholdChoice:
    """R with the least mean simulated time over ``trials`` batches of ``batch_size`` drawn from ``lengths``."""
    if batch_size < 1 or trials < 1:
        raise FusionPolicyError(f"batch_size={batch_size} and trials={trials} are invalid: both must be >= 1")
    rng = random.Random(seed)
    batches = [lengths.draw(batch_size, rng) for _ in range(trials)]
    points = sweep(batches, cost)
    best = min(points, key=lambda p: (p[1], p[0]))[0]
    unfused = sum(simulate(b, cost, 0.0).total_s for b in batches) / trials
    return ThresholdChoice(best, tuple(points), unfused)
