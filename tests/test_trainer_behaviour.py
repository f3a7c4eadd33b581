"""Trainer behaviour on 4 gloo ranks in one launch (tests/scenario_trainer_behaviour.py), against
references written here from the definitions: the engine's old log-probs and recompute_logprobs,
GRPO and REINFORCE++ (no critic placed; their advantages, GRPO's on multi-turn episodes rewarded at an
intermediate turn too), the adaptive KL coefficient (Ziegler et al. 2019), the KL and entropy terms of the
loss, and the batch statistics the metrics report.
"""

import math

import pytest

from rlhf.data.synthetic import gold_reward
from rlhf.testing.distributed import launch

LOGPROB_TOL = 1e-5
TOL = 1e-5  # float32 sums of a few dozen O(1) values, against float64 references
KL_COEF_RTOL = 1e-6  # float32 controller arithmetic; one update moves the coefficient by >= 8e-5 here
ITERATIONS = [("grpo", 0), ("grpo", 1), ("grpo", 2), ("reinforce", None)]


@pytest.fixture(scope="module")
def results():
    return launch(4, "scenario_trainer_behaviour:run")


def _record(results, trainer: str, index):
    """Rank 0's record of one iteration: metrics and batch fields."""
    recorded = results[0][trainer]
    return recorded if index is None else recorded[index]


def _valid(rec, field: str) -> list:
    """Each sample's values of a response-aligned field on its response tokens."""
    return [row[:n] for row, n in zip(rec[field], rec["response_lengths"])]


def _padded(rows: list, width: int) -> list:
    """Rows right-padded with zeros to ``width`` columns (the batch's response layout)."""
    return [row + [0.0] * (width - len(row)) for row in rows]


def _max_diff(a: list, b: list) -> float:
    """Largest absolute difference of two equally shaped lists of rows."""
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))


def test_engine_old_logprobs_equal_unsharded_actor(results):
    out = results[0]
    assert {"stop", "length"} <= set(out["finish_reasons"])  # responses of several lengths, EOS among them
    assert out["engine_vs_unsharded"] < LOGPROB_TOL


def test_recomputed_old_logprobs_equal_engine(results):
    out = results[0]
    assert out["engine_logprob_mean"] < -1.0  # so the zeros learn() was given cannot pass for them
    assert out["recomputed_vs_engine"] < LOGPROB_TOL


@pytest.mark.parametrize("trainer", ["grpo", "reinforce"])
def test_estimators_without_critic_place_no_critic(results, trainer):
    for rank in results:
        placed = rank[f"{trainer}_placed"]
        assert not [t for t in placed["models"] + placed["tasks"] if t.startswith("critic")], placed
        assert placed["optimizers"] == ["actor"]
    records = results[0][trainer] if trainer == "grpo" else [results[0][trainer]]
    for rec in records:
        assert "value_loss" not in rec["metrics"] and "policy_loss" in rec["metrics"]


def _grpo_reference(rec, eps: float) -> list:
    """(score - group mean) / (group std + eps) on each valid token, the group being the samples of
    one prompt (unbiased std), 0 past each response."""
    groups = {}
    for score, prompt in zip(rec["scores"], rec["prompt_ids"]):
        groups.setdefault(prompt, []).append(score)
    rows = []
    for score, prompt, length in zip(rec["scores"], rec["prompt_ids"], rec["response_lengths"]):
        group = groups[prompt]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
        rows.append([(score - mean) / (std + eps)] * length)
    assert sorted(len(g) for g in groups.values()) == [4, 4, 4, 4]  # 4 prompts x 4 samples
    return _padded(rows, len(rec["advantages"][0]))


@pytest.mark.parametrize("index", [0, 1, 2])
def test_grpo_advantages_match_group_reference(results, index):
    rec = _record(results, "grpo", index)
    assert _max_diff(rec["advantages"], _grpo_reference(rec, results[0]["grpo_eps"])) < TOL


