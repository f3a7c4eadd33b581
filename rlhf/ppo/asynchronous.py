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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.batch import Batch
from rlhf.parallel import Placement
from rlhf.parallel.exchange import first_rank

if TYPE_CHECKING:
    from rlhf.ppo.trainer import IterationResult, Trainer


def learner_group(placement: Placement):
    """The process group of every rank besides actor_gen's (collective: every rank calls it)."""
    generation = set(placement["actor_gen"].ranks)
    return dist.new_group([r for r in range(placement.world_size) if r not in generation])


@dataclass
class AheadBatch:
    """A batch generated ahead of its iteration (on every rank; ``policy_versions`` says which weights
    sampled each token) and the data position before its prompts were drawn."""

    batch: Batch
    data_position: dict


class GenerationAhead:
    """The asynchronous iteration of a Trainer (module docstring): up to K batches generated ahead."""

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer
        self.k = trainer.config.ppo.max_staleness
        self.generating = trainer.groups["actor_gen"] is not None
        self.learner_root = first_rank(trainer.learners)
        self.waiting: deque[AheadBatch] = deque()
        self.version = 0  # the policy version of the weights actor_gen holds
        self._pending = None  # (prompts, this rank's samples, data position) until the ranks meet

    def data_position(self) -> dict:
        """Where a resumed run continues drawing prompts: before the oldest batch not trained yet."""
        return self.waiting[0].data_position if self.waiting else self.trainer.prompts.state_dict()

    def forget(self) -> None:
        """Drop the batches generated ahead (a checkpoint was loaded: its position is before them)."""
        self.waiting.clear()

    def step(self) -> "IterationResult":
        """One iteration: learners train on the oldest batch while actor_gen generates K iterations
        ahead, then all ranks meet (collective)."""
        t = self.trainer
        t.timer.start_iteration(t.iteration + 1)
        platform.reset_peak_memory()
        if not self.waiting:  # the run's start, or a resumed one
            with t.timer.stage("reshard"):
                t.sync_generation_weights()
            self.version = t.iteration
            for ahead in range(self.k):
                self._generate(t.iteration + ahead)
        oldest = self.waiting.popleft()
        batch, local = None, {}
        self._generate(t.iteration + self.k, meet=False)  # draws the prompts on every rank
        if not self.generating:
            batch, local = t.update_from(oldest.batch)
        with t.timer.stage("wait"):  # until the other side is done too
            dist.barrier()
        local["generation_idle_fraction" if self.generating else "training_idle_fraction"] = (
            t.timer.seconds["wait"] / t.timer.elapsed())
        self._meet()
        batch = self._share_learned(batch)
        with t.timer.stage("reshard"):
            t.sync_generation_weights()
        local.update(staleness_metrics(batch, t.iteration))
        self.version = t.iteration + 1
        return t.finish_iteration(batch, local)

    # ---- pieces ------------------------------------------------------------------------

    def _generate(self, iteration: int, meet: bool = True) -> None:
        """Draw the prompts of (0-based) ``iteration`` and generate them on actor_gen; none past the run's
        end. ``meet``: gather the samples now (collective); else at the next :meth:`_meet`."""
        t = self.trainer
        self._pending = None
        if iteration >= t.config.run.iterations:
            return
        position = t.prompts.state_dict()
        prompts = next(t.prompts)
        with t.timer.stage("generation") if self.generating else contextlib.nullcontext():
            mine, _ = t.generate_here(prompts, iteration)
        self._pending = (prompts, mine, position)
        if meet:
            with t.timer.stage("wait"):
                self._meet()

    def _meet(self) -> None:
        """Gather the generated samples of the pending batch onto every rank and queue it (collective)."""
        if self._pending is None:
            return
        prompts, mine, position = self._pending
        self._pending = None
        batch = self.trainer.collect_rollout(prompts, mine).batch
        versions = torch.full_like(batch.rollout_logprobs, float(self.version)) * batch.response_mask
        self.waiting.append(AheadBatch(batch.with_fields(policy_versions=versions), position))

    def _share_learned(self, batch: Batch | None) -> Batch:
        """The learners' finished batch on every rank, and their KL coefficient, which the checkpoint
        keeps (collective; generation ranks have neither)."""
        kl = self.trainer.kl
        box = [None if batch is None else (batch.to("cpu"), float(kl.value))]
        dist.broadcast_object_list(box, src=self.learner_root)
        if batch is None:
            batch, kl_coef = box[0]
            kl.value = torch.tensor(kl_coef)
        return batch.to(platform.device())


def staleness_metrics(batch: Batch, version: int) -> dict:
    """``staleness_mean`` and ``staleness_max``: policy versions between the weights that sampled each
    response token and ``version``, the weights the batch updates."""
    mask = batch.response_mask
    staleness = (version - batch.policy_versions) * mask
    return {"staleness_mean": staleness.sum() / mask.sum().clamp(min=1), "staleness_max": staleness.max()}
