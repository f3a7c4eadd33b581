"""The PPO trainer: one synchronous iteration over the six tasks, top to bottom.

    prompts -> reshard actor_train into actor_gen -> generate (one engine per actor_gen replica)
            -> infer: ref_inf (ref_logprobs), reward_inf (scores), critic_inf (values)
            -> advantages (KL-penalised token rewards, estimator registry)
            -> PPO epochs: actor_train and critic_train through the instruction executor
            -> reshard critic_train into critic_inf -> metrics

With ``--inter-stage-fusion`` generation and inference overlap: the long
tail migrates to a few instances and the ranks it frees infer finished
samples while those generate (rlhf/fusion/inter_stage.py, docs/fusion.md).

Every rank runs the same program and takes part in the tasks whose meshes
hold it. Samples move between meshes as one ``Batch``: after generation and
after inference every rank receives the whole batch (an object all-gather;
a batch is small next to the models), so each task's DP replica takes its
share by index. Weights move only by resharding. Synchronous semantics: every
mini-batch sees samples of the current policy (docs/training.md).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import random
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.algorithms import (AdvantageInputs, balanced_minibatches, compute_advantages, make_kl_controller,
                             masked_mean, policy_loss, token_rewards, value_loss)
from rlhf.batch import Batch
from rlhf.checkpoint.megatron import ours_to_megatron
from rlhf.checkpoint.rlhf_state import ModelSlot, load_rlhf_state, save_rlhf_state
from rlhf.config import ConfigError
from rlhf.ppo import layout
from rlhf.ppo.config import JobConfig
from rlhf.engine import Engine, EngineConfig, Request, SamplingParams
from rlhf.fusion.inter_stage import InterStageFusion
from rlhf.fusion.policy import long_tailed_lengths
from rlhf.memory import ModuleOffloader, StorageRelease, module_tensors, storage_bytes
from rlhf.metrics import MetricsWriter, StageTimer, reduce_metrics, with_rates, write_trace
from rlhf.models.gpt import build_model
from rlhf.models.logprobs import vocab_parallel_entropy, vocab_parallel_log_probs
from rlhf.models.naming import named_global_parameters
from rlhf.optim import ModelOptimizer
from rlhf.parallel.exchange import gather_to_all, shares
from rlhf.parallel.groups import TaskGroups, build_task_groups
from rlhf.parallel.reshard import load_full_weights, reshard
from rlhf.pipeline.compiler import serial_schedule
from rlhf.pipeline.executor import ModelRuntime, run_step
from rlhf.pipeline.microbatch import pipeline_forward
from rlhf.pipeline.timeline import StageTimes, idle_fraction
from rlhf.schedule.io import load_schedule, save_schedule, schedule_from_dict, schedule_to_dict
from rlhf.schedule.schedule import Schedule
from rlhf.schedule.search import SearchConfig, search
from rlhf.tasks import MODEL_SEEDS, TASK_MODEL, WEIGHTS_TASK, task_kind

RewardFn = Callable[[list, list], list]
"""``fn(prompts, responses) -> scores``: token-id lists in, one float per sample out."""

FUSED_SCHEDULE_FILE = "fused_schedule.json"
"""Beside the checkpoints (``<save>/``): the fused schedule searched at start-up, reused on resume."""

MEGATRON_EXPORT_DIR = "megatron"
"""Beside the checkpoints (``<save>/``): the actor as Megatron-LM checkpoints with ``--save-format torch_dist``."""

INFERENCE_FIELDS = {"ref_inf": "ref_logprobs", "reward_inf": "scores", "critic_inf": "values",
                    "actor_train": "old_logprobs"}
"""What each inference pass adds to the batch (actor_train only with recompute_logprobs)."""

OFFLOADED_TASKS = ("ref_inf", "reward_inf")
"""The frozen models' tasks, whose weights ``memory.offload_ref_reward`` keeps on the host between uses."""


@dataclass
class IterationResult:
    """What one iteration produced: the final batch and the metrics reduced over ranks (both on every rank)."""

    batch: Batch
    metrics: dict = field(default_factory=dict)


