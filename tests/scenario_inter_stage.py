"""4-rank scenario: the trainer's generation and inference with inter-stage fusion vs without.

One trainer per placement (2 generation instances of TP2, and 4 of TP1) on the
long-tailed workload (sampled at temperature 1, per-sample lengths). The same
prompts run unfused, then fused at several R with K/V or token-only
migration; each run's batch after inference (tokens, engine log-probs,
reference log-probs, scores, values) is returned with what the fusion did.
"""

import torch.distributed as dist

from rlhf import platform
from rlhf.config import RunConfig
from rlhf.ppo.config import FusionConfig, GenerationConfig, JobConfig, ModelsConfig, PPOConfig
from rlhf.data import ByteTokenizer, PromptBatchIterator
from rlhf.data.synthetic import SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.ppo.trainer import Trainer

from scenario_trainer import RESUME_MODEL, synthetic_weights

PLANS = {
    "2 instances": {"actor_train": {"ranks": "0-3", "tp": 2, "pp": 2},
                    "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True},
                    "actor_gen": {"ranks": "0-3", "tp": 2, "dp": 2},
                    "ref_inf": {"ranks": "2-3"}, "reward_inf": {"ranks": "0-1"},
                    "critic_inf": {"ranks": "0-3", "tp": 2}},
    "4 instances": {"actor_train": {"ranks": "0-3", "dp": 4}, "critic_train": {"ranks": "0-3", "dp": 4},
                    "actor_gen": {"ranks": "0-3", "dp": 4}, "ref_inf": {"ranks": "0-3", "dp": 4},
                    "reward_inf": {"ranks": "0-3", "tp": 2}, "critic_inf": {"ranks": "0-3", "dp": 2, "pp": 2}},
}
RUNS = (("R=0.5 kv", 0.5, True), ("R=0.5 tokens", 0.5, False), ("R=0", 0.0, True), ("R=1", 1.0, True))
CHECK_EVERY = 2
SEED = 9
"""Run, prompt and sampling seed: a workload whose long tail migrates in both plans (tested)."""
FIELDS = ("tokens", "old_logprobs", "ref_logprobs", "scores", "values")


def _trainer(placement, seed: int) -> Trainer:
    config = JobConfig(models=ModelsConfig(actor=RESUME_MODEL, critic=RESUME_MODEL),
                       run=RunConfig(iterations=1, seed=seed),
                       generation=GenerationConfig(max_prompt_len=8, max_response_len=20, temperature=1.0,
                                                   long_tail_median=4),
                       ppo=PPOConfig(rollout_batch_size=8, n_samples_per_prompt=2, ppo_mini_batch_size=16,
                                     micro_batch_size=2),
                       fusion=FusionConfig(inter_stage_fusion=True, migration_threshold=0.5,
                                           migration_check_every=CHECK_EVERY))
    prompts = PromptBatchIterator(SyntheticPromptDataset(SyntheticPromptConfig(seed=seed, max_length=8)), 8, seed=seed)
    return Trainer(config, placement, prompts, ByteTokenizer(), initial_weights=synthetic_weights(31),
                   reward_fn=gold_reward)


def _rollout(trainer: Trainer, prompts) -> dict:
    """generate + infer on ``prompts``: the batch's fields (host) and what the fusion did, gathered."""
    rollout = trainer.generate(prompts)
    fused, early = (None, None) if rollout.fusion is None else (rollout.fusion.fused, rollout.fusion.early)
    batch = trainer.infer(rollout.batch.to(platform.device()), rollout.fusion)
    stats = [] if fused is None else [(dist.get_rank(), fused.migrate_step, fused.moved_out, fused.moved_in,
                                       fused.refused, len(fused.finished_at_migration))]
    rows = 0 if early is None else sum(len(out) for out in early.outputs)  # computed on this rank
    if fused is not None:
        stats = [(*stats[0], trainer.inter_stage.streamed)]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (stats, rows))
    return {"fields": {f: getattr(batch, f).cpu().numpy() for f in FIELDS},  # numpy: a queue cannot hold tensors
            "samples": list(zip(batch.prompt_ids.tolist(), batch.sample_indices.tolist())),
            "finish_reasons": batch.finish_reasons, "stats": [s for p in parts for s in p[0]],
            "early_done": {} if early is None else {task: len(index) for task, index in early.done.items()},
            "early_rows": sum(p[1] for p in parts)}


def run(seed: int = SEED) -> dict:
    out = {}
    for label, plan in PLANS.items():
        placement = Placement.from_plan(plan, dist.get_world_size())
        build_task_groups(placement)  # collective; creates the one-rank groups the test weights are drawn with
        trainer = _trainer(placement, seed)
        prompts = next(trainer.prompts)
        fusion = trainer.inter_stage
        trainer.inter_stage = None
        runs = {"unfused": _rollout(trainer, prompts)}
        trainer.inter_stage = fusion
        for name, threshold, kv in RUNS:
            fusion.threshold, fusion.migrate_kv = threshold, kv
            runs[name] = _rollout(trainer, prompts)
        out[label] = runs
    return out
