"""4-rank scenario for asynchronous iterations (--max-staleness K): actor_gen on ranks 0-1, the rest on 2-3.

Exactly once: an epoch of 12 prompts (6 iterations of 2 prompts x 2 samples) runs straight, and again as
3 iterations, a save, and a fresh trainer that loads and runs the other 3, for K = 0, 1 and 2; the reward
function records every prompt it scores on each rank (it scores each trained sample once: on rank 0 when
synchronous, on the learners' first rank otherwise).
Off-policy correction: with the policy frozen (learning rate 1e-12) K = 1 runs with and without
--tis-cap, whose losses must agree; with a learning rate the weights of the corrected run must move off 1.
Partial rollouts (--partial-rollouts, K = 2, "p2", generation as one TP2 replica, learning rates 1e-12,
long-tailed lengths up to 16): the same epoch straight, with generation slowed (a sleep per engine step) so
that samples are in flight when the weights of an update arrive and the learners infer streamed samples
while they wait, and with a save and load.
Learning: the tiny default job as pretrain_rlhf.py builds it from the flags (parse_args, build_placement,
build_trainer; the gold rule as its reward function) with K = 1 and 2, 20 iterations each: K = 1 with no
placement flag (the built-in asynchronous plan), K = 2 with APART's flags.
"""

import time

from rlhf.config import CheckpointConfig, RunConfig
from rlhf.data import ByteTokenizer, PromptBatchIterator
from rlhf.data.synthetic import SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
from rlhf.models import ModelConfig
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.ppo.arguments import parse_args
from rlhf.ppo.config import GenerationConfig, JobConfig, ModelsConfig, PPOConfig, RewardConfig
from rlhf.ppo.job import build_trainer
from rlhf.ppo.layout import build_placement
from rlhf.ppo.trainer import Trainer
from rlhf.testing.models import full_weights

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                    vocab_size=320, max_seq_len=32)  # holds the byte tokenizer's 259 ids
PLAN = {"actor_gen": {"ranks": [0, 1], "dp": 2},
        "actor_train": {"ranks": [2, 3], "pp": 2},
        "critic_train": {"ranks": [2, 3], "pp": 2, "reverse_pp": True},
        "ref_inf": {"ranks": [2, 3]}, "reward_inf": {"ranks": [2, 3]}, "critic_inf": {"ranks": [2, 3], "tp": 2}}
APART = ["--actor-gen", "tp=1,dp=2,ranks=0-1", "--actor-train", "tp=1,pp=2,ranks=2-3",
         "--critic-train", "dp=1,pp=2,ranks=2-3,reverse_pp", "--ref-inf", "ranks=2-3", "--reward-inf", "ranks=2-3",
         "--critic-inf", "tp=1,ranks=2-3"]
"""The tiny default's tasks with generation on ranks 0-1 and everything else on 2-3 (pretrain_rlhf.py flags)."""
LEARNING_ITERATIONS = 20
PLACEMENT = Placement.from_plan(PLAN, 4)
TP2_GENERATION = Placement.from_plan({**PLAN, "actor_gen": {"ranks": [0, 1], "tp": 2}}, 4)
WEIGHTS: dict = {}  # the actor's and critic's full weights, drawn once by run()
PROMPTS, PER_ITERATION = 12, 2


class Recorder:
    """gold_reward that keeps every prompt it scored (as a tuple of ids)."""

    def __init__(self):
        self.prompts: list = []

    def __call__(self, prompts: list, responses: list) -> list:
        self.prompts.extend(tuple(p) for p in prompts)
        return gold_reward(prompts, responses)


def dataset():
    return SyntheticPromptDataset(SyntheticPromptConfig(num_prompts=PROMPTS, seed=3, max_length=8))


def trainer(staleness: int, iterations: int, reward_fn, root: str | None = None, placement=PLACEMENT,
            long_tail_median: int = 0, **ppo) -> Trainer:
    """A fresh trainer of 2 prompts x 2 samples per iteration from fixed weights (no reward model: the
    function's score is the reward); responses of at most 6 tokens, or with ``long_tail_median`` of
    lognormal lengths up to 16."""
    options = dict(rollout_batch_size=PER_ITERATION, n_samples_per_prompt=2, ppo_mini_batch_size=4,
                   micro_batch_size=2, lr=1e-3, max_staleness=staleness)
    config = JobConfig(models=ModelsConfig(actor=MODEL, critic=MODEL), run=RunConfig(iterations=iterations, seed=7),
                       generation=GenerationConfig(max_prompt_len=8, max_response_len=16 if long_tail_median else 6,
                                                   long_tail_median=long_tail_median),
                       ppo=PPOConfig(**{**options, **ppo}), reward=RewardConfig(reward_fn="test:recorder"),
                       checkpoint=CheckpointConfig(save=root))
    prompts = PromptBatchIterator(dataset(), PER_ITERATION, seed=7)
    return Trainer(config, placement, prompts, ByteTokenizer(), initial_weights=WEIGHTS, reward_fn=reward_fn)


