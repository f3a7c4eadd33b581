"""Reward-model training (train_reward.py): exactness on 4 gloo ranks, resume, the checkpoint as PPO's reward
model, the HF export against transformers, and the command line end to end.

The 4-rank scenario (tests/scenario_reward_training.py) compares one step on TP2xPP2 and on PP2xDP2 with
single-process PyTorch written from the loss definition; transformers is the oracle of the HF export.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf.checkpoint.sources import open_source
from rlhf.data.synthetic import preference_records
from rlhf.testing.distributed import launch
from rlhf.testing.tools import load_tool

synthetic_preferences = load_tool("synthetic_preferences")

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(4, "scenario_reward_training:run", root=str(tmp_path_factory.mktemp("reward")))[0]


@pytest.mark.parametrize("layout", ["tp2pp2", "pp2dp2", "tp2pp2-full", "pp2dp2-selective"])
def test_one_step_equals_the_loss_definition(results, layout):
    r = results["exactness"][layout]
    assert r["recompute"] == (layout.split("-") + [None])[1]  # recomputing (full, selective) trains the same
    assert r["names"] and r["moved"] > 1e-4  # the step changed every parameter the reference has
    assert r["max_diff"] < TOL
    ref, metrics = r["reference"], r["metrics"]
    assert ref["grad_norm"] > 0.05  # the step clipped (CLIP = 0.05)
    assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert metrics["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert metrics["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    assert metrics["eval_accuracy"] == ref["eval_accuracy"]


def test_one_bf16_step_is_within_bf16_of_the_loss_definition(results):
    """train_reward.py --bf16 (bf16 model, fp32 main weights and moments): the step's loss and gradient norm
    within bf16's ~3 significant digits of the fp32 definition's, and the weights moved by the update."""
    r = results["exactness"]["tp2pp2-bf16"]
    ref, metrics = r["reference"], r["metrics"]
    assert r["names"] and r["moved"] > 1e-4
    assert metrics["loss"] == pytest.approx(ref["loss"], rel=0.01)
    assert metrics["grad_norm"] == pytest.approx(ref["grad_norm"], rel=0.05)
    assert metrics["eval_accuracy"] == ref["eval_accuracy"]


def test_resume_continues_exactly(results):
    assert results["loaded_at"] == 2 and results["resume_moved"] > 1e-4
    for straight, resumed in zip(results["straight_metrics"], results["resumed_metrics"]):
        assert set(straight) == set(resumed)
        for key, value in straight.items():
            if not key.startswith("time_") and not key.endswith("_per_s"):
                assert resumed[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert "eval_accuracy" in results["straight_metrics"][1]  # iteration 4: eval_interval 2
    assert results["resume_param_diff"] < 1e-6


def test_checkpoint_is_pretrain_rlhfs_reward_model(results):
    """PPO's reward_inf (TP2, loaded as --reward-model <root>) scores the pairs as the trained model does."""
    assert results["ppo_score_diff"] < TOL
    root = os.path.dirname(results["hf"])
    reward, critic = open_source(root, "reward"), open_source(root, "critic")  # --reward-model / --critic-model
    assert reward.checkpoint_model == critic.checkpoint_model == "reward"
    assert not reward.new_head and not critic.new_head and reward.config == critic.config


def test_tiny_default_reward_model_is_cached(results):
    """pretrain_rlhf.py's start-up reward training (4 steps here) is written once and then loaded: the loaded
    weights equal the fresh training's bitwise; an entry whose bytes changed is trained again (to the same
    weights), a truncated one is not read; another seed misses; RLHF_CACHE_DIR=off turns the cache off."""
    cache = results["cache"]
    trained, hit, retrained, hit_again = cache["lines"]
    for line in (trained, retrained):
        assert re.fullmatch(r"reward model: 4 steps on \d+ synthetic preference pairs in [\d.]+ s; held-out "
                            r"\(\d+ pairs\): accuracy [\d.]+, loss [\d.]+", line), line
    for line in (hit, hit_again):
        assert line.startswith("reward model: 4 steps on ") and ", cached (" in line, line
        assert line.split("; ")[1] == trained.split("; ")[1]  # the held-out numbers of the training
    assert cache["equal"] == [True, True, True]
    assert len(cache["entries"]) == 2 and {os.path.splitext(e)[1] for e in cache["entries"]} == {".json", ".safetensors"}
    assert cache["truncated_read"] is None and cache["other_seed"] is None and cache["off"] == (None, None)


