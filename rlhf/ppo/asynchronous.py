"""Asynchronous iterations with a staleness bound (``--max-staleness K``, docs/async.md).

actor_gen runs on ranks of its own (rlhf.ppo.layout.check_generation_apart).
While the other ranks (the *learners*) infer and train on iteration i's batch,
actor_gen generates the batch of iteration i + K with the weights it holds;
then every rank meets once: the new batch is gathered, the learned batch is
shared (for the metrics and the sample log), and the updated actor is
resharded into actor_gen. So the weights that generate a batch are those after
i updates and it is trained by the update from i + K to i + K + 1: K policy
versions stale (fewer in the first K iterations, which are generated before
training starts, with the initial weights)::

    generation ranks | gen i+K (weights v_i) | wait | meet |
    learner ranks    | infer + train on i   | wait | meet | reshard v_{i+1} -> actor_gen

The old log-probs are recomputed by actor_train before the update (decoupled
PPO's proximal policy; PPOConfig.recomputes_logprobs): the clipped ratio is
taken against them, and ``--tis-cap`` weights each token by proximal over
behaviour (the engine's) probability. Each batch waiting is kept with the data
position before its prompts were drawn; a checkpoint saves the oldest one's,
and the resumed run generates those prompts again (with the resumed weights),
so every prompt is trained exactly once. Generation stops drawing prompts
K iterations before the run's end.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.batch import Batch
from rlhf.parallel import Placement
from rlhf.parallel.collectives import new_group
from rlhf.parallel.exchange import first_rank
from rlhf.ppo.rollouts import Rollout, RolloutHost, RolloutSource

if TYPE_CHECKING:
    from rlhf.fusion.inter_stage import FusionOutcome


def learner_group(placement: Placement):
    """The process group of every rank besides actor_gen's (collective: every rank calls it)."""
    generation = set(placement["actor_gen"].ranks)
    return new_group([r for r in range(placement.world_size) if r not in generation], "the learners")


