"""The PPO epochs of one iteration: mini-batches, the two losses, and the schedule that runs them.

    batch (advantages, returns) -> per epoch: token-balanced mini-batches, this DP replica's share
      -> micro-batches -> the instruction executor runs the actor's and the critic's passes:
         serial 1F1B over each model's own mesh, or one fused actor/critic schedule
      -> one optimizer step per mini-batch and model

Where the fused schedule comes from (``--intra-stage-fusion``): the ``schedule`` file, checked at
start-up (rlhf/ppo/layout.py); or, without one, the first iteration runs serial 1F1B, measures
every stage's forward and backward seconds (``measuring``), and a fused schedule is searched for
them on rank 0 (rlhf/schedule/search.py), shared, and cached beside the checkpoints
(``FUSED_SCHEDULE_FILE``) so that a resumed run reuses it instead of measuring again.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from rlhf.algorithms import balanced_minibatches, masked_mean, policy_loss, value_loss
from rlhf.batch import Batch
from rlhf.metrics import StageTimer
from rlhf.models.logprobs import vocab_parallel_entropy
from rlhf.parallel import Placement
from rlhf.parallel.groups import TaskGroups
from rlhf.pipeline.compiler import serial_schedule
from rlhf.pipeline.executor import ModelRuntime, run_step
from rlhf.pipeline.timeline import StageTimes, idle_fraction
from rlhf.ppo import layout
from rlhf.ppo.config import JobConfig
from rlhf.pipeline.inference import micro_batch_count, response_logprobs
from rlhf.schedule.io import load_schedule, save_schedule, schedule_from_dict, schedule_to_dict
from rlhf.schedule.schedule import Schedule
from rlhf.schedule.search import SearchConfig, search

FUSED_SCHEDULE_FILE = "fused_schedule.json"
"""Beside the checkpoints (``<save>/``): the fused schedule searched at start-up, reused on resume."""


class PPOUpdate:
    """The trained models' PPO epochs on this rank (collective: every rank runs them together).

    ``models``/``groups``: this rank's modules and process groups by task; ``optimizers``: by model
    name (those this rank trains); ``timer``: the trainer's, which takes every executor step's
    timeline (the trace and the bubble metric).
    """

    def __init__(self, config: JobConfig, placement: Placement, groups: dict, models: dict, optimizers: dict,
                 timer: StageTimer):
        self.config, self.placement, self.groups, self.models = config, placement, groups, models
        self.optimizers, self.timer = optimizers, timer
        self.trained = config.trained_tasks()
        self.schedules = {name: serial_schedule(name, placement[task], layout.microbatches(config, placement, task))
                          for name, task in self.trained.items()}
        fusion = config.fusion.intra_stage_fusion
        self.fused: Schedule | None = layout.fused_schedule(config, placement) if fusion else None
        self.stage_times = StageTimes()  # what the search needs, while ``measuring``

    @property
    def measuring(self) -> bool:
        """Whether the stages are being timed for a fused schedule still to be searched (fusion without a
        schedule file, until the first iteration's update ends or a resumed run finds the cached one)."""
        return self.config.fusion.intra_stage_fusion and self.fused is None

    def run(self, batch: Batch, iteration: int) -> dict:
        """``ppo_epochs`` passes of token-balanced mini-batches; one optimizer step per mini-batch and model.
        Returns this rank's token-weighted loss statistics and its training bubble fraction."""
        ppo = self.config.ppo
        recorded, timelines = [], []
        for epoch in range(ppo.ppo_epochs):
            plans = {name: self._minibatches(batch, task, iteration, epoch) for name, task in self.trained.items()}
            for m in range(ppo.minibatches):
                runtimes = {}
                for name, task in self.trained.items():
                    g = self.groups[task]
                    if g is not None:
                        members = [i for part in plans[name][m] for i in part]
                        runtimes[name] = self._runtime(name, task, batch.select(plans[name][m][g.coord.dp]),
                                                       int(batch.response_lengths[members].sum()), recorded)
                self._run_minibatch(runtimes, timelines)
        if self.measuring:  # the first iteration measured the stages: fuse from now on
            self.fused = self._search_fused_schedule()
        idle = idle_fraction(timelines)
        return {**_mean_records(recorded), **({} if idle is None else {"training_bubble_fraction": idle})}

    def reuse_cached_schedule(self, root: str) -> None:
        """Take the fused schedule a run that saved into checkpoint root ``root`` searched, if it is
        there and this run is still measuring (a resumed run does not measure again)."""
        cached = os.path.join(root, FUSED_SCHEDULE_FILE)
        if self.measuring and os.path.isfile(cached):
            schedule = load_schedule(cached)
            layout.check_fused(self.config, schedule, self.placement)
            self.fused = schedule

    def _run_minibatch(self, runtimes: dict, timelines: list) -> None:
        """One optimizer step of every trained model on this rank: the fused schedule over both
        models, or each model's serial 1F1B over its own mesh."""
        if self.fused is not None:
            if runtimes:  # a fused pipeline spans the same ranks for both models
                self._record_step(run_step(self.fused, runtimes, group=self.groups["actor_train"].mesh_group),
                                  timelines)
            return
        for name, rt in runtimes.items():
            self._record_step(run_step(self.schedules[name], {name: rt}, group=rt.groups.mesh_group), timelines)

    def _record_step(self, step, timelines: list) -> None:
        """Keep an executor step's timeline: for the trace, the bubble metric and (while measuring)
        the stage times the search needs."""
        self.timer.include(step.timeline)
        timelines.append(step.timeline)
        if self.measuring:
            self.stage_times.add(step.timeline, {m: self.groups[t].coord.pp for m, t in self.trained.items()
                                                 if self.groups[t] is not None})

    def _search_fused_schedule(self) -> Schedule:
        """A fused schedule for the measured stage times, searched on rank 0 and shared (collective)."""
        costs = self.stage_times.per_stage({m: self.placement[t].strategy.pp for m, t in self.trained.items()})
        problem = layout.fusion_problem(self.config, self.placement, costs)
        found = [None]
        if dist.get_rank() == 0:
            budget = self.config.fusion.search_budget
            found = [schedule_to_dict(search(problem, SearchConfig(budget_s=budget, memory_budget_s=budget / 4,
                                                                   seed=self.config.run.seed)).schedule)]
        dist.broadcast_object_list(found, src=0)
        schedule = schedule_from_dict(found[0])
        layout.check_fused(self.config, schedule, self.placement)
        root = self.config.checkpoint.save
        if root is not None and dist.get_rank() == 0:  # a resumed run reuses it (reuse_cached_schedule)
            os.makedirs(root, exist_ok=True)
            save_schedule(os.path.join(root, FUSED_SCHEDULE_FILE), schedule)
        return schedule

    def _minibatches(self, batch: Batch, task: str, iteration: int, epoch: int) -> list:
        """result[m][dp] = sample indices; the same on every rank (seeded by run seed, iteration, epoch)."""
        gen = torch.Generator().manual_seed(self.config.run.seed * 7919 + iteration * 131 + epoch)
        return balanced_minibatches(batch.sequence_lengths, self.config.ppo.minibatches,
                                    self.placement[task].strategy.dp, generator=gen)

    def _runtime(self, name: str, task: str, share: Batch, minibatch_tokens: int, recorded: list) -> ModelRuntime:
        """The executor's view of one model for one mini-batch on this rank."""
        g, ppo = self.groups[task], self.config.ppo
        micro = share.split(micro_batch_count(len(share), ppo.micro_batch_size))
        # Each micro-batch's token-mean loss is rescaled so that, after the executor's
        # 1/micro-batches and the DP average, the gradient is the mini-batch's token mean.
        scale = len(micro) * g.mesh.strategy.dp / max(minibatch_tokens, 1)
        loss = (functools.partial(actor_loss, clip_eps=ppo.clip_eps, scale=scale, recorded=recorded) if name == "actor"
                else functools.partial(critic_loss, value_clip=ppo.value_clip, scale=scale, recorded=recorded))
        return ModelRuntime(name, g.mesh, micro, self.models[task], g, self.optimizers[name], loss,
                            self.config.models[name].hidden_size)


def actor_loss(logits: torch.Tensor, mb: Batch, g: TaskGroups, *, clip_eps: float, scale: float, recorded: list):
    """The clipped policy loss of one micro-batch from its vocab-parallel logits, as the executor
    backpropagates it (token sum x ``scale``); its statistics are appended to ``recorded``."""
    mask = mb.response_mask
    logprobs = response_logprobs(logits, mb, g)
    loss, metrics = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask, clip_eps=clip_eps)
    entropy = mb.response_from_positions(vocab_parallel_entropy(logits[:, :-1], g.tp))
    tokens = mask.sum()
    recorded.append((tokens, {"policy_loss": loss.detach(), "entropy_mean": masked_mean(entropy, mask),
                              "clip_fraction": metrics["clipfrac"], "approx_kl": metrics["approx_kl"]}))
    return loss * tokens * scale


def critic_loss(values: torch.Tensor, mb: Batch, g: TaskGroups, *, value_clip: float | None, scale: float,
                recorded: list):
    """The clipped value loss of one micro-batch from the critic's per-position values (token sum x
    ``scale``); its statistics are appended to ``recorded``. ``g`` is unused: the executor passes every
    loss the task's groups."""
    mask = mb.response_mask
    loss, metrics = value_loss(mb.response_from_positions(values), mb.values, mb.returns, mask, clip_eps=value_clip)
    tokens = mask.sum()
    recorded.append((tokens, {"value_loss": loss.detach(), "value_clip_fraction": metrics["vf_clipfrac"]}))
    return loss * tokens * scale


def _mean_records(recorded: list) -> dict:
    """Token-weighted means of the per-micro-batch training metrics recorded on this rank."""
    sums, weights = {}, {}
    for tokens, metrics in recorded:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value * tokens
            weights[key] = weights.get(key, 0.0) + tokens
    return {key: sums[key] / weights[key].clamp(min=1) for key in sums}
