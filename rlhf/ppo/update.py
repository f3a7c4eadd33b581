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

from rlhf import platform
from rlhf.algorithms import balanced_minibatches, kl_estimate, masked_mean
from rlhf.algorithms.losses import (loss_denominator, loss_numerator, policy_loss_per_token, truncated_is_weights,
                                    value_loss_per_token)
from rlhf.batch import Batch
from rlhf.config import ConfigError
from rlhf.metrics import StageTimer
from rlhf.models import moe
from rlhf.models.packing import PackedLayout, unpacked
from rlhf.parallel import Placement
from rlhf.parallel.exchange import first_rank
from rlhf.parallel.groups import TaskGroups
from rlhf.pipeline.compiler import serial_schedule
from rlhf.pipeline.executor import ModelRuntime, run_step
from rlhf.pipeline.inference import response_logprobs
from rlhf.pipeline.timeline import StageTimes, idle_fraction
from rlhf.ppo import layout
from rlhf.ppo.config import JobConfig
from rlhf.schedule.io import load_schedule, save_schedule, schedule_from_dict, schedule_to_dict
from rlhf.schedule.schedule import Schedule
from rlhf.schedule.search import SearchConfig, search

CONSECUTIVE_SKIPS = "_consecutive_skipped_steps"
"""``<model>_consecutive_skipped_steps``: the metric of a model's optimizer steps skipped in a row."""
FUSED_SCHEDULE_FILE = "fused_schedule.json"
"""Beside the checkpoints (``<save>/``): the fused schedule searched at start-up, reused on resume."""


