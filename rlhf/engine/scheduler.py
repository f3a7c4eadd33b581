"""Scheduler: which sequences compute how many tokens this step (continuous batching).

Policy, per step, under a token budget (``max_tokens_per_step``):

1. Running sequences, oldest first, each gets ``min(uncomputed, budget left)``
   tokens (one when decoding, a chunk when prefilling). When the KV manager
   has no blocks, the *newest* running sequence is preempted (blocks freed,
   re-prefilled later from its tokens, which are kept) until the allocation
   fits or the sequence itself was the newest.
2. Waiting sequences (preempted ones first, then arrivals in order) join
   while budget, ``max_num_seqs`` and free blocks allow. Without continuous
   batching they join only when nothing is running (static batching).

The oldest running sequence can always preempt every other one, and
`Engine.add_request` rejects sequences bigger than the whole pool, so the
scheduler makes progress every step: no crash, no deadlock, no dropped sample.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rlhf.engine.kv_manager import KVManager
from rlhf.engine.sequence import Sequence, Status


@dataclass
class SchedulerOutput:
    """What the model runs this step: (sequence, tokens to compute) and block copies."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    """Waiting queue + running batch over one KV manager."""

    def __init__(self, kv: KVManager, max_tokens_per_step: int, max_num_seqs: int,
                 continuous_batching: bool = True, prefix_sharing: bool = True):
        self.kv = kv
        self.max_tokens_per_step = max_tokens_per_step
        self.max_num_seqs = max_num_seqs
        self.continuous_batching = continuous_batching
        self.prefix_sharing = prefix_sharing
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new (or imported, not yet computed) sequence at the back."""
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose blocks are already allocated (fork, KV import)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work (see module docstring)."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_tokens_per_step)
        if self.continuous_batching or not self.running:
            self._schedule_waiting(out, budget)
        return out

    def schedule_in_flight(self) -> SchedulerOutput | None:
        """The step after one in which every running sequence sampled a token the host has not read yet: each
        computes that token, at its next position. None when the scheduler has to decide on the tokens: a
        waiting sequence could join, the budget does not cover every sequence, or one might need a preemption
        (a token more takes at most one fresh block, a new one or a copy of a shared partial one, so as many
        free blocks as sequences always do).

        Equal to what `schedule` does once the tokens are read if none of them finished; a sequence they
        finish has this step's token computed for nothing (the engine drops it)."""
        n = len(self.running)
        joins = self.continuous_batching and self.waiting and n < min(self.max_num_seqs, self.max_tokens_per_step)
        if joins or n > self.max_tokens_per_step or self.kv.pool.num_free < n:
            return None
        out = SchedulerOutput()
        for seq in self.running:
            out.scheduled.append((seq, 1))
            out.copies.extend(self.kv.allocate_slots(seq.seq_id, seq.num_computed, 1))
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed, n)
            while copies is None and self.running[-1] is not seq:
                out.preempted.append(self.preempt(self.running[-1]))
                copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed, n)
            if copies is None:  # seq is the newest: preempt it and stop
                out.preempted.append(self.preempt(seq))
                break
            out.scheduled.append((seq, n))
            out.copies.extend(copies)
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.prefix_sharing and seq.num_computed == 0:
                seq.num_computed = self.kv.match_prefix(seq.seq_id, seq.tokens, len(seq.tokens) - 1)
            n = min(seq.num_uncomputed, budget)
            copies = self.kv.allocate_slots(seq.seq_id, seq.num_computed, n)
            if copies is None:
                self.kv.free(seq.seq_id)
                seq.num_computed = 0
                return
            self.waiting.popleft()
            self.add_running(seq)
            out.scheduled.append((seq, n))
            out.copies.extend(copies)
            budget -= n

    def preempt(self, seq: Sequence) -> Sequence:
        """Free the running sequence's blocks and put it at the front of the waiting queue (its tokens
        are kept and computed again when it runs)."""
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq

    def set_aside(self, seq: Sequence) -> None:
        """Take a sequence out of the batch and keep its blocks (a finished turn held for the next one)."""
        self.running.remove(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or exported) sequence and return its blocks to the pool."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
