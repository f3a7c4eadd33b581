"""tools/generate.py: greedy decoding matches transformers' generate token for token.

A tiny random Llama with the byte tokenizer's vocabulary (259) is saved as an
HF directory and converted to our checkpoint with tools/convert_checkpoint.py;
generate.py runs on both (one subprocess, since it sets up torch.distributed).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)
import convert_checkpoint  # noqa: E402
import generate  # noqa: E402

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
    assert convert_checkpoint.main(["hf-to-ours", "--hf", hf_dir, "--out", ours]) == 0
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    common = ["--prompts", str(prompts), "--max-new-tokens", str(NEW_TOKENS), "--tokenizer", "byte"]
    argvs = {"hf": ["--load", hf_dir, "--out", str(tmp / "hf.jsonl"), "--greedy"] + common,
             "ours": ["--load", ours, "--out", str(tmp / "ours.jsonl"), "--greedy"] + common,
             "sampled": ["--load", ours, "--out", str(tmp / "s.jsonl"), "--top-k", "5", "--top-p", "0.9",
                         "--temperature", "0.7", "--seed", "1"] + common}
    code = (f"import sys; sys.path.insert(0, {TOOLS!r}); import generate\n"
            + "".join(f"assert generate.main({a!r}) == 0\n" for a in argvs.values()))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {k: [json.loads(line) for line in open(a[a.index("--out") + 1])] for k, a in argvs.items()}
    return model, out


def _hf_greedy(model, prompt: str) -> list[int]:
    ids = torch.tensor([[257] + list(prompt.encode())])
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


def test_sampling_runs_and_stops_at_limits(runs):
    _, out = runs
    for record in out["sampled"]:
        ids = record["completion_ids"]
        assert 1 <= len(ids) <= NEW_TOKENS and all(0 <= i < 259 for i in ids)
        assert EOS not in ids[:-1]


def test_decode_stops_at_eos():
    logits = torch.zeros(1, 1, 8)
    seq = iter([3, 5, 7, 1])
    got = generate.decode(lambda ids: logits.expand(1, ids.shape[1], 8), [0], 10, eos_id=7,
                          pick=lambda _: next(seq), max_len=100)
    assert got == [3, 5, 7]


def test_top_k_one_is_argmax():
    pick = generate.make_picker(generate.SamplingConfig(top_k=1, seed=0))
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert {pick(logits) for _ in range(10)} == {1}
    with pytest.raises(ValueError, match="top_p"):
        generate.SamplingConfig(top_p=0.0)
