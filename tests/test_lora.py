"""LoRA: ours at TP2xPP2 (and TP2xDP2 with the distributed optimizer) against an HF Llama with PEFT's LoRA.

The PEFT model's adapters are made non-zero (random B and A) and saved with
``save_pretrained``; ours loads the HF base and PEFT's files, so both start
equal. Then the same logits and adapter gradients on the first batch, and the
same adapters after 3 AdamW steps on the same 3 batches, within 1e-5
(tests/scenario_lora.py runs ours on 4 gloo ranks).
"""

import pytest
import torch

from rlhf.checkpoint.peft import peft_to_ours
from rlhf.testing.distributed import launch

TOL = 1e-5
LR = 1e-2
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=128)  # 2 KV groups per TP rank: q/k/v interleave
LEARN_FLAGS = ["--lora-rank", "8", "--lora-alpha", "16", "--lora-modules-to-save", "lm_head,norm", "--lr", "1e-2",
               "--critic-lora-rank", "8", "--critic-lr", "3e-3"]
LEARN_ITERATIONS = 12
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy of next-token prediction (as the scenario's)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _peft_reference(root) -> dict:
    """HF base + PEFT LoRA (random non-zero factors) saved under ``root``; its logits and adapter gradients on
    the first batch and its adapters after one AdamW step per batch."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(rms_norm_eps=1e-5, **SHAPE))
    with torch.no_grad():  # larger weights than the default init, so mismatches show
        for p in base.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    base.save_pretrained(root / "base")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS))
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in lora.values():
            p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root / "adapter")
    batches = [torch.randint(0, SHAPE["vocab_size"], (2, 12)) for _ in range(3)]
    opt = torch.optim.AdamW(lora.values(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    out = {"batches": batches}
    for step, ids in enumerate(batches):
        logits = model(ids).logits
        _loss(logits, ids).backward()
        if step == 0:
            out["logits"] = logits.detach()
            out["grads"] = peft_to_ours({n: p.grad.clone() for n, p in lora.items()})
        opt.step()
        opt.zero_grad()
    out["adapters"] = peft_to_ours(get_peft_model_state_dict(model))
    return out


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    reference = _peft_reference(root)
    results = launch(4, "scenario_lora:run", timeout_s=900, base_dir=str(root / "base"),
                     adapter_dir=str(root / "adapter"), batches=reference["batches"], lr=LR,
                     root=str(root / "ckpt"), learn_flags=LEARN_FLAGS, learn_iterations=LEARN_ITERATIONS)
    reference["ckpt"] = root / "ckpt"
    return reference, results


def test_trainer_trains_adapters_only_and_the_engine_runs_them(parity):
    """PPO with LoRA on actor and critic: B moves from zero, the frozen base does not (the critic's new value head
    trains), and the engine's log-probs equal the trainer's at every iteration, so actor_gen got the merged
    weights W + s B A after each update."""
    _, results = parity
    out = results[0]["trainer"]
    assert out["adapters"] == 2 * 7 * 2 + 2 * 2 * 2  # actor: 2 layers x 7 projections x (A, B); critic: q, v
    assert out["b_moved"] > 1e-3 and out["head_moved"] > 1e-4
    assert out["frozen_moved"] == 0.0
    assert max(out["mismatch"]) < 1e-4, out["mismatch"]


def test_lora_run_resumes_exactly(parity):
    """2 iterations, save, load into a fresh trainer, 2 more: the same weights (base and adapters) and metrics as
    4 straight."""
    _, results = parity
    out = results[0]["trainer"]
    assert out["resume_param_diff"] == 0.0
    for straight, resumed in zip(out["straight_metrics"], out["resumed_metrics"]):
        for key, value in straight.items():  # timings differ run to run
            if not key.startswith("time_") and not key.endswith("_per_s") and key != "training_bubble_fraction":
                assert resumed[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


def test_lora_checkpoint_holds_only_what_trains_and_refuses_another_base(parity):
    """The LoRA models' checkpoint files hold their adapters (and the critic's value head) with their optimizer
    state, no frozen base tensor, in fewer bytes than the base alone; loading it onto another base is refused
    in one line naming a tensor that differs."""
    from rlhf.models.lora import is_adapter

    _, results = parity
    out = results[0]["trainer"]
    sizes = {}
    for model, trained in (("actor", is_adapter), ("critic", lambda n: is_adapter(n) or n == "output_layer.weight")):
        names, size = out["contents"][model]
        weights = [n for n in names if "/" not in n]
        assert weights and all(trained(n) for n in weights), [n for n in weights if not trained(n)]
        assert {n.split("/", 1)[1] for n in names if "/" in n} == set(weights)  # exp_avg, exp_avg_sq, step
        assert size < out["base_bytes"][model] / 2, (model, size, out["base_bytes"][model])
        sizes[model] = (size, out["base_bytes"][model])
    print("checkpoint bytes (LoRA model files, frozen base left out):", sizes)
    refusal = out["refusal"]
    assert refusal is not None and "\n" not in refusal
    assert "holds LoRA adapters trained on another base than the one loaded now" in refusal
    assert "decoder.layers.0." in refusal or "embedding" in refusal, refusal


def test_reference_from_actor_base_is_the_initial_actor(parity):
    """--reference-from-actor-base: after 2 iterations the reference log-probs (actor_train, adapters disabled)
    equal a separately built reference's (a copy of the initial actor on ref_inf) on the same batch, while the
    policy's differ; no rank builds a reference model."""
    _, results = parity
    out = results[0]["reference_from_base"]
    assert out["ref_diff"] < 1e-5 and out["policy_vs_ref"] > 1e-3, out
    for r in results:
        assert "ref_inf" not in r["reference_from_base"]["models"]
    assert any("ref_inf" in r["reference_from_base"]["separate_models"] for r in results)