def test_reinforce_pp_advantages_match_definition(results):
    """Returns: discounted sums of -kl_coef * (old - ref) per token plus the score on the last token;
    advantages: those returns whitened over every valid token of the batch."""
    out, rec = results[0], results[0]["reinforce"]
    gamma, coef = out["reinforce_gamma"], out["kl_coef"]  # a fixed coefficient (no kl_target)
    returns = []
    for old, ref, score in zip(_valid(rec, "old_logprobs"), _valid(rec, "ref_logprobs"), rec["scores"]):
        rewards = [-coef * (o - r) for o, r in zip(old, ref)]
        rewards[-1] += score
        running, row = 0.0, []
        for reward in reversed(rewards):
            running = reward + gamma * running
            row.insert(0, running)
        returns.append(row)
    flat = [g for row in returns for g in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((g - mean) ** 2 for g in flat) / (len(flat) - 1) + out["reinforce_eps"])
    width = len(rec["returns"][0])
    assert _max_diff(rec["returns"], _padded(returns, width)) < TOL
    assert _max_diff(rec["advantages"], _padded([[(g - mean) / std for g in row] for row in returns], width)) < TOL


def test_adaptive_kl_coefficient_follows_ziegler(results):
    """beta_next = beta * (1 + clip(KL / target - 1, -0.2, 0.2) * samples / horizon), KL the logged
    per-sequence mean of the iteration."""
    out = results[0]
    logged = [rec["metrics"] for rec in out["grpo"]]
    assert abs(logged[0]["kl_coef"] - out["kl_coef"]) < 1e-8  # it starts at PPOConfig.kl_coef
    for before, after in zip(logged, logged[1:]):
        error = min(max(before["kl_mean"] / out["kl_target"] - 1.0, -0.2), 0.2)
        expected = before["kl_coef"] * (1.0 + error * out["rollout"] / out["kl_horizon"])
        assert abs(after["kl_coef"] - expected) <= KL_COEF_RTOL * expected, (before, after)
        assert abs(after["kl_coef"] - before["kl_coef"]) > 10 * KL_COEF_RTOL * expected  # it moved


@pytest.mark.parametrize("trainer,index", ITERATIONS, ids=["grpo-1", "grpo-2", "grpo-3", "reinforce++-1"])
def test_metrics_are_statistics_of_the_batch(results, trainer, index):
    rec = _record(results, trainer, index)
    metrics, lengths, scores = rec["metrics"], rec["response_lengths"], rec["scores"]
    n = len(lengths)
    assert metrics["samples_count"] == n == results[0]["rollout"]
    assert metrics["tokens_count"] == sum(lengths)
    assert metrics["response_length_max"] == max(lengths)
    assert abs(metrics["response_length_mean"] - sum(lengths) / n) < TOL
    mean = sum(scores) / n
    assert abs(metrics["reward_mean"] - mean) < TOL
    assert abs(metrics["reward_std"] - math.sqrt(sum((s - mean) ** 2 for s in scores) / n)) < TOL
    # the KL estimator: k1 with the KL in the rewards (REINFORCE++), k3 with it in the loss (GRPO's default)
    estimate = (lambda d: d) if trainer == "reinforce" else (lambda d: math.exp(-d) - 1 + d)
    kl = [sum(estimate(o - r) for o, r in zip(old, ref)) for old, ref in zip(_valid(rec, "old_logprobs"),
                                                                             _valid(rec, "ref_logprobs"))]
    assert abs(metrics["kl_mean"] - sum(kl) / n) < TOL
    prompts = [row[:p] for row, p in zip(rec["tokens"], rec["prompt_lengths"])]
    responses = [row[p:p + r] for row, p, r in zip(rec["tokens"], rec["prompt_lengths"], lengths)]
    assert abs(metrics["gold_reward_mean"] - sum(gold_reward(prompts, responses)) / n) < TOL


