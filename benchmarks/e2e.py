"""End-to-end PPO iteration: where the time goes, and what the engine's batching is worth.

Runs the job ``pretrain_rlhf.py`` runs (the built-in tiny default unless job
flags follow ``--``) in-process on 4 gloo ranks (``rlhf.testing.distributed.launch``,
one torch thread per rank, as ``OMP_NUM_THREADS=1 torchrun`` gives): the
reward-model fit and the trainer as ``rlhf.ppo.job.build_trainer`` builds them,
``--warmup`` iterations, then ``--iterations`` timed ones. Each iteration is
seen as its slowest rank saw it (what the job waited for): that rank's own
stage timers and the rest of its iteration (fetching prompts, batch metrics,
the metrics reduction), which add up to its span. It prints the median
iteration's breakdown in seconds and as shares, and its samples/s and
generated tokens/s. (The metrics file's ``time_*_s`` are maxima per stage
over ranks, which need not add up.)

Side by side, after each timed iteration and on the same actor weights, the
same generation requests (the next prompts, with the seeds ``Trainer.generate``
gives them) run twice through ``Trainer.generate``: with the trainer's engine
(continuous batching, the n samples of a prompt sharing its prefill) and with
the same engine configuration switched to one sample at a time
(``max_num_seqs=1``, no continuous batching, no prefix sharing), the way a
per-sample ``generate`` loop works. Samples are seeded per sample, so both
produce the same tokens (printed as a check); the ratio of their medians is
what batching saves in this iteration's generation stage. See docs/e2e.md.

    python benchmarks/e2e.py [--iterations 5] [--warmup 2] [-- pretrain_rlhf.py flags]

The last line is the summary, e.g.
``e2e: iteration 1.10 s (gen 0.25, inf 0.18, adv 0.00, train 0.51, reshard 0.01), 69 samples/s, 1010 tokens/s``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform as host
import statistics
import time

WORLD_SIZE = 4
STAGES = (("generation", "gen"), ("inference", "inf"), ("advantage", "adv"), ("training", "train"),
          ("reshard", "reshard"))
"""(trainer stage, short label in the summary line), in iteration order."""


# -- on every rank -------------------------------------------------------------------
def measure(job_flags: list, iterations: int, warmup: int) -> list:
    """This rank's records of the timed iterations (collective: every rank runs it): its own stage
    seconds and iteration span (``Trainer.timer`` read right after ``step()``, so the span includes
    the metrics reduction), the trainer's reduced metrics, and the side-by-side generation."""
    import torch.distributed as dist

    from rlhf.ppo.arguments import parse_args
    from rlhf.ppo.job import build_trainer
    from rlhf.ppo.layout import build_placement

    config = parse_args(job_flags)
    trainer = build_trainer(config, build_placement(config, dist.get_world_size()))
    reference = one_sample_at_a_time(trainer)
    for _ in range(warmup):
        trainer.step()
    records = []
    for _ in range(iterations):
        metrics = trainer.step().metrics
        records.append({"spans": trainer.timer.metrics(), "metrics": metrics, **side_by_side(trainer, reference)})
    return records


def one_sample_at_a_time(trainer):
    """An engine on this rank's actor_gen weights with the trainer engine's configuration, but
    one running sequence, no continuous batching and no prefix sharing (None off actor_gen)."""
    from rlhf.engine import Engine

    if trainer.engine is None:
        return None
    config = dataclasses.replace(trainer.engine.config, max_num_seqs=1, continuous_batching=False,
                                 prefix_sharing=False)
    return Engine(trainer.models["actor_gen"], trainer.groups["actor_gen"], trainer.config.models.actor, config)