class GenerationAhead(RolloutSource):
    """The asynchronous iteration (module docstring): up to K batches generated ahead.

    Each batch waiting was generated on every actor_gen replica and gathered onto every rank;
    ``positions`` keeps the data position before each batch's prompts were drawn, by its (0-based)
    iteration. rlhf.ppo.partial_rollouts.PartialRollouts runs generation free between the meetings.
    """

    def __init__(self, host: RolloutHost):
        super().__init__(host)
        self.k = host.config.ppo.max_staleness
        self.generating = host.groups["actor_gen"] is not None
        self.learner_root = first_rank(host.learners)
        self.waiting: deque[Batch] = deque()
        self.positions: dict[int, dict] = {}
        self.version = 0  # the policy version of the weights actor_gen holds
        self._pending = None  # (prompts, this rank's samples) until the ranks meet

    def data_position(self) -> dict:
        return self.positions.get(self.host.iteration, super().data_position())

    def forget(self) -> None:
        """Drop the batches generated ahead (a checkpoint was loaded: its position is before them)."""
        self.waiting.clear()
        self.positions.clear()

    def next_rollout(self) -> Optional[Rollout]:
        """Learners: the oldest batch waiting (and what they inferred of it meanwhile). Generation ranks
        generate the batch K iterations ahead instead (None). The run's first call generates the first
        K batches (collective)."""
        host = self.host
        if not self.waiting:  # the run's start, or a resumed one
            with host.timer.stage("reshard"):
                host.sync_generation_weights()
            self._hold_version(host.iteration)
            self._fill()
        oldest = self.waiting.popleft()
        self.positions.pop(host.iteration, None)
        if self.generating:
            self._generate_meanwhile()
            return None
        return Rollout(oldest, self._inferred(host.iteration))

    def after_update(self, batch: Optional[Batch], local: dict) -> Batch:
        """Every rank meets: the learned batch is shared, the update's weights resharded into actor_gen
        (collective); ``local`` gets the idle fraction and the staleness metrics."""
        host = self.host
        if not self.generating:
            self._updated()
        self._meet()
        local["generation_idle_fraction" if self.generating else "training_idle_fraction"] = (
            host.timer.seconds["wait"] / host.timer.elapsed())
        batch = self._share_learned(batch)
        with host.timer.stage("reshard"):
            host.sync_generation_weights()
        self._hold_version(host.iteration + 1)
        local.update(self._metrics(batch))
        return batch

    # ---- what the lockstep iteration does at each point of the iteration ------------------------

    def _fill(self) -> None:
        """At the start: the first K batches, each generated and gathered at once (collective)."""
        for ahead in range(self.k):
            self._generate(self.host.iteration + ahead)
            self._meet()

    def _generate_meanwhile(self) -> None:
        """Generation ranks, while the learners train: the batch K iterations ahead."""
        self._generate(self.host.iteration + self.k)

    def _updated(self) -> None:
        """Learners, after their update: draw the prompts the generation ranks drew meanwhile."""
        self._generate(self.host.iteration + self.k)

    def _metrics(self, batch: Batch) -> dict:
        """The iteration's asynchronous metrics (rlhf.ppo.asynchronous.staleness_metrics)."""
        return staleness_metrics(batch, self.host.iteration)

    def _inferred(self, iteration: int) -> "FusionOutcome | None":
        """What the learners inferred of batch ``iteration`` while it was generated (none in lockstep)."""
        return None

    def _meet(self) -> None:
        """Wait for both sides, then gather the pending batch's samples onto every rank and queue it
        (collective)."""
        with self.host.timer.stage("wait"):
            dist.barrier()
        if self._pending is not None:
            prompts, mine = self._pending
            self._pending = None
            self.waiting.append(self.host.collect_rollout(prompts, mine).batch)

    # ---- pieces ------------------------------------------------------------------------

    def _hold_version(self, version: int) -> None:
        """actor_gen now holds the weights after ``version`` updates; its engine records them per token."""
        self.version = version
        if self.host.engine is not None:
            self.host.engine.refresh_weights(version, keep_kv=self.host.config.ppo.partial_rollout_kv == "keep")

    def _draw(self, iteration: int):
        """The prompts of (0-based) ``iteration``, its data position kept (every rank draws them, in order)."""
        self.positions[iteration] = self.host.prompts.state_dict()
        return next(self.host.prompts)

    def _generate(self, iteration: int) -> None:
        """Draw the prompts of ``iteration`` and generate them on actor_gen (pending until the next
        :meth:`_meet`); none past the run's end."""
        t = self.host
        if iteration >= t.config.run.iterations:
            return
        prompts = self._draw(iteration)
        with t.timer.stage("generation") if self.generating else contextlib.nullcontext():
            mine, _ = t.generate_here(prompts, iteration)
        self._pending = (prompts, mine)

    def _share_learned(self, batch: Batch | None) -> Batch:
        """The learners' finished batch on every rank, and their KL coefficient, which the checkpoint
        keeps (collective; generation ranks have neither)."""
        kl = self.host.kl
        box = [None if batch is None else (batch.to("cpu"), float(kl.value))]
        dist.broadcast_object_list(box, src=self.learner_root)
        if batch is None:
            batch, kl_coef = box[0]
            kl.value = torch.tensor(kl_coef)
        return batch.to(platform.device())


def staleness_metrics(batch: Batch, version: int) -> dict:
    """``staleness_mean`` and ``staleness_max``: policy versions between the weights that sampled each
    response token and ``version``, the weights the batch updates; ``partial_samples_fraction``: of the
    samples, those whose tokens more than one version sampled (partial rollouts)."""
    mask = batch.response_mask
    staleness = (version - batch.policy_versions) * mask
    newest = (batch.policy_versions * mask).amax(dim=1)
    oldest = torch.where(mask.bool(), batch.policy_versions, newest.unsqueeze(1)).amin(dim=1)
    return {"staleness_mean": staleness.sum() / mask.sum().clamp(min=1), "staleness_max": staleness.max(),
            "partial_samples_fraction": (newest > oldest).float().mean()}
