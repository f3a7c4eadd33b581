"""tools/generate.py on HF models with their own tokenizers: greedy ids equal transformers' generate.

A tiny random Llama and a tiny random Qwen2 (QKV bias), vocab_size=320, are
each saved with a byte-level BPE tokenizer of 300 ids that defines ``<s>`` but
adds nothing ("plain"), and with the same tokenizer plus a post-processor that
prepends ``<s>`` ("bos"); a tiny Qwen3 (QK-norm, head_dim 24 != 64 / 4) and a
tiny Qwen3-MoE (4 experts, top-2) with the plain one. generate.py must tokenize like
``AutoTokenizer(dir)(text)`` and may pick ids 300..319 (past the tokenizer,
inside the model's vocabulary) exactly when transformers does. A copy of
the plain Llama whose generation_config.json adds an end-of-turn id to
``eos_token_id`` must stop where transformers stops on either id.
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from rlhf.engine.completions import read_prompts

BOS, EOS = 0, 1  # the trainer puts the special tokens first
TOKENIZER_VOCAB, MODEL_VOCAB = 300, 320
NEW_TOKENS = 48
CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "Reinforcement learning from human feedback trains a policy with a reward model.",
    "A reward model scores the completions; the critic estimates their value.",
    "Tokens are bytes merged by byte pair encoding, one merge at a time.",
]
PROMPTS = [  # 1, 2, 7, 14, 16, 25, 32 and 40 tokens without the BOS
    "a",
    "The",
    "Hello there",
    "The quick brown fox",
    "A reward model scores the completions.",
    "A reward model scores the completions of the policy.",
    "The critic estimates the value of each token.",
    "Reinforcement learning trains a policy; the critic scores it.",
]
CONFIGS = [(family, tok) for family in ("llama", "qwen2") for tok in ("plain", "bos")] + [
    ("qwen3", "plain"), ("qwen3_moe", "plain")]


def _tokenizer_object():
    """Byte-level BPE trained on CORPUS to 300 ids; <s>=0 and </s>=1; no post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() == TOKENIZER_VOCAB and tok.token_to_id("<s>") == BOS
    return tok


def _save_tokenizer(tok, path: str, prepend_bos: bool) -> None:
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    if prepend_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)


def _tiny_model(family: str):
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    config_cls, model_cls, extra = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}), "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24}),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"num_experts": 4, "num_experts_per_tok": 2,
                                                            "norm_topk_prob": True, "moe_intermediate_size": 32}),
    }[family]
    cfg = config_cls(vocab_size=MODEL_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     bos_token_id=BOS, eos_token_id=EOS, **extra)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # peaked distributions: no near-ties in the argmax
    return model


def build_dirs(tmp) -> dict:
    """(family, tokenizer) -> (HF directory, model) for the CONFIGS."""
    torch.manual_seed(5)
    models = {family: _tiny_model(family) for family in ("llama", "qwen2", "qwen3", "qwen3_moe")}
    dirs = {}
    for family, tok_kind in CONFIGS:
        path = str(tmp / f"{family}_{tok_kind}")
        models[family].save_pretrained(path)
        _save_tokenizer(_tokenizer_object(), path, prepend_bos=tok_kind == "bos")
        dirs[family, tok_kind] = (path, models[family])
    return dirs


