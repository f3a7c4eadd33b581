"""Prompt datasets: records, errors with file:line, length policy, shuffle, exact resume."""
import json
import logging

import pytest
import torch

from test_tokenizers import make_hf_dir

from rlhf.data import (
    ByteTokenizer,
    PromptBatchIterator,
    PromptDataError,
    PromptDataset,
    PromptDatasetConfig,
    PromptFormatError,
    build_tokenizer,
)

BOS = ByteTokenizer.BOS


def write_jsonl(path, lines):
    """``lines``: dicts are dumped as JSON, strings written verbatim."""
    with open(path, "w", encoding="utf-8") as f:
        for x in lines:
            f.write((json.dumps(x, ensure_ascii=False) if not isinstance(x, str) else x) + "\n")
    return str(path)


def dataset(paths, **kw):
    return PromptDataset(PromptDatasetConfig(paths, **kw), ByteTokenizer())


def numbered(tmp_path, n, name="p.jsonl"):
    return write_jsonl(tmp_path / name, [{"prompt": f"prompt {i}", "id": i} for i in range(n)])


# ----------------------------------------------------------------------------- records
def test_jsonl_prompts_and_metadata(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "héllo", "id": 7, "tags": ["x"]}, "",
                                              {"prompt": "bye"}])
    ds = dataset(path)
    assert len(ds) == 2
    p = ds[0]
    assert p.token_ids == (BOS,) + tuple("héllo".encode())
    assert p.text == "héllo" and p.source == f"{path}:1" and p.index == 0
    assert dict(p.metadata) == {"id": 7, "tags": ["x"]}
    assert ds[1].source == f"{path}:3"  # blank line 2 ignored, numbering kept
    assert ds.stats.records == 2 and ds.stats.loaded == 2


def test_parquet_prompts(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"question": ["a", None, "ccc"], "score": [1.0, 2.0, 3.0]}), path)
    ds = dataset(path, prompt_field="question", on_error="skip", add_bos=False)
    assert [p.text for p in ds] == ["a", "ccc"]
    assert ds[1].source == f"{path}:3" and dict(ds[1].metadata) == {"score": 3.0}
    with pytest.raises(PromptFormatError, match=rf"^{path}:2: field 'question' must be a string, got NoneType$"):
        dataset(path, prompt_field="question")


def test_chat_messages_rendered_with_template(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": msgs, "lang": "en"}])
    ds = dataset(path, messages_field="messages", add_bos=True)
    expected = "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert ds[0].text == expected
    assert ds[0].token_ids == (BOS,) + tuple(expected.encode())
    assert dict(ds[0].metadata) == {"lang": "en"}
    # by default template text gets no special tokens added (the template spells them out)
    assert dataset(path, messages_field="messages")[0].token_ids == tuple(expected.encode())
    # plain text prompts wrapped as one user turn
    path2 = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "Hi"}])
    assert dataset(path2, chat_template_for_text=True)[0].text == "<|user|>\nHi<|end|>\n<|assistant|>\n"


# ----------------------------------------------------------------------------- malformed
MALFORMED = [
    {"prompt": "good one"},
    '{"prompt": "unterminated',
    {"text": "no prompt field"},
    {"prompt": 5},
    "[1, 2]",
    {"prompt": ""},
    {"prompt": "good two"},
]
REASONS = {
    2: "invalid JSON",
    3: "missing field 'prompt' (fields present: text)",
    4: "field 'prompt' must be a string, got int",
    5: "expected a JSON object, got list",
    6: "field 'prompt' is empty",
}


def test_malformed_lines_skipped_with_file_line_warnings(tmp_path, caplog):
    path = write_jsonl(tmp_path / "m.jsonl", MALFORMED)
    with open(path, "ab") as f:
        f.write(b'{"prompt": "\xff\xfe"}\n')  # line 8: not UTF-8
    with caplog.at_level(logging.WARNING, logger="rlhf.data.prompts"):
        ds = dataset(path, on_error="skip")
    assert [p.text for p in ds] == ["good one", "good two"]
    assert ds.stats.malformed == 6 and ds.stats.records == 8 and ds.stats.loaded == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for line, reason in {**REASONS, 8: "not valid UTF-8"}.items():
        assert any(f"{path}:{line}: {reason}" in w for w in warnings), (line, warnings)
    assert "6 malformed skipped" in ds.stats.summary()


