"""4-rank scenario for the trainer: one PPO iteration on given samples vs textbook PPO.

The trainer runs actor_train TP2xPP2, critic_train PP2xDP2 reversed, ref_inf
TP1 on ranks {2, 3} and reward_inf TP1 on ranks {0, 1}, on a fixed batch of
samples (generation given). The reference is plain single-process PyTorch
written here from the definitions: KL-penalised rewards, the recursive GAE
loop, whitened advantages, the clipped surrogate minus an entropy bonus (the
entropy of the whole tempered softmax) and the clipped value loss as token
means over the mini-batch (and again as means over its sequences, with
--loss-agg seq-mean-token-mean; as sums per sequence, with seq-mean-token-sum
on the planner's placement; and normalised by --max-response-len, with
seq-mean-token-sum-norm on multi-turn samples), gradient-norm clipping (set low
enough that it clips) and torch AdamW. Both start from the same full weights;
the scenario returns the largest parameter differences, and the losses each
optimizer step minimised against those the trainer logged. The same
iteration runs again on the placement the planner's search picks for this job
on 4 CPU ranks, so the plans tools/plan_placement.py writes are checked to
train, not only to validate, with packed token-budget micro-batches
(--max-tokens-per-microbatch), against textbook PPO and the padded run, on
multi-turn samples whose observations are holes in the loss mask, and scored
by a reward function returning NaN and infinity for two samples with
--skip-nonfinite-samples, against textbook PPO on the other six. A run whose
reference infers NaN (every gradient NaN) stops at --max-skipped-steps.
The actor's loss at TP2 (the vocabulary split, two padded ids) with an entropy
bonus: its gradient w.r.t. the logits against an unsharded written-out loss.
"""

import os
from dataclasses import replace

import torch
import torch.distributed as dist

from rlhf import platform
from rlhf.batch import Batch
from rlhf.checkpoint.storage import list_checkpoints
from rlhf.config import CheckpointConfig, ConfigError, RunConfig
from rlhf.ppo.config import (AdaptersConfig, FusionConfig, GenerationConfig, JobConfig, MemoryConfig, ModelsConfig,
                             PPOConfig, RewardConfig)
from rlhf.data import ByteTokenizer, PromptBatchIterator
from rlhf.data.synthetic import SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
from rlhf.engine.types import SampleResult
from rlhf.memory import module_tensors, storage_bytes
from rlhf.models import ModelConfig
from rlhf.models.gpt import stage_forward
from rlhf.models.precision import PrecisionConfig
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.parallel.reshard import gather_tp_full_weights
from rlhf.schedule.generators import serial_1f1b
from rlhf.schedule.io import save_schedule
from rlhf.schedule.problem import ModelSpec, Problem
from rlhf.schedule.search import SearchConfig, search
from rlhf.testing.models import full_weights, plain_logprobs, unsharded
from rlhf.testing.reference import gae_loop
from rlhf.checkpoint.megatron import open_megatron, read_megatron_state
from rlhf.ppo.trainer import MEGATRON_EXPORT_DIR, Trainer
from rlhf.ppo.update import ActorLoss
from rlhf.tasks import FROZEN_TASKS

ACTOR = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                    vocab_size=64, max_seq_len=32)
CRITIC = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                     vocab_size=64, max_seq_len=32)
PLAN = {
    "actor_train": {"ranks": "0-3", "tp": 2, "pp": 2},
    "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True},
    "actor_gen": {"ranks": "0-3", "tp": 2, "dp": 2},
    "ref_inf": {"ranks": [2, 3]},
    "reward_inf": {"ranks": [0, 1]},
    "critic_inf": {"ranks": "0-3", "tp": 2},
}
PPO = PPOConfig(rollout_batch_size=4, n_samples_per_prompt=2, ppo_mini_batch_size=8, ppo_epochs=2,
                micro_batch_size=2, lr=5e-4, critic_lr=1e-3, clip_grad=0.05, clip_eps=0.2, value_clip=0.2,
                kl_coef=0.1, gamma=1.0, lam=0.95, entropy_coef=0.01)
NORM_LENGTH = GenerationConfig().max_response_len  # seq-mean-token-sum-norm's constant in the runs that use it
TEMPERATURE = 0.7  # every log-prob of the iteration is of logits / T (the engine sampled at T)
BETAS = (0.9, 0.95)  # rlhf.optim.OptimizerConfig's defaults
# Adam's first steps move a weight by about lr whatever its gradient's size, so a gradient element
# near 0 turns float noise into up to ~1e-2 lr of difference (1.006e-5 seen at lr 1e-3): lr stays small.
# prompt lengths and response lengths of the 8 samples (two per prompt)
PROMPTS = [3, 5, 2, 6]
RESPONSES = [4, 7, 1, 5, 6, 3, 7, 2]