class Trainer:
    """PPO over the placement's six task meshes (collective: every rank builds one).

    ``prompts`` yields PromptBatch-like objects (``.prompts`` with ``token_ids``);
    ``initial_weights`` maps a model name to what it starts from instead of
    random weights: its full state dict (global names), or a function
    ``names -> full state dict`` of those names (a rank asks for its own
    stage's, so it reads no more); the reference starts as a copy of the
    actor unless given. ``reward_fn`` scores samples (rank 0 calls it, every
    rank gets its scores): the reward when the config has no reward model
    (``JobConfig.has_reward_model``), else logged beside the model's score.
    """

    def __init__(self, config: JobConfig, placement, prompts, tokenizer,
                 initial_weights: Optional[dict] = None, reward_fn: Optional[RewardFn] = None):
        self.config, self.placement, self.prompts, self.tokenizer = config, placement, prompts, tokenizer
        if reward_fn is None and not config.has_reward_model:
            raise ValueError("a run without a reward model needs a reward_fn: its scores are the reward")
        self.reward_fn = reward_fn
        self.groups = build_task_groups(placement)
        self.tasks = list(config.needed_tasks())
        self.models = {t: self._build(t) for t in self.tasks if self.groups[t] is not None}
        initial_weights = initial_weights or {}
        self._load_initial(initial_weights)
        self.optimizers = self._build_optimizers()
        self.schedules = {name: serial_schedule(TASK_MODEL[task], placement[task],
                                                 layout.microbatches(config, placement, task))
                          for name, task in self._trained().items()}
        self.fused = layout.fused_schedule(config, placement) if config.fusion.intra_stage_fusion else None
        self.stage_times = StageTimes() if config.fusion.intra_stage_fusion and self.fused is None else None
        self._training_steps = []  # this iteration's executor timelines
        self.engine = self._build_engine()
        self.inter_stage = (InterStageFusion(config, placement, self._inference_tasks(), EngineConfig().max_num_seqs)
                            if config.fusion.inter_stage_fusion else None)
        self._fused, self._early = None, None  # this iteration's fused generation and early inference
        self.kl = make_kl_controller(config.ppo.kl_config)
        self.timer = StageTimer(trace_iteration=config.logging.trace_iteration)
        self.iteration = 0
        if "reference" not in initial_weights:
            self._reshard("actor_train", "ref_inf")
        self._reshard("critic_train", "critic_inf")
        self.offloaders = self._build_offloaders()
        self.generation_memory = self._build_generation_memory()
        self._memory_bytes = {}  # stage -> the most resident_bytes() noted in it this iteration (_note_memory)
        self.memory_bytes = {}  # the same of the last finished iteration on this rank (metrics: the heaviest rank)

    # ---- the iteration ---------------------------------------------------------------

    def train(self) -> None:
        """Iterations until ``config.run.iterations``, each logged (rank 0 writes), saved when configured."""
        cfg, ckpt = self.config, self.config.checkpoint
        with MetricsWriter(cfg.logging, cfg.run.iterations, dist.get_rank(), self.iteration) as writer:
            while self.iteration < cfg.run.iterations:
                writer.log(self.iteration + 1, self.step().metrics)
                last = self.iteration == cfg.run.iterations
                if ckpt.save and (last or (ckpt.save_interval and self.iteration % ckpt.save_interval == 0)):
                    self.save(ckpt.save)

    # ---- checkpoints -----------------------------------------------------------------

    def save(self, root: str) -> str:
        """Save every model (with optimizer and LR schedule), the KL controller, the data position
        and each rank's RNG as checkpoint ``iteration`` under ``root`` (collective, atomic)."""
        with self._on_device(*self.offloaders):  # collectives gather the weights where they compute
            path = save_rlhf_state(root, self.iteration, self._slots(), data_position=self.prompts.state_dict(),
                                   extra={"kl_coef": float(self.kl.value)}, group=dist.group.WORLD)
        if self.config.checkpoint.save_format == "torch_dist":
            self._export_megatron_actor(root)
        return path

    def _export_megatron_actor(self, root: str) -> None:
        """The actor of the checkpoint just saved, again as a Megatron-LM torch_dist checkpoint in
        ``<root>/megatron`` (rank 0 reads it back from disk and writes it; collective)."""
        if dist.get_rank() == 0:
            ours_to_megatron(root, os.path.join(root, MEGATRON_EXPORT_DIR), "actor", self.iteration)
        dist.barrier()

    def load(self, root: str) -> None:
        """Resume from the latest complete checkpoint under ``root`` (any layout; collective)."""
        with self._on_device(*self.offloaders, write_back=True):
            state = load_rlhf_state(root, self._slots(), group=dist.group.WORLD)
        self.iteration = state.iteration
        self.prompts.load_state_dict(state.data_position)
        self.kl.value = torch.tensor(state.extra["kl_coef"])
        self._reshard("critic_train", "critic_inf")
        cached = os.path.join(root, FUSED_SCHEDULE_FILE)
        if self.stage_times is not None and os.path.isfile(cached):  # searched by the run that saved
            self.fused = load_schedule(cached)
            layout.check_fused(self.config, self.fused, self.placement)
            self.stage_times = None

    def _slots(self) -> dict:
        """Each model of this run where its weights live (WEIGHTS_TASK), with its optimizer if trained."""
        slots = {}
        for model, task in WEIGHTS_TASK.items():
            if task in self.tasks:
                opt = self.optimizers.get(model)
                slots[model] = ModelSlot(self.config.models[model], task_kind(task), self.models.get(task),
                                         self.groups[task], opt, opt.scheduler if opt is not None else None)
        return slots

    def step(self) -> IterationResult:
        """One PPO iteration on the next prompts."""
        self.timer.start_iteration(self.iteration + 1)
        platform.reset_peak_memory()
        prompts = next(self.prompts)
        with self.timer.stage("reshard"):
            self.sync_generation_weights()
        with self.timer.stage("generation"):
            batch = self.generate(prompts)
        return self.learn(batch)

    def learn(self, batch: Batch) -> IterationResult:
        """Everything after generation: inference, advantages, PPO epochs, critic reshard.

        Returns the final batch and the iteration's metrics, reduced over all ranks (collective).
        """
        batch = batch.to(platform.device())  # per-token tensors live where the models compute
        with self.timer.stage("inference"):
            batch = self.infer(batch)
        with self.timer.stage("advantage"):
            batch, local = self.advantages(batch)
        with self.timer.stage("training"):
            local.update(self.update(batch))
            self._note_memory("training")
        with self.timer.stage("reshard"):
            self._reshard("critic_train", "critic_inf")
            self._note_memory("reshard")
        self.iteration += 1
        local.update(self._batch_metrics(batch))
        local.update(self.timer.metrics())
        local.update(self._memory_metrics())
        if self.inter_stage is not None:
            g = self.groups["actor_gen"]
            local.update(self.inter_stage.metrics(self._fused, None if g is None else g.tp_rank))
        metrics = with_rates(reduce_metrics(local))
        if self.inter_stage is not None:
            self.inter_stage.observe(batch.response_lengths.tolist(), metrics,
                                     self.placement["actor_gen"].strategy.dp)
            self._fused = None
        if self.timer.timeline is not None:
            write_trace(self.config.logging.trace_file, self.timer.timeline)
        return IterationResult(batch, metrics)

    # ---- 1. generation ---------------------------------------------------------------

    def sync_generation_weights(self) -> None:
        """Reshard the trained actor into the generation layout (before every generation), into
        storage allocated again if the last generation released it."""
        if self.generation_memory is not None:
            self.generation_memory.restore()
        self._reshard("actor_train", "actor_gen")
        self._note_memory("reshard")

    def generate(self, prompt_batch) -> Batch:
        """Samples of ``prompt_batch`` from the actor_gen replicas, as one Batch on every rank.

        Prompt ``i`` goes to replica ``i % dp``; every TP rank of a replica runs
        the same engine on the same requests, and its TP rank 0 contributes them.
        """
        g = self.groups["actor_gen"]
        mine = []
        if self.generation_memory is not None and self.generation_memory.released:  # the same on every rank
            raise RuntimeError("actor_gen's weights and KV cache were released after the last generation "
                               "(memory.release_generation_memory); call sync_generation_weights() first")
        fused = None
        if self.inter_stage is not None:
            self.inter_stage.start_iteration()
        if g is not None:
            dp = g.mesh.strategy.dp
            requests = [Request(str(i), tuple(p.token_ids), self._sampling_params(i))
                        for i, p in enumerate(prompt_batch.prompts) if i % dp == g.coord.dp]
            if self.inter_stage is not None:
                fused = self.inter_stage.generate(self.engine, requests, g)
                results = fused.samples
            else:
                results = self.engine.generate(requests)
            mine = results if g.tp_rank == 0 else []
        self._note_memory("generation")
        if self.generation_memory is not None:
            self.generation_memory.release()
        ids = {str(i): i for i in range(len(prompt_batch.prompts))}
        if self.inter_stage is None:
            samples = gather_to_all(mine)
        else:  # the freed ranks infer what finished by the migration, then the streamed tail, while the rest generate
            early = self.inter_stage.infer_early(fused, lambda part: Batch.from_samples(
                part, self.tokenizer.pad_id, ids).to(platform.device()), self._infer_on_device)
            samples, self._early = self.inter_stage.gather(mine, early, fused)
            self._fused = fused
        samples = sorted(samples, key=lambda s: (int(s.request_id), s.sample_index))
        return Batch.from_samples(samples, self.tokenizer.pad_id, ids)

    def _sampling_params(self, prompt_index: int) -> SamplingParams:
        """Prompt ``prompt_index``'s sampling: the configured one, or the declared long-tailed workload
        (``generation.long_tail_median``: a drawn length per sample, EOS ignored)."""
        gen, n = self.config.generation, self.config.ppo.n_samples_per_prompt
        seed = self._sample_seed(prompt_index)
        common = dict(max_new_tokens=gen.max_response_len, temperature=gen.temperature, top_p=gen.top_p,
                      top_k=gen.top_k, seed=seed, n=n)
        if not gen.long_tail_median:
            return SamplingParams(stop_token_ids=(self.tokenizer.eos_id,), **common)
        lengths = long_tailed_lengths(n, random.Random(seed), median=gen.long_tail_median, cap=gen.max_response_len)
        return SamplingParams(sample_max_new_tokens=tuple(lengths), **common)

    def _sample_seed(self, prompt_index: int) -> int:
        """Distinct per (run seed, iteration, prompt); the engine adds the sample index."""
        n = self.config.ppo.n_samples_per_prompt
        return (self.config.run.seed * 1_000_003 + self.iteration) * 65_537 + prompt_index * n

    # ---- 2. inference ----------------------------------------------------------------

    def infer(self, batch: Batch) -> Batch:
        """ref_logprobs, scores, values (with a critic) and recomputed old_logprobs (if asked), on every rank."""
        early, self._early = self._early, None
        outputs = {} if early is None else {name: dict(rows) for name, rows in early.rows.items()}
        for task, name in self._inference_tasks():
            if task in self.models:
                done = set() if early is None else early.done.get(task, set())
                remaining = [i for i in range(len(batch)) if i not in done]
                index = [remaining[k] for k in shares(len(remaining), self.groups[task].mesh.strategy.dp)[
                    self.groups[task].coord.dp]]
                if index:  # fewer samples left than replicas: the idle ones (all their ranks) skip
                    outputs.setdefault(name, {}).update(self._infer_on_device(task, batch.select(index), index))
        self._note_memory("inference")
        merged = {}
        for part in gather_to_all([outputs]):
            for name, rows in part.items():
                merged.setdefault(name, {}).update(rows)
        fields = {name: torch.stack([_response_width(rows[i], batch.response_width) for i in range(len(batch))])
                  .to(batch.tokens.device) for name, rows in merged.items()}
        if not self.config.has_reward_model:
            fields["scores"] = self._function_scores(batch)
        return batch.with_fields(**fields)

    def _function_scores(self, batch: Batch) -> torch.Tensor:
        """[N] float32 scores of ``reward_fn`` on the batch, the same on every rank (collective).

        Rank 0 calls the function once and broadcasts its scores, or why they
        are unusable: every rank then raises the same ConfigError, so a
        function that raises, or is not deterministic, cannot split the ranks.
        """
        box = [None]
        if dist.get_rank() == 0:
            try:
                box = [checked_scores(self.reward_fn, *_prompts_and_responses(batch))]
            except ConfigError as exc:
                box = [str(exc)]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], str):
            raise ConfigError(box[0], "reward.reward_fn")
        return torch.tensor(box[0], dtype=torch.float32, device=batch.tokens.device)

    def _inference_tasks(self) -> list[tuple[str, str]]:
        """[(task, the batch field it adds)] of this run's inference passes, in order."""
        return [(task, name) for task, name in INFERENCE_FIELDS.items() if task in self.tasks
                and (task != "actor_train" or self.config.ppo.recompute_logprobs)]

    def _infer_on_device(self, task: str, part: Batch, index: list) -> dict:
        """`_infer_rows` with ``task``'s model on the compute device (offloaded ones are loaded for it)."""
        with self._on_device(task):
            rows = self._infer_rows(task, part, index)
            self._note_memory("inference")
        return rows

    def _infer_rows(self, task: str, part: Batch, index: list) -> dict:
        """``task``'s outputs for the samples of ``part`` (this rank's replica runs them, micro-batched
        through its pipeline), whose batch indices are ``index``.

        Returns {sample index: output row} on the last stage's TP rank 0, else {}; rows are
        host tensors, since they travel to every rank as pickled objects.
        """
        g, model = self.groups[task], self.models[task]
        rows, done = {}, 0
        for mb in part.split(_count(len(part), self.config.ppo.micro_batch_size)):
            out = pipeline_forward(model, g, mb.tokens)
            if out is not None:
                values = _INFERENCE_OUTPUT[task](out, mb, g).cpu()
                if g.tp_rank == 0:
                    rows.update({index[done + k]: values[k] for k in range(len(mb))})
            done += len(mb)
        return rows

    # ---- 3. advantages ---------------------------------------------------------------

    def advantages(self, batch: Batch) -> tuple[Batch, dict]:
        """KL-penalised token rewards and the configured estimator (identical on every rank)."""
        mask = batch.response_mask
        rewards, kl = token_rewards(batch.scores, batch.old_logprobs, batch.ref_logprobs, mask,
                                    self.kl.value, self.config.ppo.kl_estimator)
        advantages, returns = compute_advantages(AdvantageInputs.from_batch(batch, rewards),
                                                 self.config.ppo.advantage_config)
        sequence_kl = kl.sum(dim=1).mean()
        metrics = {"kl_mean": sequence_kl, "kl_coef": self.kl.value.clone()}
        self.kl.update(sequence_kl, len(batch))
        return batch.with_fields(advantages=advantages, returns=returns), metrics

    # ---- 4. PPO epochs ---------------------------------------------------------------

    def update(self, batch: Batch) -> dict:
        """``ppo_epochs`` passes of token-balanced mini-batches; one optimizer step per mini-batch and model."""
        ppo = self.config.ppo
        recorded, self._training_steps = [], []
        for epoch in range(ppo.ppo_epochs):
            plans = {name: self._minibatches(batch, task, epoch) for name, task in self._trained().items()}
            for m in range(ppo.minibatches):
                runtimes = {}
                for name, task in self._trained().items():
                    g = self.groups[task]
                    if g is not None:
                        members = [i for part in plans[name][m] for i in part]
                        runtimes[name] = self._runtime(name, task, batch.select(plans[name][m][g.coord.dp]),
                                                       int(batch.response_lengths[members].sum()), recorded)
                self._run_minibatch(runtimes)
        if self.stage_times is not None:  # the first iteration measured the stages: fuse from now on
            self.fused = self._search_fused_schedule()
            self.stage_times = None
        idle = idle_fraction(self._training_steps)
        return {**_mean_records(recorded), **({} if idle is None else {"training_bubble_fraction": idle})}

    def _run_minibatch(self, runtimes: dict) -> None:
        """One optimizer step of every trained model on this rank: the fused schedule over both
        models, or each model's serial 1F1B over its own mesh."""
        if self.fused is not None:
            if runtimes:  # a fused pipeline spans the same ranks for both models
                self._record_step(run_step(self.fused, runtimes, group=self.groups["actor_train"].mesh_group))
            return
        for name, rt in runtimes.items():
            self._record_step(run_step(self.schedules[name], {name: rt}, group=rt.groups.mesh_group))

    def _record_step(self, step) -> None:
        """Keep an executor step's timeline: for the trace, the bubble metric and (before a
        searched fused schedule exists) the stage times the search needs."""
        self.timer.include(step.timeline)
        self._training_steps.append(step.timeline)
        if self.stage_times is not None:
            self.stage_times.add(step.timeline, {m: self.groups[t].coord.pp for m, t in self._trained().items()
                                                 if self.groups[t] is not None})

    def _search_fused_schedule(self) -> Schedule:
        """A fused schedule for the measured stage times, searched on rank 0 and shared (collective)."""
        costs = self.stage_times.per_stage({m: self.placement[t].strategy.pp for m, t in self._trained().items()})
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
        if root is not None and dist.get_rank() == 0:  # a resumed run reuses it (see load)
            os.makedirs(root, exist_ok=True)
            save_schedule(os.path.join(root, FUSED_SCHEDULE_FILE), schedule)
        return schedule

    def _minibatches(self, batch: Batch, task: str, epoch: int) -> list:
        """result[m][dp] = sample indices; the same on every rank (seeded by run seed, iteration, epoch)."""
        gen = torch.Generator().manual_seed(self.config.run.seed * 7919 + self.iteration * 131 + epoch)
        return balanced_minibatches(batch.sequence_lengths, self.config.ppo.minibatches,
                                    self.placement[task].strategy.dp, generator=gen)

    def _runtime(self, name: str, task: str, share: Batch, minibatch_tokens: int, recorded: list) -> ModelRuntime:
        """The executor's view of one model for one mini-batch on this rank."""
        g = self.groups[task]
        micro = share.split(_count(len(share), self.config.ppo.micro_batch_size))
        # Each micro-batch's token-mean loss is rescaled so that, after the executor's
        # 1/micro-batches and the DP average, the gradient is the mini-batch's token mean.
        scale = len(micro) * g.mesh.strategy.dp / max(minibatch_tokens, 1)
        loss = self._actor_loss if name == "actor" else self._critic_loss
        return ModelRuntime(name, g.mesh, micro, self.models[task], g, self.optimizers[name],
                            lambda out, mb, groups: loss(out, mb, groups, scale, recorded),
                            self.config.models[name].hidden_size)

    def _actor_loss(self, logits, mb: Batch, g: TaskGroups, scale: float, recorded: list):
        ppo = self.config.ppo
        mask = mb.response_mask
        logprobs = _response_logprobs(logits, mb, g)
        loss, metrics = policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask, clip_eps=ppo.clip_eps)
        entropy = mb.response_from_positions(vocab_parallel_entropy(logits[:, :-1], g.tp))
        tokens = mask.sum()
        recorded.append((tokens, {"policy_loss": loss.detach(), "entropy_mean": masked_mean(entropy, mask),
                                  "clip_fraction": metrics["clipfrac"], "approx_kl": metrics["approx_kl"]}))
        return loss * tokens * scale

    def _critic_loss(self, values, mb: Batch, g: TaskGroups, scale: float, recorded: list):
        mask = mb.response_mask
        loss, metrics = value_loss(mb.response_from_positions(values), mb.values, mb.returns, mask,
                                   clip_eps=self.config.ppo.value_clip)
        tokens = mask.sum()
        recorded.append((tokens, {"value_loss": loss.detach(), "value_clip_fraction": metrics["vf_clipfrac"]}))
        return loss * tokens * scale

    # ---- building --------------------------------------------------------------------

    def _build(self, task: str) -> torch.nn.Module:
        g, model = self.groups[task], TASK_MODEL[task]
        return build_model(self.config.models[model], task_kind(task), g.pg_collection, g.stage,
                           seed=self.config.run.seed + MODEL_SEEDS[model],
                           padded_vocab=layout.padded_vocab_size(self.config, model, self.placement))

    def _load_initial(self, weights: dict) -> None:
        """Starting weights into the task that owns each model's weights (the others are resharded).

        A function in ``weights`` is asked for this rank's stage only, one model at a time.
        """
        for model, full in weights.items():
            task = WEIGHTS_TASK[model]
            if task in self.models:
                stage = self.models[task]
                if callable(full):
                    full = full(list(named_global_parameters(stage)))
                load_full_weights(stage, self.groups[task], full)

    def _trained(self) -> dict:
        """{model: its training task} of the models this run trains."""
        return self.config.trained_tasks()

    def _build_optimizers(self) -> dict:
        """megatron DDP + AdamW + LR schedule per trained model on this rank (collective over its task)."""
        ppo = self.config.ppo
        lrs = {"actor": ppo.lr, "critic": ppo.critic_lr}
        return {m: ModelOptimizer(self.models[t], self.groups[t], ppo.optimizer_config(lrs[m]))
                for m, t in self._trained().items() if t in self.models}

    def _build_engine(self) -> Optional[Engine]:
        if "actor_gen" not in self.models:
            return None
        gen = self.config.generation
        prompts = self.config.ppo.rollout_batch_size // self.placement["actor_gen"].strategy.dp + 1
        longest = gen.max_prompt_len + gen.max_response_len
        blocks = prompts * self.config.ppo.n_samples_per_prompt * (longest // 16 + 2)
        return Engine(self.models["actor_gen"], self.groups["actor_gen"], self.config.models.actor,
                      EngineConfig(num_blocks=blocks, max_model_len=longest))

    def _build_offloaders(self) -> dict:
        """{task: its offloader} of this rank's reference and reward models (``memory.offload_ref_reward``;
        they move to the host now)."""
        if not self.config.memory.offload_ref_reward:
            return {}
        return {t: ModuleOffloader(self.models[t]) for t in OFFLOADED_TASKS if t in self.models}

    def _build_generation_memory(self) -> Optional[StorageRelease]:
        """What ``memory.release_generation_memory`` frees outside generation on this rank: actor_gen's
        parameters and the KV cache (nothing where actor_gen is not placed), released now (the first
        reshard allocates them again)."""
        if not self.config.memory.release_generation_memory:
            return None
        held = [] if self.engine is None else [*self.models["actor_gen"].parameters(), self.engine.decoder.kv_cache]
        release = StorageRelease(held)
        release.release()
        return release

    def _on_device(self, *tasks: str, write_back: bool = False) -> contextlib.ExitStack:
        """A context with the offloaded models of ``tasks`` on the compute device (others: as they are);
        ``write_back`` keeps what the body wrote into them (a checkpoint load)."""
        stack = contextlib.ExitStack()
        for task in tasks:
            if task in self.offloaders:
                stack.enter_context(self.offloaders[task].on_device(write_back))
        return stack

    def _reshard(self, src: str, dst: str) -> None:
        """Copy the weights of ``src``'s model into ``dst``'s layout (the ranks of either mesh)."""
        if src not in self.tasks or dst not in self.tasks:
            return
        if self.groups[src] is None and self.groups[dst] is None:
            return
        reshard(self.placement[src], (self.groups[src], self.models.get(src)),
                self.placement[dst], (self.groups[dst], self.models.get(dst)),
                self.config.models[TASK_MODEL[src]].num_layers)

    # ---- metrics ---------------------------------------------------------------------

    def resident_bytes(self) -> int:
        """Bytes of model weights (parameters and buffers) and KV cache this rank holds where it computes
        now: an offloaded model counts while loaded, released storage as 0 (optimizer state not included)."""
        total = 0
        for task, model in self.models.items():
            offloader = self.offloaders.get(task)
            total += offloader.resident_bytes() if offloader else sum(storage_bytes(module_tensors(model)).values())
        if self.engine is not None:
            total += sum(storage_bytes([self.engine.decoder.kv_cache]).values())
        return total

    def _note_memory(self, stage: str) -> None:
        """Keep the most :meth:`resident_bytes` seen in ``stage`` this iteration (noted after its loads,
        before its releases)."""
        self._memory_bytes[stage] = max(self._memory_bytes.get(stage, 0), self.resident_bytes())

    def _memory_metrics(self) -> dict:
        """``memory_<stage>_bytes_max`` of the stages noted since the last call (their heaviest rank, by
        the metric's name) and, on an accelerator, ``memory_peak_bytes_max``: its allocator's peak since
        the iteration began (rlhf.platform.peak_memory_bytes)."""
        self.memory_bytes, self._memory_bytes = self._memory_bytes, {}
        out = {f"memory_{stage}_bytes_max": float(n) for stage, n in self.memory_bytes.items()}
        peak = platform.peak_memory_bytes()
        if peak is not None:
            out["memory_peak_bytes_max"] = float(peak)
        return out

    def _batch_metrics(self, batch: Batch) -> dict:
        """Per-iteration statistics of the samples (every rank holds the batch; counts from rank 0 only)."""
        lengths = batch.response_lengths.float()
        out = {"reward_mean": batch.scores.mean(), "reward_std": batch.scores.std(correction=0),
               "response_length_mean": lengths.mean(), "response_length_max": lengths.max()}
        if dist.get_rank() == 0:  # *_count keys are summed over the ranks that report them
            out.update(samples_count=float(len(batch)), tokens_count=lengths.sum())
        if self.reward_fn is not None and self.config.has_reward_model:
            out["gold_reward_mean"] = self._function_scores(batch).mean()
        return out


def checked_scores(fn: RewardFn, prompts: list, responses: list) -> list[float]:
    """``fn(prompts, responses)`` as one float per sample; a ConfigError (``reward.reward_fn``) says what
    went wrong when it raises or returns anything else (a list, tuple or array of finite numbers)."""
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
    try:
        scores = fn(prompts, responses)
    except Exception as exc:  # noqa: BLE001 -- whatever user code raises is reported against its flag
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise ConfigError(f"{name} raised {type(exc).__name__}: {exc} (at {where.filename}:{where.lineno})",
                          "reward.reward_fn") from None
    scores = scores.tolist() if hasattr(scores, "tolist") else scores  # a numpy array or torch tensor
    if not isinstance(scores, (list, tuple)) or len(scores) != len(prompts):
        got = f"{len(scores)} score(s)" if isinstance(scores, (list, tuple)) else f"a {type(scores).__name__}"
        raise ConfigError(f"{name} returned {got} for {len(prompts)} samples; it must return a list of one "
                          "number per sample", "reward.reward_fn")
    for i, score in enumerate(scores):
        if isinstance(score, bool) or not isinstance(score, numbers.Real) or not math.isfinite(score):
            raise ConfigError(f"{name} returned {score!r} for sample {i}; every score must be a finite number",
                              "reward.reward_fn")
    return [float(score) for score in scores]


def _reward_scores(values: torch.Tensor, mb: Batch, g) -> torch.Tensor:
    """The reward model's score: its value at each sample's last token (prompt + response)."""
    return mb.last_token_values(values).float()


def _response_logprobs(logits: torch.Tensor, mb: Batch, g) -> torch.Tensor:
    """[b, R] log-probs of the response tokens from vocab-parallel logits [b, T, V/tp]."""
    return mb.response_from_positions(vocab_parallel_log_probs(logits[:, :-1], mb.tokens[:, 1:], g.tp))


_INFERENCE_OUTPUT = {
    "ref_inf": _response_logprobs,
    "reward_inf": _reward_scores,
    "critic_inf": lambda values, mb, g: mb.response_from_positions(values.float()),
    "actor_train": _response_logprobs,
}
"""What each inference task's last stage returns per micro-batch: [b, R] or [b]."""


def _response_width(row: torch.Tensor, width: int) -> torch.Tensor:
    """A response-aligned row ([R'] for a sub-batch inferred early) zero-padded to the batch's ``width``;
    a per-sample score ([]) as it is."""
    return row if row.dim() == 0 else torch.nn.functional.pad(row, (0, width - row.shape[0]))


def _count(n: int, size: int) -> int:
    """Micro-batches of at most ``size`` samples for ``n`` samples (at least one)."""
    return max(1, -(-n // size))


def _prompts_and_responses(batch: Batch) -> tuple[list, list]:
    rows = batch.tokens.tolist()
    p, r = batch.prompt_lengths.tolist(), batch.response_lengths.tolist()
    return [row[:a] for row, a in zip(rows, p)], [row[a:a + b] for row, a, b in zip(rows, p, r)]


def _mean_records(recorded: list) -> dict:
    """Token-weighted means of the per-micro-batch training metrics recorded on this rank."""
    sums, weights = {}, {}
    for tokens, metrics in recorded:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value * tokens
            weights[key] = weights.get(key, 0.0) + tokens
    return {key: sums[key] / weights[key].clamp(min=1) for key in sums}
