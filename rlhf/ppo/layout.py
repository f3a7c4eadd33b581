"""The PPO job laid out on a placement: every check and derived size that needs both.

A ``JobConfig`` holds values; a ``Placement`` says where each task runs.
Together they fix the batch shapes per mesh (micro-batches per DP replica),
each model's padded vocabulary, and the fused actor/critic schedule's
problem. ``build_placement`` is the one gate a launch passes before any
model is built: the plan on N ranks checked against the models' shapes,
the batch sizes and the fused schedule (the dry run and the job both call
it). Without a plan file the job starts from a built-in plan (``built_in_plan``).
"""

from __future__ import annotations

import math

from rlhf import platform
from rlhf.cli import flag_name
from rlhf.config import ConfigError
from rlhf.engine.types import EngineConfig
from rlhf.models.config import padded_vocab_size as padded_size
from rlhf.parallel import Placement, PlacementError
from rlhf.parallel.mesh import sharing_ranks
from rlhf.parallel.placement import parse_ranks
from rlhf.pipeline.compiler import compile_all
from rlhf.ppo.config import JobConfig
from rlhf.schedule.generators import serial_1f1b
from rlhf.schedule.io import load_schedule
from rlhf.schedule.problem import ModelSpec, Problem, ProblemError
from rlhf.schedule.schedule import Schedule, ScheduleError
from rlhf.tasks import MODELS, TASK_MODEL, TASKS

DEFAULT_PLANS = {
    4: {"actor_train": {"ranks": "0-3", "tp": 2, "pp": 2},
        "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True},
        "actor_gen": {"ranks": "0-3", "tp": 2, "dp": 2},
        "ref_inf": {"ranks": "2-3"},
        "reward_inf": {"ranks": "0-1"},
        "critic_inf": {"ranks": "0-3", "tp": 2}},
}
"""The built-in plan per world size of a synchronous job without a plan file (4 ranks: every kind of layout
at once, as examples/placement_4ranks.json); other world sizes run every task data parallel on all ranks."""

ASYNC_PLANS = {
    4: {"actor_gen": {"ranks": "0-1", "tp": 1, "dp": 2},
        "actor_train": {"ranks": "2-3", "tp": 1, "pp": 2},
        "critic_train": {"ranks": "2-3", "dp": 1, "pp": 2, "reverse_pp": True},
        "ref_inf": {"ranks": "2-3"},
        "reward_inf": {"ranks": "2-3"},
        "critic_inf": {"ranks": "2-3", "tp": 1}},
}
"""The built-in plan per world size of an asynchronous job (``--max-staleness`` K > 0) without a plan file:
actor_gen on ranks of its own (4 ranks: docs/async.md's plan); other world sizes of 2 or more get
:func:`generation_apart_plan`."""


def generation_apart_plan(world_size: int) -> dict:
    """actor_gen data parallel on the first ``world_size // 2`` ranks, every other task data parallel on the
    rest (the learners keep the odd rank: training is the heavier side)."""
    half = world_size // 2
    learners = {"ranks": f"{half}-{world_size - 1}"}
    return {task: {"ranks": f"0-{half - 1}"} if task == "actor_gen" else dict(learners) for task in TASKS}


def plan_flags(plan: dict) -> str:
    """A plan as the per-task flags that place it (``--actor-gen ranks=0-1,tp=1,dp=2 ...``)."""
    specs = {task: ",".join(key if value is True else f"{key}={value}" for key, value in entry.items())
             for task, entry in plan.items()}
    return " ".join(f"{flag_name(task)} {spec}" for task, spec in specs.items())


def built_in_plan(config: JobConfig, world_size: int) -> dict | None:
    """The plan a job without a plan file starts from: ``DEFAULT_PLANS``' when synchronous (None: every task
    data parallel on all ranks); with ``max_staleness`` > 0, ``ASYNC_PLANS``' or :func:`generation_apart_plan`,
    and on 1 rank, where actor_gen cannot have ranks of its own, a ConfigError naming ppo.max_staleness.
    Mixture-of-experts models get expert parallelism in it (:func:`with_expert_parallelism`)."""
    staleness = config.ppo.max_staleness
    if not staleness:
        plan = DEFAULT_PLANS.get(world_size)
        return plan if plan is None else with_expert_parallelism(plan, config, world_size)
    if world_size < 2:
        raise ConfigError(f"max_staleness {staleness} generates while the other tasks train, so actor_gen needs "
                          f"ranks of its own, which 1 rank cannot give; launch on 2 or more ranks, where the "
                          f"job puts actor_gen apart by itself (on 4 ranks: {plan_flags(ASYNC_PLANS[4])}), or "
                          "drop --max-staleness", "ppo.max_staleness")
    return with_expert_parallelism(ASYNC_PLANS.get(world_size) or generation_apart_plan(world_size), config,
                                   world_size)