def test_new_metrics_are_statistics_of_the_batch(results):
    """Issue #26's batch statistics against the batch: extremes, truncation, advantages and returns over the
    response tokens, and (GRPO recomputes its old log-probs) the engine's rollout log-probs against them."""
    for trainer, index in ITERATIONS:
        rec = _record(results, trainer, index)
        metrics, lengths, scores = rec["metrics"], rec["response_lengths"], rec["scores"]
        assert metrics["response_length_min"] == min(lengths)
        assert abs(metrics["reward_min"] - min(scores)) < TOL and abs(metrics["reward_max"] - max(scores)) < TOL
        truncated = sum(r == "length" for r in rec["finish_reasons"]) / len(lengths)
        assert metrics["truncated_fraction"] == pytest.approx(truncated)
        advantages = [a for row in _valid(rec, "advantages") for a in row]
        mean = sum(advantages) / len(advantages)
        assert abs(metrics["advantage_mean"] - mean) < TOL
        std = math.sqrt(sum((a - mean) ** 2 for a in advantages) / len(advantages))
        assert abs(metrics["advantage_std"] - std) < TOL
        returns = [g for row in _valid(rec, "returns") for g in row]
        assert abs(metrics["return_mean"] - sum(returns) / len(returns)) < TOL
        if trainer == "grpo":
            pairs = [(o, r) for old, roll in zip(_valid(rec, "old_logprobs"), _valid(rec, "rollout_logprobs"))
                     for o, r in zip(old, roll)]
            k3 = [math.exp(o - r) - 1 - (o - r) for o, r in pairs]  # KL(rollout || trainer) on rollout samples
            assert abs(metrics["mismatch_kl"] - sum(k3) / len(k3)) < TOL
            assert metrics["mismatch_logprob_abs_max"] == pytest.approx(max(abs(o - r) for o, r in pairs), abs=TOL)


def test_grpo_update_changes_with_the_kl_coefficient(results):
    """GRPO's KL acts as a loss term (TRL's beta): the same samples and advantages, another update."""
    zero, one = results[0]["grpo_kl0"], results[0]["grpo_kl1"]
    for key in ("reward_mean", "advantage_mean", "advantage_std", "kl_mean"):
        assert zero[key] == one[key], key  # the same samples, advantages and KL before the update
    assert "kl_loss" not in zero and one["kl_loss"] > 0
    assert results[0]["grpo_kl_actor_diff"] > 1e-5


def test_grpo_update_changes_with_the_entropy_coefficient(results):
    """--entropy-coef 0.5 against 0 on the same samples: the bonus has a gradient, so the update differs (it was
    a constant once: both runs' second iterations were identical), and its aggregated entropy is logged."""
    zero, bonus = results[0]["grpo_kl0"], results[0]["grpo_entropy"]
    for key in ("reward_mean", "advantage_mean", "advantage_std", "kl_mean"):
        assert zero[key] == bonus[key], key  # the same samples and advantages before the update
    assert "entropy_loss" not in zero and bonus["entropy_loss"] > 0
    assert results[0]["grpo_entropy_actor_diff"] > 1e-5


def _grpo_by_the_definition(record: dict, eps: float) -> list:
    """Each sample's GRPO advantage on its model tokens: its episode's score (the sum of its turns' rewards) less
    its prompt's mean score, over the scores' unbiased std + eps; 0 at observations and padding."""
    scores = [sum(row) for row in record["turn_rewards"]]
    groups = {}
    for prompt, score in zip(record["prompt_ids"], scores):
        groups.setdefault(prompt, []).append(score)
    out = []
    for prompt, score, mask in zip(record["prompt_ids"], scores, record["response_mask"]):
        group = groups[prompt]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        out.append([(score - mean) / (std + eps) * m for m in mask])
    return out