def slowed(step, seconds: float):
    """An engine's ``step`` that sleeps first: generation slower than training."""
    def slow_step():
        time.sleep(seconds)
        return step()
    return slow_step


def iterations(t: Trainer, reinfer: bool = False) -> list[dict]:
    """Step ``t`` to its last iteration: each one's metrics, with whether every sample's policy versions
    never decrease along its tokens (``versions_ordered``) and, with ``reinfer`` (an asynchronous run), on
    the learners how far the batch's inference fields (some inferred in streaming rounds) are from
    inferring the whole batch again now (``inference_diff``; at learning rate 1e-12 the weights have not
    moved since)."""
    out = []
    while t.iteration < t.config.run.iterations:
        result = t.step()
        batch, mask = result.batch, result.batch.response_mask
        versions = batch.policy_versions
        ordered = versions is None or bool((versions[:, 1:] >= versions[:, :-1]).logical_or(mask[:, 1:] == 0).all())
        diff = 0.0
        if reinfer and t.groups["actor_gen"] is None:
            scorer, t.reward_fn = t.reward_fn, gold_reward  # the recorder counts the epoch's scoring alone
            again = t.infer(batch)
            t.reward_fn = scorer
            diff = max(float(((getattr(again, f) - getattr(batch, f)) * mask).abs().max())
                       for f in ("ref_logprobs", "values", "old_logprobs"))
        out.append({**result.metrics, "versions_ordered": ordered, "inference_diff": diff})
    return out


def exactly_once(name: str, k: int, root: str, slow: bool = False, **options) -> dict:
    """The prompts the reward function scored over the epoch straight (and the metrics) and over a run saved
    and loaded halfway."""
    straight = Recorder()
    t = trainer(k, PROMPTS // PER_ITERATION, straight, **options)
    if slow and t.engine is not None:
        t.engine.step = slowed(t.engine.step, 0.15)
    metrics = iterations(t, reinfer=slow)
    resumed = Recorder()
    first = trainer(k, PROMPTS // PER_ITERATION // 2, resumed, root=f"{root}/{name}", **options)
    first.train()
    second = trainer(k, PROMPTS // PER_ITERATION, resumed, **options)
    second.load(f"{root}/{name}")
    second.train()
    return {"straight": straight.prompts, "resumed": resumed.prompts, "metrics": metrics}


def run(root: str) -> dict:
    global WEIGHTS
    build_task_groups(PLACEMENT)  # the process groups the weights are drawn with
    WEIGHTS = {"actor": full_weights("lm", MODEL, 21), "critic": full_weights("value", MODEL, 22)}
    out = {"dataset": [tuple(p.token_ids) for p in dataset()]}
    for k in (0, 1, 2):
        out[k] = exactly_once(f"k{k}", k, root)
    out["p2"] = exactly_once("p2", 2, root, slow=True, partial_rollouts=True, placement=TP2_GENERATION, lr=1e-12,
                             critic_lr=1e-12, long_tail_median=4)
    for name, options in (("frozen", dict(lr=1e-12)), ("frozen_corrected", dict(lr=1e-12, tis_cap=2.0)),
                          ("corrected", dict(tis_cap=2.0))):
        t = trainer(1, 3, Recorder(), **options)
        out[name] = [t.step().metrics for _ in range(3)]
    for k, placement_flags in ((1, []), (2, APART)):  # K = 1: the built-in asynchronous plan, no placement flags
        config = parse_args([*placement_flags, "--max-staleness", str(k), "--iterations", str(LEARNING_ITERATIONS),
                             "--reward-fn", "rlhf.data.synthetic:gold_reward", "--no-progress"])
        t = build_trainer(config, build_placement(config, 4))
        out[f"learning_k{k}"] = [t.step().metrics for _ in range(LEARNING_ITERATIONS)]
    return out
