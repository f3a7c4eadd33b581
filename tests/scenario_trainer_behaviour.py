"""4-rank scenario for trainer behaviour beyond tests/scenario_trainer.py's one iteration on given samples.

One launch on the built-in 4-rank plan (``rlhf.config.DEFAULT_PLANS[4]``:
actor_gen TP2xDP2, actor_train TP2xPP2, ref and reward TP1 on rank pairs),
the tiny presets, the byte tokenizer and the synthetic prompts, 4 prompts x
4 samples of at most 8 tokens. Two trainers, both without a critic:

- GRPO with ``recompute_logprobs`` and an adaptive KL coefficient, three
  iterations. Iteration 1 is ``step()`` taken apart (reshard, ``generate``,
  ``learn``) to keep the engine's batch; ``learn`` gets it with its old
  log-probs zeroed, so the recomputed ones can only come from actor_train.
  Rank 0 recomputes the engine's samples' log-probs with an unsharded actor
  from the same start weights (plain log-softmax).
- REINFORCE++ (gamma 0.9), one ``step()``.
- The RL semantics of issue #26, one ``step()`` each from the same weights and seed: GRPO with its KL in
  the loss at two coefficients (the update must differ); REINFORCE++ sampling at T=0.3 and T=1.0 (the
  entropy of the tempered policy must be lower at 0.3); and the on-policy gates on one mini-batch with
  recomputed log-probs (the first update starts at ratio 1 and approximate KL 0, and the engine's
  log-probs equal the trainer's, so truncated importance sampling weighs every token 1).
- The entropy bonus: GRPO with --entropy-coef 0.5 from the same weights and seed as the coefficient-0 run (the
  update must differ).
- Multi-turn rewards: GRPO (its KL in the loss), one ``step()`` on two-turn episodes of an environment
  rewarding turn 1 only (`TurnOneRewarded`: its length / 8) and one rewarding every turn 1 alike
  (`TurnOneConstant`: 1.0); the test computes GRPO's advantages from the definitions.
- An agent in the loop (``--agent``, `two_turn_agent`): GRPO, one ``step()``, 16 episodes of two chat
  requests each through the per-episode endpoints of actor_gen's two TP2 replicas, the reward the
  second reply's length; then a step whose agent raises on one replica (`failing_agent`): every rank
  must stop with its message.

Start weights are made here: the actor's with EOS made likely (so responses
end at different lengths), a reference of another seed (so the KL penalty is
not 0) and a random reward model. Rank 0 returns the batches and metrics; the
test compares them with references written in the test.
"""

import math

import torch
import torch.distributed as dist

from rlhf.config import RunConfig
from rlhf.ppo.config import GenerationConfig, JobConfig, ModelsConfig, PPOConfig
from rlhf.ppo.layout import DEFAULT_PLANS
from rlhf.data import ByteTokenizer, PromptBatchIterator
from rlhf.data.synthetic import SyntheticPromptConfig, SyntheticPromptDataset, gold_reward
from rlhf.envs.environment import Environment, EnvironmentStep, ModelTurn
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups
from rlhf.testing.models import full_weights, plain_logprobs, unsharded
from rlhf.ppo.trainer import Trainer

MODELS = ModelsConfig()  # the tiny presets
GENERATION = GenerationConfig(max_response_len=8)
PPO = dict(rollout_batch_size=4, n_samples_per_prompt=4, ppo_mini_batch_size=8, micro_batch_size=2, kl_coef=0.1)
KL_TARGET = 2.0  # the first iterations' KL (about 2.1, then 0.5) exercise the controller unclipped, then clipped
EOS_PROBABILITY = 0.15
SEED = 7
FIELDS = ("tokens", "prompt_lengths", "response_lengths", "prompt_ids", "scores", "rollout_logprobs",
          "old_logprobs", "ref_logprobs", "advantages", "returns", "finish_reasons")
"""Batch fields rank 0 returns (as lists)."""


def _likely_eos(full: dict, eos_id: int, probability: float) -> dict:
    """The actor's full weights with EOS about ``probability`` likely at every position.

    Every token's embedding gets a constant 1 in column 0, which dominates the
    residual stream (the other entries are ~0.02), so after the final RMS norm
    that column is about sqrt(hidden) everywhere; the output layer reads it
    into the EOS logit only: logit_eos ~ log(probability / (1 - probability) * (vocab - 1)).
    """
    embedding, head = full["embedding.word_embeddings.weight"].clone(), full["output_layer.weight"].clone()
    vocab, hidden = head.shape
    embedding[:, 0] = 1.0
    head[eos_id, 0] = math.log(probability / (1 - probability) * (vocab - 1)) / math.sqrt(hidden)
    return {**full, "embedding.word_embeddings.weight": embedding, "output_layer.weight": head}


def _start_weights(eos_id: int) -> dict:
    """Full start weights of the actor, the reference and the reward model (same on every rank)."""
    return {"actor": _likely_eos(full_weights("lm", MODELS["actor"], 101), eos_id, EOS_PROBABILITY),
            "reference": full_weights("lm", MODELS["reference"], 202),
            "reward": full_weights("value", MODELS["reward"], 303)}