@pytest.mark.parametrize("environment", ["TurnOneRewarded", "TurnOneConstant"])
def test_grpo_counts_a_turns_reward_once_on_every_model_token(results, environment):
    """Two-turn episodes whose environment rewards turn 1 and not turn 2: every episode's score is its turn-1
    reward, and its GRPO advantage sits on the model tokens of both turns, as the definition gives (turn 2's
    tokens used to lose turn 1's reward). When every episode scores the same, every advantage is 0."""
    record = results[0]["environments"][environment]
    assert all(sum(r != 0 for r in row) <= 1 for row in record["turn_rewards"])  # turn 1's end only
    holes = [row.index(0) < len(row) - row[::-1].index(1) for row in record["response_mask"] if 0 in row]
    assert any(holes)  # some episodes have a second turn after the observation
    assert record["scores"] == pytest.approx([sum(row) for row in record["turn_rewards"]])
    want = _grpo_by_the_definition(record, results[0]["grpo_eps"])
    assert _max_diff(record["advantages"], want) < TOL
    if environment == "TurnOneConstant":
        assert set(record["scores"]) == {1.0}
        assert all(a == 0.0 for row in record["advantages"] for a in row)
    else:
        assert max(abs(a) for row in record["advantages"] for a in row) > 0.1


def test_a_lower_temperature_gives_a_lower_entropy(results):
    """The entropy of softmax(logits / T) the update logs, on the same seed."""
    assert results[0]["entropy_t0.3"] < results[0]["entropy_t1"]


def test_the_first_update_starts_on_policy(results):
    """Gates as slime and NeMo-RL keep them: on one mini-batch the first update's ratio is 1 and its
    approximate KL 0, and the engine's rollout log-probs equal the trainer's (fp32)."""
    gates = results[0]["gates"]
    assert gates["approx_kl"] < 1e-8
    assert abs(gates["ratio_mean"] - 1) < 1e-5 and abs(gates["ratio_max"] - 1) < 1e-5
    assert gates["mismatch_kl"] < 1e-4
    assert abs(gates["tis_weight_mean"] - 1) < 1e-5 and gates["tis_capped_fraction"] == 0.0  # --tis-cap 2 ran


def test_agent_episodes_through_the_endpoint_are_all_trained(results):
    """16 agent programs (4 prompts x 4 samples) on the openai client, two requests each, served by actor_gen's
    two TP2 replicas: every sample of the batch is a two-turn episode whose observation (the template's
    continuation for the second user message) is a hole in the mask, its score is the agent's reward (the
    second reply's token count), and the GRPO step trained on all 16."""
    r = results[0]
    assert len(r["agent_scores"]) == 16 and sorted(r["agent_prompt_ids"]) == sorted(list(range(4)) * 4)
    for k, mask in enumerate(r["agent_mask"]):
        length = r["agent_response_lengths"][k]
        runs, previous = [], 0
        for column, m in enumerate(mask[:length]):
            if m and not previous:
                runs.append([column, column])
            if m:
                runs[-1][1] = column + 1
            previous = m
        assert len(runs) == 2, (k, mask)  # two turns, an observation between them
        assert runs[1][1] == length and r["agent_scores"][k] == runs[1][1] - runs[1][0]
        p = r["agent_prompt_lengths"][k]
        observation = r["agent_tokens"][k][p + runs[0][1]:p + runs[1][0]]
        assert bytes(t for t in observation if t < 256).decode().endswith("more<|end|>\n<|assistant|>\n"), k
    m = r["agent_metrics"]
    assert m["turns_mean"] == 2 and m["multi_turn_fraction"] == 1 and m["samples_count"] == 16
    assert m["reward_mean"] == pytest.approx(sum(r["agent_scores"]) / 16)
    assert r["agent_actor_moved"] > 0


def test_an_agent_that_raises_stops_every_rank_with_its_message(results):
    """One agent of generation replica 0 raises in the next iteration: replica 1's ranks, whose agents were
    fine, stop too, with the same line, instead of waiting at the gather."""
    for r in results:
        assert r["agent_failure"] == ("agent failing_agent failed on sample 0 of prompt 0: ValueError: scripted "
                                      "failure")