class PPOUpdate:
    """The trained models' PPO epochs on this rank (collective: every rank runs them together).

    ``models``/``groups``: this rank's modules and process groups by task; ``optimizers``: by model
    name (those this rank trains); ``timer``: the trainer's, which takes every executor step's
    timeline (the trace and the bubble metric).
    """

    def __init__(self, config: JobConfig, placement: Placement, groups: dict, models: dict, optimizers: dict,
                 timer: StageTimer, group=None):
        self.config, self.placement, self.groups, self.models = config, placement, groups, models
        self.optimizers, self.timer = optimizers, timer
        self.group = group  # the ranks that run update(): all, or the learners of an asynchronous run
        self.trained = config.trained_tasks()
        self.schedules: dict = {}  # serial 1F1B by (model, micro-batches): serial()
        fusion = config.fusion.intra_stage_fusion
        self.fused: Schedule | None = layout.fused_schedule(config, placement) if fusion else None
        self.stage_times = StageTimes()  # what the search needs, while ``measuring``

    @property
    def measuring(self) -> bool:
        """Whether the stages are being timed for a fused schedule still to be searched (fusion without a
        schedule file, until the first iteration's update ends or a resumed run finds the cached one)."""
        return self.config.fusion.intra_stage_fusion and self.fused is None

    def run(self, batch: Batch, iteration: int, kl_coef: float) -> dict:
        """``ppo_epochs`` passes of token-balanced mini-batches; one optimizer step per mini-batch and model
        (the critic alone while ``iteration`` < ``critic_warmup``); ``kl_coef`` weighs the KL loss term.
        Returns this rank's loss statistics, its models' gradient norms and learning rates and its
        training bubble fraction."""
        ppo = self.config.ppo
        trained = {m: t for m, t in self.trained.items() if m == "critic" or iteration >= ppo.critic_warmup}
        losses = {name: self._loss(name, kl_coef) for name in trained}
        timelines, steps, forwards = [], {name: [] for name in trained}, dict.fromkeys(trained, 0)
        for epoch in range(ppo.ppo_epochs):
            plans = {name: self._minibatches(batch, task, iteration, epoch) for name, task in trained.items()}
            for m in range(ppo.minibatches):
                runtimes = {}
                for name, task in trained.items():
                    g = self.groups[task]
                    if g is not None:
                        members = [i for part in plans[name][m] for i in part]
                        runtimes[name] = self._runtime(name, task, batch.select(plans[name][m][g.coord.dp]),
                                                       batch.select(members), losses[name])
                self._run_minibatch(runtimes, timelines, measured=len(trained) == len(self.trained))
                for name, rt in runtimes.items():
                    steps[name].append(rt.optimizer.last_step)
                    forwards[name] += len(rt.microbatches)
        if self.measuring and len(trained) == len(self.trained):  # the stages are measured: fuse from now on
            self.fused = self._search_fused_schedule()
        out = {k: v for loss in losses.values() for k, v in loss.metrics().items()}
        for name, task in trained.items():
            if self.groups[task] is not None:
                out.update(losses[name].step_losses(self.groups[task], len(steps[name])))
                if self.config.models[name].is_moe:
                    out.update(moe_metrics(name, self.config.models[name], self.models[task], self.groups[task],
                                           forwards[name]))
        for name, done in steps.items():
            out.update(step_metrics(name, done, self.optimizers.get(name)))
        idle = idle_fraction(timelines)
        return out if idle is None else {**out, "training_bubble_fraction": idle}

    def reuse_cached_schedule(self, root: str) -> None:
        """Take the fused schedule a run that saved into checkpoint root ``root`` searched, if it is
        there and this run is still measuring (a resumed run does not measure again)."""
        cached = os.path.join(root, FUSED_SCHEDULE_FILE)
        if self.measuring and os.path.isfile(cached):
            schedule = load_schedule(cached)
            layout.check_fused(self.config, schedule, self.placement)
            self.fused = schedule

    def _run_minibatch(self, runtimes: dict, timelines: list, measured: bool) -> None:
        """One optimizer step of every trained model on this rank: the fused schedule over both
        models, or each model's serial 1F1B over its own mesh (also while the critic warms up alone).
        ``measured``: the step counts towards the stage times a fused schedule is searched for."""
        if self.fused is not None and len(runtimes) == len(self.trained):
            # a fused pipeline spans the same ranks for both models
            self._record_step(run_step(self.fused, runtimes, group=self.groups["actor_train"].mesh_group),
                              timelines, measured)
            return
        for name, rt in runtimes.items():
            self._record_step(run_step(self.serial(name, len(rt.microbatches)), {name: rt}, group=rt.groups.mesh_group),
                              timelines, measured)

    def serial(self, name: str, microbatches: int) -> Schedule:
        """Serial 1F1B of model ``name`` over ``microbatches`` per replica (made once per count: token-budget
        micro-batches vary in number between mini-batches and DP replicas)."""
        key = (name, microbatches)
        if key not in self.schedules:
            self.schedules[key] = serial_schedule(name, self.placement[self.trained[name]], microbatches)
        return self.schedules[key]

    def _record_step(self, step, timelines: list, measured: bool) -> None:
        """Keep an executor step's timeline: for the trace, the bubble metric and (while measuring)
        the stage times the search needs."""
        self.timer.include(step.timeline)
        timelines.append(step.timeline)
        if self.measuring and measured:
            self.stage_times.add(step.timeline, {m: self.groups[t].coord.pp for m, t in self.trained.items()
                                                 if self.groups[t] is not None})

    def _search_fused_schedule(self) -> Schedule:
        """A fused schedule for the measured stage times, searched on the first rank of ``group`` and shared
        (collective over it)."""
        costs = self.stage_times.per_stage({m: self.placement[t].strategy.pp for m, t in self.trained.items()},
                                           group=self.group)
        problem = layout.fusion_problem(self.config, self.placement, costs)
        found, first = [None], first_rank(self.group)
        if dist.get_rank() == first:
            budget = self.config.fusion.search_budget
            found = [schedule_to_dict(search(problem, SearchConfig(budget_s=budget, memory_budget_s=budget / 4,
                                                                   seed=self.config.run.seed)).schedule)]
        dist.broadcast_object_list(found, src=first, group=self.group)
        schedule = schedule_from_dict(found[0])
        layout.check_fused(self.config, schedule, self.placement)
        root = self.config.checkpoint.save
        if root is not None and dist.get_rank() == first:  # a resumed run reuses it (reuse_cached_schedule)
            os.makedirs(root, exist_ok=True)
            save_schedule(os.path.join(root, FUSED_SCHEDULE_FILE), schedule)
        return schedule

    def _minibatches(self, batch: Batch, task: str, iteration: int, epoch: int) -> list:
        """result[m][dp] = sample indices; the same on every rank (seeded by run seed, iteration, epoch)."""
        gen = torch.Generator().manual_seed(self.config.run.seed * 7919 + iteration * 131 + epoch)
        return balanced_minibatches(batch.sequence_lengths, self.config.ppo.minibatches,
                                    self.placement[task].strategy.dp, generator=gen)

    def _loss(self, name: str, kl_coef: float) -> ModelLoss:
        """The loss of model ``name`` for this iteration (it keeps the statistics of its micro-batches)."""
        ppo, gen = self.config.ppo, self.config.generation
        if name == "critic":
            return CriticLoss(ppo, gen.max_response_len)
        return ActorLoss(ppo, gen.max_response_len, gen.logprob_temperature, kl_coef if ppo.kl_in_loss else 0.0)

    def _runtime(self, name: str, task: str, share: Batch, minibatch: Batch, loss: ModelLoss) -> ModelRuntime:
        """The executor's view of one model for one mini-batch (``minibatch``: every DP replica's samples) on
        this rank (``share``): each micro-batch's loss is its aggregation numerator / the mini-batch's
        denominator, times the micro-batches x DP replicas the executor and the gradient reduction average
        over, so that the gradient is that of the mini-batch's aggregated loss. A mixture of experts' auxiliary
        losses weigh each micro-batch by its share of the mini-batch's tokens alike; a MoE actor compares its
        routing with the engine's, or replays it (``ppo.routing_replay``)."""
        g, ppo, cfg = self.groups[task], self.config.ppo, self.config.models[name]
        fused = self.config.fusion.intra_stage_fusion  # a fused schedule's micro-batch count is fixed
        fixed = layout.microbatches(self.config, self.placement, task) if fused else None
        micro = share.micro_batches(ppo.micro_batch_size, ppo.packing_budget, count=fixed)
        averaged = len(micro) * g.mesh.strategy.dp
        aux_weights = routing = None
        if cfg.is_moe:
            tokens = int(minibatch.sequence_lengths.sum())
            aux_weights = [int(mb.sequence_lengths.sum()) / tokens * g.mesh.strategy.dp for mb in micro]
            routing = ppo.routing_replay if name == "actor" and share.routing is not None else None
        return ModelRuntime(name, g.mesh, micro, self.models[task], g, self.optimizers[name],
                            functools.partial(loss, denominator=loss.denominator(minibatch), averaged=averaged),
                            cfg.hidden_size, packed=loss.packed, aux_loss_weights=aux_weights,
                            routing_replay=routing)


