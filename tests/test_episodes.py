"""Multi-turn episodes as training data (rlhf/envs/episodes.py, Batch.loss_mask): the observations are holes.

Episodes of a scripted environment (fixed observations at known places) become a Batch whose loss mask
covers exactly the model's tokens; GAE over it equals verl's multi-turn GAE (the recursive loop that carries
the next value and the running advantage across observation tokens); the KL sits on the model's tokens only;
the PPO loss equals one written out token by token over the model's tokens. The engine side (each turn
against a fresh generation, K/V kept, TP2) is in test_engine_generation.py.
"""

import pytest
import torch

from rlhf.algorithms import AdvantageInputs, compute_advantages
from rlhf.algorithms.estimators import AdvantageConfig
from rlhf.algorithms.kl import token_rewards
from rlhf.algorithms.losses import policy_loss
from rlhf.batch import Batch
from rlhf.config import ConfigError
from rlhf.envs.environment import EnvironmentStep, checked_step, load_environment, observation_kind
from rlhf.envs.episodes import Episode, turn_reward_rows

# (prompt, [(model turn, observation), ...]): the observation after the last turn is None
SCRIPTS = [
    ([1, 2, 3], [([10, 11, 12], [90, 91]), ([13, 14], [92]), ([15], None)]),
    ([4, 5], [([20, 21, 22, 23], None)]),
    ([6], [([30], [93, 94, 95]), ([31, 32, 33], None)]),
]


def _episode(index: int, prompt, turns) -> Episode:
    """An episode as the runner records it; turn k's reward is 0.5 + k, at the turn's last token."""
    tokens, mask, logprobs, positions = [], [], [], []
    for turn, observation in turns:
        tokens += turn
        mask += [1] * len(turn)
        logprobs += [-0.1 * (t % 7) - 0.05 for t in turn]
        positions.append(len(tokens) - 1)
        for t in observation or ():
            tokens.append(t)
            mask.append(0)
            logprobs.append(0.0)
    return Episode(str(index), 0, tuple(prompt), tuple(tokens), tuple(logprobs), "stop", 0.0, loss_mask=tuple(mask),
                   rewards=tuple(0.5 + k for k in range(len(turns))), reward_positions=tuple(positions),
                   turns=len(turns))


@pytest.fixture(scope="module")
def batch():
    episodes = [_episode(i, p, t) for i, (p, t) in enumerate(SCRIPTS)]
    batch = Batch.from_samples(episodes, pad_id=0, prompt_ids={str(i): i for i in range(len(episodes))})
    return batch.with_fields(turn_rewards=turn_reward_rows(episodes, batch.response_width))


def _model_positions(turns) -> list[int]:
    """Response columns of the model's tokens, from the script alone."""
    out, k = [], 0
    for turn, observation in turns:
        out += range(k, k + len(turn))
        k += len(turn) + len(observation or ())
    return out


def test_the_loss_mask_covers_exactly_the_models_tokens(batch):
    for i, (_, turns) in enumerate(SCRIPTS):
        want = torch.zeros(batch.response_width)
        want[_model_positions(turns)] = 1
        assert torch.equal(batch.response_mask[i], want), i
    assert batch.response_lengths.tolist() == [9, 4, 7]


def test_turn_rewards_sit_at_the_end_of_their_turns(batch):
    for i, (_, turns) in enumerate(SCRIPTS):
        ends = [max(_model_positions(turns[:k + 1])) for k in range(len(turns))]
        want = torch.zeros(batch.response_width)
        want[ends] = torch.tensor([0.5 + k for k in range(len(turns))])
        assert torch.equal(batch.turn_rewards[i], want), i


def verl_multi_turn_gae(rewards, values, mask, gamma, lam):
    """verl's compute_gae_advantage_return (multi-turn form), written from its description: walking back in
    time, a masked token passes the next value and the running advantage through unchanged."""
    next_value = torch.zeros(rewards.shape[0])
    running = torch.zeros(rewards.shape[0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        running = candidate * mask[:, t] + (1 - mask[:, t]) * running
        advantages[:, t] = running
    return advantages, advantages + values


def test_gae_over_an_episode_batch_equals_verls_multi_turn_gae(batch):
    """The trainer's token rewards (each turn's reward at its end, the KL penalty on the model's tokens only)
    and GAE over them against verl's multi-turn loop on the same rewards."""
    g = torch.Generator().manual_seed(3)
    mask = batch.response_mask
    values = torch.randn(mask.shape, generator=g) * mask
    ref_logprobs = batch.old_logprobs + 0.1 * torch.randn(mask.shape, generator=g) * mask
    scored = batch.with_fields(values=values, ref_logprobs=ref_logprobs)
    rewards, kl = token_rewards(torch.zeros(3), scored.old_logprobs, scored.ref_logprobs, mask, 0.05,
                                placed=batch.turn_rewards)
    assert torch.all(kl[mask == 0] == 0) and torch.all(rewards[mask == 0] == 0)  # no KL, no reward at observations
    torch.testing.assert_close(rewards + 0.05 * kl, batch.turn_rewards)
    config = AdvantageConfig(estimator="gae", gamma=0.9, lam=0.8, whiten=False)
    advantages, returns = compute_advantages(AdvantageInputs.from_batch(scored, rewards, -0.05 * kl), config)
    want_adv, want_ret = verl_multi_turn_gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(advantages * mask, want_adv * mask, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(returns * mask, want_ret * mask, rtol=1e-6, atol=1e-6)
    assert torch.all(advantages[mask == 0] == 0)  # verl carries a value there, which no loss reads


def test_the_ppo_loss_equals_a_masked_loss_written_out_token_by_token(batch):
    g = torch.Generator().manual_seed(4)
    mask = batch.response_mask
    old = batch.old_logprobs
    new = old + 0.3 * torch.randn(mask.shape, generator=g)
    advantages = torch.randn(mask.shape, generator=g)
    loss, _ = policy_loss(new, old, advantages, mask, agg="token-mean", clip_eps=0.2)
    terms = []
    for i, (_, turns) in enumerate(SCRIPTS):
        for k in _model_positions(turns):
            ratio = float(torch.exp(new[i, k] - old[i, k]))
            a = float(advantages[i, k])
            terms.append(max(-a * ratio, -a * min(max(ratio, 0.8), 1.2)))
    assert float(loss) == pytest.approx(sum(terms) / len(terms), rel=1e-6)


def test_episode_score_and_environment_checks():
    episode = _episode(0, *SCRIPTS[0])
    assert episode.score == 0.5 + 1.5 + 2.5
    with pytest.raises(ValueError, match="returned reward nan; it must be a finite number"):
        checked_step(EnvironmentStep(reward=float("nan")), "Env.step")
    with pytest.raises(ValueError, match="returned a dict; it must return an EnvironmentStep"):
        checked_step({"reward": 1}, "Env.step")
    assert [observation_kind(o, "Env.step") for o in (None, [], [3, 4], [{"role": "tool"}], "hi")] == [
        None, None, "ids", "messages", "text"]
    with pytest.raises(ValueError, match="give token ids, chat messages"):
        observation_kind([1.5], "Env.step")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        load_environment("no_such_module:Env")
    with pytest.raises(ConfigError, match="is not a subclass of rlhf.envs.environment.Environment"):
        load_environment("rlhf.envs.environment:EnvironmentStep")