def _samples(actor, holes: bool = False) -> list:
    """Fixed prompts and responses; old log-probs from the initial actor (as the engine reports them).
    ``holes``: each response of 4 tokens or more is two turns with a 2-token observation between them
    (its columns 1 and 2: loss_mask 0, log-prob 0 as the episode runner records them)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for s, r in enumerate(RESPONSES):
        prompt = torch.randint(0, ACTOR.vocab_size, (PROMPTS[s // 2],), generator=g).tolist()
        response = torch.randint(0, ACTOR.vocab_size, (r,), generator=g).tolist()
        with torch.no_grad():
            tokens = torch.tensor([prompt + response], device=platform.device())
            lp = plain_logprobs(actor, tokens, len(prompt), r, TEMPERATURE)[0]
        mask = [0 if holes and r >= 4 and k in (1, 2) else 1 for k in range(r)]
        out.append(SampleResult(str(s // 2), s % 2, tuple(prompt), tuple(response),
                                tuple(x * m for x, m in zip(lp.tolist(), mask)), "length", 0.0,
                                loss_mask=tuple(mask) if holes else ()))
    return out


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """A [N, R] loss reduced over the whole mini-batch as its name says: token-mean (every valid token
    alike), else a mean over sequences of each one's token mean, token sum, or token sum / NORM_LENGTH."""
    if agg == "token-mean":
        return (per_token * mask).sum() / mask.sum()
    per_sequence = (per_token * mask).sum(dim=1)
    divisor = {"seq-mean-token-mean": mask.sum(dim=1), "seq-mean-token-sum": 1.0,
               "seq-mean-token-sum-norm": NORM_LENGTH}[agg]
    return (per_sequence / divisor).mean()


def _policy(actor, tokens: torch.Tensor, prompt_len: int, response_len: int) -> tuple:
    """[1, r] log-probs of the response tokens and [1, r] entropies of the tempered softmax predicting them."""
    logp = torch.log_softmax(stage_forward(actor, tokens).float()[:, :-1] / TEMPERATURE, -1)
    window = slice(prompt_len - 1, prompt_len - 1 + response_len)
    picked = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return picked[:, window], -(logp.exp() * logp).sum(-1)[:, window]


def _textbook_iteration(full: dict, samples: list, agg: str = "token-mean", scores=None, models=(ACTOR, CRITIC)
                        ) -> dict:
    """One PPO iteration from the definitions, one sample at a time where it is clearer; ``scores``: the samples'
    scores (default: the reward model's); ``models``: the actor's and the critic's shapes."""
    actor_cfg, critic_cfg = models
    actor, critic = unsharded("lm", actor_cfg, full["actor"]), unsharded("value", critic_cfg, full["critic"])
    reference = unsharded("lm", actor_cfg, full.get("reference", full["actor"]))
    reward = unsharded("value", critic_cfg, full["reward"])
    seqs = [(torch.tensor([list(s.prompt) + list(s.tokens)]), len(s.prompt), len(s.tokens)) for s in samples]
    R = max(r for _, _, r in seqs)

    def padded(rows):
        return torch.stack([torch.nn.functional.pad(x, (0, R - x.numel())) for x in rows])

    with torch.no_grad():
        old = padded([torch.tensor(s.logprobs) for s in samples])
        ref = padded([plain_logprobs(reference, t, p, r, TEMPERATURE)[0] for t, p, r in seqs])
        score = torch.stack([stage_forward(reward, t)[0, p + r - 1] for t, p, r in seqs]) if scores is None else scores
        old_values = padded([stage_forward(critic, t)[0, p - 1:p - 1 + r] for t, p, r in seqs])
    mask = padded([torch.tensor(s.loss_mask or [1] * len(s.tokens), dtype=torch.float32) for s in samples])
    rewards = -PPO.kl_coef * (old - ref) * mask
    for i, (_, _, r) in enumerate(seqs):
        rewards[i, r - 1] += score[i]
    adv, returns = gae_loop(rewards, old_values, mask, PPO.gamma, PPO.lam)
    valid = mask > 0
    mean, var = adv[valid].mean(), adv[valid].var(unbiased=True)
    adv = torch.where(valid, (adv - mean) / torch.sqrt(var + 1e-8), torch.zeros_like(adv))

    a_opt = torch.optim.AdamW(actor.parameters(), lr=PPO.lr, betas=BETAS, weight_decay=0.0)
    c_opt = torch.optim.AdamW(critic.parameters(), lr=PPO.critic_lr, betas=BETAS, weight_decay=0.0)
    norms, losses = [], {"policy_loss": [], "entropy_loss": [], "value_loss": []}
    for _ in range(PPO.ppo_epochs):  # one mini-batch holds every sample
        new, entropy = (padded([x[0] for x in column]) for column in zip(*[_policy(actor, *seq) for seq in seqs]))
        ratio = torch.exp(new - old)
        surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - PPO.clip_eps, 1 + PPO.clip_eps))
        policy, bonus = _aggregate(surrogate, mask, agg), _aggregate(entropy, mask, agg)
        a_loss = policy - PPO.entropy_coef * bonus
        losses["policy_loss"].append(policy.item())
        losses["entropy_loss"].append(bonus.item())
        a_opt.zero_grad()
        a_loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(actor.parameters(), PPO.clip_grad)))
        a_opt.step()
        values = padded([stage_forward(critic, t)[0, p - 1:p - 1 + r] for t, p, r in seqs])
        clipped = old_values + (values - old_values).clamp(-PPO.value_clip, PPO.value_clip)
        v_loss = 0.5 * _aggregate(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask, agg)
        losses["value_loss"].append(v_loss.item())
        c_opt.zero_grad()
        v_loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(critic.parameters(), PPO.clip_grad)))
        c_opt.step()
    return {"actor": dict(actor.named_parameters()), "critic": dict(critic.named_parameters()), "norms": norms,
            "losses": {name: sum(values) / len(values) for name, values in losses.items()},  # the steps' mean
            "advantages": adv, "returns": returns, "scores": score, "ref_logprobs": ref, "values": old_values,
            "kl_mean": ((old - ref) * mask).sum(dim=1).mean().item()}


