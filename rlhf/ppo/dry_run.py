"""What a launch of ``pretrain_rlhf.py`` will run, told before anything starts: the ``--dry-run`` check.

``pretrain_rlhf.py --dry-run --world-size N [flags]`` runs every check the
job makes before it builds a model (the flags, the placement on N ranks
against the models' shapes and the batch sizes, the fused schedule against
the training placements: ``rlhf.ppo.layout.build_placement``) and describes
the result: each model's size, each task's ranks and layout. It starts no
process, opens no process group and builds no model: shapes come from
presets (with the job tokenizer's ids, as the job's), JSON files or the
config files of model directories, parameters are counted from the shapes
by the planner's count (rlhf/planner/shapes.py). Not checked here (the job
checks them at start-up, before any model is built): that the tokenizer's
ids fit the actor's vocabulary, the prompt file's records, the reward
function's import and a ``--load`` root's checkpoints.

It also prints the planner's predicted memory per rank (rlhf/planner/cost.py
``task_memory``) in the parts the job measures and logs (``memory_training_*``
metrics, docs/training.md), at the job's precision (rlhf/ppo/memory_plan.py, which also chooses the
``--max-tokens-per-microbatch auto`` budget this report shows for a GPU).
A mixture of experts' model line adds its experts and its total and active
parameters (rlhf.planner.shapes ``active_parameter_count``); a task with
expert parallelism (ep > 1) its experts per rank and the bytes each of its
ranks sends in expert all-to-alls per iteration, predicted at full-length
samples and the job's activation type (rlhf.planner.cost
``expert_alltoall_bytes_per_iteration``).
"""

from __future__ import annotations

from rlhf.planner.cost import MEMORY_PARTS, expert_alltoall_bytes_per_iteration
from rlhf.planner.shapes import active_parameter_count, parameter_count, rank_parameters
from rlhf.ppo import layout
from rlhf.ppo.memory_plan import MEMORY_MARGIN, auto_budget, job_precision, predicted_memory, workload
from rlhf.ppo.config import JobConfig
from rlhf.tasks import MODEL_KIND, MODELS, TASK_MODEL


def short_count(count: float) -> str:
    """``6738415616`` -> ``6.74B``; ``M`` below a billion, ``K`` below a million."""
    for scale, unit in ((1e9, "B"), (1e6, "M")):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return f"{count / 1e3:.1f}K"


def describe_experts(cfg, kind: str) -> str:
    """A mixture of experts' part of its model line: the experts, and its total and active parameters."""
    if not cfg.is_moe:
        return ""
    shared = (f" and a shared expert (ffn {cfg.moe_shared_expert_intermediate_size})"
              if cfg.moe_shared_expert_intermediate_size else "")
    return (f"; mixture of experts: {cfg.num_experts} experts (ffn {cfg.expert_ffn_hidden_size}), each token to "
            f"{cfg.moe_router_topk}{shared}: {short_count(parameter_count(cfg, kind))} parameters in all, "
            f"{short_count(active_parameter_count(cfg, kind))} active per token")


def describe_placement(placement) -> list[str]:
    """One line per placed task: its ranks, ``dp x pp x tp`` and a reversed pipeline."""
    lines = []
    for task, mesh in placement.meshes.items():
        reverse = " (reversed pipeline)" if mesh.reverse_pp else ""
        lines.append(f"  {task:13s} ranks {list(mesh.ranks)} {mesh.strategy}{reverse}")
    return lines


def dry_run(config: JobConfig, world_size: int) -> str:
    """Check ``config`` on ``world_size`` ranks as the job does before building models, and describe the
    launch (raises the job's PlacementError / ConfigError on bad input; builds nothing)."""
    placement = layout.build_placement(config, world_size)
    needed = config.needed_tasks()
    lines = [f"dry run: {world_size} ranks; the flags, the placement, the model shapes and the fused schedule "
             "are valid (no process started, no model built)", "models (parameters, untied embeddings):"]
    for model in MODELS:
        cfg, kind = config.models[model], MODEL_KIND[model]
        used = any(TASK_MODEL[t] == model for t in needed)
        source = config.models.weights.get(model)
        lines.append(f"  {model:10s} {short_count(parameter_count(cfg, kind)):>8s} {kind:5s} {cfg.num_layers} layers, "
                     f"hidden {cfg.hidden_size}, ffn {cfg.ffn_hidden_size}, {cfg.num_attention_heads} heads "
                     f"({cfg.num_kv_heads} KV), vocab {cfg.vocab_size}, context {cfg.max_seq_len}"
                     + describe_experts(cfg, kind)
                     + (f"; from {source}" if source else "") + ("" if used else "; not used by this job"))
    lines += layout.plan_note(config, world_size)
    moe = any(config.models[m].is_moe for m in MODELS)
    lines.append("tasks (parameters per rank: the largest pipeline stage / tp" + (", its experts / ep" if moe else "")
                 + "):")
    trained = set(config.trained_tasks().values())
    wl, element = workload(config), job_precision(config).weight
    for task, line in zip(placement.meshes, describe_placement(placement)):
        mesh, model = placement[task], TASK_MODEL[task]
        cfg = config.models[model]
        line += f"; {short_count(rank_parameters(cfg, MODEL_KIND[model], mesh.strategy))}/rank"
        if cfg.is_moe and mesh.strategy.ep > 1:
            a2a = expert_alltoall_bytes_per_iteration(task, cfg, mesh, wl, element=element)
            line += (f"; ep {mesh.strategy.ep}: {cfg.num_experts // mesh.strategy.ep} experts per rank, expert "
                     f"all-to-all {short_bytes(a2a)} sent per rank per iteration (predicted)")
        if task in trained and config.ppo.packing_budget is None:
            line += f"; {layout.microbatches(config, placement, task)} micro-batches per mini-batch and DP replica"
        lines.append(line + ("" if task in needed else "; placed, not run by this job"))
    lines += [_describe_batches(config), *_describe_auto_budget(config, placement),
              _describe_generation(config, placement), _describe_training(config, placement)]
    lines += describe_memory(config, placement)
    return "\n".join(lines)


