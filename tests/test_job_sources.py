"""pretrain_rlhf.py from files: HF and our-checkpoint models, an HF tokenizer, a prompt file, --reward-fn.

transformers is the oracle. One 4-rank run starts the actor from a tiny HF
Llama (with a word-level HF tokenizer, the default --tokenizer), the
reference from our checkpoint of another Llama, the critic from the actor's
directory (a new value head) and the reward model from a Qwen2
SequenceClassification, greedy, on a JSONL prompt file, with a recording
--reward-fn logged beside the reward model. Its first iteration must show
transformers' numbers: the prompts are AutoTokenizer's ids, the responses
are transformers' greedy generate, kl_mean is the actor/reference KL that
transformers computes and reward_mean the HF reward model's score. A 2-rank
run with only --reward-fn must score by the function alone, going on past
the NaN and infinite scores it returns with --skip-nonfinite-samples, and
one whose function returns one score for the batch must stop every rank
naming the flag. Bad inputs are refused in-process by the argument parser and the job.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf.ppo.arguments import flag_of, parse_args, tokenizer_name
from rlhf.checkpoint.convert import hf_to_ours
from rlhf.checkpoint.hf import read_hf_config, read_hf_state
from rlhf.checkpoint.sources import open_source, read_weights
from rlhf.cli import UsageError
from rlhf.config import ConfigError
from rlhf.parallel import Placement
from rlhf.ppo import layout
from rlhf.tasks import MODELS

ROOT = Path(__file__).resolve().parents[1]
BOS, EOS = 0, 1
WORDS = "the a cat dog sat ran on under mat log big small red blue and then".split()
PROMPTS = ["the cat sat on the mat", "a dog ran", "the big red dog sat under a log", "cat and dog",
           "the small blue cat ran then sat", "a mat", "the dog sat on a big log and then ran", "red cat"]
SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, bos_token_id=BOS, eos_token_id=EOS)
RESPONSE_LEN = 8
RUN = ["--temperature", "0", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--ppo-mini-batch-size",
       "8", "--micro-batch-size", "2", "--max-prompt-len", "16", "--max-response-len", str(RESPONSE_LEN),
       "--no-progress"]


# ---- files -------------------------------------------------------------------------------

def _save_tokenizer(path: str) -> None:
    """A word-level HF tokenizer over WORDS (<s>=0, </s>=1, <unk>=2) whose post-processor prepends <s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<s>", "</s>", "<unk>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(path)


def _hf_model(cls, config, seed: int, scale: float = 1.0, noise: float = 0.05):
    """A random HF model: weights times ``scale`` plus normal noise (larger than the default init)."""
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale).add_(torch.randn_like(p) * noise)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The HF models (kept in memory as the oracle), their directories, our checkpoint and the prompt file."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForSequenceClassification

    root = tmp_path_factory.mktemp("sources")
    out = {"root": root}
    # the actor's weights x8: peaked distributions, so greedy decoding has no near-ties
    out["actor"] = _hf_model(LlamaForCausalLM, LlamaConfig(**SHAPE), seed=1, scale=8.0)
    out["reference"] = _hf_model(LlamaForCausalLM, LlamaConfig(**SHAPE), seed=2)
    out["reward"] = _hf_model(Qwen2ForSequenceClassification, Qwen2Config(num_labels=1, pad_token_id=EOS, **SHAPE),
                              seed=3)
    for name in ("actor", "reference", "reward"):
        out[f"{name}_dir"] = str(root / name)
        out[name].save_pretrained(out[f"{name}_dir"])
    _save_tokenizer(out["actor_dir"])
    # the reference as our checkpoint, under the converter's default model name "actor"
    out["reference_ckpt"] = str(root / "reference_ckpt")
    hf_to_ours(out["reference_dir"], out["reference_ckpt"])
    out["prompts"] = str(root / "prompts.jsonl")
    Path(out["prompts"]).write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
    return out