def test_malformed_line_fatal_names_file_line(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", MALFORMED)
    with pytest.raises(PromptFormatError) as info:
        dataset(path)  # on_error="raise" is the default
    assert str(info.value).startswith(f"{path}:2: invalid JSON (")
    assert (info.value.path, info.value.line) == (path, 2)
    path2 = write_jsonl(tmp_path / "m2.jsonl", MALFORMED[2:])
    with pytest.raises(PromptFormatError, match=rf"^{path2}:1: missing field 'prompt'"):
        dataset(path2)


def test_bad_chat_messages_are_malformed(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user"}]},
                                              {"messages": "hi"}])
    with pytest.raises(PromptFormatError, match=rf"{path}:1: field 'messages': message 0 has no 'content'"):
        dataset(path, messages_field="messages")
    with pytest.raises(PromptDataError, match="no usable prompts"):
        dataset(path, messages_field="messages", on_error="skip")


def test_warnings_are_capped(tmp_path, caplog):
    path = write_jsonl(tmp_path / "m.jsonl", ["{bad"] * 5 + [{"prompt": "ok"}])
    with caplog.at_level(logging.WARNING, logger="rlhf.data.prompts"):
        ds = dataset(path, on_error="skip", max_warnings=2)
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("skipping malformed" in m for m in msgs) == 2
    assert any("3 more malformed" in m for m in msgs)
    assert ds.stats.malformed == 5


def test_missing_file(tmp_path):
    with pytest.raises(PromptDataError, match="nope.jsonl: prompt file not found"):
        dataset(str(tmp_path / "nope.jsonl"))


# ----------------------------------------------------------------------------- length policy
def test_overlong_rejected_vs_left_truncated(tmp_path):
    path = write_jsonl(tmp_path / "l.jsonl", [{"prompt": "abc"}, {"prompt": "abcdefgh"},
                                              {"prompt": "0123456789"}, {"prompt": "abcd"}])
    rej = dataset(path, max_prompt_length=5, overlong="reject")
    assert [p.text for p in rej] == ["abc", "abcd"]  # BOS + 4 bytes = 5 fits
    assert (rej.stats.rejected_overlong, rej.stats.truncated, rej.stats.loaded) == (2, 0, 2)
    assert "2 over-long (> 5 tokens) rejected" in rej.stats.summary()

    trunc = dataset(path, max_prompt_length=5, overlong="truncate_left")
    assert len(trunc) == 4
    assert trunc[1].token_ids == (BOS,) + tuple(b"efgh")  # BOS kept, last tokens kept
    assert trunc[2].token_ids == (BOS,) + tuple(b"6789")
    assert [p.truncated for p in trunc] == [False, True, True, False]
    assert (trunc.stats.rejected_overlong, trunc.stats.truncated) == (0, 2)
    assert "2 left-truncated" in trunc.stats.summary()

    nobos = dataset(path, max_prompt_length=5, overlong="truncate_left", add_bos=False)
    assert nobos[1].token_ids == tuple(b"defgh")


