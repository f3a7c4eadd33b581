"""The PPO trainer: one synchronous iteration over the six tasks, top to bottom.

    prompts -> reshard actor_train into actor_gen -> generate (one engine per actor_gen replica)
            -> infer: ref_inf (ref_logprobs), reward_inf (scores), critic_inf (values)
            -> advantages (KL-penalised token rewards, estimator registry)
            -> PPO epochs: actor_train and critic_train through the instruction executor (update.py)
            -> reshard critic_train into critic_inf -> metrics

With ``--inter-stage-fusion`` generation and inference overlap: the long
tail migrates to a few instances and the ranks it frees infer finished
samples while those generate (rlhf/fusion/inter_stage.py, docs/fusion.md);
generation hands what they inferred to the inference phase with the batch.

Every rank runs the same program and takes part in the tasks whose meshes
hold it. Samples move between meshes as one ``Batch``: after generation and
after inference every rank receives the whole batch (an object all-gather;
a batch is small next to the models), so each task's DP replica takes its
share by index. Weights move only by resharding.

When the samples are generated is a rollout source's choice (rlhf/ppo/rollouts.py, the one seam):
synchronous by default (every mini-batch sees samples of the current policy, docs/training.md),
K iterations ahead on ranks of their own with ``--max-staleness K`` (rlhf/ppo/asynchronous.py), and
free-running between the iterations with ``--partial-rollouts`` (rlhf/ppo/partial_rollouts.py). The
trainer is their host: it owns generation (requests_here, generate_here, collect_rollout), inference,
the update and the metrics; a source calls those and never imports this module.
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.algorithms import AdvantageInputs, compute_advantages, make_kl_controller, token_rewards
from rlhf.algorithms.shaping import overlong_penalty
from rlhf.batch import Batch
from rlhf.checkpoint.convert import ours_to_megatron
from rlhf.checkpoint.rlhf_state import ModelSlot, load_rlhf_state, save_rlhf_state
from rlhf.data.tokenizer import readable_text
from rlhf.engine import Engine, EngineConfig, Request, SamplingParams, mixed_seed
from rlhf.envs.agents import AgentDriver, load_agent
from rlhf.envs.environment import load_environment
from rlhf.envs.episodes import EnvironmentDriver, EpisodeFailure, EpisodeRunner, turn_reward_rows
from rlhf.fusion.inter_stage import FusionOutcome, InterStageFusion
from rlhf.fusion.policy import long_tailed_lengths
from rlhf.fusion.runtime import FusedGeneration
from rlhf.memory import StageMemory
from rlhf.metrics import MetricsWriter, StageTimer, reduce_metrics, with_rates, write_trace
from rlhf.models.gpt import build_model
from rlhf.models.lora import adapters_disabled, apply_lora, has_adapters, merged_parameters
from rlhf.models.naming import named_global_parameters
from rlhf.optim import ModelOptimizer
from rlhf.parallel.dealing import shares
from rlhf.parallel.exchange import gather_to_all
from rlhf.parallel.groups import build_task_groups
from rlhf.parallel.reshard import load_full_weights, reshard
from rlhf.pipeline.inference import InferenceRunner
from rlhf.ppo import layout
from rlhf.ppo.asynchronous import GenerationAhead, learner_group
from rlhf.ppo.batch_metrics import batch_metrics
from rlhf.ppo.config import JobConfig
from rlhf.ppo.memory_plan import describe_choice, resolve_micro_batches
from rlhf.ppo.partial_rollouts import PartialRollouts, signal_group
from rlhf.ppo.reward_fn import RewardFn, check_model_scores, drop_nonfinite_samples, function_scores
from rlhf.ppo.rollouts import Lockstep, Rollout, RolloutSource
from rlhf.ppo.update import PPOUpdate, stop_after_skipped_steps
from rlhf.tasks import INFERENCE_FIELDS, MODEL_SEEDS, TASK_MODEL, WEIGHTS_TASK, task_kind

MEGATRON_EXPORT_DIR = "megatron"
"""Beside the checkpoints (``<save>/``): the actor as Megatron-LM checkpoints with ``--save-format torch_dist``."""


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
        chosen = resolve_micro_batches(config, placement)  # --max-tokens-per-microbatch auto, for this device
        if chosen.ppo.max_tokens_per_microbatch != config.ppo.max_tokens_per_microbatch and dist.get_rank() == 0:
            print(describe_choice(chosen, placement), flush=True)
        config = chosen
        self.config, self.placement, self.prompts, self.tokenizer = config, placement, prompts, tokenizer
        if reward_fn is None and not config.has_reward_model and config.generation.multi_turn is None:
            raise ValueError("a run without a reward model needs a reward_fn: its scores are the reward")
        if reward_fn is not None and config.generation.multi_turn is not None:
            raise ValueError(f"a reward_fn cannot go with {config.generation.multi_turn}: the episodes' rewards "
                             "are the reward")
        self.reward_fn = reward_fn
        self.groups = build_task_groups(placement)
        self.driver = self._episode_driver()
        self.learners = learner_group(placement) if config.ppo.max_staleness else None
        self.tasks = list(config.needed_tasks())
        self.models = {t: self._build(t) for t in self.tasks if self.groups[t] is not None}
        initial_weights = initial_weights or {}
        self._load_initial(initial_weights)
        self._attach_adapters()  # after the base weights, before DDP: only adapters require grad
        self.optimizers = self._build_optimizers()
        self.timer = StageTimer(trace_iteration=config.logging.trace_iteration)
        self.ppo_update = PPOUpdate(config, placement, self.groups, self.models, self.optimizers, self.timer,
                                    group=self.learners)
        engine_config = self._engine_config()
        self.engine = (Engine(self.models["actor_gen"], self.groups["actor_gen"], config.models.actor, engine_config)
                       if "actor_gen" in self.models else None)
        self.inter_stage = (InterStageFusion(config, placement, self.inference_tasks(), engine_config.max_num_seqs)
                            if config.fusion.inter_stage_fusion else None)
        self.kl = make_kl_controller(config.ppo.kl_config)
        self.iteration = 0
        if "reference" not in initial_weights:
            self._reshard("actor_train", "ref_inf")
        self._reshard("critic_train", "critic_inf")
        self.memory = StageMemory(self.models, None if self.engine is None else self.engine.decoder.kv_cache,
                                  offload_frozen=config.memory.offload_ref_reward,
                                  release_generation=config.memory.release_generation_memory,
                                  optimizers=self.optimizers)
        self.inference = InferenceRunner(self.models, self.groups, self.memory, config.ppo.micro_batch_size,
                                         config.generation.logprob_temperature, config.ppo.packing_budget,
                                         config.ppo.routing_replay)
        self.rollouts = self._rollout_source()

    # ---- the iteration ---------------------------------------------------------------

    def train(self) -> None:
        """Iterations until ``config.run.iterations``, each logged (rank 0 writes; a decoded sample every
        ``logging.log_samples``), saved when configured; a model whose last ``ppo.max_skipped_steps`` optimizer
        steps were all skipped stops the run after its iteration is logged (a ConfigError on every rank)."""
        cfg, ckpt = self.config, self.config.checkpoint
        with MetricsWriter(cfg.logging, cfg.run.iterations, dist.get_rank(), self.iteration,
                           checkpoint=ckpt) as writer:
            while self.iteration < cfg.run.iterations:
                result = self.step()
                writer.log(self.iteration, result.metrics)
                stop_after_skipped_steps(result.metrics, cfg.ppo.max_skipped_steps)
                every = cfg.logging.log_samples
                if every and self.iteration % every == 0 and dist.get_rank() == 0:
                    writer.print_text(self.describe_sample(result.batch, 0))
                last = self.iteration == cfg.run.iterations
                if ckpt.save and (last or (ckpt.save_interval and self.iteration % ckpt.save_interval == 0)):
                    self.save(ckpt.save)

    def step(self) -> IterationResult:
        """One PPO iteration: the rollout source's next batch (rlhf/ppo/rollouts.py), the update on the ranks
        that have it, what the source does after the update, the metrics (collective)."""
        self.timer.start_iteration(self.iteration + 1)
        platform.reset_peak_memory()
        rollout = self.rollouts.next_rollout()
        batch, local, fusion = None, {}, None
        if rollout is not None:
            fusion = rollout.fusion
            batch, local = self.update_from(rollout.batch, fusion)
        batch = self.rollouts.after_update(batch, local)
        return self.finish_iteration(batch, local, fusion)

    def learn(self, batch: Batch, fusion: Optional[FusionOutcome] = None) -> IterationResult:
        """Everything after generation: :meth:`update_from`, then :meth:`finish_iteration`."""
        batch, local = self.update_from(batch, fusion)
        return self.finish_iteration(batch, local, fusion)

    def update_from(self, batch: Batch, fusion: Optional[FusionOutcome] = None) -> tuple[Batch, dict]:
        """Inference (with what ``fusion``'s freed ranks inferred already), advantages, PPO epochs, critic
        reshard: the batch with every field, and this rank's metrics. Collective over the ranks that run
        these tasks (all, or an asynchronous run's learners)."""
        batch = batch.to(platform.device())  # per-token tensors live where the models compute
        with self.timer.stage("inference"):
            batch = self.infer(batch, fusion)
        with self.timer.stage("advantage"):
            batch, local = self.advantages(batch)
        with self.timer.stage("training"):
            with self.memory.training_activations():
                local.update(self.update(batch))
            self.memory.note("training")
        with self.timer.stage("reshard"):
            self._reshard("critic_train", "critic_inf")
            self.memory.note("reshard")
        return batch, local

    def finish_iteration(self, batch: Batch, local: dict, fusion: Optional[FusionOutcome] = None
                         ) -> IterationResult:
        """Count the iteration and reduce its metrics (``local`` and the batch's, timings, memory) over
        all ranks (collective; ``batch`` complete on every rank)."""
        self.iteration += 1
        local.update(batch_metrics(batch, self.config, self.reward_fn))
        local.update(self.timer.metrics())
        local.update(self.memory.metrics())
        fused = None if fusion is None else fusion.fused
        if self.inter_stage is not None:
            g = self.groups["actor_gen"]
            local.update(self.inter_stage.metrics(fused, None if g is None else g.tp_rank))
        metrics = with_rates(reduce_metrics(local))
        if self.inter_stage is not None:
            self.inter_stage.observe(batch.response_lengths.tolist(), metrics,
                                     self.placement["actor_gen"].strategy.dp)
        if self.timer.timeline is not None:
            write_trace(self.config.logging.trace_file, self.timer.timeline)
        return IterationResult(batch, metrics)

    # ---- 1. generation ---------------------------------------------------------------

    def sync_generation_weights(self) -> None:
        """Reshard the trained actor into the generation layout (before every generation), into
        storage allocated again if the last generation released it."""
        self.memory.restore_generation()
        self._reshard("actor_train", "actor_gen")
        self.memory.note("reshard")

    def generate(self, prompt_batch) -> Rollout:
        """Samples of ``prompt_batch`` from the actor_gen replicas, as one Batch on every rank
        (collective): :meth:`generate_here`, then :meth:`collect_rollout`."""
        mine, fused = self.generate_here(prompt_batch, self.iteration)
        return self.collect_rollout(prompt_batch, mine, fused)

    def generate_here(self, prompt_batch, iteration: int) -> tuple[list, Optional[FusedGeneration]]:
        """This rank's part of generating ``prompt_batch`` for (0-based) iteration ``iteration``, whose
        index seeds the sampling: the samples it contributes, and what inter-stage fusion did here.

        Prompt ``i`` goes to replica ``i % dp``; every TP rank of a replica runs the same engine on the
        same requests, and its TP rank 0 contributes them. Collective over actor_gen's ranks only.
        """
        if self.memory.generation_released:  # the same on every rank
            raise RuntimeError("actor_gen's weights and KV cache were released after the last generation "
                               "(memory.release_generation_memory); call sync_generation_weights() first")
        if self.inter_stage is not None:
            self.inter_stage.start_iteration()
        g, mine, fused = self.groups["actor_gen"], [], None
        if g is not None:
            requests = self.requests_here(prompt_batch, iteration)
            if self.inter_stage is not None:
                fused = self.inter_stage.generate(self.engine, requests, g)
                results = fused.samples
            elif self.config.generation.multi_turn is not None:
                results = self._episodes(prompt_batch, requests)
            else:
                results = self.engine.generate(requests)
            mine = results if g.tp_rank == 0 else []
        self.memory.note("generation")
        self.memory.release_generation()
        if self.memory.generation_released and self.engine is not None:
            self.engine.forget_graphs()  # they would replay the freed storage's addresses
        return mine, fused

    def _episodes(self, prompt_batch, requests: list[Request]) -> list:
        """This replica's requests as multi-turn episodes (rlhf/envs/episodes.py); what an environment or agent
        raised comes back as an EpisodeFailure in their place, so that every rank stops at the gather."""
        gen, g = self.config.generation, self.groups["actor_gen"]
        if self.driver is not None:
            self.driver.prompt_records = lambda rid: prompt_batch.prompts[int(rid)]
        runner = EpisodeRunner(self.engine, self.driver, self.tokenizer, gen.max_turns, gen.max_response_len,
                               gen.max_turn_tokens, tp_group=g.tp)
        try:
            return runner.run(requests)
        except (RuntimeError, ValueError) as exc:
            return [EpisodeFailure(str(exc))]

    def requests_here(self, prompt_batch, iteration: int) -> list[Request]:
        """The engine requests of this actor_gen replica for ``prompt_batch`` in (0-based) ``iteration``:
        prompt ``i`` (request id ``str(i)``) goes to replica ``i % dp``."""
        g = self.groups["actor_gen"]
        return [Request(str(i), tuple(p.token_ids), self._sampling_params(i, iteration))
                for i, p in enumerate(prompt_batch.prompts) if i % g.mesh.strategy.dp == g.coord.dp]

    def collect_rollout(self, prompt_batch, mine: list, fused: Optional[FusedGeneration] = None) -> Rollout:
        """Every rank's generated samples of ``prompt_batch`` as one Batch on every rank (collective);
        with inter-stage fusion the freed ranks first infer what finished early."""
        ids = {str(i): i for i in range(len(prompt_batch.prompts))}
        fusion = None
        if self.inter_stage is None:
            samples = gather_to_all(mine)
            failures = [s.message for s in samples if isinstance(s, EpisodeFailure)]
            if failures:
                raise RuntimeError(failures[0])
        else:  # the freed ranks infer what finished by the migration, then the streamed tail, while the rest generate
            early = self.inter_stage.infer_early(fused, lambda part: Batch.from_samples(
                part, self.tokenizer.pad_id, ids).to(platform.device()), self.inference)
            samples, early = self.inter_stage.gather(mine, early, fused)
            fusion = FusionOutcome(fused, early)
        samples = sorted(samples, key=lambda s: (int(s.request_id), s.sample_index))
        batch = Batch.from_samples(samples, self.tokenizer.pad_id, ids)
        if self.config.generation.multi_turn is not None:  # the episodes' rewards, at their turns and summed
            batch = batch.with_fields(scores=torch.tensor([s.score for s in samples], dtype=torch.float32),
                                      turn_rewards=turn_reward_rows(samples, batch.response_width))
        return Rollout(batch, fusion)

    def _sampling_params(self, prompt_index: int, iteration: int) -> SamplingParams:
        """Prompt ``prompt_index``'s sampling: the configured one, stopping at the tokenizer's stop ids and
        ``generation.stop_token_ids``, or the declared long-tailed workload (``generation.long_tail_median``:
        a drawn length per sample, EOS ignored). Log-probs are of logits / T, as the update's are. The
        seed is mixed from (run seed, iteration, prompt), so no two requests of a run share one; the
        engine mixes in the sample index."""
        gen, n = self.config.generation, self.config.ppo.n_samples_per_prompt
        seed = mixed_seed(self.config.run.seed, iteration, prompt_index)
        common = dict(max_new_tokens=gen.max_response_len, temperature=gen.temperature, top_p=gen.top_p,
                      top_k=gen.top_k, seed=seed, n=n, logprobs_of="tempered")
        if not gen.long_tail_median:
            stops = tuple(dict.fromkeys((*self.tokenizer.stop_token_ids, *gen.stop_token_ids)))
            return SamplingParams(stop_token_ids=stops, **common)
        lengths = long_tailed_lengths(n, random.Random(seed), median=gen.long_tail_median, cap=gen.max_response_len)
        return SamplingParams(sample_max_new_tokens=tuple(lengths), **common)

    # ---- 2. inference ----------------------------------------------------------------

    def infer(self, batch: Batch, fusion: Optional[FusionOutcome] = None) -> Batch:
        """ref_logprobs, scores, values (with a critic) and recomputed old_logprobs (if asked), on every rank
        (of ``learners``: an asynchronous run's ranks besides actor_gen's; all ranks otherwise). A NaN or
        infinite score stops the run, or with ``reward.skip_nonfinite_samples`` drops its sample (sample_mask).

        Each task's replicas share the samples ``fusion``'s freed ranks did not infer already; the
        outputs of every rank (those included) are gathered as batches and put back by sample.
        """
        early = None if fusion is None else fusion.early
        outputs = [] if early is None else list(early.outputs)
        outputs += self.infer_here(batch, {} if early is None else early.done)
        self.memory.note("inference")
        names = [name for _, name in self.inference_passes()]
        batch = batch.with_fields_from(gather_to_all(outputs, group=self.learners), names)
        skip = self.config.reward.skip_nonfinite_samples
        if "reward_inf" in self.inference_tasks() and not skip:
            check_model_scores(batch)
        if self.reward_fn is not None and not self.config.has_reward_model:
            batch = batch.with_fields(scores=function_scores(self.reward_fn, batch, group=self.learners,
                                                             nonfinite_ok=skip))
        return drop_nonfinite_samples(batch) if skip else batch

    def infer_here(self, batch: Batch, done: dict) -> list[Batch]:
        """This rank's inference outputs for ``batch``: each inference task's replicas share the samples not
        in ``done[task]`` (indices), and this rank infers its replica's share (collective over each task's
        ranks; the outputs are on a task's last stage, TP rank 0)."""
        outputs = []
        for task, name in self.inference_passes():
            if task in self.models:
                remaining = [i for i in range(len(batch)) if i not in done.get(task, set())]
                g = self.groups[task]
                index = [remaining[k] for k in shares(len(remaining), g.mesh.strategy.dp)[g.coord.dp]]
                if not index:  # fewer samples left than replicas: the idle ones (all their ranks) skip
                    continue
                base = name == "ref_logprobs" and task == "actor_train"
                with adapters_disabled(self.models[task]) if base else contextlib.nullcontext():
                    out = self.inference.infer(task, batch.select(index), name)
                if out is not None:
                    outputs.append(out)
        return outputs

    def inference_passes(self) -> list[tuple[str, str]]:
        """(task, the batch field it adds) of this run's inference passes, in order: each inference task's,
        and with ``lora.reference_from_actor_base`` the reference log-probs from actor_train with the actor's
        adapters disabled (its base, which the reference would copy), first, in ref_inf's place."""
        passes = [(task, INFERENCE_FIELDS[task]) for task in self.inference_tasks()]
        if self.config.lora.reference_from_actor_base:
            passes.insert(0, ("actor_train", "ref_logprobs"))
        return passes

    def inference_tasks(self) -> list[str]:
        """This run's inference tasks, in order (rlhf.tasks.INFERENCE_FIELDS: what each adds)."""
        return [task for task in INFERENCE_FIELDS if task in self.tasks
                and (task != "actor_train" or self.config.ppo.recomputes_logprobs)]

    # ---- 3. advantages ---------------------------------------------------------------

    def advantages(self, batch: Batch) -> tuple[Batch, dict]:
        """Token rewards (the score, shaped by the overlong penalty, at the last token, or a multi-turn
        episode's rewards at its turns' ends; minus the KL penalty when it acts in the rewards) and the
        configured estimator (identical on every rank). The KL of the old policy against the reference
        drives the adaptive controller wherever the penalty acts."""
        ppo, mask = self.config.ppo, batch.response_mask
        scores, metrics = batch.scores, {}
        if ppo.overlong_punishment is not None:
            penalty = overlong_penalty(batch.response_lengths, self.config.generation.max_response_len,
                                       *ppo.overlong_punishment).to(scores.device)
            scores, metrics["overlong_penalty_mean"] = scores + penalty, penalty.mean()
        coef = torch.zeros(()) if ppo.kl_in_loss else self.kl.value
        placed = batch.turn_rewards  # a multi-turn episode's rewards sit at its turns; only the penalty is left
        at_end = scores if placed is None else scores - batch.scores
        rewards, kl = token_rewards(at_end, batch.old_logprobs, batch.ref_logprobs, mask, coef, ppo.kl_estimator_name,
                                    placed)
        scored = batch.with_fields(scores=scores)  # the outcome estimators read the shaped (episode) score
        inputs = AdvantageInputs.from_batch(scored, rewards, kl_penalty=-coef * kl)
        advantages, returns = compute_advantages(inputs, ppo.advantage_config)
        trained = torch.tensor(float(len(batch))) if batch.sample_mask is None else batch.sample_mask.sum()
        sequence_kl = kl.sum(dim=1).sum() / trained.clamp(min=1)  # over the samples trained on (sample_mask)
        metrics.update(kl_mean=sequence_kl, kl_coef=self.kl.value.clone())
        self.kl.update(sequence_kl, trained)
        return batch.with_fields(advantages=advantages, returns=returns), metrics

    # ---- 4. PPO epochs ---------------------------------------------------------------

    def update(self, batch: Batch) -> dict:
        """``ppo_epochs`` passes of token-balanced mini-batches; one optimizer step per mini-batch and
        model (rlhf/ppo/update.py). Returns this rank's loss statistics and bubble fraction."""
        return self.ppo_update.run(batch, self.iteration, float(self.kl.value))

    # ---- 5. weights between meshes ---------------------------------------------------

    def _reshard(self, src: str, dst: str) -> None:
        """Copy the weights of ``src``'s model into ``dst``'s layout (the ranks of either mesh)."""
        if src not in self.tasks or dst not in self.tasks:
            return
        if self.groups[src] is None and self.groups[dst] is None:
            return
        source, cfg = self.models.get(src), self.config.models[TASK_MODEL[src]]
        merged = merged_parameters(source) if has_adapters(source) else None  # W + s B A: dst has no adapters
        reshard(self.placement[src], (self.groups[src], source),
                self.placement[dst], (self.groups[dst], self.models.get(dst)),
                cfg.num_layers, src_params=merged, num_experts=cfg.num_experts)

    # ---- checkpoints -----------------------------------------------------------------

    def save(self, root: str) -> str:
        """Save every model (with optimizer and LR schedule), the KL controller, the data position
        and each rank's RNG as checkpoint ``iteration`` under ``root`` (collective, atomic). Batches
        generated ahead (asynchronous runs) are not saved: the position is that of their prompts, which
        the resumed run generates again."""
        with self.memory.on_device(*self.memory.offloaders):  # collectives gather the weights where they compute
            position = self.rollouts.data_position()
            path = save_rlhf_state(root, self.iteration, self._slots(), data_position=position,
                                   extra={"kl_coef": float(self.kl.value)}, group=dist.group.WORLD,
                                   keep_last=self.config.checkpoint.keep_last)
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
        with self.memory.on_device(*self.memory.offloaders, write_back=True):
            state = load_rlhf_state(root, self._slots(), group=dist.group.WORLD)
        self.iteration = state.iteration
        self.prompts.load_state_dict(state.data_position)
        self.rollouts.forget()
        self.kl.value = torch.tensor(state.extra["kl_coef"])
        self._reshard("critic_train", "critic_inf")
        self.ppo_update.reuse_cached_schedule(root)  # searched by the run that saved

    def _slots(self) -> dict:
        """Each model of this run where its weights live (WEIGHTS_TASK), with its optimizer if trained."""
        slots = {}
        for model, task in WEIGHTS_TASK.items():
            if task in self.tasks:
                opt = self.optimizers.get(model)
                source = self.config.models.weights.get(model)  # a LoRA checkpoint records it, not the base
                slots[model] = ModelSlot(self.config.models[model], task_kind(task), self.models.get(task),
                                         self.groups[task], opt, opt.scheduler if opt is not None else None,
                                         base_source=None if source is None else os.path.abspath(source))
        return slots

    def describe_sample(self, batch: Batch, index: int) -> str:
        """Sample ``index`` of ``batch`` as text for the log: the iteration, its reward (or that it was dropped for
        a non-finite one) and how it ended, then its prompt and response decoded by the job's tokenizer."""
        p, r = int(batch.prompt_lengths[index]), int(batch.response_lengths[index])
        tokens = batch.tokens[index].tolist()
        dropped = batch.sample_mask is not None and not batch.sample_mask[index]
        reward = "non-finite, dropped" if dropped else f"{float(batch.scores[index]):.4g}"
        return (f"iteration {self.iteration}, sample {index} (reward {reward}, "
                f"{batch.finish_reasons[index]}):\n  prompt:   {readable_text(self.tokenizer, tokens[:p])!r}\n"
                f"  response: {readable_text(self.tokenizer, tokens[p:p + r])!r}")

    # ---- building --------------------------------------------------------------------

    def _build(self, task: str) -> torch.nn.Module:
        g, model = self.groups[task], TASK_MODEL[task]
        recompute = self.config.memory.recompute if task in self.config.trained_tasks().values() else {}
        return build_model(self.config.models[model], task_kind(task), g.pg_collection, g.stage,
                           seed=self.config.run.seed + MODEL_SEEDS[model], dtype=self.config.precision.dtype,
                           padded_vocab=layout.padded_vocab_size(self.config, model, self.placement), **recompute)

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

    def _attach_adapters(self) -> None:
        """LoRA adapters on each trained model that the flags give them (rlhf/models/lora.py): its training
        task's copy gets them and everything else is frozen, but a critic's value head, which is new."""
        for model, task in self.config.trained_tasks().items():
            lora = self.config.lora.for_model(model)
            if lora is None or task not in self.models:
                continue
            head = ("output_layer.weight",) if task_kind(task) == "value" else ()
            apply_lora(self.models[task], lora, self.config.models[model],
                       seed=self.config.run.seed + MODEL_SEEDS[model], trainable=head)

    def _episode_driver(self):
        """What answers the model between turns (an environment's or an agent's driver), on the first TP rank
        of each generation replica; None elsewhere and in single-turn runs."""
        gen, g = self.config.generation, self.groups.get("actor_gen")
        if gen.multi_turn is None:
            return None
        target = load_environment(gen.environment) if gen.environment else load_agent(gen.agent)  # every rank
        if g is None or g.tp_rank != 0:
            return None
        if gen.environment is not None:
            return EnvironmentDriver(target, self.tokenizer)
        return AgentDriver(target, self.tokenizer, prompt_records=None, max_prompt_len=gen.max_prompt_len)

    def _rollout_source(self) -> RolloutSource:
        """How batches reach the update: generated now (Lockstep), K iterations ahead (``ppo.max_staleness``)
        or free-running between meetings (``ppo.partial_rollouts``); collective."""
        ppo = self.config.ppo
        if ppo.partial_rollouts:
            return PartialRollouts(self, signal_group(self.placement, self.learners))
        return GenerationAhead(self) if ppo.max_staleness else Lockstep(self)

    def _engine_config(self) -> EngineConfig:
        """Each actor_gen replica's engine (rlhf.ppo.layout.engine_config)."""
        return layout.engine_config(self.config, self.placement)

    def _build_optimizers(self) -> dict:
        """megatron DDP + AdamW + LR schedule per trained model on this rank (collective over its task)."""
        ppo = self.config.ppo
        lrs = {"actor": ppo.lr, "critic": ppo.critic_lr}
        return {m: ModelOptimizer(self.models[t], self.groups[t], ppo.optimizer_config(lrs[m]), self.config.precision)
                for m, t in self.config.trained_tasks().items() if t in self.models}