def test_tiny_default_learns_with_lora_and_the_output_layer_trained(parity):
    """The tiny default (random actor) with LoRA on every projection plus lm_head and the RMSNorms trained in
    full (--lora-modules-to-save), rewarded by the synthetic task's gold rule: the mean reward of the last 4 of
    12 iterations exceeds the first 4's by more than 0.08 (measured: 0.10 -> 0.41; plain LoRA stays near 0.1,
    docs/lora.md)."""
    _, results = parity
    rewards = results[0]["learns"]
    assert len(rewards) == LEARN_ITERATIONS
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.08, rewards


def test_lora_dropout_acts_in_training_forwards_only(parity):
    """--lora-dropout 0.5 on the tiny default with --recompute-logprobs (lr 1e-2, B trained from zero): actor_train's
    inference pass (the old log-probs) equals the engine's, mismatch_kl < 1e-6 in every iteration (it rose to
    4.3e-5 and 1.6e-4 when the pass ran with dropout). On one adapted rank: inference passes repeat exactly and
    leave the model in training mode; a training forward differs from them (dropout acts); megatron's full
    recompute draws the same masks in backward as in forward (the adapters' gradients equal the run without
    recompute from the same seed, where another seed's masks move them)."""
    _, results = parity
    out = results[0]["dropout"]
    assert len(out["mismatch_kl"]) == 3 and max(out["mismatch_kl"]) < 1e-6, out["mismatch_kl"]
    assert out["inference_repeat_diff"] == 0.0 and out["still_training"]
    assert out["train_vs_inference"] > 1e-3, out
    assert out["recompute_grad_diff"] < 1e-7 and out["other_masks_grad_diff"] > 1e-4, out


def _max_diff(ours: dict, theirs: dict) -> float:
    return max((torch.as_tensor(ours[n]) - theirs[n]).abs().max().item() for n in ours)


def _reports(results, layout):
    return [r[layout] for r in results if r[layout]["report"]]