def short_bytes(n: float) -> str:
    """``3145728`` -> ``3.00 MiB`` (KiB, MiB, GiB)."""
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def describe_memory(config: JobConfig, placement) -> list[str]:
    """The predicted bytes per rank, one line each, in the parts of the logged memory metrics."""
    precision = job_precision(config)
    kv = "freed between generations" if config.memory.release_generation_memory else "resident"
    lines = [f"memory per rank, predicted (planner, {precision.name}: {precision.weight} B weights, "
             f"{precision.grad} B gradients, {precision.main + precision.optimizer} B optimizer state per trained "
             f"parameter; the largest call's activations; KV cache {kv}):"]
    for rank, parts in sorted(predicted_memory(config, placement, precision).items()):
        shown = ", ".join(f"{p} {short_bytes(parts[p])}" for p in MEMORY_PARTS)
        lines.append(f"  rank {rank}: {shown}; total {short_bytes(sum(parts.values()))}")
    return lines


def _describe_generation(config: JobConfig, placement) -> str:
    fusion, gen = config.fusion, config.generation
    workload = (f"long-tailed workload (lognormal lengths, median {gen.long_tail_median}, EOS ignored)"
                if gen.long_tail_median else "samples end at EOS or --max-response-len")
    ppo = config.ppo
    if ppo.max_staleness:
        free = (f", running free with partial rollouts (samples in flight take each update's weights, K/V: "
                f"{ppo.partial_rollout_kv})" if ppo.partial_rollouts else "")
        return (f"generation: {placement['actor_gen'].strategy.dp} instance(s), {workload}; asynchronous: "
                f"{ppo.max_staleness} iteration(s) ahead of training on ranks of its own (--max-staleness "
                f"{ppo.max_staleness}){free}, the old log-probs recomputed by actor_train")
    if not fusion.inter_stage_fusion:
        return f"generation: {placement['actor_gen'].strategy.dp} instance(s), {workload}; inference after it " \
               "(no --inter-stage-fusion)"
    threshold = "auto" if fusion.migration_threshold is None else f"{fusion.migration_threshold:g}"
    return (f"generation: {placement['actor_gen'].strategy.dp} instances, {workload}; inter-stage fusion: the long "
            f"tail migrates at R={threshold} (K/V: {fusion.migrate_kv}, counts every {fusion.migration_check_every} "
            "steps) and the freed ranks infer the finished samples")


def _describe_batches(config: JobConfig) -> str:
    ppo, gen = config.ppo, config.generation
    return (f"PPO: {ppo.rollout_batch_size} prompts x {ppo.n_samples_per_prompt} samples = {ppo.rollout_samples} "
            f"samples per iteration ({gen.max_prompt_len} + {gen.max_response_len} tokens at most), "
            f"{ppo.minibatches} mini-batches of {ppo.ppo_mini_batch_size} x {ppo.ppo_epochs} epoch(s), "
            + (f"micro-batches of {ppo.micro_batch_size}" if ppo.packing_budget is None else
               f"packed micro-batches of up to {ppo.packing_budget} tokens")
            + f"; {config.run.iterations} iterations")


CARDS_GIB = {"H100": 80, "H200": 141}
"""The cards an automatic token budget is shown for (their memory in GiB)."""


def _describe_auto_budget(config: JobConfig, placement) -> list[str]:
    """What ``--max-tokens-per-microbatch auto`` (the default) becomes on the CPU and on each card of
    ``CARDS_GIB`` (rlhf/ppo/memory_plan.py); nothing when the flag gave a budget or 0."""
    if config.ppo.max_tokens_per_microbatch is not None:
        return []
    ppo = config.ppo
    padded = f"padded micro-batches of {ppo.micro_batch_size} samples"
    if config.fusion.intra_stage_fusion:
        return [f"micro-batches (--max-tokens-per-microbatch auto): {padded} on every device (the fused schedule "
                "fixes their count); --max-tokens-per-microbatch N packs them"]
    cards = ", ".join(f"up to {auto_budget(config, placement, gib * 2 ** 30)} tokens on an {name} ({gib} GiB)"
                      for name, gib in CARDS_GIB.items())
    return [f"micro-batches (--max-tokens-per-microbatch auto): on a GPU packed, {cards}: the largest budget whose "
            f"predicted peak is within {MEMORY_MARGIN:.0%} of the card; on the CPU {padded}; "
            "--max-tokens-per-microbatch 0 keeps them padded everywhere"]


def _describe_training(config: JobConfig, placement) -> str:
    if not config.fusion.intra_stage_fusion:
        return "training: actor and critic one after the other, serial 1F1B each (no --intra-stage-fusion)"
    schedule = layout.fused_schedule(config, placement)
    if schedule is None:
        return ("training: fused (--intra-stage-fusion) without a schedule file: the first iteration runs serial "
                "1F1B, measures every stage and searches a fused schedule for it")
    shape = ", ".join(f"{m.name} pp{m.pp} x{m.pipelines} pipeline(s) of {m.microbatches} micro-batches {m.direction}"
                      for m in schedule.problem.models)
    metrics = schedule.metrics
    speed = (f"; searched makespan {metrics['serial_1f1b'] / metrics['makespan']:.2f}x faster than serial 1F1B"
             if metrics.get("makespan") and metrics.get("serial_1f1b") else "")
    return f"training: fused schedule {config.fusion.schedule} ({shape}{speed})"

