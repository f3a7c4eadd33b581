"""The main job until the PPO trainer lands: all six task models on their meshes.

Each iteration runs, on the placement given: inference forward passes for
actor generation, reference, reward and critic; one forward/backward and SGD
step for actor and critic training (stand-in losses: actor next-token NLL,
critic MSE to the reward scores); then reshards the trained actor and critic
weights into the generation and critic-inference layouts. It prints per-task
results and times on rank 0. Real work, not a PPO run: the PPO trainer will
replace the stand-in losses with rlhf.algorithms.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.config import JobConfig
from rlhf.models.gpt import build_model
from rlhf.models.logprobs import vocab_parallel_log_probs
from rlhf.parallel.data_parallel import average_gradients
from rlhf.parallel.groups import build_task_groups
from rlhf.parallel.reshard import reshard
from rlhf.pipeline.microbatch import pipeline_forward, pipeline_forward_backward
from rlhf.tasks import TASK_MODEL, TASKS, TRAIN_TASK, task_kind


def _replica_batch(tokens: torch.Tensor, groups, mbs: int) -> torch.Tensor:
    d = groups.coord.dp
    return tokens[d * mbs:(d + 1) * mbs]


def _gather_report(local: dict) -> dict:
    """Merge every rank's results (collective); rank 0 prints them."""
    merged: dict = {}
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, local)
    for report in reports:
        for key, value in report.items():
            merged.setdefault(key, []).append(value)
    return {k: sum(v) / len(v) for k, v in merged.items()}


def run_smoke(config: JobConfig, placement) -> None:
    """Build the six task models and run ``config.run.iterations`` smoke iterations."""
    run = config.run
    groups = build_task_groups(placement)
    models = {
        task: build_model(config.models[TASK_MODEL[task]], task_kind(task), g.pg_collection, g.stage, seed=run.seed)
        for task, g in groups.items() if g is not None
    }
    optimizers = {task: torch.optim.SGD(models[task].parameters(), lr=1e-2)
                  for task in TRAIN_TASK.values() if task in models}
    mbs, seq = run.micro_batch_size, run.seq_length
    vocab = config.models.actor.vocab_size
    for it in range(run.iterations):
        torch.manual_seed(run.seed + it)
        tokens = torch.randint(0, vocab, (mbs * dist.get_world_size(), seq))
        local, times = {}, {}
        for task in TASKS:
            start = time.perf_counter()
            g = groups[task]
            if g is not None:
                ids = _replica_batch(tokens, g, mbs)
                local.update(_run_task(task, models[task], g, ids, optimizers.get(task)))
            dist.barrier()
            times[f"time_{task}_s"] = time.perf_counter() - start
        start = time.perf_counter()
        for src, dst in (("actor_train", "actor_gen"), ("critic_train", "critic_inf")):
            if groups[src] is not None or groups[dst] is not None:
                reshard(placement[src], (groups[src], models.get(src)), placement[dst],
                        (groups[dst], models.get(dst)), config.models[TASK_MODEL[src]].num_layers)
        dist.barrier()
        times["time_reshard_s"] = time.perf_counter() - start
        report = _gather_report(local)
        if dist.get_rank() == 0:
            print(f"iteration {it + 1}/{run.iterations}: " +
                  ", ".join(f"{k}={v:.4f}" for k, v in sorted(report.items())), flush=True)
            print("  times: " + ", ".join(f"{k[5:-2]}={v * 1000:.0f}ms" for k, v in times.items()), flush=True)


def _run_task(task: str, model, g, ids: torch.Tensor, optimizer) -> dict:
    """One task's work on this rank; returns scalars to report (last stage only)."""
    lm = task_kind(task) == "lm"
    if task not in TRAIN_TASK.values():
        out = pipeline_forward(model, g, ids)
        if out is None:
            return {}
        if lm:
            return {f"{task}_logprob": vocab_parallel_log_probs(out[:, :-1], ids[:, 1:], g.tp).mean().item()}
        return {f"{task}_value": out[:, -1].mean().item()}
    if lm:
        loss = pipeline_forward_backward(
            model, g, ids, lambda logits: -vocab_parallel_log_probs(logits[:, :-1], ids[:, 1:], g.tp).mean())
    else:
        loss = pipeline_forward_backward(model, g, ids, lambda values: F.mse_loss(values, torch.zeros_like(values)))
    average_gradients(model, g.dp)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {} if loss is None else {f"{task}_loss": loss.item()}
