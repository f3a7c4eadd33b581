"""Partial rollouts (``--partial-rollouts``, docs/async.md): generation runs free between meetings.

The lockstep asynchronous iteration (rlhf/ppo/asynchronous.py) generates one
batch per iteration and then waits for the learners, so a long-tailed batch
idles the engine at its tail. Here the generation ranks keep every batch the
staleness bound allows in their engine at once (batch j may start once
actor_gen holds the weights after j - K updates) and only stop stepping it
when the learners, done with their update, signal, and the batch they need
next is finished on this rank. Then all ranks meet as in the lockstep
iteration: the finished batches are gathered, the update's weights are
resharded into actor_gen, and the samples still in flight continue under
them, tokens and rollout log-probs kept, K/V computed again by prefill
(``--partial-rollout-kv recompute``) or kept (``keep``). The engine records
each token's policy version, so a sample that spans updates says which
weights sampled which token; ``staleness_max`` stays <= K because a batch
starts no earlier than K versions before the update that trains it::

    generation ranks | batches i+1 .. i+K in flight, weights v_i | meet | same, weights v_i+1 ...
    learner ranks    | infer + train on batch i    | signal       | meet | ...

The signal is an asynchronous all-reduce on a gloo group of the first learner
and the generation ranks, which the generation ranks poll between engine
steps (the TP ranks of a replica agree on it, so they stop at the same step).
Samples in flight at a checkpoint are not saved: the data position is that of
the oldest batch not trained, and a resumed run generates again from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.parallel import Placement
from rlhf.parallel.exchange import first_rank
from rlhf.ppo.asynchronous import GenerationAhead

SIGNAL_BACKEND = "gloo"
"""The signal group's backend: its tensors stay on the host and its work can be polled."""


def signal_group(placement: Placement, learners):
    """The group of the first learner and actor_gen's ranks (collective: every rank calls it)."""
    return dist.new_group(sorted({first_rank(learners), *placement["actor_gen"].ranks}), backend=SIGNAL_BACKEND)


@dataclass
class InFlight:
    """A batch this generation rank started: its prompts, how many samples it owes, those finished."""

    prompts: object
    expected: int
    finished: list = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.finished) == self.expected


class PartialRollouts(GenerationAhead):
    """The asynchronous iteration with generation running free between meetings (module docstring)."""

    def __init__(self, trainer, signals):
        super().__init__(trainer)
        self.signals = signals
        self.in_flight: dict[int, InFlight] = {}  # by (0-based) iteration, generation ranks only
        self.next_start = self.next_delivery = 0
        self._signal_flag = None

    def forget(self) -> None:
        super().forget()
        self.in_flight.clear()
        if self.trainer.engine is not None:
            self.trainer.engine.abort_all()

    # ---- step()'s hooks --------------------------------------------------------------------

    def _fill(self) -> None:
        """At the start: start what the bound allows, then meet once the first batch is finished."""
        self.next_start = self.next_delivery = self.trainer.iteration
        if self.generating:
            self._run_until(self.trainer.iteration, signal=None)
        self._meet()

    def _generate_meanwhile(self) -> None:
        """Generate until the learners signal and this rank's share of the batch they need next is done."""
        self._signal_flag = torch.zeros(1)  # alive until the signal has arrived
        signal = dist.all_reduce(self._signal_flag, group=self.signals, async_op=True)
        self._run_until(self.trainer.iteration + 1, signal)

    def _updated(self) -> None:
        """Learners, after their update: the first signals the generation ranks."""
        if dist.get_rank() == self.learner_root:
            dist.all_reduce(torch.ones(1), group=self.signals, async_op=True).wait()

    def _meet(self) -> None:
        """Gather every batch finished on all generation ranks onto every rank, in order, and queue them
        (collective; the learners draw their prompts here)."""
        t = self.trainer
        with t.timer.stage("wait"):
            finished = torch.tensor([self._finished_run() if self.generating else t.config.run.iterations],
                                    device=platform.device())
            dist.all_reduce(finished, op=dist.ReduceOp.MIN)
        for iteration in range(self.next_delivery, self.next_delivery + int(finished)):
            if self.generating:
                started = self.in_flight.pop(iteration)
                prompts = started.prompts
                mine = started.finished if t.groups["actor_gen"].tp_rank == 0 else []
            else:
                prompts, mine = self._draw(iteration), []
            self.waiting.append(t.collect_rollout(prompts, mine).batch)
        self.next_delivery += int(finished)

    # ---- generation ranks ------------------------------------------------------------------

    def _run_until(self, need: int, signal) -> None:
        """Step the engine, starting each batch the bound allows, until this rank's share of batch ``need``
        is finished (or ``need`` is past the run) and ``signal`` (if any) has arrived on every TP rank."""
        t = self.trainer
        while True:
            self._start_allowed()
            ready = need >= t.config.run.iterations or need < self.next_delivery or self.in_flight[need].done
            if ready and self._agreed(signal is None or signal.is_completed()):
                break
            if not ready or t.engine.has_unfinished():
                with t.timer.stage("generation"):
                    self._engine_step()
            else:  # everything allowed is finished: nothing to do until the learners' update
                with t.timer.stage("wait"):
                    signal.wait()
        if signal is not None:
            signal.wait()
        t.memory.note("generation")

    def _start_allowed(self) -> None:
        """Start every batch whose weights are at most K versions older than the update that trains it."""
        t = self.trainer
        while self.next_start <= self.version + self.k and self.next_start < t.config.run.iterations:
            j = self.next_start
            prompts = self._draw(j)
            requests = t.requests_here(prompts, j)
            for request in requests:
                t.engine.add_request(replace(request, request_id=f"{j}/{request.request_id}"))
            self.in_flight[j] = InFlight(prompts, sum(r.params.n for r in requests))
            self.next_start += 1

    def _engine_step(self) -> None:
        for sample in self.trainer.engine.step():
            iteration, request_id = sample.request_id.split("/")
            self.in_flight[int(iteration)].finished.append(replace(sample, request_id=request_id))

    def _finished_run(self) -> int:
        """How many batches from the next to deliver on are finished on this rank, in a row."""
        count = 0
        while self.next_delivery + count in self.in_flight and self.in_flight[self.next_delivery + count].done:
            count += 1
        return count

    def _agreed(self, arrived: bool) -> bool:
        """Whether the signal arrived on any TP rank of this replica (then every one waits for it)."""
        g = self.trainer.groups["actor_gen"]
        if g.mesh.strategy.tp == 1:
            return arrived
        flag = torch.tensor([float(arrived)], device=platform.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g.tp)
        return bool(flag.item())
