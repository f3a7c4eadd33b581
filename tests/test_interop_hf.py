"""HF interop: tiny random Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints -> our model at TP2 and PP2 -> HF again.

transformers is the oracle: our logits (and per-token values of a sequence
classifier) must match its to 1e-4 in fp32, and exporting the sharded model
back must reproduce the original safetensors exactly. ``llama_v67`` has a
vocabulary of 67 ids, which tp=2 does not divide: it runs padded (68 rows, and
256 with a whole TP slice of padding), its engine's greedy tokens must be
transformers' ``generate``, and its log-probs and entropy transformers'.
``qwen3`` has QK-norm and a head dimension of 24 (4 heads x 24 != hidden 64);
``qwen3_moe`` 4 experts, top-2, norm_topk_prob.
"""

import json
import os
import re
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from rlhf.checkpoint.convert import export_saved_model
from rlhf.checkpoint.hf import (HFConversionError, export_hf, fuse_qkv, hf_config_dict, hf_sources, read_hf_config,
                               read_hf_state, split_qkv)
from rlhf.checkpoint.sources import read_full_state
from rlhf.models import ModelConfig
from rlhf.models.naming import owning_stage
from rlhf.models.config import padded_vocab_size
from rlhf.testing.distributed import launch
from rlhf.testing.tools import load_tool

convert_checkpoint = load_tool("convert_checkpoint")

TOL = 1e-4
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


MOE = {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "moe_intermediate_size": 32}


def _hf_models():
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen2ForSequenceClassification, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig,
                              Qwen3MoeForCausalLM)

    return {
        "llama": (LlamaForCausalLM, LlamaConfig(rope_theta=5000.0, rms_norm_eps=1e-5, **SHAPE), "lm"),
        "qwen2_tied": (Qwen2ForCausalLM, Qwen2Config(tie_word_embeddings=True, rope_theta=1e6, **SHAPE), "lm"),
        "qwen2_score": (Qwen2ForSequenceClassification, Qwen2Config(num_labels=1, pad_token_id=0, **SHAPE), "value"),
        "llama_newhead": (LlamaForCausalLM, LlamaConfig(**SHAPE), "value"),
        "llama_v67": (LlamaForCausalLM, LlamaConfig(**{**SHAPE, "vocab_size": ODD_VOCAB}), "lm"),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(head_dim=24, tie_word_embeddings=True, rope_theta=1e6, **SHAPE),
                  "lm"),
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(router_aux_loss_coef=0.01, **MOE, **SHAPE), "lm"),
    }


ODD_VOCAB, NEW_TOKENS = 67, 10
PROMPTS = [[60, 2, 2, 41, 9, 33, 66], [12], [11, 3], [61, 14, 9, 0, 47, 16, 17, 20, 15, 34, 33]]  # [11, 3] -> 66


@torch.no_grad()
def _hf_reference(model) -> dict:
    """transformers' greedy tokens for PROMPTS, with their log-probs, the entropies there and the smallest
    top-1 / top-2 logit gap along the way (so a near-tie cannot make the comparison flaky)."""
    out = {"tokens": [], "lp": [], "entropy": [], "gap": float("inf")}
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, pad_token_id=0)
        tokens = gen[0, len(prompt):]
        logp = torch.log_softmax(model(gen).logits[0, len(prompt) - 1:-1].double(), -1)
        out["tokens"].append(tokens.tolist())
        out["lp"].append(logp.gather(-1, tokens[:, None]).squeeze(-1))
        out["entropy"].append(-(logp.exp() * logp).sum(-1))
        top2 = logp.topk(2).values
        out["gap"] = min(out["gap"], (top2[:, 0] - top2[:, 1]).min().item())
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("interop")
    torch.manual_seed(0)
    all_ids = torch.randint(0, SHAPE["vocab_size"], (2, 12))
    cases = []
    for i, (name, (cls, cfg, role)) in enumerate(_hf_models().items()):
        torch.manual_seed(100 + i)
        model = cls(cfg).eval()
        with torch.no_grad():  # larger weights than the default init, so mismatches show
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        path = str(root / name)
        model.save_pretrained(path)
        ids = all_ids % cfg.vocab_size
        with torch.no_grad():
            if role == "lm":
                expected = model(ids).logits
            elif name == "qwen2_score":  # per-token scores: the head on every position
                expected = model.score(model.model(ids).last_hidden_state).squeeze(-1)
            else:
                expected = None
        case = {"name": name, "dir": path, "role": role, "ids": ids, "expected": expected}
        if cfg.vocab_size == ODD_VOCAB:  # both layouts (tp 2 and 1) share one padded size
            case.update(padded=padded_vocab_size(ODD_VOCAB, 1, [2, 1]), prompts=PROMPTS, new_tokens=NEW_TOKENS,
                        reference=_hf_reference(model))
        cases.append(case)
    results = launch(2, "scenario_interop:run", cases=cases, out_root=str(root / "ours"))
    return cases, results