def _trainer(placement, weights: dict, generation: GenerationConfig = GENERATION, **ppo) -> Trainer:
    """A Trainer of the synthetic task from ``weights`` with PPO settings ``PPO`` + ``ppo`` (collective); the
    gold reward scores its samples unless an agent's or an environment's episodes bring their own."""
    config = JobConfig(models=MODELS, run=RunConfig(iterations=3, seed=SEED), generation=generation,
                       ppo=PPOConfig(**{**PPO, **ppo}))
    dataset = SyntheticPromptDataset(SyntheticPromptConfig(num_prompts=64, max_length=GENERATION.max_prompt_len))
    prompts = PromptBatchIterator(dataset, config.ppo.rollout_batch_size, seed=SEED)
    return Trainer(config, placement, prompts, ByteTokenizer(), initial_weights=weights,
                   reward_fn=None if generation.multi_turn else gold_reward)


def _first_iteration(trainer: Trainer):
    """``step()`` taken apart: (the engine's batch, the iteration's result on it with old log-probs zeroed)."""
    trainer.sync_generation_weights()
    generated = trainer.generate(next(trainer.prompts)).batch
    return generated, trainer.learn(generated.with_fields(old_logprobs=torch.zeros_like(generated.old_logprobs)))


def _unsharded_logprobs(full: dict, batch) -> torch.Tensor:
    """[N, R] log-probs of ``batch``'s response tokens under the unsharded actor ``full``, 0 past each response."""
    actor, out = unsharded("lm", MODELS["actor"], full), torch.zeros_like(batch.old_logprobs)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(batch.prompt_lengths.tolist(), batch.response_lengths.tolist())):
            out[i, :r] = plain_logprobs(actor, batch.tokens[i:i + 1, :p + r], p, r)[0]
    return out


def _record(result) -> dict:
    """An iteration's metrics and batch fields as plain Python values."""
    batch = result.batch
    return {"metrics": dict(result.metrics), **{name: _plain(getattr(batch, name)) for name in FIELDS}}


def _plain(value):
    """A batch field as plain Python values (lists; finish reasons as they are)."""
    return list(value) if isinstance(value, tuple) else value.tolist()


def _semantics(placement, weights: dict) -> dict:
    """One step of each trainer issue #26's semantics are checked on: their metrics, and how far the GRPO
    actors moved apart (the same samples, a KL coefficient of 0 against 1 in the loss)."""
    out = {}
    actors = {}
    for coef in (0.0, 1.0):
        trainer = _trainer(placement, weights, advantage_estimator="grpo", kl_coef=coef)
        out[f"grpo_kl{coef:g}"] = dict(trainer.step().metrics)
        actors[coef] = _actor_weights(trainer)
    out["grpo_kl_actor_diff"] = max((actors[0.0][k] - actors[1.0][k]).abs().max().item() for k in actors[0.0])
    bonus = _trainer(placement, weights, advantage_estimator="grpo", kl_coef=0.0, entropy_coef=0.5)
    out["grpo_entropy"] = dict(bonus.step().metrics)
    after = _actor_weights(bonus)
    out["grpo_entropy_actor_diff"] = max((after[k] - actors[0.0][k]).abs().max().item() for k in after)
    for temperature in (0.3, 1.0):
        trainer = _trainer(placement, weights, generation=GenerationConfig(max_response_len=8,
                                                                           temperature=temperature),
                           advantage_estimator="reinforce++")
        out[f"entropy_t{temperature:g}"] = trainer.step().metrics["entropy_mean"]
    gates = _trainer(placement, weights, advantage_estimator="grpo", recompute_logprobs=True, tis_cap=2.0,
                     ppo_mini_batch_size=PPO["rollout_batch_size"] * PPO["n_samples_per_prompt"])
    out["gates"] = dict(gates.step().metrics)
    return out


class TurnOneRewarded(Environment):
    """Two turns with the observation "ok" between them: turn 1 earns its length / 8, turn 2 earns 0."""

    def turn_one_reward(self, turn: ModelTurn) -> float:
        return len(turn.token_ids) / 8

    def step(self, turn: ModelTurn) -> EnvironmentStep:
        if turn.index == 0:
            return EnvironmentStep(observation="ok", reward=self.turn_one_reward(turn))
        return EnvironmentStep(reward=0.0, done=True)


class TurnOneConstant(TurnOneRewarded):
    """`TurnOneRewarded`, but turn 1 always earns 1.0: every episode scores the same."""

    def turn_one_reward(self, turn: ModelTurn) -> float:
        return 1.0


def _environments(placement, weights: dict) -> dict:
    """One GRPO step (KL in the loss) on `TurnOneRewarded`'s and on `TurnOneConstant`'s two-turn episodes: the
    batches' masks, turn rewards, scores, prompt ids and advantages."""
    out = {}
    for name in ("TurnOneRewarded", "TurnOneConstant"):
        generation = GenerationConfig(max_response_len=16, max_turn_tokens=6, max_turns=2,
                                      environment=f"{__name__}:{name}")
        batch = _trainer(placement, weights, generation=generation, advantage_estimator="grpo").step().batch
        out[name] = {field: _plain(getattr(batch, field))
                     for field in ("response_mask", "turn_rewards", "scores", "prompt_ids", "advantages")}
    return out


