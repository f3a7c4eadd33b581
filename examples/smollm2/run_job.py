"""Run one ``pretrain_rlhf.py`` job on N CPU ranks and print what docs/real_model.md records.

    python examples/smollm2/run_job.py --out DIR [--nproc 4] -- <pretrain_rlhf.py flags>

Starts ``torchrun --standalone`` (one torch thread per rank) with
``--metrics-file DIR/metrics.jsonl --tensorboard-dir DIR/tb`` added. While it
runs it prints one line per finished iteration (the reward and the seconds of
each stage) and polls every rank's peak resident memory (VmHWM in
/proc/<pid>/status). At the end it prints the mean seconds per stage over the
iterations after the first (which pays one-off start-up costs) and the peak
RSS per rank, and writes them to DIR/summary.json. Exits with torchrun's status.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

STAGES = ("generation", "inference", "training", "reshard")


def _children(pid: int) -> list[int]:
    """Child processes of ``pid`` (started by any of its threads)."""
    out = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return out


def _rank_and_peak(pid: int) -> tuple[int, int] | None:
    """(RANK, peak RSS bytes) of a torchrun worker, or None for another process (or one gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return (int(env[b"RANK"]), hwm) if b"RANK" in env else None


def _line(record: dict) -> str:
    stages = ", ".join(f"{s} {record.get(f'time_{s}_s', 0.0):.1f}" for s in STAGES)
    return (f"iteration {record['iteration']:3d}: reward {record['reward_mean']:.3f}  "
            f"({record['time_iteration_s']:.1f} s: {stages})")


def run(out: str, nproc: int, job_flags: list[str]) -> int:
    """Run the job, printing iterations as they finish; returns torchrun's exit status."""
    os.makedirs(out, exist_ok=True)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", f"--nproc-per-node={nproc}", "pretrain_rlhf.py", *job_flags, "--no-progress",
           "--metrics-file", metrics, "--tensorboard-dir", os.path.join(out, "tb")]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    peaks: dict[int, int] = {}
    records: list[dict] = []
    while True:
        done = proc.poll() is not None
        for pid in _children(proc.pid):
            found = _rank_and_peak(pid)
            if found:
                peaks[found[0]] = max(peaks.get(found[0], 0), found[1])
        if os.path.exists(metrics):
            with open(metrics, encoding="utf-8") as f:
                lines = [json.loads(line) for line in f if line.strip()]
            for record in lines[len(records):]:
                print(_line(record), flush=True)
            records = lines
        if done:
            break
        time.sleep(1.0)
    summarize(out, records, peaks)
    return proc.returncode


def summarize(out: str, records: list[dict], peaks: dict[int, int]) -> None:
    """Print and save the mean stage seconds (iterations after the first) and the peak RSS per rank."""
    steady = records[1:] or records
    means = {s: statistics.fmean(r.get(f"time_{s}_s", 0.0) for r in steady) for s in ("iteration",) + STAGES}
    summary = {"iterations": len(records), "seconds_per_iteration": means,
               "reward_mean": [r["reward_mean"] for r in records],
               "peak_rss_gib_per_rank": {rank: peaks[rank] / 2**30 for rank in sorted(peaks)}}
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    if steady:
        print(f"mean of iterations 2..{len(records)}: {means['iteration']:.1f} s per iteration ("
              + ", ".join(f"{s} {means[s]:.1f}" for s in STAGES) + ")")
    print("peak RSS per rank: " + ", ".join(f"rank {r} {g:.2f} GiB"
                                            for r, g in summary["peak_rss_gib_per_rank"].items()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for metrics.jsonl, tb/ and summary.json")
    p.add_argument("--nproc", type=int, default=4, help="ranks (CPU processes)")
    p.add_argument("job_flags", nargs=argparse.REMAINDER, help="-- then the pretrain_rlhf.py flags")
    args = p.parse_args(argv)
    flags = args.job_flags[1:] if args.job_flags[:1] == ["--"] else args.job_flags
    return run(args.out, args.nproc, flags)


if __name__ == "__main__":
    sys.exit(main())