def _errs(results, key, field):
    return [r[key][field] for r in results if field in r[key]]


NAMES = ["llama", "qwen2_tied", "qwen2_score", "llama_v67", "qwen3", "qwen3_moe"]


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(setup, name, layout):
    _, results = setup
    errs = _errs(results, f"{name}/{layout}", "err")
    assert len(errs) == (2 if layout == "tp2" else 1)  # the last-stage ranks report
    assert max(errs) < TOL
    assert all(_errs(results, f"{name}/{layout}", "padding_inf"))  # padded ids (llama_v67's 67) are -inf


@pytest.mark.parametrize("padding", ["hf", "wide"])
def test_padded_vocab_engine_at_tp2_matches_transformers(setup, padding):
    """Greedy tokens equal transformers' generate; engine, training path and transformers agree on the
    log-probs (and the training path's entropy) within 1e-4 -- with 68 rows loaded from HF, and with 256
    rows (rank 1 all padding, padded output rows set to 10) loaded from our TP2 checkpoint."""
    cases, results = setup
    ref = next(c for c in cases if c["name"] == "llama_v67")["reference"]
    assert ref["gap"] > 1e-3  # no near-tie along transformers' greedy path (our logits are off by ~1e-6)
    for rank in results:
        ours = rank["llama_v67/padded"][padding]
        assert ours["tokens"] == ref["tokens"]
        for engine_lp, train_lp, hf_lp, entropy, hf_entropy in zip(ours["engine_lp"], ours["train_lp"], ref["lp"],
                                                                   ours["entropy"], ref["entropy"]):
            assert torch.allclose(torch.tensor(engine_lp), torch.tensor(train_lp), rtol=0, atol=TOL)
            assert torch.allclose(torch.tensor(train_lp, dtype=torch.float64), hf_lp, rtol=0, atol=TOL)
            assert torch.allclose(torch.tensor(entropy, dtype=torch.float64), hf_entropy, rtol=0, atol=TOL)


def test_padded_vocab_reshards_tp2_to_pp2(setup):
    _, results = setup
    errs = [r["llama_v67/padded"]["reshard_err"] for r in results if "reshard_err" in r["llama_v67/padded"]]
    assert len(errs) == 1 and errs[0] < TOL  # the PP2 last stage holds transformers' logits


