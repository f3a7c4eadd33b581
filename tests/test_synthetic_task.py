"""The built-in synthetic task: seeded prompts, the gold rule, the preference pairs its reward model trains on."""

import pytest
import torch

from rlhf.data import PromptBatchIterator
from rlhf.data.synthetic import (GOLD_TARGET_IDS, TEXT_IDS, SyntheticPromptConfig, SyntheticPromptDataset,
                                  gold_reward, preference_pairs, preference_records, sample_responses)
from rlhf.data.tokenizer import ByteTokenizer

BOS, EOS, PAD = ByteTokenizer.BOS, ByteTokenizer.EOS, ByteTokenizer.PAD


# -- prompts ------------------------------------------------------------------
def test_prompts_are_deterministic_in_the_seed():
    a, b = SyntheticPromptDataset(), SyntheticPromptDataset()
    assert [p.token_ids for p in a] == [p.token_ids for p in b]
    assert a.fingerprint == b.fingerprint
    other = SyntheticPromptDataset(SyntheticPromptConfig(seed=1))
    assert other.fingerprint != a.fingerprint
    assert a[0].token_ids != other[0].token_ids


def test_prompts_are_bos_then_upper_case_words_within_the_length_range():
    ds = SyntheticPromptDataset(SyntheticPromptConfig(num_prompts=200, min_length=5, max_length=9))
    assert len(ds) == 200
    assert {len(p) for p in ds} == set(range(5, 10))
    for i, p in enumerate(ds):
        assert p.index == i and p.source == f"synthetic:0:{i}"
        assert p.token_ids[0] == BOS
        text = bytes(p.token_ids[1:]).decode("ascii")
        assert p.text == text
        assert text == text.strip() and "  " not in text
        assert set(text) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZ ")


def test_prompts_feed_the_batch_iterator_and_resume_exactly():
    ds = SyntheticPromptDataset(SyntheticPromptConfig(num_prompts=10))
    it = PromptBatchIterator(ds, batch_size=4, seed=3)
    first = next(it)
    assert first.token_ids == [list(ds[i].token_ids) for i in first.indices]
    state = it.state_dict()
    expected = [next(it).indices for _ in range(3)]
    resumed = PromptBatchIterator(SyntheticPromptDataset(SyntheticPromptConfig(num_prompts=10)), batch_size=4)
    resumed.load_state_dict(state)
    assert [next(resumed).indices for _ in range(3)] == expected
    # 10 prompts, batches of 4, drop_last: two batches per epoch, the third batch opens epoch 1
    assert (state["epoch"], state["index"]) == (0, 4) and resumed.epoch == 1


def test_resuming_on_other_synthetic_prompts_is_refused():
    it = PromptBatchIterator(SyntheticPromptDataset(SyntheticPromptConfig(num_prompts=10)), batch_size=4)
    other = PromptBatchIterator(SyntheticPromptDataset(SyntheticPromptConfig(num_prompts=10, seed=9)),
                                batch_size=4)
    with pytest.raises(ValueError, match="fingerprint mismatch"):
        other.load_state_dict(it.state_dict())


@pytest.mark.parametrize("field, value, words", [
    ("num_prompts", 0, "num_prompts=0: must be >= 1"),
    ("min_length", 1, "min_length=1: must be >= 2"),
    ("max_length", 3, "max_length=3: must be >= min_length=4"),
    ("seed", 1.5, "seed=1.5: must be an int"),
])
def test_prompt_config_errors_name_the_field(field, value, words):
    with pytest.raises(ValueError, match=f"SyntheticPromptConfig.{words}"):
        SyntheticPromptConfig(**{field: value})


# -- gold rule ----------------------------------------------------------------
def test_gold_reward_is_the_fraction_of_lower_case_letters_eos_included():
    a, b, upper_b = ord("a"), ord("b"), ord("B")
    responses = [[], [EOS], [a, b, EOS], [a, upper_b], [a, b, ord("c"), ord("z")],
                 [ord("`"), ord("{"), 300, PAD, BOS], [a, 97 + 256, ord(" "), EOS]]
    prompts = [[BOS, a, a]] * len(responses)  # prompt letters never count
    assert gold_reward(prompts, responses) == [0.0, 0.0, 2 / 3, 0.5, 1.0, 0.0, 0.25]
    assert GOLD_TARGET_IDS == tuple(range(97, 123))


def test_gold_reward_of_a_uniform_policy_is_about_26_of_259():
    """The tiny default's untrained actor is near-uniform over the byte tokenizer's 259 ids."""
    ids = torch.randint(259, (4000, 32), generator=torch.Generator().manual_seed(0)).tolist()
    mean = sum(gold_reward([[BOS]] * len(ids), ids)) / len(ids)
    assert abs(mean - 26 / 259) < 0.003  # standard error ~0.0008


def test_gold_reward_needs_one_prompt_per_response():
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        gold_reward([[BOS], [BOS]], [[EOS]])


# -- preference pairs ------------------------------------------------------------
def test_responses_span_the_score_range():
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    r = sample_responses(2000, range(512), 20, gen(), eos_id=EOS, eos_probability=0.25)
    assert r == sample_responses(2000, range(512), 20, gen(), eos_id=EOS, eos_probability=0.25)
    assert {len(ri) for ri in r} == set(range(1, 21))
    assert abs(sum(ri[-1] == EOS for ri in r) / len(r) - 0.25) < 0.04
    scores = torch.tensor(gold_reward([[]] * len(r), r))
    # q ~ U(0, 1): scores spread over [0, 1], not piled at a uniform policy's 0.05
    assert abs(scores.mean().item() - 0.5) < 0.05
    assert (scores < 0.1).float().mean() > 0.1 and (scores > 0.9).float().mean() > 0.05


def test_preference_pairs_follow_the_gold_rule_and_drop_ties():
    prompts = [[BOS, 65], [BOS, 66, 67]]
    pairs = preference_pairs(prompts, 1000, range(512), 8, torch.Generator().manual_seed(1), EOS, 0.25)
    assert 850 < len(pairs) < 1000  # ties (equal scores, e.g. two letter-free answers) are dropped
    for prompt, chosen, rejected in pairs:
        assert prompt in prompts
        assert gold_reward([prompt], [chosen])[0] > gold_reward([prompt], [rejected])[0]


def test_tiny_default_reward_model_trains_on_the_tokenizers_ids():
    """The pairs pretrain_rlhf.py trains the tiny default's reward model on draw from the preset's vocabulary,
    the byte tokenizer's ids: every id they hold has a token, and each of the 259 occurs."""
    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.job import prompt_dataset, synthetic_preferences

    config, tokenizer = parse_args([]), ByteTokenizer()
    held_out, train = synthetic_preferences(config, prompt_dataset(config, tokenizer), tokenizer, 1000)
    assert (len(held_out), len(train)) == (483, 955)  # 512 and 1000 draws, ties dropped (the run prints 483)
    assert {i for pairs in (held_out, train) for p in pairs for i in p.chosen + p.rejected} == set(range(259))


def test_preference_records_are_text_ordered_by_the_rule():
    records = preference_records(300, seed=2)
    tok = ByteTokenizer()
    assert len(records) > 250 and records == preference_records(300, seed=2)
    for r in records:
        chosen, rejected = (tok.encode(r[k]) for k in ("chosen", "rejected"))
        assert set(chosen + rejected) <= set(TEXT_IDS)
        assert r["prompt"].replace(" ", "").isupper()
        assert gold_reward([[]], [chosen])[0] > gold_reward([[]], [rejected])[0]