def _gathered(trainer, task: str) -> dict:
    """Full weights of ``task``'s model, merged from every rank's stage (collective)."""
    g = trainer.groups[task]
    mine = gather_tp_full_weights(trainer.models[task], g) if g is not None else {}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v.cpu() for part in parts for k, v in part.items()}  # .cpu(): comparable with CPU references


def run(root: str) -> dict:
    """The textbook comparison, then the resume comparison (checkpoints under ``root``)."""
    placement = Placement.from_plan(PLAN, dist.get_world_size())
    groups = build_task_groups(placement)  # collective; creates the one-rank groups rlhf.testing.models uses
    out, padded = _against_textbook(placement)
    out.update(_entropy_gradient(groups["actor_train"]))
    sequence_mean, _ = _against_textbook(placement, "seq-mean-token-mean")  # the critic's DP2 counts sequences
    out.update({f"seq_mean_{k}": v for k, v in sequence_mean.items()
                if k.endswith(("_max_diff", "_moved", "_vs_token_mean", "_losses", "metrics"))})
    out.update(_packed(placement, padded))
    multi_turn, _ = _against_textbook(placement, "seq-mean-token-sum-norm", holes=True)
    out.update({f"multi_turn_{k}": v for k, v in multi_turn.items()
                if k.endswith(("_max_diff", "_moved", "metrics", "_losses"))})
    out.update(_skip_nonfinite(placement))
    out.update(_skipped_steps_stop(placement))
    out.update(_planned())
    out.update(_resume(placement, root))
    out.update(_optimizer_paths(placement))
    out.update(_fusion(root))
    out.update(_critic_warmup(placement))
    out.update(_mixture_of_experts())
    out.update(_routing_replay(root))
    out.update(_moe_learns())
    return out


MOE_LEARNING_ITERATIONS = 12


def _moe_learns() -> dict:
    """The main job's trainer built from ``--actor-model tiny-moe --critic-model tiny-moe-critic --routing-replay
    --recompute-logprobs`` on the built-in plan of 4 ranks (EP2 in every task but generation), the synthetic
    task's gold rule as the reward: each iteration's metrics, and the plan's layouts."""
    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.job import build_trainer
    from rlhf.ppo.layout import build_placement

    config = parse_args(["--actor-model", "tiny-moe", "--critic-model", "tiny-moe-critic", "--routing-replay",
                         "--recompute-logprobs", "--iterations", str(MOE_LEARNING_ITERATIONS),
                         "--reward-fn", "rlhf.data.synthetic:gold_reward", "--no-progress"])
    placement = build_placement(config, dist.get_world_size())
    trainer = build_trainer(config, placement)
    return {"moe_learning": [{k: float(v) for k, v in trainer.step().metrics.items()}
                             for _ in range(MOE_LEARNING_ITERATIONS)],
            "moe_learning_plan": {task: str(mesh.strategy) for task, mesh in placement.meshes.items()}}