def side_by_side(trainer, reference) -> dict:
    """Seconds of ``Trainer.generate`` on the next prompts with the trainer's engine and with
    ``reference`` (same weights, same seeds), this rank's engine steps (decoder forwards) for each,
    and how many samples came out identical."""
    import torch.distributed as dist

    prompts, ours = next(trainer.prompts), trainer.engine
    out, batches = {}, {}
    for name, engine in (("engine", ours), ("one_at_a_time", reference)):
        trainer.engine = engine
        steps = engine.stats.steps if engine is not None else 0
        dist.barrier()  # both start together on every rank: the slowest rank's span is the stage's
        start = time.perf_counter()
        batches[name] = trainer.generate(prompts).batch
        out[f"time_{name}_s"] = time.perf_counter() - start
        out[f"steps_{name}"] = engine.stats.steps - steps if engine is not None else 0
    trainer.engine = ours
    ours_seqs, ref_seqs = (_sequences(batches[name]) for name in ("engine", "one_at_a_time"))
    out["identical_samples"] = sum(a == b for a, b in zip(ours_seqs, ref_seqs))
    out["samples"], out["generated_tokens"] = len(ours_seqs), int(batches["engine"].response_lengths.sum())
    return out


def _sequences(batch) -> list:
    """Each sample's prompt + response token ids (padding cut off)."""
    return [tuple(row[:n]) for row, n in zip(batch.tokens.tolist(), batch.sequence_lengths.tolist())]


