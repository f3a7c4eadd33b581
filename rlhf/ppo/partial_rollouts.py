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
While the batch the learners need is not whole, each signal opens a
streaming round instead: the samples of it finished since the last round
reach the learners, who infer them (reference, reward, critic, proximal
log-probs: the weights the next update starts from) and signal again; the
update then infers only the rest of the batch.
Samples in flight at a checkpoint are not saved: the data position is that of
the oldest batch not trained, and a resumed run generates again from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.batch import Batch
from rlhf.fusion.inter_stage import EarlyInference, FusionOutcome
from rlhf.parallel import Placement
from rlhf.parallel.collectives import new_group
from rlhf.parallel.exchange import first_rank, gather_to_all
from rlhf.ppo.asynchronous import GenerationAhead
from rlhf.ppo.rollouts import RolloutHost

SIGNAL_BACKEND = "gloo"
"""The signal group's backend: its tensors stay on the host and its work can be polled."""


def signal_group(placement: Placement, learners):
    """The group of the first learner and actor_gen's ranks (collective: every rank calls it)."""
    return new_group({first_rank(learners), *placement["actor_gen"].ranks}, "the update signal",
                     backend=SIGNAL_BACKEND)


@dataclass
class InFlight:
    """A batch this generation rank started: its prompts, how many samples it owes, those finished."""

    prompts: object
    expected: int
    finished: list = field(default_factory=list)
    streamed: int = 0  # of ``finished``, those sent to the learners in streaming rounds

    @property
    def done(self) -> bool:
        return len(self.finished) == self.expected


