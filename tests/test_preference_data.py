"""Preference data (rlhf.data.PreferenceDataset) and train_reward.py's flags, in process.

Every record layout is checked against token ids written out here from the
byte tokenizer's rules (BOS + UTF-8 bytes; chat template ``<|role|>\\ncontent<|end|>\\n``,
then ``<|assistant|>\\n``), and every bad-data case against its count or its ``file:line``.
"""

import json
from pathlib import Path

import pytest

from rlhf.cli import UsageError
from rlhf.config import ConfigError
from rlhf.data import ByteTokenizer, PreferenceDataset, PreferenceDatasetConfig, PromptBatchIterator
from rlhf.data.prompts import PromptDataError, PromptFormatError
from rlhf.models.config import preset
from rlhf.parallel import PlacementError
from rlhf.reward_model.arguments import parse_args, reward_flag_of
from rlhf.reward_model.config import TASK, RewardJobConfig
from rlhf.reward_model.job import build_placement
from rlhf.reward_model.job import preference_data

TOK = ByteTokenizer()
BOS, EOS = TOK.BOS, TOK.EOS


def _ids(text: str) -> list:
    return list(text.encode())


def _write(tmp_path: Path, records: list, name: str = "pairs.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _load(path: str, **config) -> PreferenceDataset:
    return PreferenceDataset(PreferenceDatasetConfig(paths=path, **{"max_length": 256, **config}), TOK)


# ---- layouts -------------------------------------------------------------------------------

def test_text_records_are_prompt_then_answer_then_eos(tmp_path):
    path = _write(tmp_path, [{"prompt": "Q?", "chosen": "yes", "rejected": "no", "margin": 1.5, "id": 7}, "",
                             {"prompt": "A", "chosen": "b", "rejected": "c</s>", "margin": 0}])
    data = _load(path, margin_field="margin")
    first, second = data
    assert (first.prompt, first.chosen, first.rejected) == (
        tuple([BOS] + _ids("Q?")), tuple(_ids("yes") + [EOS]), tuple(_ids("no") + [EOS]))
    assert (first.margin, first.source, first.index, first.length) == (1.5, f"{path}:1", 0, 7)
    assert second.source == f"{path}:3" and second.margin == 0.0  # the blank line 2 is not a record
    assert data.stats.records == data.stats.loaded == 2


def _chat(*turns) -> list:
    return [{"role": role, "content": content} for role, content in zip(("user", "assistant") * 3, turns)]


PROMPT_TEXT = "<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|user|>\nBye?<|end|>\n<|assistant|>\n"
EXPECTED = (tuple(_ids(PROMPT_TEXT)), tuple(_ids("Bye!<|end|>\n") + [EOS]), tuple(_ids("No<|end|>\n") + [EOS]))


@pytest.mark.parametrize("record", [
    # TRL's HH-RLHF: whole conversations that agree up to the answer
    {"chosen": _chat("Hi", "Hello", "Bye?", "Bye!"), "rejected": _chat("Hi", "Hello", "Bye?", "No")},
    # UltraFeedback binarized: a string prompt repeating the user turn, whole conversations
    {"prompt": "Bye?", "chosen": _chat("Hi", "Hello", "Bye?", "Bye!"), "rejected": _chat("Hi", "Hello", "Bye?", "No"),
     "score_chosen": 8.0, "score_rejected": 2.0},
    # an explicit prompt conversation and the answers alone
    {"prompt": _chat("Hi", "Hello", "Bye?"), "chosen": [{"role": "assistant", "content": "Bye!"}],
     "rejected": [{"role": "assistant", "content": "No"}]},
    # raw HH-RLHF text dialogues
    {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Bye?\n\nAssistant: Bye!",
     "rejected": "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Bye?\n\nAssistant: No"},
], ids=["conversations", "ultrafeedback", "prompt-messages", "hh-text"])
def test_chat_layouts_render_the_conversation_with_the_template(tmp_path, record):
    (pair,) = _load(_write(tmp_path, [record]))
    assert (pair.prompt, pair.chosen, pair.rejected) == EXPECTED


def test_parquet_rows_with_message_lists(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"chosen": _chat("Hi", "Hello", "Bye?", "Bye!"), "rejected": _chat("Hi", "Hello", "Bye?", "No")}] * 2
    path = str(tmp_path / "pairs.parquet")
    pq.write_table(pa.Table.from_pylist(records), path)
    data = _load(path)
    assert [(p.prompt, p.chosen, p.rejected) for p in data] == [EXPECTED] * 2 and data[1].source == f"{path}:2"


def test_text_prompts_in_the_chat_template(tmp_path):
    (pair,) = _load(_write(tmp_path, [{"prompt": "Hi", "chosen": "a", "rejected": "b"}]), chat_template_for_text=True)
    assert pair.prompt == tuple(_ids("<|user|>\nHi<|end|>\n<|assistant|>\n")) and pair.chosen == (97, EOS)


# ---- bad data ------------------------------------------------------------------------------

