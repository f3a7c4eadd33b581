"""1-rank scenario for the "no host stall" goal (docs/gpu.md): the would-be host synchronisations
(rlhf.testing.host_syncs) of one training and one inference micro-batch, padded and packed.

A micro-batch's data is made before its compute: the trainer slices the mini-batch (Batch.micro_batches) and
finds each packed layout (ModelRuntime, InferenceRunner) from host fields only, which Batch keeps on the CPU.
What is counted is the compute that follows on the device: an inference micro-batch's forward and what its
task makes of it (the actor's log-probs, the critic's values), and a training micro-batch's forward, the
actor's loss (clipped policy loss, KL in the loss, an entropy bonus, truncated importance sampling) or the
critic's, and its backward. The optimizer step is not part of a micro-batch (megatron's found-inf and grad
norm reads happen once per mini-batch there). On a GPU (tests/test_gpu.py) the same blocks run under
``torch.cuda.set_sync_debug_mode("error")`` (rlhf.platform.syncs_raise), which also catches the blocking
host-to-device copies the CPU counter cannot see.
"""

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.batch import Batch
from rlhf.models import ModelConfig
from rlhf.models.gpt import build_model, stage_forward
from rlhf.models.packing import PackedLayout
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.pipeline.inference import task_output
from rlhf.pipeline.microbatch import pipeline_forward
from rlhf.ppo.config import PPOConfig
from rlhf.ppo.update import ActorLoss, CriticLoss
from rlhf.testing.host_syncs import HostSyncCounter

CFG = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                  vocab_size=64, max_seq_len=32)
PROMPTS, RESPONSES = [3, 5, 2, 4], [6, 2, 7, 4]
PPO = PPOConfig(entropy_coef=0.01, kl_in="loss", kl_estimator="k3", tis_cap=2.0, mask_truncated=True,
                recompute_logprobs=True)


def _batch() -> Batch:
    gen = torch.Generator().manual_seed(0)
    n, width, columns = len(PROMPTS), max(p + r for p, r in zip(PROMPTS, RESPONSES)), max(RESPONSES)
    mask = (torch.arange(columns) < torch.tensor(RESPONSES)[:, None]).float()

    def field():
        return torch.randn(n, columns, generator=gen) * mask

    return Batch(tokens=torch.randint(0, CFG.vocab_size, (n, width), generator=gen), pad_id=0,
                 prompt_lengths=torch.tensor(PROMPTS), response_lengths=torch.tensor(RESPONSES),
                 prompt_ids=torch.arange(n), sample_indices=torch.zeros(n, dtype=torch.int64),
                 finish_reasons=("stop", "length", "stop", "stop"), old_logprobs=field() - 4,
                 rollout_logprobs=field() - 4, ref_logprobs=field() - 4, advantages=field(), values=field(),
                 returns=field())


def _events(counter) -> list:
    return [f"{e.op} at {e.where}" for e in counter.events]


def _counts(models: dict, g, mb: Batch, packed: PackedLayout | None) -> dict:
    out = {}
    for task, model in models.items():
        with HostSyncCounter() as counter, platform.syncs_raise():
            task_output(task, pipeline_forward(model, g, mb.tokens, packed), mb, g, 1.0, packed)
        out[f"inference/{task}"] = _events(counter)
    settings = PPOConfig(**{**vars(PPO), "max_tokens_per_microbatch": None if packed is None else 64})
    losses = {"actor_train": ActorLoss(settings, max(RESPONSES), temperature=0.7, kl_coef=0.05),
              "critic_train": CriticLoss(settings, max(RESPONSES))}
    for task, loss in losses.items():
        model = models["actor_train" if task == "actor_train" else "critic_inf"]
        denominator = loss.denominator(mb)  # once per mini-batch, before its micro-batches
        with HostSyncCounter() as counter, platform.syncs_raise():
            loss(stage_forward(model, mb.tokens, None, packed), mb, g, packed, denominator, averaged=1).backward()
        out[f"training/{task}"] = _events(counter)
    return out


def run():
    build_task_groups(Placement.from_plan({}, dist.get_world_size()))
    g = local_groups()
    models = {"actor_train": build_model(CFG, "lm", g.pg_collection, g.stage, seed=1),
              "critic_inf": build_model(CFG, "value", g.pg_collection, g.stage, seed=2)}
    mb = _batch().to(platform.device())
    return {"padded": _counts(models, g, mb, None), "packed": _counts(models, g, mb, PackedLayout.of(mb))}