@pytest.mark.parametrize("prepend_bos", [False, True])
@pytest.mark.parametrize("backend", ["transformers", "tokenizers"])
def test_default_special_tokens_are_autotokenizers(tmp_path, backend, prepend_bos):
    from transformers import AutoTokenizer

    tok_dir = make_hf_dir(tmp_path / "tok", prepend_bos=prepend_bos)  # <s> = 1, hello = 7, world = 8
    texts = ["hello world", "world", "hello hello world"]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": t} for t in texts])
    tok = build_tokenizer(tok_dir, backend=backend)

    def ids(**kw):
        return [list(p.token_ids) for p in PromptDataset(PromptDatasetConfig(path, **kw), tok)]

    hf = AutoTokenizer.from_pretrained(tok_dir)
    assert ids() == [hf(t).input_ids for t in texts]
    assert [i[0] == 1 for i in ids()] == [prepend_bos] * 3
    assert ids(add_bos=False) == [hf(t, add_special_tokens=False).input_ids for t in texts]
    assert ids(add_bos=True) == [[1] + hf(t, add_special_tokens=False).input_ids for t in texts]
    # truncate_left keeps the BOS the tokenizer added
    truncated = ids(max_prompt_length=2, overlong="truncate_left")
    assert truncated == ([[1, 8]] * 3 if prepend_bos else [[7, 8], [8], [7, 8]])


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize("kw, match", [
    (dict(paths=[]), "paths"),
    (dict(paths="a.txt"), "extension"),
    (dict(paths="a.jsonl", max_prompt_length=0), "max_prompt_length=0"),
    (dict(paths="a.jsonl", overlong="cut"), "overlong='cut'"),
    (dict(paths="a.jsonl", on_error="ignore"), "on_error='ignore'"),
    (dict(paths="a.jsonl", format="csv"), "format='csv'"),
    (dict(paths="a.jsonl", prompt_field=""), "prompt_field"),
    (dict(paths="a.jsonl", add_bos="yes"), "add_bos='yes'"),
    (dict(paths="a.jsonl", max_prompt_length=1, overlong="truncate_left", add_bos=False), "max_prompt_length=1"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        PromptDatasetConfig(**kw)


def test_config_normalises_paths():
    assert PromptDatasetConfig("a.jsonl").paths == ("a.jsonl",)
    assert PromptDatasetConfig(["a.txt"], format="jsonl").paths == ("a.txt",)


# ----------------------------------------------------------------------------- iteration
def ids_of(it, n_batches):
    return [next(it).indices for _ in range(n_batches)]


def test_deterministic_shuffle(tmp_path):
    ds = dataset(numbered(tmp_path, 20))
    a = ids_of(PromptBatchIterator(ds, 4, seed=1), 10)
    b = ids_of(PromptBatchIterator(ds, 4, seed=1), 10)
    c = ids_of(PromptBatchIterator(ds, 4, seed=2), 10)
    assert a == b and a != c
    epoch0, epoch1 = sum(a[:5], []), sum(a[5:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(20))  # each epoch a permutation
    assert epoch0 != epoch1  # reshuffled per epoch
    plain = ids_of(PromptBatchIterator(ds, 4, shuffle=False), 2)
    assert plain == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_drop_last_and_epochs(tmp_path):
    ds = dataset(numbered(tmp_path, 10))
    it = PromptBatchIterator(ds, 4, shuffle=False, num_epochs=2)
    got = [(b.epoch, b.start, b.indices) for b in it]
    assert got == [(0, 0, [0, 1, 2, 3]), (0, 4, [4, 5, 6, 7]),
                   (1, 0, [0, 1, 2, 3]), (1, 4, [4, 5, 6, 7])]
    it = PromptBatchIterator(ds, 4, shuffle=False, drop_last=False, num_epochs=1)
    assert [b.indices for b in it] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptBatchIterator(ds, 11)


def test_resume_position_exact(tmp_path):
    ds = dataset(numbered(tmp_path, 11))
    ref = PromptBatchIterator(ds, 3, seed=5)
    expected = ids_of(ref, 12)  # crosses several epochs (3 batches per epoch)

    run = PromptBatchIterator(ds, 3, seed=5)
    first = ids_of(run, 7)
    state = json.loads(json.dumps(run.state_dict()))  # through JSON, as in a checkpoint
    assert (state["epoch"], state["index"], state["seed"]) == (2, 3, 5)

    resumed = PromptBatchIterator(ds, 3, seed=999)  # saved seed wins
    resumed.load_state_dict(state)
    assert first + ids_of(resumed, 5) == expected

    # at an epoch boundary as well
    run = PromptBatchIterator(ds, 3, seed=5)
    ids_of(run, 3)
    resumed = PromptBatchIterator(ds, 3, seed=5)
    resumed.load_state_dict(run.state_dict())
    assert ids_of(resumed, 9) == expected[3:]


def test_resume_refuses_other_data(tmp_path):
    it = PromptBatchIterator(dataset(numbered(tmp_path, 11)), 3)
    next(it)
    state = it.state_dict()
    other = PromptBatchIterator(dataset(numbered(tmp_path, 12, "q.jsonl")), 3)
    with pytest.raises(PromptDataError, match="saved for 11 prompts, dataset has 12"):
        other.load_state_dict(state)
    changed = write_jsonl(tmp_path / "r.jsonl", [{"prompt": f"other {i}"} for i in range(11)])
    with pytest.raises(PromptDataError, match="fingerprint"):
        PromptBatchIterator(dataset(changed), 3).load_state_dict(state)
    lenient = PromptBatchIterator(dataset(changed), 3)
    lenient.load_state_dict(state, strict=False)
    assert (lenient.epoch, lenient.index) == (0, 3)


def test_padded_batch(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab"}, {"prompt": "abcd"}])
    it = PromptBatchIterator(dataset(path, add_bos=False), 2, shuffle=False)
    batch = next(it)
    ids, lengths = batch.padded(pad_id=0)
    assert lengths.tolist() == [2, 4]
    assert ids.tolist() == [[0, 0, 97, 98], [97, 98, 99, 100]]
    ids, _ = batch.padded(pad_id=0, side="right")
    assert ids.tolist() == [[97, 98, 0, 0], [97, 98, 99, 100]]
    assert ids.dtype == torch.long
