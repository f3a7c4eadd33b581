"""The main job as a user runs it: torchrun pretrain_rlhf.py on 4 CPU ranks, the built-in tiny default."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("iteration", "reward_mean", "reward_std", "gold_reward_mean", "kl_mean", "entropy_mean",
            "clip_fraction", "approx_kl", "value_loss", "response_length_mean", "response_length_max",
            "samples_per_s", "tokens_per_s", "time_generation_s", "time_inference_s", "time_advantage_s",
            "time_training_s", "time_reshard_s")


def _torchrun(*flags, nproc=4):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "pretrain_rlhf.py"), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("main")


@pytest.fixture(scope="module")
def default_run(run_dir):
    metrics = run_dir / "metrics.jsonl"
    out = _torchrun("--iterations", "12", "--metrics-file", str(metrics), "--no-progress", "--log-samples", "1",
                    "--save", str(run_dir / "ckpt"), "--save-interval", "6", "--tensorboard-dir", str(run_dir / "tb"),
                    "--trace-iteration", "2", "--trace-file", str(run_dir / "trace.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines(), [json.loads(line) for line in metrics.read_text().splitlines()]


def test_default_placement_runs_every_kind_of_mesh(default_run):
    lines, _ = default_run
    assert "  actor_train   ranks [0, 1, 2, 3] dp1xpp2xtp2" in lines
    assert "  critic_train  ranks [0, 1, 2, 3] dp2xpp2xtp1 (reversed pipeline)" in lines
    assert "  ref_inf       ranks [2, 3] dp2xpp1xtp1" in lines
    trained = next(line for line in lines if line.startswith("reward model: 300 steps on "))
    assert float(trained.split("accuracy ")[1].split(",")[0]) >= 0.95  # held-out synthetic preference pairs


def test_metrics_file_has_every_iteration(default_run):
    _, records = default_run
    assert [r["iteration"] for r in records] == list(range(1, 13))
    for record in records:
        assert set(REQUIRED) <= set(record)
        assert 0.0 <= record["gold_reward_mean"] <= 1.0
        assert record["samples_per_s"] > 0 and record["response_length_max"] <= 16
    # the reference starts as a copy of the actor and the engine's log-probs equal the training model's
    assert abs(records[0]["kl_mean"]) < 1e-4


def test_trace_and_tensorboard_of_the_run(default_run, run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    stages = {(e["pid"], e["name"]) for e in events if e.get("cat") == "STAGE"}
    for rank in range(4):  # every rank's stages of iteration 2 are in the one trace
        assert {(rank, s) for s in ("generation", "inference", "training", "reshard")} <= stages
    assert any(e.get("cat") == "FORWARD" for e in events)  # the executor's instructions too
    tb = EventAccumulator(str(run_dir / "tb"))
    tb.Reload()
    gold = [s.value for s in tb.Scalars("gold_reward_mean")]
    assert gold == pytest.approx([r["gold_reward_mean"] for r in default_run[1]], rel=1e-6)


def test_models_have_the_tokenizers_ids_and_samples_decode(default_run, run_dir):
    """The tiny presets take the byte tokenizer's 259 ids (the actor's layouts pad a 260th, never sampled), so
    every sampled id has a token: each iteration's decoded response shows no ``<id N>``."""
    from rlhf.checkpoint.rlhf_state import saved_model_config

    lines, _ = default_run
    models = ("actor", "reference", "critic", "reward")
    assert {m: saved_model_config(str(run_dir / "ckpt"), m)[0].vocab_size for m in models} == dict.fromkeys(models, 259)
    responses = [line for line in lines if line.startswith("  response: ")]
    assert len(responses) == 12 and not [r for r in responses if "<id " in r], responses


def test_gold_reward_rises(default_run):
    _, records = default_run
    gold = [r["gold_reward_mean"] for r in records]
    first, last = sum(gold[:4]) / 4, sum(gold[-4:]) / 4
    assert last > first + 0.04, gold


def test_checkpoints_every_save_interval_and_at_the_end(default_run, run_dir):
    """(Resuming from them, killed ranks included, is tests/test_faults.py's.)"""
    assert sorted(os.listdir(run_dir / "ckpt")) == ["iter_0000006", "iter_0000012", "latest"]


def test_load_of_a_root_without_checkpoint_is_refused(tmp_path):
    out = _torchrun("--load", str(tmp_path), nproc=2)
    assert out.returncode != 0
    assert f"pretrain_rlhf.py: --load {tmp_path}: no checkpoint in {tmp_path}" in out.stderr


def test_main_job_rejects_invalid_placement_with_clear_message():
    out = _torchrun("--actor-train", "tp=2,pp=2,ranks=0-1", nproc=2)
    assert out.returncode != 0
    assert "invalid placement: actor_train: pp*tp = 2*2 does not divide the mesh size 2" in out.stderr


def test_main_job_rejects_batch_sizes_the_placement_cannot_split():
    out = _torchrun("--micro-batch-size", "32", nproc=2)  # mini-batch 32 over actor_train dp2
    assert out.returncode != 0  # torchrun reports a failed worker as 1
    assert ("pretrain_rlhf.py: --ppo-mini-batch-size: ppo_mini_batch_size 32 must be a multiple of "
            "actor_train's dp 2 x micro_batch_size 32") in out.stderr
    assert out.stderr.count("pretrain_rlhf.py: --ppo-mini-batch-size") == 1  # rank 0 only


def test_flag_errors_print_once_with_status_2():
    out = _torchrun("--iterations", "0", nproc=2)
    assert out.stderr.count("pretrain_rlhf.py: --iterations: iterations must be an integer >= 1, got 0") == 1
    assert "exitcode  : 2" in out.stderr  # torchrun's report of the workers' status
    out = _torchrun("--iterations", "x", nproc=2)
    assert out.stderr.count("error: argument --iterations: invalid int value: 'x'") == 1
    assert 'pretrain_rlhf.py", line' not in out.stderr  # no traceback through our code (torchrun prints its own)


@pytest.mark.parametrize("flags", [("--iterations", "x"), ("--iterations", "0")])
def test_other_ranks_outwait_the_first_ranks_flag_error(flags):
    """A launcher stops every worker once one fails: a rank other than 0 that refused the flags
    first would have rank 0 killed before it printed why, so the others exit later than rank 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="1")
    started = time.monotonic()
    other = subprocess.Popen([sys.executable, str(ROOT / "pretrain_rlhf.py"), *flags], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = subprocess.run([sys.executable, str(ROOT / "pretrain_rlhf.py"), *flags], cwd=ROOT,
                           env=dict(env, RANK="0"), capture_output=True, text=True, timeout=120)
    assert first.returncode == 2 and "--iterations" in first.stderr
    time.sleep(max(0.0, started + 6.0 - time.monotonic()))  # a refusal alone takes ~2 s
    try:
        assert other.poll() is None  # still waiting once rank 0 has printed and exited
    finally:
        other.kill()
        _, err = other.communicate()
    assert err == ""  # and it prints nothing itself

