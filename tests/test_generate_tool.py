"""tools/generate.py (on the generation engine): greedy decoding matches transformers' generate.

A tiny random Llama with the byte tokenizer's vocabulary (259) is saved as an
HF directory and converted to our checkpoint with tools/convert_checkpoint.py;
generate.py runs on both (one subprocess, since it sets up torch.distributed).
"""

import json
import subprocess
import sys

import pytest
import torch

from rlhf.cli import UsageError
from rlhf.testing.tools import load_tool

convert_checkpoint = load_tool("convert_checkpoint")

PROMPTS = [{"prompt": "Hello", "id": 1}, {"prompt": "RLHF on CPU: ", "id": 2}, {"prompt": "x", "id": 3}]
NEW_TOKENS = 12
EOS = 258


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    tmp = tmp_path_factory.mktemp("generate")
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=257, eos_token_id=EOS, pad_token_id=256)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # peaked distributions: no near-ties in the argmax
    hf_dir, ours = str(tmp / "hf"), str(tmp / "ours")
    model.save_pretrained(hf_dir)
    wide = LlamaForCausalLM(LlamaConfig(**dict(cfg.to_dict(), vocab_size=320))).eval()
    with torch.no_grad():
        wide.lm_head.weight.zero_()  # every id equally likely: sampling draws ids >= 259 (no byte token)
    wide.save_pretrained(str(tmp / "wide"))
    assert convert_checkpoint.main(["hf-to-ours", "--hf", hf_dir, "--out", ours]) == 0
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    common = ["--prompts", str(prompts), "--max-new-tokens", str(NEW_TOKENS), "--tokenizer", "byte"]
    argvs = {"hf": ["--load", hf_dir, "--out", str(tmp / "hf.jsonl"), "--greedy"] + common,
             "ours": ["--load", ours, "--out", str(tmp / "ours.jsonl"), "--greedy"] + common,
             "sampled": ["--load", ours, "--out", str(tmp / "s.jsonl"), "--top-k", "5", "--top-p", "0.9",
                         "--temperature", "0.7", "--seed", "1"] + common,
             "wide": ["--load", str(tmp / "wide"), "--out", str(tmp / "wide.jsonl"), "--seed", "2"] + common,
             "add_bos": ["--load", ours, "--out", str(tmp / "add_bos.jsonl"), "--greedy", "--add-bos"] + common,
             "no_bos": ["--load", ours, "--out", str(tmp / "no_bos.jsonl"), "--greedy", "--no-bos"] + common}
    too_long = tmp / "too_long.jsonl"
    too_long.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "x" * 100}) + "\n")
    overlong = ["--load", ours, "--out", str(tmp / "never.jsonl"), "--prompts", str(too_long), "--tokenizer", "byte"]
    bad_flag = argvs["ours"][:argvs["ours"].index("--out")] + ["--out", str(tmp / "never.jsonl"), "--top-k", "-1",
                                                                "--prompts", str(prompts), "--tokenizer", "byte"]
    code = ("from rlhf.testing.tools import load_tool; generate = load_tool('generate')\n"
            + "".join(f"assert generate.main({a!r}) == 0\n" for a in argvs.values())
            + f"assert generate.main({overlong!r}) == 2\n"
            + f"assert generate.main({bad_flag!r}) == 2\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {k: [json.loads(line) for line in open(a[a.index("--out") + 1])] for k, a in argvs.items()}
    out["refusals"] = [line for line in proc.stderr.splitlines() if line.startswith("generate.py: ")]
    out["notes"] = [line for line in proc.stdout.splitlines() if "outside the tokenizer's vocabulary" in line]
    return model, out


def _hf_greedy(model, prompt: str, bos: bool = True) -> list[int]:
    ids = torch.tensor([[257] * bos + list(prompt.encode())])
    out = model.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=256)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("source", ["hf", "ours"])
def test_greedy_matches_transformers_generate(runs, source):
    model, out = runs
    assert len(out[source]) == len(PROMPTS)
    for record, prompt in zip(out[source], PROMPTS):
        assert record["id"] == prompt["id"] and record["prompt"] == prompt["prompt"]
        assert record["completion_ids"] == _hf_greedy(model, prompt["prompt"])
        decoded = bytes(i for i in record["completion_ids"] if i < 256).decode("utf-8", errors="replace")
        assert record["completion"] == decoded


def test_bos_flags_choose_the_prompt_ids(runs):
    """--add-bos puts the BOS first (the byte tokenizer's own rule: the default's output); --no-bos encodes the
    text alone."""
    model, out = runs
    assert out["add_bos"] == out["ours"]
    assert [r["completion_ids"] for r in out["no_bos"]] == [_hf_greedy(model, p["prompt"], bos=False) for p in PROMPTS]


def test_sampling_runs_and_stops_at_limits(runs):
    _, out = runs
    for record in out["sampled"]:
        ids = record["completion_ids"]
        assert 1 <= len(ids) <= NEW_TOKENS and all(0 <= i < 259 for i in ids)
        assert EOS not in ids[:-1]


