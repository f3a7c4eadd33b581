"""Faults of a long run on the main job as a user launches it (torchrun, CPU ranks, the tiny default with a
recording reward function): killed ranks, and a rank that stops answering.

The command relaunches with ``--save DIR --load DIR``. One torchrun of 4 ranks with ``--max-restarts 3`` meets
a SIGKILL of one rank in iteration 3 of 6 in each of its first three attempts: during generation, during an
optimizer step, and during the save of iteration 3 (tests/scenario_faults.py). Each restart resumes from the
checkpoint of iteration 2. The run must end as one uninterrupted run of the same command: the same metrics, and
every prompt scored for the trained batches once, in the same order. A rank stopped by SIGSTOP (2 ranks, which
start faster) must end the job after the collective timeout with one line naming the collective.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "tests" / "scenario_faults.py"
ITERATIONS = 6
SMALL = ("--rollout-batch-size", "4", "--ppo-mini-batch-size", "8", "--no-progress")
"""The tiny default with 16 samples per iteration, 2 optimizer steps of 8."""
VARYING = re.compile(r"^(time_|memory_)|_per_s$|^training_bubble_fraction$")
"""Metrics of time and memory, which a restarted run need not repeat."""


def job(run_dir: Path, faults: str = "", restarts: int = 0, flags=(), ranks: int = 4):
    """torchrun of the fault-injecting entry script: ``--save`` and ``--load`` the same root."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           f"--max-restarts={restarts}", str(ENTRY), "--iterations", str(ITERATIONS), "--save-interval", "1",
           "--save", str(run_dir / "ckpt"), "--load", str(run_dir / "ckpt"), "--reward-fn", "scenario_faults:recorder",
           "--metrics-file", str(run_dir / "metrics.jsonl"), *SMALL, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", FAULTS=faults, FAULTS_RECORD=str(run_dir / "scored.jsonl"))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finished(run_dir: Path, faults: str = "", restarts: int = 0, flags=()):
    """(stdout, stderr) of a job that must succeed."""
    proc = job(run_dir, faults, restarts, flags)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return out, err


def kill_every_process_of(run_dir: Path) -> None:
    """SIGKILL torchrun and its workers (each in a session of its own): every process naming the job's root."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run_dir / "ckpt") in cmdline.read_bytes().decode(errors="replace"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass  # gone meanwhile


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def trained_prompts(run_dir: Path, resumed_from: list[int]) -> list:
    """The prompts of the iterations that count, in order: attempt ``a`` scored iterations
    ``resumed_from[a] + 1, ...``, of which those up to the next attempt's resume point count."""
    calls = [json.loads(line) for line in (run_dir / "scored.jsonl").read_text().splitlines()]
    ends = resumed_from[1:] + [ITERATIONS]
    kept = []
    for attempt, (start, end) in enumerate(zip(resumed_from, ends)):
        mine = [c["prompts"] for c in calls if c["attempt"] == attempt]
        assert len(mine) >= end - start, (attempt, len(mine), start, end)  # it got past its resume point
        kept += mine[:end - start]
    return kept


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    out, _ = finished(run_dir)
    return run_dir, out


def test_killed_ranks_restart_from_the_last_checkpoint_and_train_every_prompt_once(uninterrupted, tmp_path):
    reference, reference_out = uninterrupted
    assert "no checkpoint there yet (it is also --save); starting from the initial weights" in reference_out
    out, err = finished(tmp_path, "kill-generation@3:1,kill-training@3:3,kill-save@3:2", restarts=3,
                        flags=("--tensorboard-dir", str(tmp_path / "tb")))
    strikes = re.findall(r"FAULT (\S+) iteration (\d+) rank (\d+)", err)
    assert strikes == [("kill-generation", "3", "1"), ("kill-training", "3", "3"), ("kill-save", "3", "2")]
    starts = [0 if "starting from the initial weights" in line else int(line.rsplit(" ", 1)[1])
              for line in out.splitlines() if line.startswith(f"--load {tmp_path / 'ckpt'}: ")]
    assert starts == [0, 2, 2, 2]  # each restart resumed from iteration 2's checkpoint
    records, expected = metrics(tmp_path), metrics(reference)
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))  # recomputed lines dropped
    for got, want in zip(records, expected):
        for key, value in want.items():
            if not VARYING.search(key):
                assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-12), (got["iteration"], key)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()  # the steps the restarts computed again were purged
    scalars = events.Scalars("policy_loss")
    assert [e.step for e in scalars] == list(range(1, ITERATIONS + 1))
    assert [e.value for e in scalars] == pytest.approx([r["policy_loss"] for r in records], rel=1e-6)
    reference_prompts = trained_prompts(reference, [0])
    assert trained_prompts(tmp_path, starts) == reference_prompts
    flat = [tuple(p) for batch in reference_prompts for p in batch]
    assert len(set(flat)) == len(flat) // 4  # each of the epoch's prompts once, with its 4 samples
    assert sorted(os.listdir(tmp_path / "ckpt")) == [f"iter_{i:07d}" for i in range(1, ITERATIONS + 1)] + ["latest"]


def test_a_rank_that_stops_answering_ends_the_job_within_the_timeout(tmp_path):
    """SIGSTOP of rank 1 of 2 in its first optimizer step, with a collective timeout of 6 s: rank 0 ends the job
    with a line naming the collective, its group and the code that waited."""
    timeout_s = 6
    proc = job(tmp_path, "stop-training@1:1", flags=("--distributed-timeout-minutes", str(timeout_s / 60)), ranks=2)
    lines, stopped_at, report = [], None, None
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("FAULT stop-training"):
                stopped_at = float(line.rsplit(" ", 1)[1])
            report = re.match(r"pretrain_rlhf\.py: rank (\d+): (.*)", line)
            if report:
                reported_at = time.time()
                break
    finally:  # torchrun would stop the stopped rank only after its 30 s grace
        kill_every_process_of(tmp_path)
        proc.communicate(timeout=60)
    assert stopped_at is not None and report is not None, "".join(lines[-40:])
    rank, message = int(report.group(1)), report.group(2)
    assert rank == 0 and timeout_s <= reported_at - stopped_at < timeout_s + 10, reported_at - stopped_at
    assert re.fullmatch(r"\w+ on ranks \[0, 1\] \(.+\) did not complete within 0\.1 min "
                        r"\(--distributed-timeout-minutes\): a rank of that group stopped answering or died; "
                        r"called from \S+\.py:\d+ \(\w+\) \(.*\)", message), message


def test_only_a_collectives_failure_is_described_as_one():
    """Other errors keep their traceback, even when their text speaks of a timeout."""
    from rlhf.parallel.collectives import describe_failure

    def reader():
        raise RuntimeError("Timed out waiting for the reward server")

    with pytest.raises(RuntimeError) as raised:
        reader()
    assert describe_failure(raised.value, 0) is None
    assert describe_failure(ValueError("Connection closed by peer"), 0) is None