GOOD = {"prompt": "P", "chosen": "a", "rejected": "b", "margin": 0}


@pytest.mark.parametrize("record, reason", [
    ({"prompt": "P", "chosen": "a"}, "missing field 'rejected' (fields present: prompt, chosen)"),
    ({"chosen": "a", "rejected": "b"}, "field 'prompt' is missing; text answers need a string prompt"),
    ({"prompt": "P", "chosen": "", "rejected": "b"}, "field 'chosen' is empty"),
    ({"prompt": "P", "chosen": "a", "rejected": ["b"]}, "'chosen' and 'rejected' must both be strings or both lists"),
    ({"chosen": _chat("Hi", "A"), "rejected": _chat("Ho", "B")}, "'chosen' and 'rejected' differ before their last"),
    ({"chosen": _chat("Hi"), "rejected": _chat("Ho")}, "the conversations hold only the answer"),
    ({"chosen": _chat("Hi", "A", "x"), "rejected": _chat("Hi", "A", "y")}, "'chosen' must end with a non-empty "
                                                                            "assistant message, got role 'user'"),
    ({"prompt": "P", "chosen": "a", "rejected": "b", "margin": "big"}, "field 'margin' (the margin) must be a finite"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"prompt": ', "invalid JSON"),
], ids=["no-rejected", "no-prompt", "empty", "mixed", "prefix", "no-user", "not-assistant", "margin", "array", "json"])
def test_a_malformed_record_is_named_by_file_and_line(tmp_path, record, reason):
    path = _write(tmp_path, [GOOD, record, GOOD])
    with pytest.raises(PromptFormatError) as exc:
        _load(path, margin_field="margin")
    assert str(exc.value).startswith(f"{path}:2: {reason}")
    data = _load(path, margin_field="margin", on_error="skip")  # or skipped and counted
    assert (len(data), data.stats.malformed, [p.source for p in data]) == (2, 1, [f"{path}:1", f"{path}:3"])


def test_identical_answers_are_dropped_and_counted(tmp_path):
    path = _write(tmp_path, [GOOD, {"prompt": "P", "chosen": "same", "rejected": "same"},
                             {"chosen": _chat("Hi", "A"), "rejected": _chat("Hi", "A")}])
    data = _load(path)
    assert (len(data), data.stats.identical) == (1, 2)
    assert "2 with identical answers dropped" in data.stats.summary()


def test_over_long_pairs_are_dropped_or_their_prompt_cut(tmp_path):
    path = _write(tmp_path, [{"prompt": "ABCDEFGH", "chosen": "xy", "rejected": "z"},  # 9 + 3 = 12 tokens
                             {"prompt": "P", "chosen": "0123456789", "rejected": "a"},  # answers alone: 11
                             GOOD])
    dropped = _load(path, max_length=10)
    assert (len(dropped), dropped.stats.dropped_overlong, dropped.stats.truncated) == (1, 2, 0)
    cut = _load(path, max_length=10, overlong="truncate_prompt")
    assert (len(cut), cut.stats.dropped_overlong, cut.stats.truncated) == (2, 1, 1)  # answers are never cut
    assert cut[0].prompt == tuple([BOS] + _ids("CDEFGH")) and cut[0].truncated and cut[0].length == 10
    assert "1 over-long (> 10 tokens) dropped; 1 prompt-truncated" in cut.stats.summary()


def test_nothing_usable_and_bad_settings_are_refused(tmp_path):
    with pytest.raises(PromptDataError, match="no usable preference pairs"):
        _load(_write(tmp_path, [{"prompt": "P", "chosen": "a", "rejected": "a"}]))
    with pytest.raises(ValueError, match=r"PreferenceDatasetConfig.overlong='cut': must be one of"):
        PreferenceDatasetConfig(paths="x.jsonl", max_length=8, overlong="cut")
    with pytest.raises(ValueError, match=r"PreferenceDatasetConfig.max_length=1: must be an int >= 2"):
        PreferenceDatasetConfig(paths="x.jsonl", max_length=1)


def test_token_id_pairs_and_the_resumable_order(tmp_path):
    config = PreferenceDatasetConfig(paths="synthetic", max_length=8)
    data = PreferenceDataset.from_token_ids([([BOS, 1], [2, 3], [4]), ([BOS], [5], [5]), ([BOS], [6], [7])],
                                            config, BOS)
    assert [(p.chosen, p.source) for p in data] == [((2, 3), "synthetic:1"), ((6,), "synthetic:3")]  # no EOS added
    assert data.stats.identical == 1
    other = PreferenceDataset.from_token_ids([([BOS, 1], [2, 3], [4]), ([BOS], [6], [8])], config, BOS)
    it = PromptBatchIterator(data, 1, seed=3)
    next(it)
    with pytest.raises(PromptDataError, match="fingerprint mismatch"):
        PromptBatchIterator(other, 1).load_state_dict(it.state_dict())


def test_job_refusal_names_the_flag(tmp_path):
    path = _write(tmp_path, [GOOD, {"prompt": "P", "chosen": "a"}])
    config = RewardJobConfig(data=parse_args(["--train-data", path]).data)
    with pytest.raises(ConfigError) as exc:
        preference_data(config, "train_data", TOK)
    assert reward_flag_of(exc.value.field_name) == "--train-data"
    assert str(exc.value).startswith(f"{path}:2: missing field 'rejected'")


# ---- flags ---------------------------------------------------------------------------------

def test_defaults_and_flags(tmp_path):
    path = _write(tmp_path, [GOOD])
    cfg = parse_args(["--train-data", path])
    assert cfg.model == preset("tiny-critic", 259) and cfg.model_dir is None  # the byte tokenizer's ids
    assert (cfg.training.global_batch_size, cfg.training.micro_batch_size, cfg.optimizer.lr) == (64, 4, 1e-5)
    assert cfg.max_length == 256 and build_placement(cfg, 4)[TASK].strategy.dp == 4  # every rank, data parallel
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"reward_inf": {"ranks": "0-3", "tp": 2}, "actor_train": {"pp": 2}}))
    cfg = parse_args(["--train-data", path, "--placement", str(plan), "--reward-inf", "pp=2", "--model", "tiny",
                      "--global-batch-size", "8", "--micro-batch-size", "1", "--center-rewards-coef", "0.01",
                      "--lr", "2e-5", "--lr-decay-style", "cosine", "--lr-decay-iters", "10", "--max-len", "64",
                      "--overlong", "truncate_prompt", "--margin-field", "m", "--train-iters", "10"])
    mesh = build_placement(cfg, 4)[TASK]  # the file's entry, the flag merged in; the other entries ignored
    assert (mesh.strategy.tp, mesh.strategy.pp, mesh.strategy.dp) == (2, 2, 1)
    assert cfg.run.iterations == 10 and cfg.max_length == 64 and cfg.training.center_rewards_coef == 0.01
    assert cfg.dataset_config(path) == PreferenceDatasetConfig(paths=path, max_length=64, margin_field="m",
                                                               overlong="truncate_prompt")