def _torchrun(tmp: Path, *flags, nproc: int):
    """pretrain_rlhf.py on ``nproc`` CPU ranks; the reward functions' module is on the path, their record in tmp."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "pretrain_rlhf.py"), *flags, "--metrics-file", str(tmp / "metrics.jsonl")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "tests"),
               RLHF_TEST_RECORD=str(tmp / "record.jsonl"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    return proc, _jsonl(tmp / "metrics.jsonl"), _jsonl(tmp / "record.jsonl")


def _jsonl(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- one run from files on 4 ranks, checked against transformers ------------------------

@pytest.fixture(scope="module")
def hf_run(files, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_run")
    proc, metrics, records = _torchrun(
        tmp, "--actor-model", files["actor_dir"], "--reference-model", files["reference_ckpt"],
        "--critic-model", files["actor_dir"], "--reward-model", files["reward_dir"],
        "--prompt-data", files["prompts"], "--reward-fn", "scenario_job_sources:record", "--iterations", "1", *RUN,
        nproc=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(metrics) == 1 and len(records) == 1  # rank 0 alone calls the function, once per iteration
    return proc.stdout, metrics[0], records[0]


def _logprobs(model, prompt: list, response: list) -> torch.Tensor:
    """[R] log-probs of the response tokens under an HF causal LM."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[positions, torch.tensor(response)]


def _score(model, prompt: list, response: list) -> float:
    """The HF sequence classifier's score at the last token of prompt + response."""
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt + response])).last_hidden_state
        return float(model.score(hidden)[0, -1, 0])


def test_prompts_are_the_hf_tokenizers_ids(files, hf_run):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(files["actor_dir"])
    expected = [tok(p).input_ids for p in PROMPTS]
    _, _, record = hf_run
    assert all(p in expected and p[0] == BOS for p in record["prompts"])
    assert len({tuple(p) for p in record["prompts"]}) == 4  # 4 prompts x 2 samples


def test_actor_starts_from_the_hf_weights(files, hf_run):
    """Greedy responses (generated on actor_gen TP2, resharded from actor_train TP2xPP2) equal transformers'."""
    _, _, record = hf_run
    for prompt, response in zip(record["prompts"], record["responses"]):
        ids = torch.tensor([prompt])
        out = files["actor"].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=RESPONSE_LEN, eos_token_id=EOS, pad_token_id=EOS)
        assert response == out[0, len(prompt):].tolist()


def test_reference_starts_from_its_checkpoint(files, hf_run):
    """kl_mean of the first iteration (k1, per sequence) is transformers' actor/reference KL on the samples."""
    _, metrics, record = hf_run
    kl = [float((_logprobs(files["actor"], p, r) - _logprobs(files["reference"], p, r)).sum())
          for p, r in zip(record["prompts"], record["responses"])]
    assert abs(kl[0]) > 1.0  # a reference that differs from the actor
    assert metrics["kl_mean"] == pytest.approx(np.mean(kl), rel=1e-5, abs=1e-4)


def test_reward_is_the_hf_reward_models_score(files, hf_run):
    stdout, metrics, record = hf_run
    scores = [_score(files["reward"], p, r) for p, r in zip(record["prompts"], record["responses"])]
    assert metrics["reward_mean"] == pytest.approx(np.mean(scores), abs=1e-5)
    assert metrics["reward_std"] == pytest.approx(np.std(scores), abs=1e-5)
    assert metrics["nonfinite_samples_dropped"] == 0  # logged without --skip-nonfinite-samples too
    assert f"reward: the reward model's score ({files['reward_dir']}); gold_reward_mean: " \
           "scenario_job_sources:record" in stdout.splitlines()


def test_reward_fn_is_logged_as_gold_beside_the_model(hf_run):
    _, metrics, record = hf_run
    assert metrics["gold_reward_mean"] == pytest.approx(np.mean(record["scores"]), abs=1e-6)


# ---- --reward-fn alone, and a function the job refuses -----------------------------------