def two_turn_agent(client, prompt) -> float:
    """Asks about the prompt's first characters, then for more; the reward is the second reply's token count."""
    messages = [{"role": "user", "content": prompt.text[1:6]}]
    first = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model="policy", messages=messages)
    return float(len(second.choices[0].model_extra["token_ids"]))


def failing_agent(client, prompt) -> float:
    """`two_turn_agent`, but sample 0 of the batch's first prompt (generation replica 0's) raises after its
    first request, while the other samples wait for their replies or go on."""
    if "/episodes/0.0/" in str(client.base_url):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        raise ValueError("scripted failure")
    return two_turn_agent(client, prompt)


def _agents(placement, weights: dict) -> dict:
    """One GRPO step whose samples are `two_turn_agent`'s episodes: the batch's masks, scores and metrics, and
    how far the actor moved."""
    generation = GenerationConfig(max_prompt_len=40, max_response_len=64, max_turn_tokens=12, max_turns=2,
                                  agent=f"{__name__}:two_turn_agent")  # this module, as the workers import it
    trainer = _trainer(placement, weights, generation=generation, advantage_estimator="grpo")
    before = _actor_weights(trainer)
    result = trainer.step()
    after = _actor_weights(trainer)
    batch = result.batch
    moved = [None] * dist.get_world_size()
    dist.all_gather_object(moved, max((after[k] - before[k]).abs().max().item() for k in after))
    if trainer.driver is not None:
        trainer.driver.agent = failing_agent
    try:
        trainer.step()
        failure = None
    except RuntimeError as exc:
        failure = str(exc)
    return {"agent_failure": failure, "agent_metrics": dict(result.metrics), "agent_actor_moved": max(moved),
            "agent_mask": _plain(batch.response_mask), "agent_scores": _plain(batch.scores),
            "agent_tokens": _plain(batch.tokens), "agent_prompt_lengths": _plain(batch.prompt_lengths),
            "agent_response_lengths": _plain(batch.response_lengths), "agent_prompt_ids": _plain(batch.prompt_ids)}


def _actor_weights(trainer: Trainer) -> dict:
    """This rank's actor_train parameters (every rank holds the same stage layout in both trainers)."""
    return {name: p.detach().clone() for name, p in trainer.models["actor_train"].named_parameters()}


def _placed(trainer: Trainer) -> dict:
    """What this rank built: its tasks' models, its optimizers, the tasks the trainer placed."""
    return {"models": sorted(trainer.models), "optimizers": sorted(trainer.optimizers), "tasks": list(trainer.tasks)}


def run() -> dict:
    placement = Placement.from_plan(DEFAULT_PLANS[4], dist.get_world_size())
    build_task_groups(placement)  # collective; creates the one-rank groups full_weights builds on
    weights = _start_weights(ByteTokenizer().eos_id)
    grpo = _trainer(placement, weights, advantage_estimator="grpo", recompute_logprobs=True, kl_target=KL_TARGET)
    generated, first = _first_iteration(grpo)
    grpo_results = [first] + [grpo.step() for _ in range(2)]
    reinforce = _trainer(placement, weights, advantage_estimator="reinforce++", gamma=0.9)
    reinforce_result = reinforce.step()
    out = {"grpo_placed": _placed(grpo), "reinforce_placed": _placed(reinforce)}
    semantics = _semantics(placement, weights)
    semantics.update(_agents(placement, weights))
    semantics["environments"] = _environments(placement, weights)
    out["agent_failure"] = semantics["agent_failure"]  # every rank's: each one must stop
    diffs = [None] * dist.get_world_size()
    for key in ("grpo_kl_actor_diff", "grpo_entropy_actor_diff"):  # every rank holds an actor stage
        dist.all_gather_object(diffs, semantics.pop(key))
        semantics[key] = max(diffs)
    if dist.get_rank() == 0:
        reference = _unsharded_logprobs(weights["actor"], generated)
        valid = generated.response_mask > 0
        out.update(engine_vs_unsharded=(generated.old_logprobs - reference).abs().max().item(),
                   recomputed_vs_engine=(first.batch.old_logprobs - generated.old_logprobs).abs().max().item(),
                   engine_logprob_mean=generated.old_logprobs[valid].mean().item(),
                   finish_reasons=list(generated.finish_reasons),
                   grpo=[_record(r) for r in grpo_results], reinforce=_record(reinforce_result),
                   rollout=PPO["rollout_batch_size"] * PPO["n_samples_per_prompt"],
                   kl_target=KL_TARGET, kl_horizon=grpo.config.ppo.kl_config.horizon,
                   grpo_eps=grpo.config.ppo.advantage_config.eps,
                   reinforce_eps=reinforce.config.ppo.advantage_config.eps,
                   reinforce_gamma=reinforce.config.ppo.gamma, kl_coef=PPO["kl_coef"], **semantics)
    return out