@pytest.mark.parametrize("layout", ["tp2pp2", "tp2dp2"])
def test_logits_match_peft(parity, layout):
    reference, results = parity
    outs = [r[layout] for r in results if r[layout]["logits"] is not None]
    assert len(outs) == (2 if layout == "tp2pp2" else 4)
    for out in outs:
        expected = reference["logits"].chunk(2 if layout == "tp2dp2" else 1)[out["dp_rank"]]
        assert (torch.as_tensor(out["logits"])[..., :SHAPE["vocab_size"]] - expected).abs().max().item() < TOL


@pytest.mark.parametrize("layout", ["tp2pp2", "tp2dp2"])
def test_adapter_gradients_and_three_steps_match_peft(parity, layout):
    reference, results = parity
    reports = _reports(results, layout)
    grads = {n: g for r in reports for n, g in r["grads"].items()}
    adapters = {n: a for r in reports for n, a in r["adapters"].items()}
    assert sorted(adapters) == sorted(reference["adapters"])  # every PEFT factor, once, whatever the stage
    if layout == "tp2pp2":  # the distributed optimizer's reduce-scatter leaves each rank its part of the grads
        assert _max_diff(grads, reference["grads"]) < TOL
    assert _max_diff(adapters, reference["adapters"]) < TOL


@pytest.mark.parametrize("layout", ["tp2pp2", "tp2dp2"])
def test_only_adapters_are_trained(parity, layout):
    _, results = parity
    for r in results:
        out = r[layout]
        assert out["trained"] and all(".lora." in n for n in out["trained"])
        assert len(out["trained"]) == out["adapters_here"]
        assert out["optimized"] >= 1


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "8", "--lora-target-modules", "q_proj,qkv_proj"],
     "--lora-target-modules: target module 'qkv_proj' does not exist; the projections are q_proj, k_proj, v_proj, "
     "o_proj, gate_proj, up_proj, down_proj"),
    (["--lora-rank", "65"], "--lora-rank: the actor's rank 65 is larger than q_proj's smaller dimension 64"),
    (["--critic-lora-rank", "8", "--critic-lora-target-modules", "down_proj,lm_head"],
     "--critic-lora-target-modules: target module 'lm_head' does not exist"),
    (["--critic-lora-rank", "49"], "--critic-lora-rank: the critic's rank 49 is larger than q_proj's smaller "
                                   "dimension 48"),
    (["--lora-rank", "8", "--lora-dropout", "1"], "--lora-dropout: dropout must be in [0, 1), got 1.0"),
    (["--lora-rank", "8", "--lora-modules-to-save", "lm_head,score"],
     "--lora-modules-to-save: modules_to_save ('lm_head', 'score'): name each of lm_head, embed_tokens, norm at "
     "most once"),
    (["--critic-lora-rank", "8", "--critic-lora-modules-to-save", "lm_head"],
     "--critic-lora-modules-to-save: the critic has no lm_head: its value head (PEFT's score) is trained already"),
    (["--reference-from-actor-base"], "--reference-from-actor-base: reference_from_actor_base takes the reference "
                                      "log-probs from the actor's base (its adapters disabled), but the actor has "
                                      "no LoRA adapters; give --lora-rank R"),
    (["--lora-rank", "8", "--lora-modules-to-save", "norm", "--reference-from-actor-base"],
     "--reference-from-actor-base: reference_from_actor_base takes the reference log-probs from the actor's base "
     "(its adapters disabled), but the actor's modules_to_save (norm) are trained in full"),
])
def test_bad_lora_flags_name_their_flag(argv, message):
    from rlhf.cli import UsageError
    from rlhf.ppo.arguments import parse_args

    with pytest.raises(UsageError) as exc:
        parse_args(argv)
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_lora_on_a_quantized_model_names_the_flag(tmp_path):
    """A GGUF file, or an HF directory that declares a quantization, cannot take adapters: dequantize first."""
    from rlhf.cli import UsageError
    from rlhf.ppo.arguments import parse_args

    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(UsageError) as exc:
        parse_args(["--actor-model", str(gguf), "--lora-rank", "8"])
    assert str(exc.value).startswith(f"--lora-rank: LoRA adapts the actor's float weights, but --actor-model {gguf} "
                                     "is a GGUF quantized file; dequantize it first: tools/convert_checkpoint.py "
                                     "gguf-to-hf")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "quantization_config": '
                                    '{"quant_method": "gguf"}}')
    with pytest.raises(UsageError) as exc:
        parse_args(["--critic-model", str(hf), "--critic-lora-rank", "8"])
    assert str(exc.value).startswith(f"--critic-lora-rank: LoRA adapts the critic's float weights, but --critic-model "
                                     f"{hf} is quantized (gguf)")