MOE_MODELS = tuple(replace(cfg, qk_norm=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
                   for cfg in (ACTOR, CRITIC))
"""ACTOR and CRITIC as mixtures of experts (QK-norm, 4 experts, top-2); no auxiliary loss, which textbook PPO
lacks (rlhf/models/moe.py weighs it per micro-batch, tests/scenario_optim.py checks the expert gradients)."""
MOE_PLAN = {
    "actor_train": {"ranks": "0-3", "dp": 2, "pp": 2, "ep": 2},
    "critic_train": {"ranks": "0-3", "dp": 4, "ep": 2},
    "actor_gen": {"ranks": "0-3", "tp": 2, "dp": 2},
    "ref_inf": {"ranks": [2, 3], "ep": 2},
    "reward_inf": {"ranks": [0, 1], "ep": 2},
    "critic_inf": {"ranks": "0-3", "tp": 2, "ep": 2},
}
"""Expert parallelism in every task that may have it (actor_gen's engine holds every expert)."""


def _moe_resume(trainer, trained: dict, full: dict, root: str) -> float:
    """``trainer`` saved under ``root`` and loaded into a fresh trainer on MOE_RESUME_PLAN (other ranks hold
    other experts): the largest difference of its actor's and critic's weights from ``trained``."""
    trainer.save(root)
    placement = Placement.from_plan({**MOE_PLAN, **MOE_RESUME_PLAN}, dist.get_world_size())
    loaded = synthetic_trainer(placement, full, mini_batch=8, model=MOE_SYNTHETIC, recompute_logprobs=True,
                               routing_replay=True)
    loaded.load(root)
    after = trained_weights(loaded)
    return max((after[m][k] - trained[m][k]).abs().max().item() for m in trained for k in trained[m])


def _mixture_of_experts() -> dict:
    """One iteration of MoE actor and critic on MOE_PLAN against textbook PPO on the same MoE modules."""
    placement = Placement.from_plan(MOE_PLAN, dist.get_world_size())
    build_task_groups(placement)
    out, _ = _against_textbook(placement, models=MOE_MODELS)
    return {f"moe_{k}": v for k, v in out.items() if k.endswith(("_max_diff", "_moved", "_losses", "metrics"))}


ENTROPY_SHAPE = dict(samples=4, positions=7, padded=2)
"""The entropy-gradient check's logits: 4 samples of 7 positions over ACTOR's vocabulary and 2 padded ids."""


def _entropy_gradient(g) -> dict:
    """ActorLoss (token-mean, entropy_coef 0.01, logits / TEMPERATURE) on random logits split over actor_train's
    TP group (ACTOR.vocab_size + 2 columns, the last two padding at -inf): the gradient w.r.t. this rank's slice
    against the same slice of the gradient of an unsharded loss written out (log_softmax over the real
    vocabulary), and how much the bonus moves that gradient."""
    n, width, padded = ENTROPY_SHAPE["samples"], ENTROPY_SHAPE["positions"], ENTROPY_SHAPE["padded"]
    gen = torch.Generator().manual_seed(9)
    full = torch.randn(n, width, ACTOR.vocab_size + padded, generator=gen)
    full[..., ACTOR.vocab_size:] = float("-inf")
    prompts, responses = torch.tensor([2, 3, 1, 2]), torch.tensor([3, 2, 5, 4])
    tokens = torch.randint(0, ACTOR.vocab_size, (n, width), generator=gen)
    batch = Batch(tokens=tokens, pad_id=0, prompt_lengths=prompts, response_lengths=responses,
                  prompt_ids=torch.arange(n), sample_indices=torch.zeros(n, dtype=torch.int64),
                  finish_reasons=("stop",) * n)
    mask = batch.response_mask.float()

    def written_out(logits: torch.Tensor, coef: float) -> torch.Tensor:
        logp = torch.log_softmax(logits[:, :-1, :ACTOR.vocab_size] / TEMPERATURE, -1)
        new = batch.response_from_positions(logp.gather(-1, tokens[:, 1:, None]).squeeze(-1))
        entropy = batch.response_from_positions(-(logp.exp() * logp).sum(-1))
        ratio = torch.exp(new - batch.old_logprobs)
        surrogate = torch.maximum(-batch.advantages * ratio, -batch.advantages * ratio.clamp(0.8, 1.2))
        return ((surrogate - coef * entropy) * mask).sum() / mask.sum()

    with torch.no_grad():
        exact = batch.response_from_positions(
            torch.log_softmax(full[:, :-1, :ACTOR.vocab_size] / TEMPERATURE, -1).gather(-1, tokens[:, 1:, None])
            .squeeze(-1))
    batch = batch.with_fields(old_logprobs=exact + 0.3 * torch.randn(exact.shape, generator=gen) * mask,
                              advantages=torch.randn(exact.shape, generator=gen) * mask)
    grads = {}
    for coef in (0.01, 0.0):
        logits = full.clone().requires_grad_()
        written_out(logits, coef).backward()
        grads[coef] = logits.grad
    tp, rank = g.tp.size(), g.tp_rank
    vocab = full.shape[-1] // tp
    mine = full[..., rank * vocab:(rank + 1) * vocab].clone().to(platform.device()).requires_grad_()
    loss = ActorLoss(replace(PPO, entropy_coef=0.01), NORM_LENGTH, TEMPERATURE, 0.0)
    loss(mine, batch.to(platform.device()), g, None, float(mask.sum()), 1).backward()
    want = grads[0.01][..., rank * vocab:(rank + 1) * vocab]
    return {f"entropy_grad_diff_rank{dist.get_rank()}": (mine.grad.cpu() - want).abs().max().item(),
            "entropy_grad_effect": (grads[0.01] - grads[0.0]).abs().max().item(),
            "entropy_grad_finite": bool(mine.grad.isfinite().all()), "entropy_tp": tp}


def _critic_warmup(placement) -> dict:
    """``critic_warmup=1``: the first iteration trains the critic alone (the actor stays where it started),
    the second trains both. Per iteration: how far each model moved and whether a policy loss was logged."""
    full = synthetic_weights(51)
    trainer = synthetic_trainer(placement, full, mini_batch=8, critic_warmup=1)
    out = {}
    for iteration in (1, 2):
        before = trained_weights(trainer)
        metrics = trainer.step().metrics
        after = trained_weights(trainer)
        out[f"warmup_{iteration}"] = {
            "policy_loss_logged": "policy_loss" in metrics, "value_loss_logged": "value_loss" in metrics,
            **{f"{m}_moved": max((after[m][k] - before[m][k]).abs().max().item() for k in after[m]) for m in after}}
    return out


def learn_fixed_samples(placement, agg: str = "token-mean", precision: PrecisionConfig = PrecisionConfig(),
                        max_tokens: int | None = None, holes: bool = False, reward_fn=None,
                        models=(ACTOR, CRITIC)) -> tuple:
    """One ``Trainer.learn`` on the fixed samples: (initial full weights, samples, result, trained full weights).
    ``max_tokens``: packed micro-batches of that many tokens (--max-tokens-per-microbatch); ``holes``:
    multi-turn samples (`_samples`); ``reward_fn``: the samples' scores instead of the reward model's, with
    --skip-nonfinite-samples, and a reference of its own weights (a KL that is not 0); ``models``: the actor's
    and the critic's (and the reward model's) shapes."""
    actor_cfg, critic_cfg = models
    generation = GenerationConfig(temperature=TEMPERATURE)
    if max_tokens is not None:  # the budget must hold the longest sample the lengths allow
        generation = replace(generation, max_prompt_len=max(PROMPTS), max_response_len=max(RESPONSES))
    reward = RewardConfig() if reward_fn is None else RewardConfig(reward_fn=f"{__name__}:{reward_fn.__name__}",
                                                                      skip_nonfinite_samples=True)
    config = JobConfig(models=ModelsConfig(actor=actor_cfg, critic=critic_cfg), run=RunConfig(iterations=1, seed=3),
                       generation=generation, ppo=replace(PPO, loss_agg=agg, max_tokens_per_microbatch=max_tokens),
                       precision=precision, reward=reward)
    full = {"actor": full_weights("lm", actor_cfg, 101), "critic": full_weights("value", critic_cfg, 202),
            "reward": full_weights("value", critic_cfg, 303)}
    if reward_fn is not None:
        full["reference"] = full_weights("lm", actor_cfg, 404)
    samples = _samples(unsharded("lm", actor_cfg, full["actor"]), holes)
    trainer = Trainer(config, placement, prompts=None, tokenizer=None, initial_weights=full, reward_fn=reward_fn)
    batch = Batch.from_samples(samples, pad_id=0, prompt_ids={str(i): i for i in range(len(PROMPTS))})
    result = trainer.learn(batch)
    return full, samples, result, trained_weights(trainer)


def _against_textbook(placement, agg: str = "token-mean", max_tokens: int | None = None,
                      holes: bool = False, models=(ACTOR, CRITIC)) -> tuple[dict, dict]:
    """The differences of one iteration on the fixed samples from the textbook's, and its trained weights."""
    full, samples, result, after = learn_fixed_samples(placement, agg, max_tokens=max_tokens, holes=holes,
                                                       models=models)
    out = {"rank": dist.get_rank(), "metrics": {k: float(v) for k, v in result.metrics.items()}}
    if dist.get_rank() == 0:
        ref = _textbook_iteration(full, samples, agg, models=models)
        for name in ("actor", "critic"):
            out[f"{name}_max_diff"] = max((after[name][k] - ref[name][k]).abs().max().item() for k in ref[name])
            out[f"{name}_moved"] = max((after[name][k] - full[name][k]).abs().max().item() for k in ref[name])
        out["smallest_grad_norm"] = min(ref["norms"])
        out["textbook_losses"] = ref["losses"]
        out["grad_norms"] = {"actor": sum(ref["norms"][0::2]) / PPO.ppo_epochs,  # the steps' mean, as logged
                             "critic": sum(ref["norms"][1::2]) / PPO.ppo_epochs}
        for field in ("advantages", "returns", "scores", "ref_logprobs", "values"):
            out[f"{field}_max_diff"] = (getattr(result.batch, field) - ref[field]).abs().max().item()
        if agg != "token-mean":  # how far this aggregation's textbook update is from token-mean's
            token_mean = _textbook_iteration(full, samples)
            for name in ("actor", "critic"):
                out[f"{name}_vs_token_mean"] = max((ref[name][k] - token_mean[name][k]).abs().max().item()
                                                   for k in ref[name])
    return out, after


NON_FINITE = {1: float("nan"), 4: float("inf")}
"""The samples `some_non_finite` scores NaN and infinity (--skip-nonfinite-samples drops them)."""


def some_non_finite(prompts: list, responses: list) -> list:
    """A reward function: each response's mean token id / vocabulary size, but NON_FINITE's scores at its samples."""
    scores = [sum(r) / len(r) / ACTOR.vocab_size for r in responses]
    return [NON_FINITE.get(i, score) for i, score in enumerate(scores)]


def _skip_nonfinite(placement) -> dict:
    """--skip-nonfinite-samples on the fixed samples scored by `some_non_finite`: the trained weights against textbook
    PPO on the six finite-scored samples alone, and so the advantages, returns, kl_mean and reward_mean (the dropped
    samples' advantages and returns: 0)."""
    full, samples, result, after = learn_fixed_samples(placement, reward_fn=some_non_finite)
    out = {"metrics": {k: float(v) for k, v in result.metrics.items()}}
    if dist.get_rank() == 0:
        kept = [i for i in range(len(samples)) if i not in NON_FINITE]
        scores = torch.tensor([some_non_finite([], [s.tokens for s in samples])[i] for i in kept])
        ref = _textbook_iteration(full, [samples[i] for i in kept], scores=scores)
        for name in ("actor", "critic"):
            out[f"{name}_max_diff"] = max((after[name][k] - ref[name][k]).abs().max().item() for k in ref[name])
            out[f"{name}_moved"] = max((after[name][k] - full[name][k]).abs().max().item() for k in ref[name])
        for field in ("advantages", "returns"):
            got = getattr(result.batch, field)
            out[f"{field}_max_diff"] = (got[kept, :ref[field].shape[1]] - ref[field]).abs().max().item()
            out[f"dropped_{field}_max"] = got[list(NON_FINITE)].abs().max().item()
        out.update(kl_mean=ref["kl_mean"], reward_mean=scores.mean().item())
    return {f"skip_{k}": v for k, v in out.items()}


def _skipped_steps_stop(placement) -> dict:
    """A reference whose weights are NaN: the KL in the rewards, so every advantage and return, is NaN, and every
    step of both models is skipped (2 an iteration). ``train()`` with --max-skipped-steps 3: the error each rank
    raised, the iteration it stopped after and how far the weights moved."""
    full = synthetic_weights(61)
    full["reference"] = {k: torch.full_like(v, float("nan")) for k, v in full["actor"].items()}
    trainer = synthetic_trainer(placement, full, mini_batch=4, max_skipped_steps=3)
    error = None
    try:
        trainer.train()
    except ConfigError as exc:
        error = (exc.field_name, str(exc))
    after = trained_weights(trainer)
    return {"skip_stop": {"error": error, "iteration": trainer.iteration,
                          "moved": max((after[m][k] - full[m][k]).abs().max().item() for m in after for k in after[m])}}


PACKED_BUDGET = 16
"""Tokens per packed micro-batch: the samples' 5 to 13 tokens make micro-batches of one or two samples, so
the critic's two DP replicas run different numbers of them."""


def _packed(placement, padded: dict) -> dict:
    """The iteration with packed micro-batches (--max-tokens-per-microbatch): against textbook PPO, and its
    trained weights against the padded run's ``padded``."""
    out, after = _against_textbook(placement, max_tokens=PACKED_BUDGET)
    if dist.get_rank() == 0:
        out.update({f"{name}_vs_padded": max((after[name][k] - padded[name][k]).abs().max().item()
                                             for k in padded[name]) for name in padded})
    return {f"packed_{k}": v for k, v in out.items() if k.endswith(("_max_diff", "_moved", "_vs_padded", "metrics"))}


def _planned() -> dict:
    """The placement tools/plan_placement.py would write for this job on 4 CPU ranks (the search with the
    constants docs/planner.md's run 7 calibrated), against textbook PPO like PLAN, with --loss-agg
    seq-mean-token-sum."""
    from rlhf.planner.cost import Cluster, Workload
    from rlhf.planner.hardware import HARDWARE_PRESETS
    from rlhf.planner.placement_search import PlacementSearchConfig, search_placements

    hw = replace(HARDWARE_PRESETS["cpu"], shared_cores=2, layer_overhead_s=3.35e-4, collective_latency_s=8.94e-4,
                 call_overhead_s=1.17e-3, update_overhead_s=4.97e-3)
    samples = PPO.rollout_batch_size * PPO.n_samples_per_prompt
    workload = Workload(samples, max(PROMPTS), max(RESPONSES), samples // PPO.ppo_mini_batch_size,
                        PPO.micro_batch_size, PPO.ppo_epochs)
    models = {"actor": ACTOR, "reference": ACTOR, "critic": CRITIC, "reward": CRITIC}
    plan = search_placements(models, workload, hw, Cluster(1, dist.get_world_size()),
                             PlacementSearchConfig(fuse_training=True)).best
    placement = Placement.from_plan(plan.plan.placement(), dist.get_world_size())
    out, _ = _against_textbook(placement, "seq-mean-token-sum")
    return {f"planned_{k}": v for k, v in out.items() if k.endswith(("_max_diff", "_moved", "_losses", "metrics"))} | {
        "planned_plan": plan.plan.describe(),
        "planned_like_plan": placement.meshes == Placement.from_plan(PLAN, dist.get_world_size()).meshes}


def trained_weights(trainer) -> dict:
    return {name: _gathered(trainer, task) for name, task in (("actor", "actor_train"), ("critic", "critic_train"))}


RESUME_MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                           vocab_size=320, max_seq_len=32)  # holds the byte tokenizer's 259 ids


