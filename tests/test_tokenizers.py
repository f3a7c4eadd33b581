"""Tokenizers: built-in byte tokenizer and HF tokenizers from a tiny local directory."""
import json
import os

import pytest

from rlhf.data import ByteTokenizer, HFTokenizer, TokenizerError, build_tokenizer
from rlhf.data import tokenizer as tokenizer_mod
from rlhf.data.tokenizer import readable_text

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "<|user|>": 4, "<|assistant|>": 5,
         "<|system|>": 6, "hello": 7, "world": 8, "how": 9, "are": 10, "you": 11, "be": 12,
         "brief": 13}


def make_hf_dir(path, chat_template=CHAT_TEMPLATE, prepend_bos=False):
    """A WordLevel tokenizer saved like a hub model (tokenizer.json + config + template).

    It defines <s> (id 1); with ``prepend_bos`` its post-processor adds it, else nothing is added.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    if prepend_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("hf_tok"))


# ----------------------------------------------------------------------------- byte
def test_byte_roundtrip_unicode():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    text = "héllo wörld — 你好 🙂\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 256, 257, 258)
    assert tok.encode("hi", add_special_tokens=True) == [257, 104, 105]  # its rule: BOS prepended


def test_byte_decode_special_tokens():
    tok = ByteTokenizer()
    ids = [tok.bos_id] + tok.encode("hi") + [tok.eos_id, tok.pad_id]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>hi</s><pad>"
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([259])


def test_byte_chat_template():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi ✓<|end|>\n<|assistant|>\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|end|>\n")
    assert tok.apply_chat_template(msgs, tokenize=True) == list(text.encode("utf-8"))


@pytest.mark.parametrize("bad, match", [
    ("hi", "must be a list"),
    ([], "empty"),
    ([{"role": "user"}], "message 0 has no 'content'"),
    ([{"role": "user", "content": 3}], "message 0 'content' must be a string"),
    ([{"role": "user", "content": "a"}, "b"], "message 1 must be an object"),
])
def test_chat_messages_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        ByteTokenizer().apply_chat_template(bad)


# ----------------------------------------------------------------------------- errors
def test_build_tokenizer_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerError, match=str(missing)):
        build_tokenizer(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("not a tokenizer")
    with pytest.raises(TokenizerError, match=f"{empty} holds no tokenizer"):
        build_tokenizer(str(empty))


# ----------------------------------------------------------------------------- HF
@pytest.mark.parametrize("backend", ["transformers", "tokenizers"])
def test_hf_tokenizer_from_local_dir(hf_dir, backend):
    tok = build_tokenizer(hf_dir, backend=backend)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("hello world how are you")
    assert ids == [7, 8, 9, 10, 11]
    assert tok.decode(ids) == "hello world how are you"
    assert tok.decode([1] + ids + [2]) == "hello world how are you"
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (len(VOCAB), 0, 1, 2)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = tok.apply_chat_template(msgs)
    assert text == "<s><|system|> be brief <|user|> hello <|assistant|>"
    assert tok.apply_chat_template(msgs, tokenize=True) == [1, 6, 12, 13, 4, 7, 5]


@pytest.mark.parametrize("prepend_bos", [False, True])
@pytest.mark.parametrize("backend", ["transformers", "tokenizers"])
def test_hf_special_tokens_as_autotokenizer_adds_them(tmp_path, backend, prepend_bos):
    from transformers import AutoTokenizer

    path = make_hf_dir(tmp_path / "tok", prepend_bos=prepend_bos)
    tok = build_tokenizer(path, backend=backend)
    text = "hello world how are you"
    assert tok.encode(text, add_special_tokens=True) == AutoTokenizer.from_pretrained(path)(text).input_ids
    assert tok.encode(text, add_special_tokens=True) == [1] * prepend_bos + [7, 8, 9, 10, 11]
    assert tok.encode(text) == [7, 8, 9, 10, 11]
    # the template spells out <s>: its ids get no second one
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True) == [1, 4, 7, 5]


def test_hf_auto_falls_back_to_tokenizers(hf_dir, monkeypatch):
    def no_transformers(path):
        raise ImportError("No module named 'transformers'")

    monkeypatch.setattr(tokenizer_mod, "_load_transformers", no_transformers)
    tok = build_tokenizer(hf_dir)
    assert "backend=tokenizers" in repr(tok)
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == \
        "<s><|user|> hello <|assistant|>"


def test_hf_without_chat_template(tmp_path):
    path = make_hf_dir(tmp_path / "plain", chat_template=None)
    tok = build_tokenizer(path)
    assert tok.encode("hello") == [7]
    with pytest.raises(TokenizerError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hello"}])


def test_hf_pad_defaults_to_eos(tmp_path):
    path = make_hf_dir(tmp_path / "nopad")
    for name in ("tokenizer_config.json",):
        cfg_path = os.path.join(path, name)
        cfg = json.load(open(cfg_path))
        cfg.pop("pad_token", None)
        json.dump(cfg, open(cfg_path, "w"))
    tok = build_tokenizer(path, backend="tokenizers")
    assert tok.pad_id == tok.eos_id == 2


# ----------------------------------------------------------------------------- stop ids
def test_byte_stop_ids_are_its_eos():
    assert ByteTokenizer().stop_token_ids == (258,)


@pytest.mark.parametrize("backend", ["transformers", "tokenizers"])
@pytest.mark.parametrize("eos_token_id, stop", [
    (None, (2,)),          # no generation_config.json
    ({}, (2,)),            # no eos_token_id in it
    (13, (2, 13)),         # an int
    ([5, 2, 13, 5], (2, 5, 13)),  # a list: the EOS first, then the file's order, each id once
])
def test_hf_stop_ids_add_generation_config_eos_ids(tmp_path, backend, eos_token_id, stop):
    path = make_hf_dir(tmp_path / "tok")
    if eos_token_id is not None:
        config = eos_token_id if isinstance(eos_token_id, dict) else {"eos_token_id": eos_token_id}
        (tmp_path / "tok" / "generation_config.json").write_text(json.dumps(config))
    assert build_tokenizer(path, backend=backend).stop_token_ids == stop


@pytest.mark.parametrize("content, match", [
    ('{"eos_token_id": [2, -1]}', r"eos_token_id -1 is invalid: it must be a token id \(an int >= 0\) or a list"),
    ('{"eos_token_id": "</s>"}', r"eos_token_id '</s>' is invalid"),
    ('{"eos_token_id": true}', r"eos_token_id True is invalid"),
    ('[2]', r"holds a JSON list; expected an object"),
    ('{"eos_token_id": ', r"cannot read .*generation_config.json: Expecting value"),
])
def test_hf_bad_generation_config_names_the_file_and_value(tmp_path, content, match):
    path = make_hf_dir(tmp_path / "tok")
    (tmp_path / "tok" / "generation_config.json").write_text(content)
    with pytest.raises(TokenizerError, match=match) as refused:
        build_tokenizer(path, backend="tokenizers")
    assert str(tmp_path / "tok" / "generation_config.json") in str(refused.value)


def test_readable_text_shows_ids_past_the_vocabulary():
    """A model may have more ids than its tokenizer (a JSON shape, an HF model's padded vocabulary): logged
    samples and the episodes' turn text must still decode."""
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("AB cd")
    text = tokenizer.decode(ids)
    assert readable_text(tokenizer, [*ids, 300, 259, *ids]) == f"{text}<id 300><id 259>{text}"
    assert readable_text(tokenizer, [*ids, 258], skip_special_tokens=False) == "AB cd</s>"
    assert readable_text(tokenizer, []) == ""