@pytest.fixture(scope="module")
def fn_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fn_run")
    proc, metrics, records = _torchrun(tmp, "--reward-fn", "scenario_job_sources:record_some_non_finite",
                                       "--skip-nonfinite-samples", "--iterations", "2", *RUN, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, metrics, records


def test_reward_fn_alone_is_the_reward(fn_run):
    """Every rank trains on rank 0's scores: the rank mean of reward_mean is the mean of the recorded finite ones,
    noise included; with --skip-nonfinite-samples the NaN and the infinity of each batch (8 samples on 2 DP
    replicas) are dropped and counted, and the run goes on."""
    stdout, metrics, records = fn_run
    assert [m["iteration"] for m in metrics] == [1, 2] and len(records) == 2
    for m, record in zip(metrics, records):
        finite = [s for s in record["scores"] if math.isfinite(s)]
        assert len(record["scores"]) == 8 and len(finite) == 6
        assert m["reward_mean"] == pytest.approx(np.mean(finite), abs=1e-6)
        assert m["reward_max"] == pytest.approx(max(finite), abs=1e-6) and m["nonfinite_samples_dropped"] == 2
        assert "gold_reward_mean" not in m
    lines = stdout.splitlines()
    assert ("reward: scenario_job_sources:record_some_non_finite (no reward model: reward_inf does not run)"
            in lines)
    assert not any(line.startswith("reward model:") for line in lines)


def test_reward_fn_with_a_wrong_count_stops_every_rank(tmp_path):
    proc, metrics, _ = _torchrun(tmp_path, "--reward-fn", "scenario_job_sources:one_score", "--iterations", "1",
                                 *RUN, nproc=2)
    assert proc.returncode != 0 and metrics == []
    assert ("pretrain_rlhf.py: --reward-fn: scenario_job_sources:one_score returned 1 score(s) for 8 samples; it "
            "must return a list of one number per sample") in proc.stderr


# ---- refusals, in-process ----------------------------------------------------------------

def _refusal(argv) -> str:
    with pytest.raises(UsageError) as exc:
        parse_args(argv)
    return str(exc.value)


def test_model_flags_refuse_what_cannot_play_the_part(files, tmp_path):
    actor, reward, ckpt = files["actor_dir"], files["reward_dir"], files["reference_ckpt"]
    (tmp_path / "empty").mkdir()
    assert _refusal(["--actor-model", str(tmp_path / "empty")]) == (
        f"--actor-model {tmp_path / 'empty'}: {tmp_path / 'empty'} is neither a Hugging Face model directory "
        "(no config.json), a Megatron-LM checkpoint (no latest_checkpointed_iteration.txt) nor our checkpoint root "
        "(no 'latest' file, no iter_* directory)")
    assert _refusal(["--actor-model", reward]).startswith(
        f"--actor-model {reward}: {reward} (Qwen2ForSequenceClassification) is a value model; the actor is a "
        "language model: give a *ForCausalLM directory")
    assert _refusal(["--reward-model", actor]).startswith(
        f"--reward-model {actor}: {actor} (LlamaForCausalLM) is a language model without a value head; the reward "
        "model is frozen, so it needs a trained one")
    assert _refusal(["--reward-model", ckpt]).startswith(
        f"--reward-model {ckpt}: checkpoint {ckpt}/iter_0000000 holds model(s) ['actor'], none named 'reward'")
    assert _refusal(["--critic-model", ckpt, "--reference-model", reward]).startswith(
        f"--reference-model {reward}: {reward} (Qwen2ForSequenceClassification) is a value model")
    assert _refusal(["--reference-model", "tiny"]) == (
        "--reference-model tiny: not a directory; give an HF model directory or our checkpoint root")


def test_a_reward_checkpoint_of_a_language_model_is_refused(files, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    hf_to_ours(files["actor_dir"], ckpt, model_name="reward", role="lm")
    assert "model 'reward' of checkpoint" in _refusal(["--reward-model", ckpt])
    assert "(role 'lm') is a language model without a value head" in _refusal(["--reward-model", ckpt])


def test_shapes_come_from_the_directories(files, tmp_path):
    """The job (and Placement.validate_models) sees the directory's shape; a vocabulary TP2 cannot split fails."""
    from transformers import LlamaConfig

    cfg = parse_args(["--actor-model", files["actor_dir"], "--reference-model", files["reference_ckpt"],
                      "--critic-model", files["actor_dir"], "--reward-model", files["reward_dir"]])
    hf = read_hf_config(files["actor_dir"]).config
    assert cfg.models.actor == cfg.models["reference"] == hf and cfg.models.critic == hf
    assert cfg.models["reward"] == read_hf_config(files["reward_dir"]).config and cfg.models["reward"].qkv_bias
    assert dict(cfg.models.weights) == {"actor": files["actor_dir"], "reference": files["reference_ckpt"],
                                        "critic": files["actor_dir"], "reward": files["reward_dir"]}
    odd = str(tmp_path / "odd")
    LlamaConfig(**dict(SHAPE, vocab_size=321), architectures=["LlamaForCausalLM"]).save_pretrained(odd)
    cfg = parse_args(["--actor-model", odd, "--critic-model", odd])  # a preset critic would have 259 ids
    placement = Placement.from_plan(layout.job_plan(cfg, 4), 4)
    placement.validate_models({m: cfg.models[m] for m in MODELS})  # tp 2 need not divide 321: rows are padded
    assert layout.padded_vocab_size(cfg, "actor", placement) == 322


def test_smaller_vocabulary_than_the_actor_is_refused(tmp_path):
    shape = tmp_path / "critic.json"
    shape.write_text(json.dumps({"vocab_size": 256}))
    assert _refusal(["--critic-model", str(shape)]).startswith(
        "--critic-model: the critic model's vocab_size=256 is smaller than the actor's 259")
    # GRPO builds no critic, and a reward function replaces the reward model: neither shape matters
    parse_args(["--critic-model", str(shape), "--advantage-estimator", "grpo",
                "--reward-fn", "rlhf.data.synthetic:gold_reward"])


@pytest.mark.parametrize("argv,message", [
    (["--prompt-data", "{prompts}"], "--prompt-data: prompt data needs a reward source: a reward model "
                                     "(--reward-model DIR), a reward function (--reward-fn MODULE:FUNCTION) or both"),
    (["--tokenizer", "{actor_dir}"], "--tokenizer: tokenizer '{actor_dir}' needs prompt data (--prompt-data)"),
    (["--tokenizer", "nowhere"], "--tokenizer: tokenizer='nowhere' is neither 'byte' nor a directory"),
    (["--prompt-data", "missing.jsonl"], "--prompt-data: prompt_data='missing.jsonl' is not a file"),
    (["--messages-field", "chat"], "--messages-field: messages_field applies to prompt data"),
    (["--reward-fn", "gold_reward"], "--reward-fn: reward_fn='gold_reward' is not MODULE:FUNCTION"),
    (["--prompt-data", "{prompts}", "--reward-fn", "m:f", "--prompt-overlong", "cut"],
     "--prompt-overlong: PromptDatasetConfig.overlong='cut': must be 'reject' or 'truncate_left'"),
])
def test_data_and_reward_flags_refuse_bad_values(files, argv, message):
    fill = {"prompts": files["prompts"], "actor_dir": files["actor_dir"]}
    assert _refusal([a.format(**fill) for a in argv]).startswith(message.format(**fill))


def test_tokenizer_beyond_the_actors_vocabulary_is_refused(tmp_path):
    from rlhf.ppo.job import job_tokenizer

    shape = tmp_path / "actor.json"
    shape.write_text(json.dumps({"vocab_size": 256}))
    with pytest.raises(ConfigError) as exc:
        job_tokenizer(parse_args(["--actor-model", str(shape)]))
    assert flag_of(exc.value.field_name) == "--tokenizer"
    assert str(exc.value).startswith("tokenizer 'byte' has 259 ids, more than the actor's vocab_size=256 "
                                     "(--actor-model)")


def test_default_tokenizer_comes_with_the_actor(files, tmp_path):
    """With prompt data the actor directory's tokenizer is the job's, and a preset model has its ids."""
    def tokenizer(actor, *flags):
        cfg = parse_args(["--actor-model", actor, "--critic-model", files["actor_dir"], *flags])
        return tokenizer_name(cfg.data, cfg.models.weights)

    with_data = ["--prompt-data", files["prompts"], "--reward-fn", "m:f"]
    assert tokenizer(files["actor_dir"], *with_data) == files["actor_dir"]
    assert tokenizer(files["actor_dir"]) == "byte"  # the synthetic task
    ckpt = str(tmp_path / "ckpt")  # a converted checkpoint keeps the tokenizer in <root>/tokenizer
    hf_to_ours(files["actor_dir"], ckpt)
    assert tokenizer(ckpt, *with_data) == os.path.join(ckpt, "tokenizer")
    assert tokenizer(files["reference_ckpt"], *with_data) == "byte"
    # a tiny-critic preset beside the HF actor (GRPO builds no critic: the actor's 320 ids need not fit in it)
    cfg = parse_args(["--actor-model", files["actor_dir"], *with_data, "--advantage-estimator", "grpo"])
    assert (cfg.models.critic.vocab_size, cfg.models.actor.vocab_size) == (len(WORDS) + 3, 320)


# ---- weights from either format, and reward functions ------------------------------------

def test_read_weights_equals_transformers_tensors(files):
    """Only the names asked for are read; a critic from a causal LM gets the converter's new head."""
    model = files["actor"]
    source = open_source(files["actor_dir"], "critic")
    names = ["embedding.word_embeddings.weight", "decoder.layers.1.mlp.linear_fc1.weight", "output_layer.weight"]
    full = read_weights(source, names, head_seed=7)
    assert sorted(full) == sorted(names)
    assert torch.equal(full[names[0]], model.model.embed_tokens.weight)
    mlp = model.model.layers[1].mlp
    assert torch.equal(full[names[1]], torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    head = torch.randn(1, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(7)) * source.config.init_std
    assert torch.equal(full["output_layer.weight"], head)


def test_both_formats_give_the_same_reward_model(files, tmp_path):
    ckpt = str(tmp_path / "rm")
    hf_to_ours(files["reward_dir"], ckpt, model_name="reward", role="value")
    hf, ours = open_source(files["reward_dir"], "reward"), open_source(ckpt, "reward")
    assert hf.config == ours.config and not hf.new_head and not ours.new_head
    names = list(read_hf_state(files["reward_dir"], read_hf_config(files["reward_dir"]), "value"))
    a, b = read_weights(hf, names, head_seed=0), read_weights(ours, names, head_seed=0)
    assert all(torch.equal(a[n], b[n]) for n in names)
    assert torch.equal(a["output_layer.weight"], files["reward"].score.weight)
    critic = open_source(ckpt, "critic")  # no model "critic": the reward model starts it
    assert critic.checkpoint_model == "reward" and not critic.new_head


def test_load_reward_fn_names_what_is_missing():
    from rlhf.data.synthetic import gold_reward
    from rlhf.ppo.reward_fn import load_reward_fn

    assert load_reward_fn("rlhf.data.synthetic:gold_reward") is gold_reward
    for spec, message in [("no_such_module_xyz:f", "no_such_module_xyz:f: cannot import module 'no_such_module_xyz' "
                                                   "(ModuleNotFoundError"),
                          ("json:nope", "json:nope: 'json' has no attribute 'nope'"),
                          ("json:__doc__", "json:__doc__ is a str, not a function")]:
        with pytest.raises(ConfigError) as exc:
            load_reward_fn(spec)
        assert str(exc.value).startswith(message) and flag_of(exc.value.field_name) == "--reward-fn"


def _boom(prompts, responses):
    raise ValueError("boom")


@pytest.mark.parametrize("fn,message", [
    (_boom, "test_job_sources:_boom raised ValueError: boom (at "),
    (lambda p, r: [1.0], "test_job_sources:<lambda> returned 1 score(s) for 2 samples"),
    (lambda p, r: 0.5, "test_job_sources:<lambda> returned a float for 2 samples"),
    (lambda p, r: [1.0, "x"], "test_job_sources:<lambda> returned 'x' for sample 1; every score must be a finite"),
    (lambda p, r: [1.0, math.nan], "test_job_sources:<lambda> returned nan for sample 1"),
])
def test_checked_scores_refuse_what_is_not_one_number_per_sample(fn, message):
    from rlhf.ppo.reward_fn import checked_scores

    with pytest.raises(ConfigError) as exc:
        checked_scores(fn, [[1], [2]], [[3], [4]])
    assert str(exc.value).startswith(message) and exc.value.field_name == "reward.reward_fn"


def test_checked_scores_take_lists_and_arrays():
    from rlhf.ppo.reward_fn import checked_scores

    assert checked_scores(lambda p, r: np.array([0.5, 2]), [[1], [2]], [[3], [4]]) == [0.5, 2.0]
    assert checked_scores(lambda p, r: (1, 0.25), [[1], [2]], [[3], [4]]) == [1.0, 0.25]


def test_a_non_finite_reward_model_score_stops_the_run_naming_the_samples():
    from rlhf.batch import Batch
    from rlhf.engine.types import SampleResult
    from rlhf.ppo.reward_fn import check_model_scores

    samples = [SampleResult(str(i // 2), i % 2, (5, 6), (7, 8, 9), (-0.1,) * 3, "stop", 0.0) for i in range(4)]
    batch = Batch.from_samples(samples, 0, {"0": 0, "1": 1})
    check_model_scores(batch.with_fields(scores=torch.tensor([0.5, -1.0, 2.0, 0.0])))
    with pytest.raises(RuntimeError, match=r"the reward model scored 2 of 4 samples non-finite, e.g. sample 1 "
                                           r"\(prompt 0, sample 1\): nan, 3 \(prompt 1, sample 1\): inf"):
        check_model_scores(batch.with_fields(scores=torch.tensor([0.5, float("nan"), 2.0, float("inf")])))


def test_skipping_passes_non_finite_scores_and_drops_their_samples():
    """With --skip-nonfinite-samples a function's NaN and infinity pass (what is not a number still stops the run),
    and the batch keeps its 4 samples, the non-finite ones with sample_mask 0, score 0 and no token in
    response_mask."""
    from rlhf.batch import Batch
    from rlhf.engine.types import SampleResult
    from rlhf.ppo.reward_fn import checked_scores, drop_nonfinite_samples

    got = checked_scores(lambda p, r: [1.0, math.nan, -math.inf], [[1]] * 3, [[2]] * 3, nonfinite_ok=True)
    assert got[0] == 1.0 and math.isnan(got[1]) and got[2] == -math.inf
    with pytest.raises(ConfigError, match="returned 'x' for sample 0; every score must be a number"):
        checked_scores(lambda p, r: ["x"], [[1]], [[2]], nonfinite_ok=True)
    samples = [SampleResult(str(i // 2), i % 2, (5, 6), (7, 8, 9)[:i % 2 + 2], (-0.1,) * (i % 2 + 2), "stop", 0.0)
               for i in range(4)]
    batch = Batch.from_samples(samples, 0, {"0": 0, "1": 1})
    dropped = drop_nonfinite_samples(batch.with_fields(scores=torch.tensor([0.5, math.nan, 2.0, math.inf])))
    assert len(dropped) == 4 and dropped.scores.tolist() == [0.5, 0.0, 2.0, 0.0]
    assert dropped.sample_mask.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert dropped.response_mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]]