def with_end_of_turn(plain: tuple, tmp) -> tuple:
    """A copy of the ``plain`` (directory, model) whose generation_config.json lists ``[EOS, turn]``: ``turn`` is
    a token the greedy continuation of the longest prompt draws a quarter of the way in (an instruct model's
    end-of-turn token, here an ordinary id, so that stopping on it shows)."""
    from transformers import AutoTokenizer

    path, model = plain
    turn = hf_greedy(model, AutoTokenizer.from_pretrained(path)(PROMPTS[-1]).input_ids)[NEW_TOKENS // 4]
    copy = str(tmp / "llama_stop")
    shutil.copytree(path, copy)
    with open(f"{copy}/generation_config.json", encoding="utf-8") as f:
        config = json.load(f)
    with open(f"{copy}/generation_config.json", "w", encoding="utf-8") as f:
        json.dump(dict(config, eos_token_id=[EOS, turn]), f)
    return copy, model


def run_generate(dirs: dict, prompts: str, tmp) -> dict:
    """Run ``tools/generate.py --greedy`` on every directory in one subprocess; config -> output records."""
    outs = {cfg: str(tmp / f"{cfg[0]}_{cfg[1]}.jsonl") for cfg in dirs}
    argvs = [["--load", path, "--prompts", prompts, "--out", outs[cfg], "--greedy",
              "--max-new-tokens", str(NEW_TOKENS)] for cfg, (path, _) in dirs.items()]
    code = ("from rlhf.testing.tools import load_tool; generate = load_tool('generate')\n"
            + "".join(f"assert generate.main({a!r}) == 0\n" for a in argvs))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {cfg: [json.loads(line) for line in open(out)] for cfg, out in outs.items()}


def hf_greedy(model, ids: list[int], eos=EOS) -> list[int]:
    """transformers' greedy continuation of ``ids``, stopping at ``eos`` (an id or a list; included when reached)."""
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=EOS)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import AutoTokenizer, GenerationConfig

    tmp = tmp_path_factory.mktemp("hf_parity")
    dirs = build_dirs(tmp)
    dirs["llama", "stop"] = with_end_of_turn(dirs["llama", "plain"], tmp)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
    outputs = run_generate(dirs, str(prompts), tmp)
    results = {}
    for cfg, (path, model) in dirs.items():
        hf_ids = [AutoTokenizer.from_pretrained(path)(p).input_ids for p in PROMPTS]
        eos = GenerationConfig.from_pretrained(path).eos_token_id  # as transformers reads the directory
        expected = [hf_greedy(model, ids, eos) for ids in hf_ids]
        results[cfg] = dict(path=path, prompts=str(prompts), hf_ids=hf_ids, expected=expected, out=outputs[cfg],
                            eos=eos)
    return results


@pytest.mark.parametrize("tok_kind", ["plain", "bos"])
def test_prompt_ids_are_the_tokenizers_own(runs, tok_kind):
    from transformers import AutoTokenizer

    from rlhf.data import build_tokenizer

    run = runs["llama", tok_kind]
    tok = build_tokenizer(run["path"])
    ids = {add_bos: [p.ids for p in read_prompts(run["prompts"], tok, add_bos)]
           for add_bos in (None, True, False)}  # default, --add-bos, --no-bos
    assert ids[None] == run["hf_ids"]
    assert all((i[0] == BOS) == (tok_kind == "bos") for i in ids[None])
    text_ids = [AutoTokenizer.from_pretrained(run["path"])(p, add_special_tokens=False).input_ids for p in PROMPTS]
    assert ids[False] == text_ids
    assert ids[True] == [[BOS] + i for i in text_ids]


@pytest.mark.parametrize("family, tok_kind", CONFIGS + [("llama", "stop")])
def test_greedy_ids_equal_transformers_generate(runs, family, tok_kind):
    run = runs[family, tok_kind]
    assert [r["id"] for r in run["out"]] == list(range(len(PROMPTS)))
    assert [r["prompt"] for r in run["out"]] == PROMPTS
    assert [r["completion_ids"] for r in run["out"]] == run["expected"]


def test_reference_picks_ids_past_the_tokenizer_and_eos(runs):
    """The configurations exercise what a tokenizer-sized logit mask breaks, and stopping at EOS."""
    expected = [ids for run in runs.values() for ids in run["expected"]]
    assert any(i >= TOKENIZER_VOCAB for ids in expected for i in ids)
    assert any(ids[-1] == EOS and len(ids) < NEW_TOKENS for ids in expected)


def test_generation_config_end_of_turn_id_stops_generation(runs):
    """Every eos_token_id of generation_config.json stops generation (the tokenizer's stop_token_ids), the stop
    token kept as the completion's last id, as transformers returns it."""
    from rlhf.data import build_tokenizer

    run, plain = runs["llama", "stop"], runs["llama", "plain"]
    eos, turn = run["eos"]
    assert eos == EOS and build_tokenizer(run["path"]).stop_token_ids == (EOS, turn)
    stopped = [r["completion_ids"] for r in run["out"]]
    assert any(ids[-1] == turn and turn not in ids[:-1] and len(ids) < NEW_TOKENS for ids in stopped)
    for ids, unstopped in zip(stopped, (r["completion_ids"] for r in plain["out"])):
        assert ids == unstopped[:len(ids)]  # the same greedy tokens, up to the first stop id