def synthetic_weights(seed: int) -> dict:
    """Full actor, critic and reward weights of RESUME_MODEL drawn from seeds ``seed``, +1, +2."""
    return {"actor": full_weights("lm", RESUME_MODEL, seed), "critic": full_weights("value", RESUME_MODEL, seed + 1),
            "reward": full_weights("value", RESUME_MODEL, seed + 2)}


def synthetic_trainer(placement, full: dict, mini_batch: int, fusion: FusionConfig = FusionConfig(),
                      checkpoint: CheckpointConfig = CheckpointConfig(), temperature: float = 1.0,
                      memory: MemoryConfig = MemoryConfig(), precision: PrecisionConfig = PrecisionConfig(),
                      lora: AdaptersConfig = AdaptersConfig(), sources: dict | None = None, cuda_graphs: bool = False,
                      model: ModelConfig = RESUME_MODEL, **optimizer) -> Trainer:
    """A fresh trainer of the synthetic task (4 prompts x 2 samples, adaptive KL) from the same weights
    (``sources``: the directories the config names as where they came from, which a LoRA checkpoint records);
    every model of shape ``model``; ``optimizer``: more PPOConfig fields."""
    models = ModelsConfig(actor=model, critic=model, weights=sources or {})
    config = JobConfig(models=models, run=RunConfig(iterations=4, seed=5),
                       generation=GenerationConfig(max_prompt_len=8, max_response_len=6, temperature=temperature,
                                                   cuda_graphs=cuda_graphs),
                       ppo=PPOConfig(rollout_batch_size=4, n_samples_per_prompt=2, ppo_mini_batch_size=mini_batch,
                                     micro_batch_size=2, kl_coef=0.05, kl_target=0.5, **optimizer),
                       fusion=fusion, checkpoint=checkpoint, memory=memory, precision=precision, lora=lora)
    prompts = PromptBatchIterator(SyntheticPromptDataset(SyntheticPromptConfig(seed=5, max_length=8)), 4, seed=5)
    return Trainer(config, placement, prompts, ByteTokenizer(), initial_weights=full, reward_fn=gold_reward)