def test_hf_export_scores_as_our_model(results):
    """transformers' *ForSequenceClassification on a right-padded batch gives our scores (its pad id is known)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(results["hf"]).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.pad_token_id == 256
    rows = results["rows"]
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [256] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        scores = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert scores.tolist() == pytest.approx(results["scores"], abs=1e-4)


# ---- the command line ----------------------------------------------------------------------

def _write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _train_reward(*flags, nproc: int):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "train_reward.py"), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """6 steps of --model tiny on 2 ranks (a PP2 pipeline), held-out scoring every 3, saved every 3;
    then resumed to 8 steps."""
    tmp = tmp_path_factory.mktemp("cli")
    train, held_out = str(tmp / "train.jsonl"), str(tmp / "eval.jsonl")
    for path, pairs, seed in ((train, "64", "0"), (held_out, "16", "1")):
        assert synthetic_preferences.main(["--out", path, "--pairs", pairs, "--seed", seed]) == 0
    common = ["--train-data", train, "--eval-data", held_out, "--metrics-file", str(tmp / "m.jsonl"),
              "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "1e-3", "--reward-inf", "pp=2"]
    first = _train_reward(*common, "--iterations", "6", "--eval-interval", "3", "--save", str(tmp / "ckpt"),
                          "--save-interval", "3", "--tensorboard-dir", str(tmp / "tb"), nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    records = [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]
    resumed = _train_reward(*common, "--iterations", "8", "--load", str(tmp / "ckpt"), "--no-progress", nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return tmp, first, records, [json.loads(line) for line in (tmp / "m.jsonl").read_text().splitlines()]


def test_cli_trains_logs_and_saves(cli_run):
    tmp, run, records, _ = cli_run
    assert "the reward model trains on ranks [0, 1] dp1xpp2xtp1" in run.stdout
    assert f"{tmp / 'train.jsonl'}: preference pairs: " in run.stdout  # each file's counts
    assert f"{tmp / 'eval.jsonl'}: preference pairs: " in run.stdout
    assert "reward: 100%" in run.stderr  # the progress bar (rank 0)
    assert [r["iteration"] for r in records] == list(range(1, 7))
    for r in records:
        assert {"loss", "accuracy", "margin_mean", "grad_norm", "lr", "pairs_per_s"} <= set(r)
        assert ("eval_accuracy" in r) == (r["iteration"] in (3, 6)) and 0 <= r["accuracy"] <= 1
    assert sorted(os.listdir(tmp / "ckpt")) == ["hf", "iter_0000003", "iter_0000006", "latest"]
    assert json.loads((tmp / "ckpt" / "hf" / "config.json").read_text())["architectures"] == \
        ["LlamaForSequenceClassification"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp / "tb"))
    tb.Reload()
    assert [s.value for s in tb.Scalars("loss")] == pytest.approx([r["loss"] for r in records], rel=1e-6)


def test_cli_resumes_to_the_new_total(cli_run):
    _, _, first, after = cli_run
    assert [r["iteration"] for r in after] == list(range(1, 9))
    assert after[:6] == first  # 7 and 8 appended to the first run's lines


def test_cli_reports_a_malformed_line(tmp_path):
    records = preference_records(4, seed=0)
    del records[1]["rejected"]
    path = _write_jsonl(tmp_path / "bad.jsonl", records)
    out = subprocess.run([sys.executable, str(ROOT / "train_reward.py"), "--train-data", path], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)  # one process, no torchrun: a world of one
    assert out.returncode == 2
    assert f"train_reward.py: --train-data: {path}:2: missing field 'rejected'" in out.stderr