class PartialRollouts(GenerationAhead):
    """The asynchronous iteration with generation running free between meetings (module docstring)."""

    def __init__(self, host: RolloutHost, signals):
        super().__init__(host)
        self.signals = signals
        self.in_flight: dict[int, InFlight] = {}  # by (0-based) iteration, generation ranks only
        self.early: dict[int, EarlyInference] = {}  # by iteration, learners only: streamed and inferred
        self.next_start = self.next_delivery = 0
        self._signal_flag = None
        self._streamed = 0  # samples of the batch being trained that were inferred in streaming rounds

    def forget(self) -> None:
        super().forget()
        self.in_flight.clear()
        self.early.clear()
        if self.host.engine is not None:
            self.host.engine.abort_all()

    # ---- the iteration's hooks --------------------------------------------------------------------

    def _fill(self) -> None:
        """At the start: start what the bound allows, then meet once the first batch is finished."""
        self.next_start = self.next_delivery = self.host.iteration
        if self.generating:
            self._run_until(self.host.iteration, signal=None)
        self._meet()

    def _generate_meanwhile(self) -> None:
        """Generate until the learners signal, streaming them the samples of the batch they need next as
        they finish, until this rank's share of it is done."""
        self._run_until(self.host.iteration + 1, self._awaited_signal())

    def _updated(self) -> None:
        """Learners, after their update: signal the generation ranks (the first learner does), then infer
        the next batch's samples as they arrive, round after round, until every share of it is done."""
        need = self.host.iteration + 1
        self._signal()
        while not self._stream_round(need):
            self._signal()

    def _inferred(self, iteration: int) -> FusionOutcome | None:
        """What the learners inferred of batch ``iteration`` in the streaming rounds, for update_from."""
        early = self.early.pop(iteration, None)
        self._streamed = len(next(iter(early.done.values()))) if early is not None and early.done else 0
        return None if early is None else FusionOutcome(None, early)

    def _metrics(self, batch: Batch) -> dict:
        """The staleness metrics, and on the learners ``streamed_samples_fraction``: of the batch, the
        samples inferred in streaming rounds while the rest were generated."""
        out = super()._metrics(batch)
        if not self.generating:
            out["streamed_samples_fraction"] = self._streamed / len(batch)
        return out

    def _meet(self) -> None:
        """Gather every batch finished on all generation ranks onto every rank, in order, and queue them
        (collective; the learners draw their prompts here)."""
        t = self.host
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
        is finished (or ``need`` is past the run). With a ``signal``: each time it has arrived (on every TP
        rank), a streaming round, until the round where every share is done. A round follows each arrival
        whether or not this rank has news, so no replica waits in a round for another one's next sample
        while its own engine could step."""
        t = self.host
        while True:
            self._start_allowed()
            if signal is None:
                if self._share_done(need):
                    break
                with t.timer.stage("generation"):
                    self._engine_step()
            elif self._agreed(signal.is_completed()):
                signal.wait()
                if self._stream_round(need):
                    break
                signal = self._awaited_signal()
            elif not self._share_done(need) or t.engine.has_unfinished():
                with t.timer.stage("generation"):
                    self._engine_step()
            else:  # everything allowed is finished: nothing to do until the learners' signal
                with t.timer.stage("wait"):
                    signal.wait()
        t.memory.note("generation")

    def _share_done(self, need: int) -> bool:
        t = self.host
        return need >= t.config.run.iterations or need < self.next_delivery or self.in_flight[need].done

    def _start_allowed(self) -> None:
        """Start every batch whose weights are at most K versions older than the update that trains it."""
        t = self.host
        while self.next_start <= self.version + self.k and self.next_start < t.config.run.iterations:
            j = self.next_start
            prompts = self._draw(j)
            requests = t.requests_here(prompts, j)
            for request in requests:
                t.engine.add_request(replace(request, request_id=f"{j}/{request.request_id}"))
            self.in_flight[j] = InFlight(prompts, sum(r.params.n for r in requests))
            self.next_start += 1

    def _engine_step(self) -> None:
        for sample in self.host.engine.step():
            iteration, request_id = sample.request_id.split("/")
            self.in_flight[int(iteration)].finished.append(replace(sample, request_id=request_id))

    def _finished_run(self) -> int:
        """How many batches from the next to deliver on are finished on this rank, in a row."""
        count = 0
        while self.next_delivery + count in self.in_flight and self.in_flight[self.next_delivery + count].done:
            count += 1
        return count

    # ---- streaming: the learners infer the next batch's samples as they finish -----------------

    def _awaited_signal(self):
        """Generation ranks: the learners' next signal (an asynchronous all-reduce to poll)."""
        self._signal_flag = torch.zeros(1)  # alive until the signal has arrived
        return dist.all_reduce(self._signal_flag, group=self.signals, async_op=True)

    def _signal(self) -> None:
        """Learners: the first one signals the generation ranks (the others just go on to the round)."""
        if dist.get_rank() == self.learner_root:
            dist.all_reduce(torch.ones(1), group=self.signals, async_op=True).wait()

    def _stream_round(self, need: int) -> bool:
        """One streaming round of batch ``need`` (collective): each generation replica sends its samples
        finished since the last round and whether its share is done; the learners infer what came, unless
        every share is done (True: the meeting follows and delivers the batch, whose inference then skips
        the samples inferred here)."""
        t = self.host
        new, done = [], True
        if self.generating and need in self.in_flight:
            started = self.in_flight[need]
            new = started.finished[started.streamed:] if t.groups["actor_gen"].tp_rank == 0 else []
            started.streamed, done = len(started.finished), started.done
        with t.timer.stage("wait"):
            parts = gather_to_all([(new, done)])
        if all(done for _, done in parts):
            return True
        samples = [s for new, _ in parts for s in new]
        if samples and not self.generating:
            with t.timer.stage("inference"):
                self._infer_early(need, samples)
        return False

    def _infer_early(self, need: int, samples: list) -> None:
        """Learners: reference, reward, critic (and proximal log-prob) inference of streamed samples of
        batch ``need``, each task's replicas sharing them, kept for its update (``early``)."""
        t = self.host
        n = t.config.ppo.n_samples_per_prompt
        samples = sorted(samples, key=lambda s: (int(s.request_id), s.sample_index))
        batch = Batch.from_samples(samples, t.tokenizer.pad_id, {s.request_id: int(s.request_id) for s in samples})
        early = self.early.setdefault(need, EarlyInference())
        early.outputs += t.infer_here(batch.to(platform.device()), {})
        for task in t.inference_tasks():
            early.done.setdefault(task, set()).update(int(s.request_id) * n + s.sample_index for s in samples)

    def _agreed(self, arrived: bool) -> bool:
        """Whether the signal arrived on any TP rank of this replica (then every one waits for it)."""
        g = self.host.groups["actor_gen"]
        if g.mesh.strategy.tp == 1:
            return arrived
        flag = torch.tensor([float(arrived)], device=platform.device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=g.tp)
        return bool(flag.item())