RESUME_OPTIMIZER = dict(use_distributed_optimizer=True, lr_warmup_iters=2, lr_decay_style="cosine", lr_decay_iters=12)
"""The resume check also covers the sharded optimizer state and a schedule in the middle of its decay."""


MOE_SYNTHETIC = replace(RESUME_MODEL, qk_norm=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, init_std=0.15,
                        moe_aux_loss_coeff=0.01)
ROUTER_SCALE, ROUTER_NOISE = 0.01, 1e-4
"""The actor's router weights are scaled by ROUTER_SCALE (near-even routing: close seconds and thirds), and
actor_gen's copy gets noise of std ROUTER_NOISE after each weight sync: a few choices flip, as rounding flips
them between engine and trainer, and the routing probabilities barely move."""


MOE_RESUME_PLAN = {"actor_train": {"ranks": "0-3", "dp": 4, "ep": 4}, "critic_train": {"ranks": "0-3", "dp": 4}}
"""Another expert layout to load MOE_PLAN's checkpoint into (EP4 actor, critic without expert parallelism)."""


def _routing_replay(root: str) -> dict:
    """One iteration of the synthetic task with MoE models (MOE_SYNTHETIC) on MOE_PLAN and --recompute-logprobs,
    actor_gen's routers perturbed after the weight sync so that the engine and the trainer pick other experts
    for some tokens: mismatch_kl, routing_agreement and the load-balancing loss with and without
    --routing-replay, and the actor's router weights after it with the load-balancing loss and without. The
    replayed run is saved (under ``root``) and loaded into MOE_RESUME_PLAN's layout: the weights' differences."""
    from rlhf.models import moe

    placement = Placement.from_plan(MOE_PLAN, dist.get_world_size())
    build_task_groups(placement)
    full = {"actor": full_weights("lm", MOE_SYNTHETIC, 61), "critic": full_weights("value", MOE_SYNTHETIC, 62),
            "reward": full_weights("value", MOE_SYNTHETIC, 63)}
    full["actor"] = {k: v * ROUTER_SCALE if k.endswith("router.weight") else v for k, v in full["actor"].items()}
    out, routers, actors = {}, {}, {}
    for run, replay, coeff in (("replay", True, 0.01), ("no_replay", False, 0.01), ("no_aux", True, 0.0)):
        trainer = synthetic_trainer(placement, full, mini_batch=8, model=replace(MOE_SYNTHETIC, moe_aux_loss_coeff=coeff),
                                    recompute_logprobs=True, routing_replay=replay)
        trainer.sync_generation_weights()
        if "actor_gen" in trainer.models:
            noise = torch.Generator().manual_seed(7)  # the same on every TP rank: the router is replicated
            for _, router in moe.routers(trainer.models["actor_gen"]):
                router.weight.data += torch.randn(router.weight.shape, generator=noise) * ROUTER_NOISE
        metrics = trainer.learn(trainer.generate(next(trainer.prompts)).batch).metrics
        out[f"moe_{run}_metrics"] = {k: float(v) for k, v in metrics.items()}
        trained = trained_weights(trainer)
        routers[run] = {k: v for k, v in trained["actor"].items() if k.endswith("router.weight")}
        actors[run] = trained["actor"]
        if run == "replay":
            out["moe_resume_diff"] = _moe_resume(trainer, trained, full, os.path.join(root, "moe"))
    out["moe_replay_vs_plain"] = max((actors["replay"][k] - actors["no_replay"][k]).abs().max().item()
                                     for k in actors["replay"])
    out["moe_aux_router_diff"] = max((routers["replay"][k] - routers["no_aux"][k]).abs().max().item()
                                     for k in routers["replay"])
    return out