@pytest.mark.parametrize("argv, message", [
    (["--train-data", "missing.jsonl"], "--train-data: train_data='missing.jsonl' is not a file"),
    (["--overlong", "cut"], "--overlong: PreferenceDatasetConfig.overlong='cut': must be one of"),
    (["--lr", "-1"], "--lr: OptimizerConfig.lr=-1.0: must be > 0"),
    (["--lr-decay-iters", "5"], "--lr-decay-iters: OptimizerConfig.lr_decay_iters=5: has no effect"),
    (["--micro-batch-size", "0"], "--micro-batch-size: micro_batch_size must be an integer >= 1, got 0"),
    (["--center-rewards-coef", "-1"], "--center-rewards-coef: center_rewards_coef=-1.0 must be >= 0"),
    (["--max-len", "300"], "--max-len: max_len=300 exceeds the model's context max_seq_len=256"),
    (["--reward-inf", "tp=two"], "--reward-inf: cannot parse 'tp=two'"),
    (["--model", "huge"], "--model huge: [Errno 2] No such file or directory: 'huge' (give a preset: tiny, "),
    (["--trace-iteration", "40"], "--trace-iteration: trace_iteration 40 is past the last iteration 30"),
])
def test_bad_flags_are_refused_naming_them(tmp_path, argv, message):
    with pytest.raises(UsageError) as exc:
        parse_args(argv if "--train-data" in argv else ["--train-data", _write(tmp_path, [GOOD])] + argv)
    assert str(exc.value).startswith(message)


@pytest.mark.parametrize("argv, error, message", [
    (["--global-batch-size", "6"], ConfigError, "global_batch_size 6 must be a multiple of the reward model's dp 4"),
    (["--reward-inf", "tp=3,ranks=0-2"], PlacementError, "reward_inf: tp=3 does not divide num_attention_heads=4"),
    (["--reward-inf", "none"], PlacementError, "reward_inf: the reward model's mesh is 'none'"),
])
def test_placements_the_model_or_batch_cannot_use_are_refused(tmp_path, argv, error, message):
    cfg = parse_args(["--train-data", _write(tmp_path, [GOOD])] + argv)
    with pytest.raises(error, match=message):
        build_placement(cfg, 4)


def test_model_directories(tmp_path):
    """An HF causal LM starts a reward model with a new value head (PPO's frozen reward model refuses it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.checkpoint.sources import ModelSourceError, open_source

    hf = str(tmp_path / "lm")
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(hf)
    cfg = parse_args(["--train-data", _write(tmp_path, [GOOD]), "--model", hf])
    assert (cfg.model_dir, cfg.model.hidden_size, cfg.model.vocab_size) == (hf, 32, 320)
    assert open_source(hf, "reward", trained=True).new_head
    with pytest.raises(ModelSourceError, match="without a value head; the reward model is frozen"):
        open_source(hf, "reward")


def test_training_data_is_required():
    with pytest.raises(UsageError, match="^--train-data: a JSONL or Parquet file of preference records is required"):
        parse_args([])