def test_moe_at_ep2_matches_transformers_and_exports_back(setup, tmp_path):
    """Qwen3-MoE with its experts split over two ranks (DP2 x EP2): both ranks' logits are transformers', and
    the checkpoint they save holds every expert, exported back to the original tensors."""
    cases, results = setup
    errs = _errs(results, "qwen3_moe/ep2", "err")
    assert len(errs) == 2 and max(errs) < TOL
    case = next(c for c in cases if c["name"] == "qwen3_moe")
    out = export_saved_model(results[0]["qwen3_moe/ep2"]["root"], str(tmp_path / "hf"))
    original, exported = (load_file(os.path.join(d, "model.safetensors")) for d in (case["dir"], out))
    assert sorted(original) == sorted(exported) and all(torch.equal(original[k], exported[k]) for k in original)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_value_model_from_causal_lm_keeps_new_head(setup, layout):
    _, results = setup
    assert _errs(results, f"llama_newhead/{layout}", "head_kept") and all(
        _errs(results, f"llama_newhead/{layout}", "head_kept"))


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("name", NAMES)
def test_export_back_is_identical(setup, tmp_path, name, layout):
    cases, results = setup
    case = next(c for c in cases if c["name"] == name)
    out = export_saved_model(results[0][f"{name}/{layout}"]["root"], str(tmp_path / "hf"))
    original, exported = load_file(os.path.join(case["dir"], "model.safetensors")), \
        load_file(os.path.join(out, "model.safetensors"))
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) for k in original)
    assert read_hf_config(out) == read_hf_config(case["dir"])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_padded_vocab_checkpoint_holds_the_models_own_shapes(setup, layout):
    """Our checkpoint of a padded model stores 67 vocabulary rows, whatever the layout padded it to."""
    cases, results = setup
    case = next(c for c in cases if c["name"] == "llama_v67")
    _, _, saved = read_full_state(results[0][f"llama_v67/{layout}"]["root"], "actor")
    want = read_hf_state(case["dir"], read_hf_config(case["dir"]))
    assert saved["embedding.word_embeddings.weight"].shape == (ODD_VOCAB, SHAPE["hidden_size"])
    assert sorted(saved) == sorted(want) and all(torch.equal(saved[k], want[k]) for k in want)


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3", "qwen3_moe"])
def test_exported_dir_loads_in_transformers(setup, tmp_path, name):
    """transformers loads our export (Qwen3-MoE: one tensor per expert, as published) to the same logits."""
    from transformers import AutoModelForCausalLM

    cases, results = setup
    out = export_saved_model(results[0][f"{name}/pp2"]["root"], str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    original = AutoModelForCausalLM.from_pretrained(next(c for c in cases if c["name"] == name)["dir"]).eval()
    assert type(model) is type(original)
    assert model.config.tie_word_embeddings == original.config.tie_word_embeddings
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


def test_qwen3_configs_round_trip(setup):
    """config.json -> ours: QK-norm, the explicit head dimension and the MoE fields."""
    cases, _ = setup
    qwen3, moe = (read_hf_config(next(c for c in cases if c["name"] == n)["dir"]) for n in ("qwen3", "qwen3_moe"))
    assert (qwen3.family, qwen3.config.qk_norm, qwen3.config.kv_channels, qwen3.config.head_dim) == \
        ("qwen3", True, 24, 24)
    assert qwen3.config.tie_embeddings and not qwen3.config.qkv_bias and not qwen3.config.is_moe
    c = moe.config
    assert moe.family == "qwen3_moe" and c.qk_norm and c.kv_channels is None
    assert (c.num_experts, c.moe_router_topk, c.expert_ffn_hidden_size, c.moe_norm_topk_prob,
            c.moe_aux_loss_coeff, c.moe_z_loss_coeff, c.ffn_hidden_size) == (4, 2, 32, True, 0.01, 0.0, 96)


def test_fused_expert_layout_reads_as_per_expert(setup, tmp_path):
    """transformers' in-memory Qwen3-MoE state dict (experts.gate_up_proj / down_proj, 3-D) reads as the
    per-expert files that save_pretrained writes."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    cases, _ = setup
    src = next(c for c in cases if c["name"] == "qwen3_moe")["dir"]
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in load_file(os.path.join(src, "model.safetensors"))
    state = AutoModelForCausalLM.from_pretrained(src).state_dict()
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    info = read_hf_config(src)
    want, got = read_hf_state(src, info), read_hf_state(str(tmp_path), info)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def test_export_in_bf16_is_the_saved_weights_rounded_and_loads_in_transformers(setup, tmp_path):
    """ours-to-hf --dtype bf16: every tensor is the fp32 export's rounded to bf16, config.json says so, and
    transformers loads it as a bf16 model."""
    from transformers import AutoModelForCausalLM

    _, results = setup
    root = results[0]["llama/tp2"]["root"]
    fp32 = load_file(os.path.join(export_saved_model(root, str(tmp_path / "fp32")), "model.safetensors"))
    out = str(tmp_path / "bf16")
    assert convert_checkpoint.main(["ours-to-hf", "--load", root, "--out", out, "--dtype", "bf16"]) == 0
    bf16 = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(bf16) == sorted(fp32)
    assert all(bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], fp32[k].bfloat16()) for k in fp32)
    assert json.load(open(os.path.join(out, "config.json")))["torch_dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16


def test_tied_export_unties_a_diverged_output_layer(setup, tmp_path):
    cases, _ = setup
    info = read_hf_config(cases[1]["dir"])
    full = read_hf_state(cases[1]["dir"], info)
    assert torch.equal(full["output_layer.weight"], full["embedding.word_embeddings.weight"])  # copied on import
    full["output_layer.weight"] = full["output_layer.weight"] + 1.0
    out = export_hf(str(tmp_path), info.config, full)
    assert not read_hf_config(out).config.tie_embeddings
    assert torch.equal(load_file(os.path.join(out, "model.safetensors"))["lm_head.weight"], full["output_layer.weight"])


class _ReadSpy:
    """Wraps safetensors.safe_open and records every tensor name read."""

    def __init__(self, real):
        self.real, self.read = real, set()

    def __call__(self, *args, **kwargs):
        spy, handle = self, self.real(*args, **kwargs)

        class Handle:
            def __enter__(self):
                self.f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                spy.read.add(name)
                return self.f.get_tensor(name)

            def get_slice(self, name):  # a lazy handle: shape checks read the header only
                return self.f.get_slice(name)

        return Handle()


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_reads_only_its_own_tensors(setup, monkeypatch, stage):
    import safetensors

    cases, _ = setup
    info = read_hf_config(cases[0]["dir"])
    names = [n for n in hf_sources(info.config, "lm_head") if owning_stage(n, info.config.num_layers, 2) == stage]
    spy = _ReadSpy(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", spy)
    assert sorted(read_hf_state(cases[0]["dir"], info, names=names)) == sorted(names)
    ends = {0: {"model.embed_tokens.weight"}, 1: {"model.norm.weight", "lm_head.weight"}}[stage]
    assert spy.read and all(n.startswith(f"model.layers.{stage}.") or n in ends for n in spy.read)


def test_qkv_fuse_split_roundtrip():
    cfg = ModelConfig(hidden_size=64, num_attention_heads=8, num_kv_heads=2)
    q, k, v = torch.randn(64, 64), torch.randn(16, 64), torch.randn(16, 64)
    fused = fuse_qkv(q, k, v, cfg)
    # group 0 = q heads 0-3 (rows 0-31), then k head 0, then v head 0
    assert torch.equal(fused[:32], q[:32]) and torch.equal(fused[32:40], k[:8]) and torch.equal(fused[40:48], v[:8])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, cfg), (q, k, v)))


def test_unsupported_checkpoints_are_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(HFConversionError, match="unsupported architectures.*LlamaForCausalLM"):
        read_hf_config(str(tmp_path))
    assert convert_checkpoint.main(["hf-to-ours", "--hf", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    with pytest.raises(HFConversionError, match="no config.json"):
        read_hf_config(str(tmp_path / "missing"))
    assert convert_checkpoint.main(["ours-to-hf", "--load", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    with pytest.raises(SystemExit) as done:
        convert_checkpoint.main(["--help"])
    help_text = capsys.readouterr().out
    assert done.value.code == 0 and "hf-to-ours" in help_text and "ours-to-hf" in help_text


QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 320}
QWEN3_MOE = {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], **MOE}


@pytest.mark.parametrize("raw, message", [
    ({**QWEN3, "attention_bias": True}, r"Qwen3 attention_bias=true \(bias on o_proj too\) is not supported"),
    ({**QWEN3, "use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({**QWEN3, "layer_types": ["full_attention", "sliding_attention"]},
     r"layer_types \['sliding_attention'\] are not supported \(only 'full_attention'\)"),
    ({**QWEN3, "architectures": ["Qwen2ForCausalLM"]},
     r"head_dim=24 x heads=4 != hidden_size=64 \(Qwen2 has no separate head dimension\)"),
    ({**QWEN3_MOE, "decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported \(every layer must be MoE"),
    ({**QWEN3_MOE, "mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported \(every layer must be MoE"),
    ({**QWEN3_MOE, "num_experts": 1}, "num_experts=1; a Qwen3-MoE needs at least 2"),
    ({k: v for k, v in QWEN3_MOE.items() if k != "moe_intermediate_size"},
     r"missing field\(s\) \['moe_intermediate_size'\]"),
])
def test_qwen3_checkpoints_that_cannot_convert_are_refused(tmp_path, raw, message):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(HFConversionError, match=f"^{tmp_path}/config.json: {message}") as err:
        read_hf_config(str(tmp_path))
    assert "\n" not in str(err.value)


def test_qwen3_moe_config_reads_transformers_num_local_experts(tmp_path):
    """transformers 5 saves a Qwen3-MoE's expert count as num_local_experts; published files say num_experts."""
    raw = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_local_experts": 4}))
    cfg = read_hf_config(str(tmp_path)).config
    assert cfg.num_experts == 4 and cfg.moe_norm_topk_prob


MOE_CFG = ModelConfig(qk_norm=True, num_experts=4, moe_ffn_hidden_size=32)


@pytest.mark.parametrize("cfg, family, message", [
    (ModelConfig(qk_norm=True), "llama",
     "family 'llama' has no QK-norm but this model has QK-norm; export it as family 'qwen3'"),
    (ModelConfig(qk_norm=True, qkv_bias=True), "qwen3",
     "family 'qwen3' has no QKV bias but this model has QKV bias; no supported HF family has QKV bias and QK-norm"),
    (ModelConfig(qk_norm=True), "qwen2",
     "family 'qwen2' has QKV bias but this model has no QKV bias; export it as family 'qwen3'"),
    (MOE_CFG, "qwen3", "family 'qwen3' has no experts but this model has experts; export it as family 'qwen3_moe'"),
    (ModelConfig(qk_norm=True), "qwen3_moe",
     "family 'qwen3_moe' has experts but this model has no experts; export it as family 'qwen3'"),
    (ModelConfig(num_experts=4), None,
     "family 'qwen3_moe' has QK-norm but this model has no QK-norm; no supported HF family has experts"),
    (replace(MOE_CFG, moe_shared_expert_intermediate_size=40), None,
     "Qwen3-MoE has no shared expert: moe_shared_expert_intermediate_size=40 cannot be exported"),
    (ModelConfig(qkv_bias=True, kv_channels=24), None,
     r"Qwen2 has no separate head dimension: kv_channels=24 x heads=4 != hidden_size=64"),
])
def test_exports_no_hf_family_can_hold_are_refused(tmp_path, cfg, family, message):
    with pytest.raises(HFConversionError, match=f"^{message}$"):
        export_hf(str(tmp_path / "out"), cfg, {}, family=family)
    assert not (tmp_path / "out").exists()


def test_default_export_family_follows_the_model():
    families = {cfg: hf_config_dict(cfg)["architectures"] for cfg in (
        ModelConfig(), ModelConfig(qkv_bias=True), ModelConfig(qk_norm=True, kv_channels=24), MOE_CFG)}
    assert list(families.values()) == [["LlamaForCausalLM"], ["Qwen2ForCausalLM"], ["Qwen3ForCausalLM"],
                                       ["Qwen3MoeForCausalLM"]]
    moe = hf_config_dict(MOE_CFG, "sequence_classification")
    assert moe["architectures"] == ["Qwen3MoeForSequenceClassification"]
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["moe_intermediate_size"], moe["intermediate_size"],
            moe["decoder_sparse_step"], moe["mlp_only_layers"]) == (4, 2, 32, 128, 1, [])