def _optimizer_paths(placement) -> dict:
    """2 iterations with megatron's distributed optimizer, and with it and overlapped gradient reduction,
    against the plain optimizer: the largest parameter differences (critic_train is DP2)."""
    full = synthetic_weights(41)
    runs = {}
    for name, options in (("plain", {}), ("distributed", {"use_distributed_optimizer": True}),
                          ("overlapped", {"use_distributed_optimizer": True, "overlap_grad_reduce": True})):
        trainer = synthetic_trainer(placement, full, mini_batch=8, **options)  # 2 micro-batches per critic replica
        for _ in range(2):
            trainer.step()
        runs[name] = trained_weights(trainer)
    plain = runs.pop("plain")
    out = {"optimizer_moved": max((plain[m][k] - full[m][k]).abs().max().item() for m in plain for k in plain[m])}
    for name, weights in runs.items():
        out[f"{name}_param_diff"] = max((weights[m][k] - plain[m][k]).abs().max().item() for m in plain for k in plain[m])
    return out


def _resume(placement, root: str) -> dict:
    """4 iterations straight vs 2, save, and 2 more in a fresh trainer that loads: metrics and weights."""
    full = synthetic_weights(11)
    straight = synthetic_trainer(placement, full, mini_batch=4, **RESUME_OPTIMIZER)
    metrics = [straight.step().metrics for _ in range(4)]
    first = synthetic_trainer(placement, full, mini_batch=4, checkpoint=CheckpointConfig(save_format="torch_dist"),
                              **RESUME_OPTIMIZER)
    for _ in range(2):
        first.step()
    released = _memory_release(placement, full, first, metrics[:2])
    first.save(root)
    saved_actor = trained_weights(first)["actor"]
    megatron_diff = None
    if dist.get_rank() == 0:  # the Megatron-LM copy holds the same actor
        exported = read_megatron_state(open_megatron(f"{root}/{MEGATRON_EXPORT_DIR}"))
        assert sorted(exported) == sorted(saved_actor)
        megatron_diff = max((exported[k] - saved_actor[k]).abs().max().item() for k in saved_actor)
    resumed = synthetic_trainer(placement, full, mini_batch=4, checkpoint=CheckpointConfig(save=root, keep_last=2),
                                **RESUME_OPTIMIZER)
    resumed.load(root)
    loaded_at = resumed.iteration
    metrics_resumed = []
    for _ in range(2):  # saving after each (--keep-last 2): iterations 3 and 4 are kept, 2 is deleted
        metrics_resumed.append(resumed.step().metrics)
        resumed.save(root)
    a, b = trained_weights(straight), trained_weights(resumed)
    return {"loaded_at": loaded_at, "straight_metrics": metrics[2:], "resumed_metrics": metrics_resumed,
            "kept_checkpoints": list_checkpoints(root),
            "resume_param_diff": max((a[m][k] - b[m][k]).abs().max().item() for m in a for k in a[m]),
            "kl_coefs": [m["kl_coef"] for m in metrics], "megatron_export_diff": megatron_diff, **released}