# -- report --------------------------------------------------------------------------
def summarize(per_rank: list) -> dict:
    """The median timed iteration (the lower median by span) as its slowest rank saw it: stages, the
    rest and the rates over its span (the parts add up to it); beside it the medians over the timed
    iterations of the side-by-side seconds (slowest rank) and engine steps (busiest replica)."""
    count = len(per_rank[0])
    rows = sorted((_breakdown(per_rank, i) for i in range(count)), key=lambda row: row["iteration"])
    out = dict(rows[(count - 1) // 2])
    for name in ("engine", "one_at_a_time"):
        out[name] = statistics.median(max(rank[i][f"time_{name}_s"] for rank in per_rank) for i in range(count))
        out[f"steps_{name}"] = statistics.median(max(rank[i][f"steps_{name}"] for rank in per_rank)
                                                 for i in range(count))
    out["tokens"] = statistics.median(r["generated_tokens"] for r in per_rank[0])
    for key in ("identical_samples", "samples"):  # summed over the timed iterations
        out[key] = sum(r[key] for r in per_rank[0])
    return out


def _breakdown(per_rank: list, i: int) -> dict:
    """Timed iteration ``i`` on its slowest rank: seconds per stage, the rest, the span, the rates."""
    spans = max((rank[i]["spans"] for rank in per_rank), key=lambda s: s["time_iteration_s"])
    row = {stage: spans.get(f"time_{stage}_s", 0.0) for stage, _ in STAGES}
    row["iteration"] = spans["time_iteration_s"]
    row["rest"] = row["iteration"] - sum(row[stage] for stage, _ in STAGES)
    for unit in ("samples", "tokens"):  # *_count: reduced by the trainer, equal on every rank
        row[f"{unit}_per_s"] = per_rank[0][i]["metrics"][f"{unit}_count"] / row["iteration"]
    return row


def report(res: dict, config, iterations: int, warmup: int, load: float) -> None:
    """The machine, the breakdown table, the side-by-side ratio, then the summary line."""
    import torch

    ppo, gen, actor = config.ppo, config.generation, config.models.actor
    print(f"machine: {host.node()} {host.machine()}, {os.cpu_count()} cores, load average {load:.2f} before "
          f"the run; world size {WORLD_SIZE} (gloo, 1 torch thread per rank); torch {torch.__version__}")
    print(f"job: actor {actor.num_layers} layers, hidden {actor.hidden_size}, vocab {actor.vocab_size}; "
          f"{ppo.rollout_batch_size} prompts x {ppo.n_samples_per_prompt} samples, responses <= "
          f"{gen.max_response_len} tokens, {ppo.minibatches} mini-batch(es) x {ppo.ppo_epochs} epoch(s); "
          f"the median of {iterations} iterations after {warmup} warm-up")
    print(f"{'stage':<12}{'seconds':>9}{'share':>8}")
    for key in [s for s, _ in STAGES] + ["rest", "iteration"]:
        print(f"{key:<12}{res[key]:>9.3f}{100 * res[key] / res['iteration']:>7.1f}%")
    print(f"throughput: {res['samples_per_s']:.1f} samples/s, {res['tokens_per_s']:.1f} generated tokens/s")
    print(f"generation side by side (same requests, weights and seeds; median {res['tokens']:.0f} generated "
          f"tokens; identical samples {res['identical_samples']}/{res['samples']}):")
    for name, label in (("engine", "engine (continuous batching, prefix sharing)"),
                        ("one_at_a_time", "one sample at a time")):
        steps = res[f"steps_{name}"]
        print(f"  {label:<46}{res[name]:>7.3f} s, {steps:>4.0f} steps per replica, "
              f"{1e3 * res[name] / steps:5.1f} ms per step")
    print(f"  engine / one sample at a time: {res['one_at_a_time'] / res['engine']:.2f}x faster")
    print(f"e2e: iteration {res['iteration']:.2f} s ("
          + ", ".join(f"{label} {res[stage]:.2f}" for stage, label in STAGES)
          + f"), {res['samples_per_s']:.0f} samples/s, {res['tokens_per_s']:.0f} tokens/s")


def parse(argv=None) -> tuple[argparse.Namespace, object]:
    """The benchmark's flags and the job's JobConfig (a bad job flag exits naming it)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Job flags after -- go to pretrain_rlhf.py's parser (e.g. -- "
                                        "--rollout-batch-size 32 --trace-iteration 3); those that only "
                                        "Trainer.train() or pretrain_rlhf.py act on (--iterations, --save, "
                                        "--load, --metrics-file, --tensorboard-dir) have no effect here.")
    ap.add_argument("--iterations", type=int, default=5,
                    help="timed iterations: the median one is broken down, the side-by-side generation "
                         "times are medians (default %(default)s)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed iterations before them (default %(default)s)")
    ap.add_argument("job_flags", nargs="*", metavar="-- JOB_FLAGS",
                    help="pretrain_rlhf.py flags (default: none, the built-in tiny default)")
    args = ap.parse_args(argv)
    if args.iterations < 1:
        ap.error(f"--iterations {args.iterations} must be >= 1")
    if args.warmup < 0:
        ap.error(f"--warmup {args.warmup} must be >= 0")
    return args, check_job(args.job_flags)


def check_job(job_flags: list):
    """The JobConfig of ``job_flags`` after the checks pretrain_rlhf.py makes before it starts
    (exits with the job's message on a bad flag or a placement the 4 ranks cannot run)."""
    from rlhf.ppo.arguments import flag_of, parse_args
    from rlhf.cli import UsageError
    from rlhf.config import ConfigError
    from rlhf.parallel import PlacementError
    from rlhf.ppo.layout import build_placement

    try:
        config = parse_args(job_flags)
    except UsageError as exc:
        raise SystemExit(f"e2e.py: {exc}") from None
    try:
        build_placement(config, WORLD_SIZE)
    except PlacementError as exc:
        raise SystemExit(f"e2e.py: invalid placement: {exc}") from None
    except ConfigError as exc:
        raise SystemExit(f"e2e.py: {flag_of(exc.field_name)}: {exc}") from None
    return config


def main(argv=None) -> None:
    args, config = parse(argv)
    from rlhf.testing.distributed import launch

    load = os.getloadavg()[0]  # other jobs on the machine take cores from the ranks
    per_rank = launch(WORLD_SIZE, "e2e:measure", timeout_s=600, job_flags=args.job_flags,
                      iterations=args.iterations, warmup=args.warmup)
    report(summarize(per_rank), config, args.iterations, args.warmup, load)


if __name__ == "__main__":
    main()