class ModelLoss:
    """One model's loss over an iteration's micro-batches: ``loss(output, mb, groups, packed, denominator,
    averaged)`` is what the executor backpropagates (``packed``: the micro-batch's layout, which the executor
    made once), and every call keeps the micro-batch's statistics for
    :meth:`metrics` and its share of the logged loss terms for :meth:`step_losses`.

    The aggregation (``ppo.loss_agg``) is exact over DP replicas and micro-batches: a micro-batch's loss is
    its numerator (additive over sequences) / the mini-batch's :meth:`denominator`, counted over all of them,
    so the shares of all micro-batches and replicas add up to the loss the optimizer step minimises. That
    sum, per term, is what is logged (``policy_loss``, ``value_loss``, ...): the mean over the iteration's
    optimizer steps of the loss each step minimised."""

    def __init__(self, ppo, max_response_len: int):
        self.ppo, self.max_response_len = ppo, max_response_len
        self.packed = ppo.packing_budget is not None  # the model output comes packed
        self.recorded: list = []  # (valid tokens, {metric: value}) per micro-batch
        self.terms: dict = {}  # {logged term: sum over this rank's micro-batches of numerator / denominator}

    def mask(self, mb: Batch) -> torch.Tensor:
        """[b, R] 0/1: the response tokens this loss trains on."""
        return mb.response_mask

    def denominator(self, minibatch: Batch) -> torch.Tensor:
        """The aggregation's denominator of a whole mini-batch (every DP replica's samples): a 0-dim float32
        tensor where the mask is, so that no micro-batch waits to read it on the host."""
        lengths = self.mask(minibatch).sum(dim=1)
        return loss_denominator(lengths, self.ppo.loss_agg, norm_length=self.max_response_len)

    def term_names(self) -> tuple:
        """The loss terms this loss logs, in a fixed order (every rank of the model's mesh agrees)."""
        raise NotImplementedError

    def share(self, per_token: torch.Tensor, mask: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
        """This micro-batch's share of the mini-batch's aggregated loss of ``per_token`` [b, R] (0-dim)."""
        return loss_numerator(per_token, mask, self.ppo.loss_agg) / denominator

    def add_term(self, name: str, value: torch.Tensor) -> None:
        """Add a micro-batch's share of loss term ``name`` (detached) to this rank's sum."""
        self.terms[name] = self.terms.get(name, 0.0) + value.detach()

    def metrics(self) -> dict:
        """Token-weighted means of the recorded statistics (maxima for ``*_max``) on this rank."""
        return combine_records(self.recorded)

    def step_losses(self, g: TaskGroups, steps: int) -> dict:
        """Each logged loss term as the mean over the iteration's ``steps`` optimizer steps of the value the
        step minimised: the shares of every micro-batch, summed over the model's mesh (collective over it;
        one TP rank of each last stage counts, its TP peers hold copies). Equal on every rank of the mesh."""
        names = self.term_names()
        if not steps or not names:
            return {}
        zero = torch.zeros((), device=platform.device())
        counted = self.terms if g.is_last_stage and g.tp_rank == 0 else {}
        sums = torch.stack([counted.get(name, zero) for name in names]).float()
        dist.all_reduce(sums, group=g.mesh_group)
        return dict(zip(names, sums / steps))


class ActorLoss(ModelLoss):
    """The clipped policy loss (clip-higher, dual-clip, log-ratio clamped), weighted per token by truncated
    importance sampling when ``tis_cap`` is set, plus the KL term (``kl_coef`` x the per-token estimate
    against the reference, when the KL acts in the loss) minus the entropy bonus (``entropy_coef`` x the
    vocabulary-parallel entropy, with its gradient); all of logits / ``temperature``, each term aggregated
    alike. With ``mask_truncated`` samples cut at the length budget are left out."""

    def __init__(self, ppo, max_response_len: int, temperature: float, kl_coef: float):
        super().__init__(ppo, max_response_len)
        self.temperature, self.kl_coef = temperature, kl_coef

    def mask(self, mb: Batch) -> torch.Tensor:
        mask = mb.response_mask
        if self.ppo.mask_truncated:
            finished = [reason != "length" for reason in mb.finish_reasons]
            mask = mask * torch.tensor(finished, dtype=mask.dtype).to(mask.device, non_blocking=True).unsqueeze(1)
        return mask

    def term_names(self) -> tuple:
        """``policy_loss``, then ``kl_loss`` (KL in the loss) and ``entropy_loss`` (an entropy bonus): the
        actor minimises policy_loss + kl_coef x kl_loss - entropy_coef x entropy_loss."""
        return ("policy_loss",) + ("kl_loss",) * bool(self.kl_coef) + ("entropy_loss",) * bool(self.ppo.entropy_coef)

    def __call__(self, logits: torch.Tensor, mb: Batch, g: TaskGroups, packed: PackedLayout | None,
                 denominator: torch.Tensor, averaged: int) -> torch.Tensor:
        ppo, mask = self.ppo, self.mask(mb)
        logprobs, entropy = response_logprobs(logits, mb, g, self.temperature, packed)
        per_token, stats = policy_loss_per_token(logprobs, mb.old_logprobs, mb.advantages, mask, ppo.clip_eps,
                                                 ppo.clip_eps_high, ppo.dual_clip)
        record = {"clip_fraction": stats["clipfrac"], "approx_kl": stats["approx_kl"],
                  "ratio_mean": stats["ratio_mean"], "ratio_max": stats["ratio_max"]}
        if ppo.tis_cap is not None:  # the surrogate weighted by proximal / behaviour (decoupled PPO)
            weights, tis = truncated_is_weights(mb.old_logprobs, mb.rollout_logprobs, mask, ppo.tis_cap, ppo.tis_mode)
            per_token = per_token * weights
            record.update(tis)
        loss = self.share(per_token, mask, denominator)
        self.add_term("policy_loss", loss)
        if self.kl_coef:
            kl = self.share(kl_estimate(logprobs, mb.ref_logprobs, ppo.kl_estimator_name), mask, denominator)
            self.add_term("kl_loss", kl)
            loss = loss + self.kl_coef * kl
        record["entropy_mean"] = masked_mean(entropy.detach(), mask)
        if ppo.entropy_coef:
            bonus = self.share(entropy, mask, denominator)
            self.add_term("entropy_loss", bonus)
            loss = loss - ppo.entropy_coef * bonus
        self.recorded.append((mask.sum(), record))
        return loss * averaged


class CriticLoss(ModelLoss):
    """The clipped value loss of the critic's per-position values against the returns."""

    def term_names(self) -> tuple:
        return ("value_loss",)

    def __call__(self, values: torch.Tensor, mb: Batch, g: TaskGroups, packed: PackedLayout | None,
                 denominator: torch.Tensor, averaged: int) -> torch.Tensor:
        mask = self.mask(mb)
        values = mb.response_from_positions(unpacked(values, packed))
        per_token, stats = value_loss_per_token(values, mb.values, mb.returns, mask,
                                                clip_eps=self.ppo.value_clip)
        loss = self.share(per_token, mask, denominator)
        self.add_term("value_loss", loss)
        self.recorded.append((mask.sum(), {"value_clip_fraction": stats["vf_clipfrac"]}))
        return loss * averaged


def moe_metrics(name: str, cfg, model, g: TaskGroups, forwards: int) -> dict:
    """A mixture of experts' ``<name>_load_balancing_loss`` and ``<name>_z_loss`` where its ``cfg`` weighs them
    (each times its coefficient, summed over the layers: the mean over the iteration's training forwards on
    every replica) and, where the
    forwards read the engine's routing, ``routing_agreement`` (the fraction of (token, layer) choices
    where the model's own top-k set equals the engine's, over the tokens the engine computed). Collective over
    the model's mesh; one TP rank of each stage counts (its TP peers route the same tokens alike)."""
    counts = g.tp_rank == 0
    aux = moe.aux_losses(model)
    agree, counted = moe.routing_agreement(model)
    values = [aux[n] if counts else 0.0 for n in moe.AUX_LOSS_NAMES]
    values += [agree if counts else 0, counted if counts else 0, forwards if counts and g.is_first_stage else 0]
    sums = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=platform.device()) for v in values])
    dist.all_reduce(sums, group=g.mesh_group)
    *losses, agree, counted, forwards = sums.tolist()
    weighed = (cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff)
    out = {f"{name}_{n}": value / max(forwards, 1) for n, value, coeff in zip(moe.AUX_LOSS_NAMES, losses, weighed)
           if coeff}
    if counted:
        out["routing_agreement"] = agree / counted
    return out