def test_lora_flags_reach_the_config():
    from rlhf.models.config import LoRAConfig
    from rlhf.ppo.arguments import parse_args

    cfg = parse_args(["--lora-rank", "8", "--lora-alpha", "16", "--lora-target-modules", "q_proj,v_proj",
                      "--critic-lora-rank", "4", "--critic-lora-target-modules", "all-linear"])
    assert cfg.lora.for_model("actor") == LoRAConfig(8, 16.0, 0.0, ("q_proj", "v_proj"))
    assert cfg.lora.for_model("actor").scaling == 2.0
    assert cfg.lora.for_model("critic") == LoRAConfig(4)
    assert parse_args([]).lora.for_model("actor") is None  # rank 0: full fine-tuning
    saved = parse_args(["--lora-rank", "8", "--lora-modules-to-save", "lm_head,norm"]).lora.for_model("actor")
    assert saved.modules_to_save == ("lm_head", "norm")


def test_reference_from_actor_base_places_no_reference():
    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.layout import job_plan

    cfg = parse_args(["--lora-rank", "8", "--reference-from-actor-base"])
    assert "ref_inf" not in cfg.needed_tasks() and "ref_inf" not in job_plan(cfg, 4)
    assert "ref_inf" in job_plan(parse_args(["--lora-rank", "8"]), 4)


def _convert(*argv) -> None:
    from rlhf.testing.tools import load_tool

    assert load_tool("convert_checkpoint").main([str(a) for a in argv]) == 0


def _peft_with_saved_modules(root):
    """An HF base and PEFT LoRA on q, v and down with modules_to_save lm_head and norm (every RMSNorm), all of
    them changed from their start, saved under ``root``; returns the live PeftModel."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    base = LlamaForCausalLM(LlamaConfig(rms_norm_eps=1e-5, **SHAPE))
    base.save_pretrained(root / "base")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            modules_to_save=["lm_head", "norm"]))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(root / "adapter")
    return model.eval()


def test_peft_adapters_with_modules_to_save_round_trip_through_ours(tmp_path):
    """peft-to-ours, then ours-to-peft and ours-to-hf: PeftModel.from_pretrained on the exported base and
    adapter gives PEFT's own logits, and the exported tensors are PEFT's, bit for bit."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    original = _peft_with_saved_modules(tmp_path)
    _convert("peft-to-ours", "--peft", tmp_path / "adapter", "--hf", tmp_path / "base", "--out", tmp_path / "ours")
    _convert("ours-to-peft", "--load", tmp_path / "ours", "--out", tmp_path / "peft")
    _convert("ours-to-hf", "--load", tmp_path / "ours", "--out", tmp_path / "hf")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    exported = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert sorted(exported) == sorted(saved) and any("lm_head" in n for n in saved)
    assert all(torch.equal(exported[n], saved[n]) for n in saved)
    loaded = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "hf"), tmp_path / "peft").eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 12))
    with torch.no_grad():
        assert (loaded(ids).logits - original(ids).logits).abs().max().item() < 1e-6


