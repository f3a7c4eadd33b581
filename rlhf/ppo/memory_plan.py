"""What fits on a rank: the planner's memory prediction of a job, and the token budget of its micro-batches.

The planner (rlhf/planner/cost.py ``task_memory``) predicts the bytes of each task on each rank from the
models' shapes, the placement, the precision and the batch; ``--dry-run`` prints it (rlhf/ppo/dry_run.py)
and the job logs what it measured beside it (``memory_training_*``, docs/training.md).

``--max-tokens-per-microbatch auto`` (the default) uses the prediction to choose the micro-batches: on a GPU
they are packed (rlhf/models/packing.py, the peers' default: no FLOPs on padding) to the largest token budget
whose predicted peak stays within ``MEMORY_MARGIN`` of the card's memory; on the CPU, and with a fused
schedule (whose micro-batch count ``--micro-batch-size`` fixes), they stay ``--micro-batch-size`` samples
padded. ``0`` gives padded micro-batches anywhere, a number that budget.
"""

from __future__ import annotations

from dataclasses import replace

from rlhf import platform
from rlhf.planner.cost import BF16, FP32, Precision, Workload, task_memory
from rlhf.planner.plan import Plan, memory_parts_per_rank
from rlhf.planner.shapes import BYTES, kv_bytes_per_token
from rlhf.ppo import layout
from rlhf.ppo.config import JobConfig
from rlhf.tasks import MODEL_KIND, TASK_MODEL

MEMORY_MARGIN = 0.85
"""The share of a card's memory an automatic token budget may fill by the planner's prediction: the planner
predicted 47.3 GiB where 52.0 GiB was measured (docs/gpu.md), 9% under, and the allocator needs headroom."""

BUDGET_STEP = 1024
"""Automatic budgets are the longest sample's tokens or a multiple of this."""


def job_precision(config: JobConfig) -> Precision:
    """The element sizes the job trains with (``--bf16``/``--fp16``, docs/precision.md): fp32 weights,
    gradients and Adam moments; or 16-bit weights with fp32 main weights and moments, and fp32 gradients
    unless fp16 keeps them 16-bit (no --accumulate-allreduce-grads-in-fp32)."""
    p = config.precision
    if p.name == "fp32":
        return FP32
    return replace(BF16, name=p.name, grad=BF16.grad if p.grads_in_fp32 else BF16.weight)


def workload(config: JobConfig) -> Workload:
    """The planner's workload of the job: its samples, token budgets, mini-batches and micro-batches (packed
    ones as the fewest full-length samples that hold their token budget: their activations at most)."""
    ppo, gen = config.ppo, config.generation
    size = ppo.micro_batch_size
    if ppo.packing_budget is not None:
        size = -(-ppo.packing_budget // (gen.max_prompt_len + gen.max_response_len))
    return Workload(ppo.rollout_samples, gen.max_prompt_len, gen.max_response_len, ppo.minibatches, size,
                    ppo.ppo_epochs)


def predicted_memory(config: JobConfig, placement, precision: Precision | None = None) -> dict:
    """{rank: {part: bytes}} the planner predicts at the peak of each rank (rlhf.planner.plan
    ``memory_parts_per_rank``) for the tasks the job runs, at ``precision`` (default :func:`job_precision`),
    with the job's activation recomputation, and its engine's KV cache (:func:`engine_kv_bytes`) resident
    unless ``--release-generation-memory`` frees it between generations."""
    precision = precision or job_precision(config)
    meshes = {t: m for t, m in placement.meshes.items() if t in config.needed_tasks()}
    wl, mem = workload(config), config.memory
    recompute = (mem.recompute_granularity, mem.recompute_num_layers)
    memory = {task: task_memory(task, config.models[TASK_MODEL[task]], MODEL_KIND[TASK_MODEL[task]], mesh, wl,
                                None, precision, recompute, "local") for task, mesh in meshes.items()}
    if "actor_gen" in memory:
        memory["actor_gen"]["kv"] = engine_kv_bytes(config, placement, precision)
    plan = Plan("job", meshes, fuse_training=config.fusion.intra_stage_fusion)
    return memory_parts_per_rank(plan, memory, resident_kv=not mem.release_generation_memory)


def engine_kv_bytes(config: JobConfig, placement, precision: Precision) -> float:
    """Bytes of the KV cache one actor_gen rank allocates (rlhf.ppo.layout.engine_config's blocks: every
    sample of a replica's share of the prompts, one prompt more, whole blocks and a spare per sequence)."""
    engine, tp = layout.engine_config(config, placement), placement["actor_gen"].strategy.tp
    per_token = kv_bytes_per_token(config.models["actor"]) / BYTES * precision.weight
    return engine.num_blocks * engine.block_size * per_token / tp


def peak_bytes(config: JobConfig, placement) -> float:
    """The largest total the planner predicts for one rank (:func:`predicted_memory`)."""
    return max(sum(parts.values()) for parts in predicted_memory(config, placement).values())


def token_budget(config: JobConfig, placement, device_bytes: float) -> int:
    """The largest budget of tokens per packed micro-batch (the longest sample's, or a multiple of
    ``BUDGET_STEP``, up to a whole mini-batch of longest samples) whose predicted peak fits
    ``MEMORY_MARGIN`` x ``device_bytes``; the longest sample's when none does."""
    gen, ppo = config.generation, config.ppo
    longest = gen.max_prompt_len + gen.max_response_len

    def fits(budget: int) -> bool:
        trial = replace(config, ppo=replace(ppo, max_tokens_per_microbatch=budget))
        return peak_bytes(trial, placement) <= MEMORY_MARGIN * device_bytes

    low, high = 0, -(-ppo.ppo_mini_batch_size * longest // BUDGET_STEP)  # in steps, above the longest sample
    if not fits(longest):
        return longest
    while low < high:  # the predicted peak grows with the budget
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(max(longest, middle * BUDGET_STEP)) else (low, middle - 1)
    return max(longest, low * BUDGET_STEP)


def auto_budget(config: JobConfig, placement, device_bytes: float) -> int:
    """What ``--max-tokens-per-microbatch auto`` becomes on a GPU of ``device_bytes``: :func:`token_budget`,
    or 0 (padded micro-batches) with a fused schedule."""
    return 0 if config.fusion.intra_stage_fusion else token_budget(config, placement, device_bytes)


def resolve_micro_batches(config: JobConfig, placement) -> JobConfig:
    """``config`` with an automatic token budget (None) chosen for this process's GPU (:func:`auto_budget`);
    as it is on the CPU (None: padded) and when the flag gave a budget or 0."""
    device_bytes = platform.device_memory_bytes()
    if config.ppo.max_tokens_per_microbatch is not None or device_bytes is None:
        return config
    budget = auto_budget(config, placement, device_bytes)
    return replace(config, ppo=replace(config.ppo, max_tokens_per_microbatch=budget))


def describe_choice(config: JobConfig, placement) -> str:
    """The line a job prints for the budget :func:`resolve_micro_batches` chose."""
    budget = config.ppo.max_tokens_per_microbatch
    if not budget:
        return (f"micro-batches (--max-tokens-per-microbatch auto): padded, {config.ppo.micro_batch_size} samples "
                "each (a fused schedule fixes their count)")
    share = peak_bytes(config, placement) / platform.device_memory_bytes()
    return (f"micro-batches (--max-tokens-per-microbatch auto): packed, up to {budget} tokens each (the planner "
            f"predicts {share:.0%} of this device's memory at the peak); --max-tokens-per-microbatch 0 restores "
            f"padded micro-batches of --micro-batch-size {config.ppo.micro_batch_size}")