def test_prompt_longer_than_context_is_refused_with_its_line(runs):
    _, out = runs
    assert len(out["refusals"]) == 2
    message = out["refusals"][0]
    assert message.startswith("generate.py: ") and "too_long.jsonl:2:" in message and "101 tokens" in message


def test_invalid_sampling_flag_is_refused_naming_the_flag(runs):
    _, out = runs
    assert out["refusals"][1] == "generate.py: --top-k: top_k=-1 is invalid: must be >= 0 (0 disables)"


def test_ids_beyond_the_byte_tokenizer_decode_as_placeholders(runs):
    """A model of 320 ids with --tokenizer byte (259): ids >= 259 stay in completion_ids, their text is U+FFFD
    (the bytes around them decoded as usual), and one line says how many there were; no crash."""
    from rlhf.data import ByteTokenizer
    from rlhf.engine.completions import UNKNOWN_ID, decode_completion

    records = runs[1]["wide"]
    wide_ids = [i for r in records for i in r["completion_ids"] if i >= 259]
    assert wide_ids, "the uniform sampler drew no id >= 259"
    for r in records:  # the byte runs between placeholders decoded alone, special tokens skipped
        parts, run = [], bytearray()
        for i in r["completion_ids"]:
            if i < 256:
                run.append(i)
            elif i >= 259:
                parts, run = parts + [run.decode("utf-8", errors="replace"), UNKNOWN_ID], bytearray()
        assert r["completion"] == "".join(parts) + run.decode("utf-8", errors="replace")
    assert runs[1]["notes"] == [f"generate: {len(wide_ids)} generated ids are outside the tokenizer's vocabulary "
                                "(259 ids, the model's 320; --tokenizer byte): their text is '\ufffd', their ids "
                                "are in completion_ids"]
    assert decode_completion(ByteTokenizer(), [104, 300, 105, 258, 259]) == ("h\ufffdi\ufffd", 2)
    assert decode_completion(ByteTokenizer(), [0xC3, 0xA9, 257]) == ("\u00e9", 0)


def test_bos_flags_and_record_errors(tmp_path, capsys):
    from rlhf.data import ByteTokenizer
    from rlhf.engine.completions import read_prompts

    generate = load_tool("generate")
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "hi"}) + "\n")
    base = ["--load", "m", "--prompts", str(path), "--out", "o.jsonl"]

    def ids(add_bos):
        return [p.ids for p in read_prompts(str(path), ByteTokenizer(), add_bos)]

    assert ids(None) == ids(True) == [[257, 104, 105]]  # the byte tokenizer's own rule: BOS first
    assert ids(False) == [[104, 105]]
    with pytest.raises(SystemExit) as refused:
        generate.main(base + ["--add-bos", "--no-bos"])
    assert refused.value.code == 2
    assert "argument --no-bos: not allowed with argument --add-bos" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n\n{"text": "no prompt"}\n')
    with pytest.raises(UsageError, match=rf"^{bad}:3: no string field 'prompt'$"):
        read_prompts(str(bad), ByteTokenizer(), None)
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(UsageError, match=rf"^{bad}:2: invalid JSON \("):
        read_prompts(str(bad), ByteTokenizer(), None)
    with pytest.raises(UsageError, match="^--prompts .*nope.jsonl: prompt file not found"):
        read_prompts(str(tmp_path / "nope.jsonl"), ByteTokenizer(), None)
    bad.write_text("")
    with pytest.raises(UsageError, match=rf"^--prompts {bad}: no prompts in the file"):
        read_prompts(str(bad), ByteTokenizer(), None)
    path.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "\u00e9t\u00e9"}) + "\n")
    with pytest.raises(UsageError, match=rf"^{path}:2: token id 195 of the tokenizer is outside the model's "
                                         r"vocabulary \(vocab_size=128\)"):
        read_prompts(str(path), ByteTokenizer(), False, vocab_size=128)
    # flags and the output path are refused before the model (--load m does not exist) is read
    missing_out = base[:-1] + [str(tmp_path / "missing" / "o.jsonl")]
    assert generate.main(missing_out) == 2
    assert capsys.readouterr().err.startswith(f"generate.py: --out {tmp_path}/missing/o.jsonl: cannot write there")
    for flags, message in ((["--temperature", "inf"], "--temperature: temperature=inf is invalid: must be a finite"),
                           (["--top-p", "nan"], "--top-p: top_p=nan is invalid: must be in (0, 1]"),
                           (["--kv-blocks", "0"], "--kv-blocks: num_blocks=0 is invalid: must be >= 1"),
                           (["--seed", str(2**64)], "--seed: 18446744073709551616 is out of range; give a number in "
                                                    "[0, 4294967295]")):
        assert generate.main(missing_out + flags) == 2
        assert capsys.readouterr().err.startswith("generate.py: " + message)