def test_a_peft_adapter_that_does_not_fit_the_model_is_one_line(tmp_path, capsys):
    """A rank in adapter_config.json that its tensors do not have, and adapters for another model's shape."""
    import json

    from rlhf.testing.tools import load_tool

    _peft_with_saved_modules(tmp_path)
    config = tmp_path / "adapter" / "adapter_config.json"
    raw = json.loads(config.read_text())
    config.write_text(json.dumps(dict(raw, r=8)))
    capsys.readouterr()  # save_pretrained's progress bars
    argv = ["peft-to-ours", "--peft", str(tmp_path / "adapter"), "--hf", str(tmp_path / "base"), "--out"]
    assert load_tool("convert_checkpoint").main(argv + [str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"convert_checkpoint.py: --peft {tmp_path / 'adapter'} on --hf {tmp_path / 'base'}: "
                          "adapter decoder.layers.0.mlp.linear_fc2.lora.down_proj.A is (4, 96), the model "
                          "(rank 8, targets q_proj,v_proj,down_proj, 2 layers) needs (8, 96)") and "\n" not in err
    config.write_text(json.dumps(raw))
    cfg = json.loads((tmp_path / "base" / "config.json").read_text())
    (tmp_path / "base" / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=128)))
    assert load_tool("convert_checkpoint").main(argv + [str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert "down_proj.A is (4, 96), the model" in err and "needs (4, 128)" in err and "\n" not in err


NEW_TOKENS = 12  # the synthetic trainer's model holds 32 positions
EOS = 1


def _word_tokenizer(path) -> None:
    """An HF tokenizer of the model's 320 ids, one word each (``t<i>``; <s> 0, </s> 1), so any id it generates
    decodes; saved in ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": EOS, **{f"t{i}": i for i in range(2, 320)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)


def _generate(model_dir, tokenizer, prompts, out) -> list:
    """tools/generate.py --greedy on ``model_dir`` (one process, as test_hf_generate_parity runs it): the
    completion ids per prompt."""
    import json
    import subprocess
    import sys

    argv = ["--load", str(model_dir), "--tokenizer", str(tokenizer), "--prompts", str(prompts), "--out", str(out),
            "--greedy", "--max-new-tokens", str(NEW_TOKENS)]
    code = f"from rlhf.testing.tools import load_tool; assert load_tool('generate').main({argv!r}) == 0"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["completion_ids"] for line in open(out)]


def test_exported_peft_adapter_generates_as_our_engine(parity, tmp_path):
    """The PPO run's LoRA checkpoint (2 iterations): transformers + PEFT on ours-to-hf's base and ours-to-peft's
    adapter give the greedy continuations our engine (tools/generate.py) gives on the merged weights
    (ours-to-hf --merge-adapters), on 8 prompts of 1 to 15 tokens; and the adapters change the logits."""
    import json

    from peft import PeftModel
    from transformers import LlamaForCausalLM

    ckpt = parity[0]["ckpt"]
    _convert("ours-to-hf", "--load", ckpt, "--out", tmp_path / "base")
    _convert("ours-to-peft", "--load", ckpt, "--out", tmp_path / "peft")
    _convert("ours-to-hf", "--load", ckpt, "--merge-adapters", "--out", tmp_path / "merged")
    _word_tokenizer(tmp_path / "tok")
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (1, 2, 3, 5, 8, 10, 13, 15)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"t{i}" for i in p)}) + "\n" for p in ids))
    ours = _generate(tmp_path / "merged", tmp_path / "tok", prompts, tmp_path / "out.jsonl")
    base = LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    with torch.no_grad():
        plain = [base(torch.tensor([i])).logits for i in ids]
    model = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    theirs = []
    with torch.no_grad():
        for i, before in zip(ids, plain):
            assert (model(torch.tensor([i])).logits - before).abs().max().item() > 1e-3  # the adapters act
            out = model.generate(torch.tensor([i]), attention_mask=torch.ones(1, len(i), dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=EOS, pad_token_id=EOS)
            theirs.append(out[0, len(i):].tolist())
    assert ours == theirs


def test_a_lora_checkpoint_as_a_starting_model_is_refused(parity):
    """Its adapters would be left out: --actor-model (or tools/generate.py --load) on it names the fix."""
    from rlhf.checkpoint.sources import ModelSourceError, open_source

    with pytest.raises(ModelSourceError) as exc:
        open_source(str(parity[0]["ckpt"]), "actor")
    assert "has LoRA adapters; export it merged first: tools/convert_checkpoint.py ours-to-hf" in str(exc.value)