def _mean(values: list) -> float:
    return sum(values) / len(values)


def step_metrics(name: str, steps: list[dict], optimizer) -> dict:
    """``<name>_lr`` and ``<name>_grad_norm``: means over an iteration's optimizer ``steps`` (``last_step``
    dicts; the norm over the applied ones), ``<name>_skipped_steps`` (steps whose gradients were not finite,
    so the weights did not move), ``<name>_consecutive_skipped_steps`` (the ``optimizer``'s skips in a row
    after them, read by :func:`stop_after_skipped_steps`) and, with fp16 loss scaling, ``<name>_loss_scale``
    (the last step's)."""
    if not steps:
        return {}
    applied = [s["grad_norm"] for s in steps if not s["skipped"]]
    out = {f"{name}_lr": _mean([s["lr"] for s in steps]), f"{name}_skipped_steps": sum(s["skipped"] for s in steps),
           f"{name}{CONSECUTIVE_SKIPS}": float(optimizer.skipped_in_a_row)}
    if applied:
        out[f"{name}_grad_norm"] = _mean(applied)
    if "loss_scale" in steps[-1]:
        out[f"{name}_loss_scale"] = steps[-1]["loss_scale"]
    return out


def stop_after_skipped_steps(metrics: dict, limit: int) -> None:
    """Stop the run once a model's last ``limit`` optimizer steps were all skipped (0: never): a ConfigError
    naming ``ppo.max_skipped_steps``, raised alike on every rank, as ``metrics`` are reduced over all ranks
    (those outside the model learn its count there)."""
    for key, count in metrics.items():
        if limit and key.endswith(CONSECUTIVE_SKIPS) and count >= limit:
            raise ConfigError(f"{key[:-len(CONSECUTIVE_SKIPS)]}: {int(count)} optimizer steps in a row skipped for "
                              f"non-finite gradients (the limit is {limit}), so it no longer learns; look for NaN or "
                              "infinity in its inputs, or lower its learning rate", "ppo.max_skipped_steps")


def combine_records(recorded: list) -> dict:
    """Token-weighted means of the per-micro-batch training metrics recorded on this rank; ``*_max``
    metrics take their largest value."""
    sums, weights, peaks = {}, {}, {}
    for tokens, metrics in recorded:
        for key, value in metrics.items():
            if key.endswith("_max"):
                peaks[key] = torch.maximum(peaks[key], value) if key in peaks else value
            else:
                sums[key] = sums.get(key, 0.0) + value * tokens
                weights[key] = weights.get(key, 0.0) + tokens
    return {**{key: sums[key] / weights[key].clamp(min=1) for key in sums}, **peaks}