def test_missing_weights_and_sharded_index(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    cases, _ = setup
    llama = cases[0]["dir"]
    info = read_hf_config(llama)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(open(os.path.join(llama, "config.json")).read())
    with pytest.raises(HFConversionError, match="no model.safetensors"):
        read_hf_state(str(tmp_path / "empty"), info)
    sharded = str(tmp_path / "sharded")
    AutoModelForCausalLM.from_pretrained(llama).save_pretrained(sharded, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    names = ["decoder.layers.1.mlp.linear_fc1.weight", "output_layer.weight"]
    got, want = read_hf_state(sharded, info, names=names), read_hf_state(llama, info)
    assert sorted(got) == sorted(names) and all(torch.equal(got[n], want[n]) for n in names)


def test_broken_hf_directories_are_refused_naming_the_file(setup, tmp_path, capsys):
    cases, _ = setup
    llama = cases[0]["dir"]

    def broken(name: str, edit) -> str:
        path = tmp_path / name
        shutil.copytree(llama, path)
        edit(path)
        return str(path)

    def truncate(file):
        return lambda p: (p / file).write_bytes((p / file).read_bytes()[:200])

    def wider(p):
        raw = json.loads((p / "config.json").read_text())
        raw["intermediate_size"] *= 2
        (p / "config.json").write_text(json.dumps(raw))

    cases = {broken("st", truncate("model.safetensors")): r"model.safetensors: cannot read safetensors \(.*\); "
                                                           "the file is truncated or not a safetensors file",
             broken("cfg", truncate("config.json")): "config.json: cannot read a Hugging Face config.json",
             broken("wide", wider): r"model.safetensors: tensor model.layers.0.mlp.down_proj.weight has shape "
                                    r"\[64, 96\] but config.json implies \[64, 192\]"}
    for path, message in cases.items():
        assert convert_checkpoint.main(["hf-to-ours", "--hf", path, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"convert_checkpoint.py: {path}/") and re.search(message, err), err
    out = str(tmp_path / "ok")
    assert convert_checkpoint.main(["hf-to-ours", "--hf", llama, "--out", out]) == 0
    capsys.readouterr()
    assert convert_checkpoint.main(["hf-to-ours", "--hf", llama, "--out", out]) == 2
    assert capsys.readouterr().err == (f"convert_checkpoint.py: --out {out}: iteration 0 already exists there; "
                                       "give another --out or --iteration\n")