def with_expert_parallelism(plan: dict, config: JobConfig, world_size: int) -> dict:
    """``plan`` with each mixture-of-experts model's tasks split by experts: a trained task's tp becomes data
    parallelism (megatron trains MoE layers at tp > 1 only with sequence parallelism), and every task but
    actor_gen (whose engine replicas each hold every expert) gets ep = gcd(dp, num_experts), the experts
    split over that many of its data-parallel replicas."""
    out = {}
    for task, entry in plan.items():
        cfg = config.models[TASK_MODEL[task]]
        entry = dict(entry)
        if cfg.is_moe and task != "actor_gen":
            size = len(parse_ranks(entry["ranks"], task, world_size)) if "ranks" in entry else world_size
            if task in config.trained_tasks().values():
                entry["tp"] = 1
            entry.pop("dp", None)  # the mesh's size over tp x pp
            entry["ep"] = math.gcd(size // (entry.get("tp", 1) * entry.get("pp", 1)), cfg.num_experts)
        out[task] = entry
    return out


def plan_note(config: JobConfig, world_size: int) -> list[str]:
    """The one start-up line saying the job runs the built-in asynchronous plan (none for any other plan)."""
    if config.placement.file or not config.ppo.max_staleness:
        return []
    return [f"placement: the built-in asynchronous plan of {world_size} ranks (--max-staleness "
            f"{config.ppo.max_staleness} without --placement): actor_gen on ranks of its own, the other tasks on "
            "the rest (per-task flags merge into it)"]


def job_plan(config: JobConfig, world_size: int) -> dict:
    """The job's plan dict on ``world_size`` ranks: its plan file, else the built-in plan
    (:func:`built_in_plan`), with the per-task flags merged in; without the tasks the job does not run
    that hold a model of their own (ref_inf under ``lora.reference_from_actor_base``)."""
    plan = config.placement.plan(None if config.placement.file else built_in_plan(config, world_size))
    if "ref_inf" not in config.needed_tasks():
        plan = {task: layout for task, layout in plan.items() if task != "ref_inf"}
    return plan


def build_placement(config: JobConfig, world_size: int) -> Placement:
    """The job's Placement on ``world_size`` ranks, checked against the models' shapes and the batch
    sizes (PlacementError or ConfigError naming what to change)."""
    placement = Placement.from_plan(job_plan(config, world_size), world_size)
    placement.validate_models({model: config.models[model] for model in MODELS})
    check_placement(config, placement)
    return placement


def check_placement(config: JobConfig, placement: Placement) -> None:
    """Refuse batch sizes that the placement's DP sizes cannot split, and a fused schedule that does not
    fit the training placements (ConfigError naming the field)."""
    ppo = config.ppo
    missing = [t for t in config.needed_tasks() if t not in placement.meshes]
    critic = [t for t in missing if t in ("critic_inf", "critic_train")]
    if critic:
        raise ConfigError(f"advantage estimator {ppo.advantage_estimator!r} needs a critic, but "
                          f"{', '.join(critic)} is not placed; place it, or pick an estimator without a "
                          "critic (grpo, reinforce++)", "ppo.advantage_estimator")
    if missing:
        raise PlacementError(f"{', '.join(missing)} must be placed: every run needs it")
    for model, task in config.trained_tasks().items():
        config.memory.check_stage_layers(task, config.models[model].num_layers // placement[task].strategy.pp)
        dp = placement[task].strategy.dp
        if ppo.ppo_mini_batch_size % (dp * ppo.micro_batch_size):
            raise ConfigError(f"ppo_mini_batch_size {ppo.ppo_mini_batch_size} must be a multiple of {task}'s "
                              f"dp {dp} x micro_batch_size {ppo.micro_batch_size} (each DP replica runs "
                              "whole micro-batches)", "ppo.ppo_mini_batch_size")
    if config.fusion.intra_stage_fusion:
        fused_schedule(config, placement)
    if ppo.max_staleness:
        check_generation_apart(placement, ppo.max_staleness)
    if config.fusion.inter_stage_fusion and placement["actor_gen"].strategy.dp < 2:
        raise ConfigError(f"inter-stage fusion migrates samples between generation instances, but actor_gen "
                          f"has dp {placement['actor_gen'].strategy.dp}; place actor_gen with dp >= 2",
                          "fusion.inter_stage_fusion")


def check_generation_apart(placement: Placement, max_staleness: int) -> None:
    """Asynchronous iterations generate while the other tasks train: actor_gen's ranks must hold no
    other task (ConfigError naming ppo.max_staleness and the first task that shares one)."""
    shared = sharing_ranks(placement.meshes, "actor_gen")
    if shared:
        task, ranks = next(iter(shared.items()))
        raise ConfigError(f"max_staleness {max_staleness} generates while the other tasks train, so actor_gen "
                          f"needs ranks of its own, but {task} shares rank(s) {ranks} with it; place "
                          "actor_gen apart (e.g. --actor-gen ranks=0-1 and every other task on ranks 2-3)",
                          "ppo.max_staleness")


def padded_vocab_size(config: JobConfig, model: str, placement: Placement) -> int:
    """Embedding / output rows of ``model`` in every layout: its vocab_size rounded up to a multiple of
    make_vocab_size_divisible_by x the lcm of the tps its weights are resharded between (its tasks';
    the actor's and the reference's together, since the reference starts as a reshard of
    actor_train), as Megatron-LM pads (rlhf.models.vocab)."""
    family = ("actor", "reference") if model in ("actor", "reference") else (model,)
    tps = [mesh.strategy.tp for task, mesh in placement.meshes.items() if TASK_MODEL[task] in family]
    return padded_size(config.models[model].vocab_size, config.models.make_vocab_size_divisible_by, tps)


def engine_config(config: JobConfig, placement: Placement) -> EngineConfig:
    """Each actor_gen replica's engine: a KV cache for all the samples of its share of the prompts (one
    prompt more, for a share that is not even) at their longest; a mixture-of-experts actor's records the
    experts it chose (routing replay, and the routing agreement without it)."""
    gen, ppo = config.generation, config.ppo
    return EngineConfig.for_batch(prompts=ppo.rollout_batch_size // placement["actor_gen"].strategy.dp + 1,
                                  samples_per_prompt=ppo.n_samples_per_prompt,
                                  max_model_len=gen.max_prompt_len + gen.max_response_len,
                                  cuda_graphs=gen.cuda_graphs and platform.has_accelerator(),
                                  record_routing=config.models.actor.is_moe)


def microbatches(config: JobConfig, placement: Placement, task: str) -> int:
    """Micro-batches one DP replica of ``task`` runs per mini-batch."""
    return config.ppo.ppo_mini_batch_size // (placement[task].strategy.dp * config.ppo.micro_batch_size)


def fused_schedule(config: JobConfig, placement: Placement) -> Schedule | None:
    """The fused schedule file checked against the training placements and micro-batch counts
    before anything runs, or None when the schedule is to be searched (then the placements are
    checked with a stand-in schedule). ConfigError names the schedule and what differs."""
    fusion = config.fusion
    try:
        if fusion.schedule is None:
            problem = fusion_problem(config, placement, {m: None for m in config.trained_tasks()})
            check_fused(config, Schedule.from_orders(problem, serial_1f1b(problem)), placement)
            return None
        schedule = load_schedule(fusion.schedule)
        check_fused(config, schedule, placement)
    except (ScheduleError, ProblemError) as exc:
        where = fusion.schedule or "intra_stage_fusion"
        raise ConfigError(f"{where}: {exc}", "fusion.schedule" if fusion.schedule else
                          "fusion.intra_stage_fusion") from None
    return schedule


def check_fused(config: JobConfig, schedule: Schedule, placement: Placement) -> None:
    """ScheduleError unless ``schedule`` runs on the training placements with this job's micro-batches."""
    trained = config.trained_tasks()
    compile_all(schedule, {m: placement[t] for m, t in trained.items()},
                {m: microbatches(config, placement, t) for m, t in trained.items()})


def fusion_problem(config: JobConfig, placement: Placement, costs: dict) -> Problem:
    """The fused-schedule problem of the training placements: per model, ``costs[model]`` =
    (forward seconds, backward seconds) per stage, or None for unit costs. Activation memory per
    stage is taken as proportional to hidden size x layers per stage (relative units)."""
    trained = config.trained_tasks()
    stages = max(placement[t].strategy.pp for t in trained.values())
    specs = []
    for model, task in trained.items():
        mesh, cfg = placement[task], config.models[model]
        pp = mesh.strategy.pp
        fwd, bwd = costs[model] or ([1.0] * pp, [2.0] * pp)
        memory = cfg.hidden_size * cfg.num_layers / pp
        # a shorter pipeline runs stages // pp of its DP replicas side by side (RLHFuse's fusion
        # factor); every replica is one pipeline with its own micro-batches
        specs.append(ModelSpec(model, pp, stages // pp, microbatches(config, placement, task),
                               "up" if mesh.reverse_pp else "down", fwd, bwd, [memory] * pp))
    return Problem(stages, tuple(specs), time_unit="s", mem_unit="rel")