def _memory_release(placement, full: dict, kept, kept_metrics: list) -> dict:
    """2 iterations with the reference and reward offloaded and actor_gen's memory released, against
    ``kept`` (the same run with both off, 2 iterations done): metrics, weights and this rank's bytes."""
    lean = synthetic_trainer(placement, full, mini_batch=4, **RESUME_OPTIMIZER,
                             memory=MemoryConfig(offload_ref_reward=True, release_generation_memory=True))
    lean_metrics = [lean.step().metrics for _ in range(2)]
    a, b = trained_weights(kept), trained_weights(lean)
    offloaded = [kept.models[t] for t in FROZEN_TASKS if t in kept.models]
    try:  # released after the last generation: generating again needs the reshard first
        lean.generate(next(lean.prompts))
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return {"lean_metrics": lean_metrics, "kept_metrics": kept_metrics, "generate_refused": refused,
            "lean_param_diff": max((a[m][k] - b[m][k]).abs().max().item() for m in a for k in a[m]),
            "lean_bytes": lean.memory.last, "kept_bytes": kept.memory.last,
            "generation_bytes": lean.memory.generation.nbytes,
            "offloaded_bytes": sum(n for m in offloaded for n in storage_bytes(module_tensors(m)).values())}


FUSED_PLAN = {"actor_train": {"ranks": "0-3", "dp": 2, "pp": 2},
              "critic_train": {"ranks": "0-3", "dp": 2, "pp": 2, "reverse_pp": True}}
"""Actor down and critic up on the same ranks with the same TP: what a fused schedule runs on."""


def _fusion(root: str) -> dict:
    """2 iterations with a searched (annealed) fused actor/critic schedule vs 2 with serial 1F1B: parameters;
    and the fused schedule with packed micro-batches."""
    placement = Placement.from_plan(FUSED_PLAN, dist.get_world_size())
    full = synthetic_weights(21)
    path = f"{root}/fused.json"
    if dist.get_rank() == 0:  # 8 samples, one mini-batch: 2 micro-batches per replica and model
        specs = tuple(ModelSpec(name, 2, 1, 2, direction, [1.0, 1.0], [2.0, 2.0], [1.0, 1.0])
                      for name, direction in (("actor", "down"), ("critic", "up")))
        result = search(Problem(2, specs), SearchConfig(budget_s=0.05, memory_budget_s=0.02))
        assert result.orders != serial_1f1b(result.problem)  # a fused order, not the serial baseline
        save_schedule(path, result.schedule)
    dist.barrier()
    serial = synthetic_trainer(placement, full, mini_batch=8)
    fused = synthetic_trainer(placement, full, mini_batch=8, fusion=FusionConfig(intra_stage_fusion=True, schedule=path))
    searched = synthetic_trainer(placement, full, mini_batch=8,
                                  fusion=FusionConfig(intra_stage_fusion=True, search_budget=0.05),
                                  checkpoint=CheckpointConfig(save=f"{root}/searched"))
    # packed: the schedule's 2 micro-batches per replica, balanced by tokens, each within 2 x 14 tokens
    packed = synthetic_trainer(placement, full, mini_batch=8, fusion=FusionConfig(intra_stage_fusion=True, schedule=path),
                               max_tokens_per_microbatch=28)
    for _ in range(2):
        serial_metrics, fused_metrics = serial.step().metrics, fused.step().metrics
        searched_metrics = searched.step().metrics
        packed.step()
    searched.save(f"{root}/searched")
    resumed = synthetic_trainer(placement, full, mini_batch=8, fusion=searched.config.fusion)
    resumed.load(f"{root}/searched")  # takes the cached schedule: no second measurement
    a, b, c, d = (trained_weights(t) for t in (serial, fused, searched, packed))
    return {"fused_param_diff": max((a[m][k] - b[m][k]).abs().max().item() for m in a for k in a[m]),
            "packed_fused_param_diff": max((a[m][k] - d[m][k]).abs().max().item() for m in a for k in a[m]),
            "searched_param_diff": max((a[m][k] - c[m][k]).abs().max().item() for m in a for k in a[m]),
            "searched_schedule": searched.ppo_update.fused is not None and searched.ppo_update.fused.model_names,
            "cached_schedule_reused": (not resumed.ppo_update.measuring
                                       and resumed.ppo_update.fused == searched.ppo_update.fused),
            "fused_moved": max((a[m][k] - full[m][k]).abs().max().item() for m in a for k in a[m]),
            "fused_value_loss": (serial_metrics["value_loss"], fused_metrics["value_loss"]),
            "bubble": (serial_metrics["training_bubble_fraction"], searched_metrics["training_bubble_fraction"])}

