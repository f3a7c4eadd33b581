"""The main job as a user runs it: torchrun pretrain_rlhf.py on 4 CPU ranks."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(*flags, nproc=4):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "pretrain_rlhf.py"), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def test_main_job_runs_all_six_tasks_on_their_meshes():
    out = _torchrun("--placement", "examples/placement_4ranks.json", "--iterations", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "  actor_train   ranks [0, 1, 2, 3] dp1xpp2xtp2" in lines
    assert "  critic_train  ranks [0, 1, 2, 3] dp2xpp2xtp1 (reversed pipeline)" in lines
    reports = [line for line in lines if line.startswith("iteration ")]
    assert [r.split(":")[0] for r in reports] == ["iteration 1/2", "iteration 2/2"]
    first = dict(kv.split("=") for kv in reports[0].split(": ", 1)[1].split(", "))
    for key in ("actor_gen_logprob", "ref_inf_logprob", "reward_inf_value", "critic_inf_value",
                "actor_train_loss", "critic_train_loss"):
        assert key in first
    # same seed and weights before any training step: generation and reference agree
    assert first["actor_gen_logprob"] == first["ref_inf_logprob"]


def test_main_job_rejects_invalid_placement_with_clear_message():
    out = _torchrun("--actor-train", "tp=2,pp=2,ranks=0-1", nproc=2)
    assert out.returncode != 0
    assert "invalid placement: actor_train: pp*tp = 2*2 does not divide the mesh size 2" in out.stderr
